"""What the launcher tests share (tests/test_launchers.py, tests/test_launchers_ray.py): the tiny GPT's
command, the plans `traces collect` runs for it, and the check of the records a launcher wrote."""

from __future__ import annotations

from pathlib import Path

from autopar.cluster import load_cluster
from autopar.traces.collect import choose_plans
from autopar.traces.record import read_records
from autopar.workload import Workload
from conftest import profile

TINY = ["gpt", "--model-arg", "size=tiny"]
QUICK = ["--steps", "2", "--warmup", "1"]  # a run's timed steps: what the records need, no more


def tiny_plans(k: int, nproc: int = 2, nodes: int = 1) -> list:
    """The plans `traces collect --plans k --nproc nproc` runs (gloo, the cpu preset)."""
    workload = Workload(profile("gpt", "fp32", size="tiny"), load_cluster("cpu").with_nodes(nodes, nproc), 16)
    return choose_plans(workload, k, 0, "gloo")


def check_records(path: Path, plans: list, launcher: str) -> list:
    """Every plan's record, in order: ok, its plan, a measured step time, the job that ran it."""
    records, problems = read_records(path)
    assert problems == []
    assert [r.plan for r in records] == [p.to_dict() for p in plans]
    for r in records:
        assert r.outcome == "ok" and r.measured["median_step_s"] > 0, r.error
        assert r.cluster["job"]["launcher"] == launcher and r.cluster["job"]["id"]
    assert len({r.cluster["job"]["id"] for r in records}) == len(records)  # a job per plan
    return records
