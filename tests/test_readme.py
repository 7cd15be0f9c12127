"""The README's "Apply a plan" example, extracted from the README so the two cannot drift: it
trains under a 2-rank plan (torchrun, gloo) and resumes from its checkpoint under a 1-rank plan
with 4 micro-batches, and the loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
# runs a script inside a process group of the backend argv[1] names: `apply` joins a group that
# exists, so the README's example (backend "auto") trains on gloo here even beside a GPU
IN_GROUP = """import runpy, sys
import torch.distributed as dist
dist.init_process_group(sys.argv[1])
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def readme_example() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Apply a plan\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the Apply a plan section has one Python example"
    return blocks[0]


@pytest.mark.slow
def test_readme_apply_example_trains_and_resumes_across_world_sizes(tmp_path):
    (tmp_path / "train.py").write_text(readme_example())
    (tmp_path / "in_group.py").write_text(IN_GROUP)
    base = dict(tp=1, pp=1, precision="fp32")
    Plan(dp=2, micro_batch_size=8, num_micro_batches=1, **base).save(tmp_path / "dp2.json")
    Plan(dp=1, micro_batch_size=4, num_micro_batches=4, **base).save(tmp_path / "one_rank.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def run(*cmd):
        done = subprocess.run([sys.executable, *cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=240, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        return [line.split() for line in done.stdout.splitlines() if line.startswith("step")]

    first = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "in_group.py", "gloo", "train.py",
                "dp2.json")
    assert (tmp_path / "ckpt").is_dir()
    resumed = run("train.py", "one_rank.json")  # one rank, no torchrun
    steps = first + resumed
    assert [int(s[1]) for s in steps] == list(range(1, 9))
    assert float(steps[-1][3]) < float(steps[0][3])
