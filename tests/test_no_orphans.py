"""A killed autopar leaves no process behind: kill -9 of `autopar search` while its child
`autopar.profile.isolated` profiles a model (issue 39, acceptance 4), and the lifeline itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SLEEPER = '''import time
import torch

def build_model():
    time.sleep(3600)  # a model that takes long to build: the profiler waits here

def example_batch(b):
    return torch.zeros(b, 2), torch.zeros(b)
'''


def live(marker: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line holds `marker`."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == os.getpid():
            continue
        try:
            cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker in cmdline and state not in ("Z", "X"):
            found.append(int(p.name))
    return found


def wait_for(condition, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.2)
    return condition()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds processes through /proc")
def test_kill_9_of_a_profiling_search_leaves_no_profiler_10_s_later(tmp_path):
    model = tmp_path / "slow_model.py"
    model.write_text(SLEEPER)
    env = {**os.environ, "AUTOPAR_CACHE_DIR": str(tmp_path / "cache")}  # a cold cache: the profiler must run
    search = subprocess.Popen([sys.executable, "-m", "autopar", "search", str(model), "--cluster", "cpu",
                               "--global-batch", "8", "--profile-timeout", "600", "-o", str(tmp_path / "plan.json")],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        profiler = wait_for(lambda: [p for p in live("autopar.profile.isolated") if p in live(str(model))], 120)
        assert profiler, "the search never started its profiler"
        time.sleep(1)  # the child is past its start-up, waiting in build_model
        search.send_signal(signal.SIGKILL)
        search.wait()
        time.sleep(10)
        assert not live(str(model)), f"processes left 10 s after kill -9 of autopar search: {live(str(model))}"
    finally:
        search.kill()
        for pid in live(str(model)):  # the test must not leave them either
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["linux", "other"])
def test_the_lifeline_ends_a_child_whose_parent_is_killed(tmp_path, platform):
    """The middle process starts a grandchild that calls die_with_parent, then is killed: the
    grandchild dies too (on Linux by PR_SET_PDEATHSIG; on another platform, as the grandchild
    pretends to run on here, by its polling thread)."""
    marker = str(tmp_path / "grandchild")
    pretend = "" if platform == "linux" else f"sys.platform = {platform!r}; "
    grandchild = (f"import os, sys, time; from autopar.executor.lifeline import die_with_parent; {pretend}"
                  f"die_with_parent(os.getppid()); open({marker!r}, 'w').close(); time.sleep(600)")
    middle = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                               f"'-c', {grandchild!r}, {marker!r}]); time.sleep(600)"])
    try:
        assert wait_for(lambda: Path(marker).exists(), 60), "the grandchild did not start"
        assert live(marker)
        middle.kill()
        middle.wait()
        assert wait_for(lambda: not live(marker), 5), "the grandchild outlived its killed parent"
    finally:
        middle.kill()
        for pid in live(marker):
            os.kill(pid, signal.SIGKILL)
