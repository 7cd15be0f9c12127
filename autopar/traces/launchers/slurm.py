"""The Slurm launcher: each plan a job of `nodes x gpus-per-node` submitted through submitit.

A job has one task per node; each task runs autopar's own `autopar run` (`run_argv`: torchrun's
agent and the node's ranks, node 0's address and a port derived from the job id), so the outcome
is decided as on one machine. Node 0 appends the record, with the job named (cluster.job), to the
trace file with the locked append: the trace file and the job folder must be on a filesystem
every node shares. Preemption: Slurm signals the job (submitit's USR2), `PlanJob.checkpoint`
resubmits the same run with its requeue count one higher, up to `max_requeues`; past that the
job ends and the submitting process records the outcome `preempted`. `local` runs the same
submission through submitit's local executor (this machine; for tests and laptops). Partition,
account, QoS and time come from flags or a small JSON file (`read_settings`).
"""

from __future__ import annotations

import hashlib
import math
import shlex
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.schema import Int, List, Obj, Str, check, loads, read_file
from autopar.traces.launchers import Launcher, RunSpec, node_record, run_argv, unran, with_job

PORTS = (20000, 20000)  # node 0's rendezvous port: first + job id mod count (jobs sharing a node differ)
MARGIN_MIN = 10  # the job's time limit beyond the run's --timeout (profiling, imports, the scheduler's signal)


