"""Launch a plan's workers through torchrun's own launcher and classify how the job ended.

`launch` builds a torchrun command line (`python -m autopar.executor.worker` per rank) and runs
it in this process with `torch.distributed.run.run`, the function behind the `torchrun`
command: same rendezvous, same elastic agent, same error files. No restarts: a failed rank
ends the job, and its recorded error is the job's error. A timeout raises in the agent's
thread, whose shutdown path then terminates every worker.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from autopar.errors import PlanError
from autopar.executor.outcome import is_oom, killed_by, oom_kills
from autopar.executor.worker import LAUNCHER_PID, failure_note
from autopar.plan import Plan


@dataclass(frozen=True)
class LaunchSpec:
    """Where and how to run: torchrun's node flags plus the worker's options."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: str = "auto"
    timeout_s: float | None = None
    steps: int = 10
    warmup: int = 3
    seed: int = 0
    optimizer: str = "adamw"
    lr: float = 1e-3
    check_parity: bool = False
    no_dropout: bool = False

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


@dataclass(frozen=True)
class LaunchResult:
    """How the job ended; `result` is rank 0's measurement (None on other nodes or on failure)."""

    outcome: str  # ok | oom | timeout | error
    error: str | None = None
    result: dict | None = None
    wall_s: float = 0.0


class _JobTimeout(Exception):
    pass


def check_world_size(plan: Plan, spec: LaunchSpec) -> None:
    """Refuse, before starting anything, a plan made for another number of ranks."""
    plan.dims.check_world(spec.world_size, f"--nnodes {spec.nnodes} x --nproc-per-node {spec.nproc_per_node} = "
                          f"{spec.world_size}", f"launch {plan.world_size} processes or use a plan for "
                          f"{spec.world_size}", needs="the plan needs ")


def torchrun_argv(plan_path, model, model_args: dict, spec: LaunchSpec, result_path) -> list[str]:
    """The torchrun command line (without `torchrun`) that runs the worker on this node."""
    if spec.nnodes == 1:
        nodes = ["--standalone", "--nnodes", "1"]  # a free local port, no clash between jobs
    else:
        nodes = ["--nnodes", str(spec.nnodes), "--node-rank", str(spec.node_rank),
                 "--master-addr", spec.master_addr, "--master-port", str(spec.master_port)]
    worker = ["--plan", str(plan_path), "--model", str(model), "--model-args", json.dumps(model_args),
              "--steps", str(spec.steps), "--warmup", str(spec.warmup), "--seed", str(spec.seed),
              "--optimizer", spec.optimizer, "--lr", str(spec.lr), "--backend", spec.backend,
              "--result", str(result_path)]
    if spec.timeout_s:
        worker += ["--timeout", str(spec.timeout_s)]
    if spec.check_parity:
        worker.append("--check-parity")
    if spec.no_dropout:
        worker.append("--no-dropout")
    return [*nodes, "--nproc-per-node", str(spec.nproc_per_node), "--max-restarts", "0",
            "--module", "autopar.executor.worker", *worker]


@contextmanager
def _deadline(seconds: float | None):
    """Raise _JobTimeout in the main thread after `seconds` (the elastic agent runs there)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _JobTimeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _failure(err, result_path: Path, oom_kills_before: int | None = None) -> tuple[str, str]:
    """(outcome, message) of the rank whose failure caused the others; its traceback is in its log.

    A rank that died of a signal (other than the agent's SIGTERM: the OOM killer, a segfault)
    caused its peers' errors; otherwise the worker's failure notes order the errors to the
    microsecond (torchrun's error files carry whole seconds, so its "first failure" may be a
    peer that only lost its connection)."""
    died = {rank: f for rank, f in err.failures.items() if f.signal_name() not in ("<N/A>", "SIGTERM")}
    notes = {}
    for rank in err.failures:
        note = Path(failure_note(result_path, rank))
        if note.exists():
            notes[rank] = json.loads(note.read_text())
    if died:
        rank = min(died, key=lambda r: died[r].timestamp)
        message = killed_by(died[rank].signal_name(), oom_kills_before)
    elif notes:
        rank = min(notes, key=lambda r: notes[r]["time"])
        message = notes[rank]["message"].strip()
    else:
        rank, failure = err.get_first_failure()
        recorded = failure.message.get("message", "") if isinstance(failure.message, dict) else ""
        message = recorded.strip() or f"exit code {failure.exitcode}"
    return ("oom" if is_oom(message) else "error"), f"rank {rank} failed: {message}"


def launch(plan_path, model, model_args: dict, spec: LaunchSpec) -> LaunchResult:
    """Run the plan's workers on this node and wait for them (a collective of all nodes)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    check_world_size(Plan.load(plan_path), spec)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autopar-run-") as tmp:
        result_path = Path(tmp) / "result.json"
        args = get_args_parser().parse_args(torchrun_argv(plan_path, model, model_args, spec, result_path))
        os.environ[LAUNCHER_PID] = str(os.getpid())  # workers inherit it: see worker._die_with_launcher
        kills = oom_kills()
        try:
            with _deadline(spec.timeout_s):
                run(args)
        except _JobTimeout:
            return LaunchResult("timeout", f"the job did not finish within --timeout {spec.timeout_s:g} s",
                                wall_s=time.perf_counter() - started)
        except ChildFailedError as err:
            outcome, message = _failure(err, result_path, kills)
            return LaunchResult(outcome, message, wall_s=time.perf_counter() - started)
        result = json.loads(result_path.read_text()) if result_path.exists() else None
        return LaunchResult("ok", result=result, wall_s=time.perf_counter() - started)

