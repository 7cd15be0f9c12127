"""experiments/planner_eval.py, the held-out evaluation the README's planner table comes from:
one zoo family with --family, and the table rewritten in place between its markers, nothing
else of the file touched, so the lead regenerates it in one command after a retrain."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from autopar.search.simplicity import TIE

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("planner_eval", ROOT / "experiments" / "planner_eval.py")
planner_eval = importlib.util.module_from_spec(spec)
spec.loader.exec_module(planner_eval)


def test_the_readme_table_is_rewritten_between_its_markers_only(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{planner_eval.MARKERS[0]} -->\n| old |\n{planner_eval.MARKERS[1]}\n\nafter\n")
    out = tmp_path / "eval"
    # the rules and random planners: this checks the evaluation and the table, not a policy
    # (tests/test_rl_planner.py checks the shipped one, which a changed space refuses until retrained)
    monkeypatch.setattr(sys, "argv", ["planner_eval.py", "--limit", "2", "--family", "bert", "--planners",
                                      "random-50,rules", "--out", str(out), "--readme", str(readme)])
    planner_eval.main()
    text = readme.read_text()
    assert text.startswith("intro\n\n") and text.endswith("\n\nafter\n") and "| old |" not in text
    assert "written by: python experiments/planner_eval.py --limit 2 --family bert --planners random-50,rules --readme" in text
    assert str(out) not in text
    rows = [line for line in text.splitlines() if line.startswith("| r")]
    assert [r.split(" | ")[0] for r in rows] == ["| random, 50", "| rules"]
    results = json.loads((out / "results.json").read_text())
    assert len(results) == 2 and all(r["workload"].startswith("bert ") for r in results)
    # the oracle returns the simplest of its ties: a planner may be up to TIE faster than it
    assert all(0 <= r["planners"][name]["ratio"] <= 1 + TIE for r in results for name in ("rules", "random-50"))


def test_a_readme_without_markers_is_refused_and_left_alone(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no table here\n")
    with pytest.raises(SystemExit, match="no planner table markers"):
        planner_eval.rewrite_readme(readme, "| table |")
    assert readme.read_text() == "no table here\n"


def test_an_unknown_family_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["planner_eval.py", "--family", "nope"])
    with pytest.raises(SystemExit) as e:
        planner_eval.main()
    assert e.value.code == 2 and "unknown family 'nope'" in capsys.readouterr().err
