"""Launchers: where the measured runs of `traces collect`, `train measured` and `traces search` run.

One interface (`Launcher.measure(plan, spec) -> trace record`) and three launchers:
`local` runs the plan on this machine, in this process's torchrun agent, as `autopar run` does
(the default, as before); `slurm` submits each plan as a job through submitit (`slurm.py`);
`ray` runs it as a Ray Train job on a running Ray cluster (`ray_cluster.py`). The two schedulers
run autopar's own `autopar run` command on each node of the job (`run_argv`), so a plan's
outcome (ok, oom, timeout, rank_failed) is decided exactly as on one machine; what only a
scheduler can do to a job (take its nodes back) is the outcome `preempted`, and the record names
the job (cluster.job: launcher, id, requeues). docs/cluster.md says what each assumes.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from autopar.errors import AutoparError, PlanError
from autopar.executor.options import RunOptions, flag, worker_argv
from autopar.plan import Plan
from autopar.traces.record import TraceRecord, append_record, read_records

LAUNCHERS = ("local", "slurm", "ray")
STOP_GRACE_S = 15  # a stopped `autopar run` ends its ranks (torchrun's agent) within this, else it is killed


@dataclass(frozen=True)
class RunSpec:
    """What every run of one command shares: the model, the run options (ranks per node in
    nproc_per_node, nodes per job in nnodes), the cluster the records name, the trace file."""

    model: str
    model_args: dict = field(default_factory=dict)
    options: RunOptions = field(default_factory=RunOptions)
    cluster: str | None = None
    trace: str | None = None


class Launcher(ABC):
    name = ""
    here = False  # the runs run on this machine (its GPUs decide the backend 'auto')

    @abstractmethod
    def measure(self, plan: Plan, spec: RunSpec) -> dict | None:
        """Run the plan; its trace record (a dict, appended to spec.trace), or None when the plan
        was refused before anything ran (the executor cannot run it there)."""

    def script(self, plan: Plan, spec: RunSpec) -> str:
        """What would be submitted for this plan (--dry-run)."""
        raise AutoparError(f"--dry-run needs --launcher slurm (the {self.name} launcher submits no script)")


class LocalLauncher(Launcher):
    """This machine, one node: torchrun's agent in this process (`run_plan`), as `autopar run`."""

    name = "local"
    here = True

    def measure(self, plan: Plan, spec: RunSpec) -> dict | None:
        if spec.options.nnodes != 1:
            raise AutoparError(f"the local launcher runs plans on this machine alone, got --nodes "
                               f"{spec.options.nnodes}; use --launcher slurm or ray")
        from autopar.traces.run_plan import run_plan  # pulls torch: imported on first use

        with tempfile.TemporaryDirectory(prefix="autopar-reward-") as tmp:
            plan_path = Path(tmp) / "plan.json"
            plan.save(plan_path)
            try:
                ran = run_plan(plan_path, spec.model, spec.model_args, spec.options, cluster=spec.cluster,
                               trace=spec.trace)
            except PlanError:  # refused before anything ran: the executor cannot run it here
                return None
        return ran.record.to_dict()


def run_argv(plan_path, spec: RunSpec, trace, node_rank: int | str = 0, master_addr: str | None = None,
             master_port: int | str | None = None) -> list[str]:
    """The `autopar run` command line of one node of a multi-node job of `spec` (the node's rank
    and node 0's address may be shell variables, as in an sbatch script)."""
    o = spec.options
    argv = ["autopar", "run", str(plan_path), str(spec.model)]
    for key, value in spec.model_args.items():
        argv += ["--model-arg", f"{key}={value}"]
    argv += [flag("nproc_per_node"), str(o.nproc_per_node), "--trace", str(trace)]
    if o.nnodes > 1:
        argv += [flag("nnodes"), str(o.nnodes), flag("node_rank"), str(node_rank), flag("master_addr"),
                 str(master_addr), flag("master_port"), str(master_port)]
    if spec.cluster:
        argv += ["--cluster", str(spec.cluster)]
    return argv + worker_argv(o)  # backend, timeout, steps, warm-up, seed, optimizer, ...


def run_command(argv: list[str], timeout_s: float) -> tuple[int, str]:
    """Run `autopar run` (argv from `run_argv`) as this Python's module; (exit status, stderr's
    last line). Interrupted (a scheduler's preemption signal raises here), it stops the run
    first: SIGTERM, which torchrun's agent passes to the ranks, then SIGKILL."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, "-m", "autopar", *argv[1:]], stdout=subprocess.DEVNULL,
                                stderr=err)
        try:
            code = proc.wait(timeout=timeout_s + 120)  # `autopar run` ends at --timeout; profiling comes first
        except BaseException:
            proc.terminate()
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
        err.seek(0)
        lines = [line for line in err.read().decode(errors="replace").splitlines() if line.strip()]
    return code, (lines[-1] if lines else f"exited with status {code}")


def node_record(argv: list[str], trace_tmp: Path, timeout_s: float) -> tuple[dict | None, str | None]:
    """Run one node's `autopar run` and read back the record it appended to `trace_tmp` (node 0);
    (record or None, why there is none: the run's refusal, exit status 2)."""
    try:
        code, last = run_command(argv, timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"`autopar run` did not end within {timeout_s + 120:g} s"
    records = read_records(trace_tmp)[0] if trace_tmp.exists() else []
    if records:
        return records[-1].to_dict(), None
    return None, last if code != 0 else None


def unran(plan: Plan, spec: RunSpec, outcome: str, error: str, job: dict) -> dict:
    """The record of a job that ended without one (`run_plan.unran_record`), appended to spec.trace."""
    from autopar.traces.run_plan import unran_record  # pulls torch: imported on first use

    return unran_record(plan, spec.model, spec.model_args, spec.options, outcome, error, cluster=spec.cluster,
                        job=job, trace=spec.trace).to_dict()


def with_job(record: dict, job: dict, trace) -> dict:
    """The record with the scheduler's job named (cluster.job), appended to `trace` (the locked append)."""
    record = {**record, "cluster": {**record["cluster"], "job": job}}
    if trace:
        append_record(trace, TraceRecord.from_dict(record))
    return record
