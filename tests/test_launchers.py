"""Launchers (issue 43): `--launcher slurm` through submitit (its local executor: the same
submission path, local processes) and a preempted Slurm job requeued once; the flags, in process.
Ray's tests are in tests/test_launchers_ray.py (a file of their own: pytest-xdist gives each file
to one worker, and together they took 10 minutes on one)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest

from autopar.cli import build_parser, main
from autopar.cluster import load_cluster
from autopar.executor.options import RunOptions
from autopar.traces.launchers import RunSpec, run_argv
from autopar.traces.launchers.search import study_key
from autopar.traces.launchers.slurm import PlanJob, SlurmLauncher, SlurmSettings
from autopar.traces.record import read_records
from autopar.workload import Workload
from conftest import error_lines, profile
from launcher_runs import QUICK, TINY, check_records, tiny_plans


# -- in-process: the script, the command each node runs, the flags ----------------------------------------------

def test_dry_run_prints_the_sbatch_script_with_the_autopar_run_command(capsys, tmp_path):
    config = tmp_path / "slurm.json"
    config.write_text(json.dumps({"partition": "gpu", "account": "proj7", "time_min": 45, "setup": ["module load cuda"]}))
    code = main(["traces", "collect", *TINY, "--plans", "1", "--nproc", "4", "--nodes", "2", "--backend", "nccl",
                 "--launcher", "slurm", "--dry-run", "--slurm-config", str(config), "--slurm-qos", "high",
                 "--slurm-folder", str(tmp_path / "jobs"), "-o", str(tmp_path / "t.jsonl")])
    out = capsys.readouterr().out
    assert code == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --cpus-per-task=4", "#SBATCH --partition=gpu", "#SBATCH --account=proj7",
                 "#SBATCH --qos=high", "#SBATCH --time=45", "#SBATCH --signal=USR2@90", "module load cuda"):
        assert line in out.splitlines(), line
    run = next(line for line in out.splitlines() if "autopar run " in line)
    assert "--nnodes 2 --node-rank $SLURM_NODEID" in run and "--nproc-per-node 4" in run and "--backend nccl" in run
    assert not (tmp_path / "t.jsonl").exists()  # nothing ran


def test_each_node_runs_the_command_autopar_run_parses_back():
    spec = RunSpec("gpt", {"size": "tiny"}, RunOptions(nproc_per_node=4, nnodes=2, steps=7, timeout_s=60.5,
                                                        backend="nccl"), cluster="dgx-a100-80g")
    argv = run_argv("p.json", spec, "t.jsonl", 1, "node0", 20123)
    args = build_parser().parse_args(argv[1:])
    assert (args.plan, args.model, args.model_arg, args.trace, args.cluster) == (
        "p.json", "gpt", ["size=tiny"], "t.jsonl", "dgx-a100-80g")
    parsed = RunOptions.from_args(args)
    assert parsed == RunOptions(nproc_per_node=4, nnodes=2, node_rank=1, master_addr="node0", master_port=20123,
                                steps=7, timeout_s=60.5, backend="nccl")


def test_a_preempted_job_is_requeued_counted_until_its_limit():
    job = PlanJob("p.json", RunSpec("gpt"), 0, max_requeues=2)
    again = job.checkpoint()
    assert again.function.requeues == 1 and again.function.plan_path == "p.json"
    assert again.function.checkpoint().function.requeues == 2
    assert PlanJob("p.json", RunSpec("gpt"), 2, max_requeues=2).checkpoint() is None  # spent: not requeued


@pytest.mark.parametrize("flags, message", [
    (["--dry-run"], "--slurm-local and --dry-run go with --launcher slurm"),
    (["--nodes", "2"], "the local launcher runs on this machine alone"),
    (["--launcher", "slurm"], "sbatch and srun, which are not on PATH here"),
    (["--launcher", "slurm", "--slurm-config", "{bad}"], "Slurm config"),
    (["--launcher", "slurm", "--slurm-max-requeues", "-1", "--slurm-local"], "--slurm-max-requeues must be 0 or more"),
])
def test_bad_launcher_flags_are_one_line(capsys, tmp_path, flags, message):
    flags = [str(tmp_path / "missing.json") if f == "{bad}" else f for f in flags]
    code = main(["traces", "collect", *TINY, "--plans", "1", "--nproc", "2", *flags, "--slurm-folder",
                 str(tmp_path / "jobs"), "-o", str(tmp_path / "t.jsonl")])
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "t.jsonl").exists()


@pytest.mark.parametrize("fix,message", [("bogus=1", "--fix bogus=1"), ("tp=4", "--fix tp=4")])
def test_a_bad_fix_of_a_measured_search_is_one_line_before_any_run(capsys, tmp_path, fix, message):
    code = main(["traces", "search", *TINY, "--trials", "1", "--nproc", "2", "--fix", fix,
                 "--storage", f"sqlite:///{tmp_path / 'study.db'}", "-o", str(tmp_path / "t.jsonl")])
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"autopar: error: {message}"), err
    assert not (tmp_path / "t.jsonl").exists() and not (tmp_path / "study.db").exists()


def test_a_measured_study_is_one_per_set_of_held_knobs():
    workload = Workload(profile("gpt", "fp32", size="tiny"), load_cluster("cpu").with_nodes(1, 2), 16)
    spec = RunSpec("gpt", {"size": "tiny"}, RunOptions(nproc_per_node=2, backend="gloo"))
    held = dataclasses.replace(workload, fixed=(("tp", 1),))
    assert study_key(workload, spec) != study_key(held, spec)
    assert study_key(held, spec) == study_key(dataclasses.replace(workload, fixed=(("tp", 1),)), spec)


# -- submitit's local executor: the Slurm submission path, local processes --------------------------------------

@pytest.mark.slow
@pytest.mark.procs
def test_slurm_local_collect_writes_the_local_launchers_records(capsys, tmp_path):
    out = tmp_path / "traces.jsonl"
    started = time.perf_counter()
    code = main(["traces", "collect", *TINY, "--plans", "4", "--nproc", "2", "--launcher", "slurm", "--slurm-local",
                 "--slurm-folder", str(tmp_path / "jobs"), *QUICK, "-o", str(out)])
    print(f"slurm-local collect of 4 plans: {time.perf_counter() - started:.0f} s")
    assert code == 0
    records = check_records(out, tiny_plans(4), "slurm")
    assert all(r.cluster["job"]["requeues"] == 0 for r in records)


@pytest.mark.slow
@pytest.mark.procs
def test_a_job_killed_mid_run_is_requeued_once_and_its_record_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the job's ranks beat under it: seen mid-run
    (tmp_path / "tmp").mkdir()
    plan = tiny_plans(1)[0]
    launcher = SlurmLauncher(SlurmSettings(local=True, folder=str(tmp_path / "jobs"), max_requeues=1))
    spec = RunSpec("gpt", {"size": "tiny"}, RunOptions(nproc_per_node=2, backend="gloo", steps=40, warmup=1),
                   trace=str(tmp_path / "traces.jsonl"))
    started = time.perf_counter()
    job = launcher.submit(plan, spec)
    deadline = time.monotonic() + 300
    while not any(json.loads(b.read_text() or "{}").get("step", -1) >= 1
                  for b in (tmp_path / "tmp").glob("autopar-run-*/result.json.rank0.beat") if b.stat().st_size):
        assert time.monotonic() < deadline and not job.done(), "the job never reached its second step"
        time.sleep(0.2)
    # submitit's preemption signal (USR2), sent as Slurm sends it: to the job's task (the local executor's
    # LocalJob._interrupt signals its controller, which forwards only SIGTERM)
    (task,) = Path(f"/proc/{job.job_id}/task/{job.job_id}/children").read_text().split()
    os.kill(int(task), signal.SIGUSR2)
    record = launcher.wait(job, plan, spec)
    print(f"preempted and requeued job: {time.perf_counter() - started:.0f} s")
    assert record["outcome"] == "ok" and record["cluster"]["job"] == {"launcher": "slurm", "id": str(job.job_id),
                                                                      "requeues": 1}
    (written,), _ = read_records(tmp_path / "traces.jsonl")  # one record: the killed attempt appended none
    assert written.cluster["job"]["requeues"] == 1 and written.outcome == "ok"
    assert "this job is preempted" in Path(job.paths.stderr).read_text()  # submitit's handler caught it
    attempts = [line for line in Path(job.paths.stdout).read_text().splitlines() if line.startswith("autopar: node 0")]
    assert [a.split("(")[1].split(")")[0] for a in attempts] == ["requeues 0", "requeues 1"]  # both ran `autopar run`