@dataclass(frozen=True)
class SlurmSettings:
    """What the cluster's scheduler needs besides the run: flags win over the --slurm-config file."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int | None = None  # default: the run's --timeout plus MARGIN_MIN
    cpus_per_task: int | None = None  # default: one core per rank
    folder: str = "autopar-slurm"  # submitit's scripts, pickles and logs; on the shared filesystem
    max_requeues: int = 3  # a preempted job is requeued this many times at most
    setup: tuple[str, ...] = ()  # lines of the sbatch script before the job starts (module load, ...)
    local: bool = False  # submitit's local executor: this machine, the same submission path

    def __post_init__(self):
        for name in ("time_min", "cpus_per_task"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise AutoparError(f"--slurm-{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.max_requeues < 0:
            raise AutoparError(f"--slurm-max-requeues must be 0 or more, got {self.max_requeues}")


SETTINGS_SCHEMA = Obj({"partition": Str(), "account": Str(), "qos": Str(), "time_min": Int(1, 10**6),
                       "cpus_per_task": Int(1, 10**4), "folder": Str(), "max_requeues": Int(0, 1000),
                       "setup": List(Str())})


def read_settings(path) -> dict:
    """The settings a --slurm-config JSON file holds (any of SETTINGS_SCHEMA's keys)."""
    d = check(loads(read_file(path, "Slurm config", AutoparError), str(path), AutoparError), SETTINGS_SCHEMA,
              f"Slurm config {path}", AutoparError)
    return {**d, **({"setup": tuple(d["setup"])} if "setup" in d else {})}


def _submitit():
    try:
        import submitit  # submitit: heavy, imported on first use
    except ImportError:
        raise AutoparError("--launcher slurm needs submitit: pip install 'autopar[cluster]'") from None
    return submitit


def master_port(job_id) -> int:
    """Node 0's rendezvous port, the same on every node of the job (from its id)."""
    head = str(job_id).split("_")[0]
    n = int(head) if head.isdigit() else int(hashlib.sha256(head.encode()).hexdigest(), 16)
    return PORTS[0] + n % PORTS[1]


@dataclass(frozen=True)
class PlanJob:
    """The submitted call: on each node, `autopar run` of the plan; node 0 returns the record.
    submitit pickles it; `checkpoint` is submitit's hook on the preemption signal."""

    plan_path: str
    spec: RunSpec
    requeues: int = 0
    max_requeues: int = 3

    def __call__(self) -> dict | None:
        submitit = _submitit()
        env = submitit.JobEnvironment()
        trace_tmp = Path(self.plan_path).with_suffix(f".{env.job_id}.node{env.node}.jsonl")
        trace_tmp.unlink(missing_ok=True)  # a requeued job runs afresh
        argv = run_argv(self.plan_path, self.spec, trace_tmp, env.node, env.hostnames[0], master_port(env.job_id))
        print(f"autopar: node {env.node} of job {env.job_id} (requeues {self.requeues}): {shlex.join(argv)}",
              flush=True)
        record, why = node_record(argv, trace_tmp, self.spec.options.timeout_s)
        trace_tmp.unlink(missing_ok=True)
        if env.node != 0:
            return None
        if record is None:
            return {"refused": why}
        job = {"launcher": "slurm", "id": str(env.job_id), "requeues": self.requeues}
        return {"record": with_job(record, job, self.spec.trace)}

    def checkpoint(self, *args, **kwargs):
        """Preempted: the same run again, counted; None (not requeued) once max_requeues are spent."""
        submitit = _submitit()
        if self.requeues >= self.max_requeues:
            return None
        return submitit.helpers.DelayedSubmission(replace(self, requeues=self.requeues + 1))


class SlurmLauncher(Launcher):
    name = "slurm"

    def __init__(self, settings: SlurmSettings | None = None, say=lambda msg: None):
        self.settings = settings or SlurmSettings()
        self.say = say
        self.here = self.settings.local

    def check_scheduler(self) -> None:
        """Before any work: the Slurm commands submitit submits with are here (or --slurm-local)."""
        if not self.settings.local and not (shutil.which("sbatch") and shutil.which("srun")):
            raise AutoparError("--launcher slurm submits with sbatch and srun, which are not on PATH here; run it "
                               "on the cluster's login node, or add --slurm-local (this machine) or --dry-run")

    def parameters(self, spec: RunSpec) -> dict:
        """The job's resources, in sbatch's terms: one task per node, its ranks' GPUs (NCCL) and cores."""
        o, s = spec.options, self.settings
        params = {"job_name": "autopar-run", "nodes": o.nnodes, "ntasks_per_node": 1,
                  "cpus_per_task": s.cpus_per_task or o.nproc_per_node,
                  "time": s.time_min or math.ceil(o.timeout_s / 60) + MARGIN_MIN}
        if o.backend == "nccl":
            params["gpus_per_node"] = o.nproc_per_node
        params.update({k: getattr(s, k) for k in ("partition", "account", "qos") if getattr(s, k)})
        if s.setup:
            params["setup"] = list(s.setup)
        return params

    def executor(self, spec: RunSpec):
        submitit = _submitit()
        params = self.parameters(spec)
        if not self.settings.local:
            self.check_scheduler()
            ex = submitit.SlurmExecutor(self.settings.folder, max_num_timeout=self.settings.max_requeues)
            ex.update_parameters(**params)
            return ex
        if spec.options.nnodes != 1:
            raise AutoparError(f"--slurm-local runs a job on this machine alone, got --nodes {spec.options.nnodes}")
        ex = submitit.LocalExecutor(self.settings.folder, max_num_timeout=self.settings.max_requeues)
        ex.update_parameters(timeout_min=params["time"], tasks_per_node=1, nodes=1,
                             gpus_per_node=params.get("gpus_per_node", 0), setup=params.get("setup", []))
        return ex

    def save_plan(self, plan: Plan) -> str:
        """The plan file every node of the job reads, in the job folder (shared)."""
        digest = hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]
        path = Path(self.settings.folder).absolute() / "plans" / f"{digest}.json"
        if not path.exists():
            plan.save(path)
        return str(path)

    def submit(self, plan: Plan, spec: RunSpec):
        """Submit the plan's job; the submitit Job."""
        job = self.executor(spec).submit(PlanJob(self.save_plan(plan), spec, 0, self.settings.max_requeues))
        self.say(f"submitted Slurm job {job.job_id}" + (" (local executor)" if self.settings.local else ""))
        return job

    def measure(self, plan: Plan, spec: RunSpec) -> dict | None:
        return self.wait(self.submit(plan, spec), plan, spec)

    def wait(self, job, plan: Plan, spec: RunSpec) -> dict | None:
        """The job's record; a job that ended without one (preempted past its requeues, cancelled,
        its node lost) is recorded here, as `preempted` or `error`."""
        from submitit.core.utils import FailedJobError, UncompletedJobError  # submitit: heavy, imported on first use

        try:
            out = job.result()
        except (FailedJobError, UncompletedJobError) as e:
            text = str(e)
            preempted = "not requeued" in text or "PREEMPTED" in text
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            reason = next((line for line in lines if "not requeued" in line), lines[-1] if lines else "")
            ended = {"launcher": "slurm", "id": str(job.job_id)}
            if preempted:
                ended["requeues"] = self.settings.max_requeues
            error = (f"job {job.job_id} was preempted and not requeued again ({reason})" if preempted
                     else f"job {job.job_id} ended without a result: {reason}; its log: {job.paths.stderr}")
            return unran(plan, spec, "preempted" if preempted else "error", error, ended)
        if out is None or "refused" in out:
            self.say(f"job {job.job_id}: the plan was refused: {(out or {}).get('refused')}")
            return None
        return out["record"]

    def script(self, plan: Plan, spec: RunSpec) -> str:
        """The sbatch script this plan's job would be submitted with; the line before srun names the
        `autopar run` each node's task runs."""
        plan_path = self.save_plan(plan)
        trace_tmp = Path(plan_path).with_suffix(".$SLURM_JOB_ID.node$SLURM_NODEID.jsonl")  # as PlanJob names it
        argv = run_argv(plan_path, spec, trace_tmp, "$SLURM_NODEID",
                        '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                        f"$(({PORTS[0]} + SLURM_JOB_ID % {PORTS[1]}))")
        shown = " ".join(a if a.startswith("$") else f'"{a}"' if "$" in a else shlex.quote(a) for a in argv)
        params = self.parameters(spec)
        params["setup"] = [*params.get("setup", []),
                           f"# each node's task runs (autopar.traces.launchers.slurm.PlanJob): {shown}",
                           f"# node 0 appends the record to {spec.trace or 'no trace file'}"]
        # what SlurmExecutor writes (its constructor needs srun on PATH, which a dry run must not)
        from submitit.slurm.slurm import _make_sbatch_string  # submitit: heavy, imported on first use

        command = " ".join([shlex.quote(sys.executable), "-u -m submitit.core._submit",
                            shlex.quote(str(Path(self.settings.folder).absolute()))])
        return _make_sbatch_string(command=command, folder=Path(self.settings.folder).absolute(), **params)

