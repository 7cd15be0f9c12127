"""experiments/published_report.py: every published row priced or left out with a reason, in-process on a
subset of the files (the whole report takes about a minute: `python experiments/published_report.py`)."""

from __future__ import annotations

import csv
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from autopar.search import published_torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("published_report", ROOT / "experiments" / "published_report.py")
report_module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = report_module  # its dataclasses resolve their module by name
spec.loader.exec_module(report_module)

SUBSET = ["flashattention_training_a100.csv", "torch_native_shared.csv"]


def _lines(path: Path) -> set[int]:
    with open(path, newline="", encoding="utf-8") as f:
        return set(range(2, 2 + len(list(csv.DictReader(f)))))


@pytest.fixture(scope="module")
def entries():
    return report_module.report(SUBSET)


def test_every_row_of_the_subset_is_priced_or_left_out_with_a_reason(entries):
    for name in SUBSET:
        mine = [e for e in entries if e.file == name]
        assert {int(e.row.split(":")[0]) for e in mine} == _lines(report_module.DATA / name), name
        for e in mine:
            priced = e.predicted is not None and math.isfinite(e.predicted) and e.predicted > 0
            assert priced != bool(e.reason), e  # one or the other, never both or neither
            assert e.fitted and e.published > 0


def test_torch_native_rows_priced_on_their_gpus_presets_and_left_out_as_the_runtime_requires(entries):
    rows = {e.row.split(":")[0]: e for e in entries if e.file == "torch_native_shared.csv"}
    t1 = rows["2"]  # torchtitan Table 1, FSDP8 bf16 eager: priced under torch on the Grand Teton preset
    assert t1.predicted is not None and "grand-teton-h100" in t1.note and "zero3" in t1.plan
    row = published_torch.ROWS[0]
    plain = published_torch.torch_plan(row, published_torch.torch_workload(row))
    assert plain.describe() == t1.plan
    # async TP is a switch; compile beside tp is priced as torchtitan ran it, and the note says the executor
    # does not run it; the interleaved row's virtual stages are not published
    assert rows["9"].predicted and rows["8"].predicted and "compiled under tp/pp" in rows["8"].note
    assert "virtual stages" in rows["11"].reason
    assert {e.row.split(":")[0] for e in entries if e.file == "torch_native_shared.csv" and not e.predicted} == {"11"}
    assert "fitted: torch runtime's gemm_efficiency, fp8_gemm_speedup" in rows["4"].fitted


def test_the_power_limited_preset_prices_the_grand_teton_row_slower_than_a_dgx_h100():
    """The 500 W, 2.4 TB/s part is slower than the 700 W SXM5 the dgx-h100 preset has, for the same plan."""
    row = published_torch.ROWS[0]
    _, _, grand_teton = published_torch.predicted_tokens_per_s(row)
    dgx = published_torch.TorchNativeRow(**{**row.__dict__, "gpu": "H100-SXM5"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(published_torch.PRESETS_BY_GPU, "H100-SXM5", "dgx-h100")
        _, _, sxm = published_torch.predicted_tokens_per_s(dgx)
    assert grand_teton < 0.97 * sxm


def test_a_file_no_reader_knows_is_listed_row_by_row(tmp_path, monkeypatch):
    (tmp_path / "new_rows.csv").write_text("model,gpus,tokens_per_s_per_gpu\nA,8,100\nB,16,200\n")
    monkeypatch.setattr(report_module, "DATA", tmp_path)
    out = report_module.report(["new_rows.csv"])
    assert [(e.row, e.published, e.predicted) for e in out] == [("2: A, 8, 100", 100.0, None),
                                                              ("3: B, 16, 200", 200.0, None)]
    assert all(e.reason == "no reader prices this file yet" for e in out)
    assert report_module.summary(out, "new_rows.csv") == (0, 2, None, None)


def test_markdown_and_text_list_every_entry_and_each_files_summary(entries):
    md = report_module.markdown(entries, SUBSET)
    assert sum(line.startswith("| `torch_native_shared.csv` | ") for line in md.splitlines()) == 28 + 1
    _, _, med, worst = report_module.summary(entries, "flashattention_training_a100.csv")
    assert f"| `flashattention_training_a100.csv` | 5 | 0 | {med:.1%} | {worst:.1%} |" in md
    text = report_module.text(entries, SUBSET)
    assert "torch_native_shared.csv: 27 priced, 1 left out" in text


def test_bad_file_name_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        report_module.main(["--files", "nope.csv"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file nope.csv" in err[0]
