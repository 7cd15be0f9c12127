"""Acceptance 1 of issue 39: the README's "Apply a plan" commands (`autopar search ... -o plan.json`,
then `autopar run plan.json ... --check-parity`), taken from the README itself, exit 0 in a fresh
folder within 180 s together. Launches the CLI and torchrun: slow tier."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from test_cpu_plans import ROOT, readme_commands

BUDGET_S = 180  # both commands together, on a clean clone (the bound)


@pytest.mark.slow
def test_the_readme_apply_commands_exit_0_within_180_s(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    (tmp_path / "autopar").symlink_to(ROOT / "autopar")  # the README's paths are the clone's
    started = time.perf_counter()
    for argv in readme_commands():
        assert argv[0] == "autopar"
        done = subprocess.run([sys.executable, "-m", "autopar", *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=BUDGET_S, check=False)
        assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-2000:])
    elapsed = time.perf_counter() - started
    assert "matches one process" in done.stdout, done.stdout[-2000:]
    assert (tmp_path / "traces.jsonl").is_file()
    assert elapsed <= BUDGET_S, f"the README's commands took {elapsed:.0f} s"
