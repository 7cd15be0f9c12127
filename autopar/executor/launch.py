"""Launch a plan's workers through torchrun's own launcher and classify how the job ended.

`launch` builds a torchrun command line (`python -m autopar.executor.worker` per rank) and runs
it in this process with `torch.distributed.run.run`, the function behind the `torchrun`
command: same rendezvous, same elastic agent, same error files. No restarts: a failed rank
ends the job, and its own error is the job's error (except an elastic job, `ElasticSpec`: torchrun
restarts its workers on another world size, `autopar.executor.elastic`). Each rank beats a heartbeat file; the
launcher watches them to order the ranks' ends and to find a stopped rank, which torchrun
would blame on the survivors' collective timeouts. A timeout raises in the agent's thread,
whose shutdown path then terminates every worker; whatever is left is killed. The ranks'
stdout and stderr (a failed job's peers print their own tracebacks of the lost connection) and
the agent's log go to files in a log folder (torchrun's --redirects, `LaunchResult.logs`), not
the terminal: the caller shows one line naming the failing rank and that folder.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from autopar.executor.mixed_layout import check_world, is_mixed_plan_file
from autopar.executor.options import RunOptions, worker_argv
from autopar.executor.outcome import is_oom, killed_by, oom_kills
from autopar.executor.worker import LAUNCHER_PID, failure_note, heartbeat_file
from autopar.mixed.plan import MixedPlan
from autopar.plan import Plan

AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's agent handles these (PContext.start)
STALE_S = 20.0  # a rank whose heartbeat is this old is stopped (it beats every worker.HEARTBEAT_S)
POLL_S = 0.2  # how often the launcher looks at the heartbeats


@dataclass(frozen=True)
class LaunchResult:
    """How the job ended; `result` is rank 0's measurement (None on other nodes or on failure)."""

    outcome: str  # ok | oom | timeout | rank_failed (autopar.traces.record.OUTCOMES)
    error: str | None = None
    result: dict | None = None
    wall_s: float = 0.0
    logs: str | None = None  # the folder of the ranks' output and the agent's log, kept when the job failed or
    # a rank wrote to stderr (else removed)


class _JobTimeout(Exception):
    pass



def check_world_size(plan: Plan, options: RunOptions) -> None:
    """Refuse, before starting anything, a plan made for another number of ranks."""
    plan.dims.check_world(options.world_size, f"--nnodes {options.nnodes} x --nproc-per-node {options.nproc_per_node} = "
                          f"{options.world_size}", f"launch {plan.world_size} processes or use a plan for "
                          f"{options.world_size}", needs="the plan needs ")


def torchrun_argv(plan_path, model, model_args: dict, options: RunOptions, result_path, logs=None) -> list[str]:
    """The torchrun command line (without `torchrun`) that runs the worker on this node."""
    if options.elastic:
        nodes = options.elastic.torchrun_flags(options.nnodes)
    elif options.nnodes == 1:
        nodes = ["--standalone", "--nnodes", "1"]  # a free local port, no clash between jobs
    else:
        nodes = ["--nnodes", str(options.nnodes), "--node-rank", str(options.node_rank),
                 "--master-addr", options.master_addr, "--master-port", str(options.master_port)]
    worker = ["--plan", str(plan_path), "--model", str(model), "--model-args", json.dumps(model_args),
              "--result", str(result_path), *worker_argv(options)]
    if not options.elastic:  # no restarts: a failed rank ends the job
        nodes += ["--max-restarts", "0"]
    if logs is not None:  # every rank's stdout and stderr to files under `logs`, none to the terminal
        nodes += ["--redirects", "3", "--log-dir", str(logs)]
    return [*nodes, "--nproc-per-node", str(options.nproc_per_node), "--module", "autopar.executor.worker", *worker]


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


@contextmanager
def _agent_log(path: Path):
    """The agent logs through the `torch.distributed` logger, to stderr (the workers it terminates,
    each failed rank's exit code): while it runs, those lines go to `path` instead."""
    logger = logging.getLogger("torch.distributed")
    saved = logger.handlers[:]
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(saved[0].formatter if saved else logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.handlers = [handler]
    try:
        yield
    finally:
        logger.handlers = saved
        handler.close()


def _rank_logs(logs: Path, local_rank: int) -> list[Path]:
    """The stderr files torchrun wrote for one local rank (one per attempt)."""
    return sorted(logs.glob(f"*/attempt_*/{local_rank}/stderr.log"))


def _keep_logs(logs: Path, launched: LaunchResult, ranks: range) -> LaunchResult:
    """The result naming its log folder: kept when the job failed or a rank wrote to stderr, else removed."""
    wrote = any(f.stat().st_size for r in range(len(ranks)) for f in _rank_logs(logs, r))
    if launched.outcome == "ok" and not wrote:
        shutil.rmtree(logs, ignore_errors=True)
        return launched
    return replace(launched, logs=str(logs))


@contextmanager
def _own_signal_handlers():
    """torchrun's agent replaces this process's handlers of AGENT_SIGNALS with its own (which raise
    SignalException) and leaves them there: put the caller's back, so that a caller launching many
    runs (the measured reward) still gets KeyboardInterrupt from Ctrl-C between them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for name in AGENT_SIGNALS if (sig := getattr(signal, name, None))}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:  # None: a handler not set from Python, which cannot be put back
                signal.signal(sig, handler)


class _Watch(threading.Thread):
    """Watches the ranks: when each rank's process ended (a pidfd per rank becomes readable at its
    exit, so the order of the ends is exact, which torchrun's whole-second error files are not),
    and which rank stopped beating its heartbeat file (SIGSTOP, a frozen host): that one is
    killed so the job ends now, and named."""

    def __init__(self, result_path: Path, ranks: range, stale_s: float):
        super().__init__(daemon=True)
        self.result_path, self.ranks, self.stale_s = result_path, ranks, stale_s
        self.beats: dict[int, dict] = {}
        self.gone: dict[int, int] = {}  # rank -> the order its process ended in (0 first)
        self.pidfds: dict[int, int] = {}  # pidfd -> rank
        self.stopped: str | None = None  # the verdict on a rank that stopped beating
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                self._look()
                ready, _, _ = select.select(list(self.pidfds), [], [], POLL_S)
                for fd in ready:  # ended in this order (ties: the same wake-up)
                    self.gone.setdefault(self.pidfds.pop(fd), len(self.gone))
                    os.close(fd)
        finally:
            for fd in self.pidfds:
                os.close(fd)

    def _look(self) -> None:
        now = time.time()
        for rank in self.ranks:
            beat = _read_json(heartbeat_file(self.result_path, rank))
            if beat is None or rank in self.gone:
                continue
            if rank not in self.beats or self.beats[rank]["pid"] != beat["pid"]:
                try:
                    self.pidfds[os.pidfd_open(beat["pid"])] = rank
                except OSError:  # ended already
                    self.gone.setdefault(rank, len(self.gone))
            self.beats[rank] = beat
            age = now - beat["time"]
            if self.stopped is None and age > self.stale_s:
                self.stopped = (f"rank {rank} stopped responding: no heartbeat for {age:.0f} s, the last at step "
                                f"{beat['step']} (process {beat['pid']} stopped or frozen)")
                _kill(beat["pid"])

    def slowest(self) -> str:
        """Which rank a timed-out job waited for: the one at the earliest step, and of those one
        that is not itself waiting inside torch (its peers wait there for it, in a collective or
        in the backward pass that launches them)."""
        if not self.beats:
            return "no rank started"

        def waiting(r: int) -> bool:
            return "/torch/" in str(self.beats[r].get("where", ""))

        rank = min(self.beats, key=lambda r: (self.beats[r]["step"], waiting(r), r))
        beat = self.beats[rank]
        step = "starting up" if beat["step"] < 0 else f"at step {beat['step']}"
        return f"rank {rank} was {step}" + (f" in {beat['where']}" if beat.get("where") else "")

    def kill_workers(self) -> None:
        """No rank outlives the launch, stopped or not."""
        for beat in self.beats.values():
            _kill(beat["pid"])


def _read_json(path) -> dict | None:
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill(pid: int) -> None:
    if _alive(pid) and "autopar.executor.worker" in _cmdline(pid):
        try:
            os.kill(pid, signal.SIGKILL)  # works on a stopped process too
        except ProcessLookupError:
            pass


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# What a rank raises when a peer, not it, failed (gloo's TCP pair, NCCL's remote-error check),
# lower case: such a rank is never named as the cause while another failed rank is not one.
PEER_LOSS = ("connection closed by peer", "connection reset by peer", "remote worker crashing",
             "remote process exited")


def _failure(err, result_path: Path, watch: _Watch, oom_kills_before: int | None = None) -> tuple[str, str]:
    """(outcome, message) of the rank whose failure caused the others'.

    The rank whose process ended first caused the rest (its peers fail on the lost connection
    after it); with its own note (the first line of its exception) if it raised, else its signal
    or exit code. Without a recorded order, a rank killed by a signal other than the agent's
    SIGTERM, then the earliest failure note, then torchrun's first failure."""
    notes = {rank: n for rank in err.failures if (n := _read_json(failure_note(result_path, rank)))}

    def own_error(rank: int) -> str:
        if rank in notes:
            return str(notes[rank].get("message", "")).strip()
        failure = err.failures.get(rank)
        if failure is None:
            return "ended"
        if failure.signal_name() != "<N/A>":
            return killed_by(failure.signal_name(), oom_kills_before)
        return f"exited with code {failure.exitcode} without raising (os._exit or sys.exit)"

    died = {rank: f for rank, f in err.failures.items() if f.signal_name() not in ("<N/A>", "SIGTERM")}
    gone = {rank: t for rank, t in watch.gone.items() if rank in err.failures}

    def lost_peer(r: int) -> bool:
        """The rank raised because a peer's connection closed: a consequence, whatever the order
        in which the processes ended (a raising rank's teardown can outlast its peers')."""
        message = str(notes.get(r, {}).get("message", "")).lower()
        return any(pattern in message for pattern in PEER_LOSS)

    def cause_first(r: int) -> tuple:
        """Ends seen at once: a signal other than the agent's SIGTERM, then an exit without a note
        (os._exit), then a raise (peers raise on the lost connection), then SIGTERM."""
        signal_name = err.failures[r].signal_name()
        kind = 0 if r in died else 3 if signal_name == "SIGTERM" else 2 if r in notes else 1
        return lost_peer(r), gone[r], kind, notes.get(r, {}).get("time", 0)

    if gone:
        rank = min(gone, key=cause_first)
    elif died:
        rank = min(died, key=lambda r: died[r].timestamp)
    elif notes:
        rank = min(notes, key=lambda r: (lost_peer(r), notes[r].get("time", 0)))
    else:
        rank, _ = err.get_first_failure()
    message = own_error(rank)
    return ("oom" if is_oom(message) else "rank_failed"), f"rank {rank} failed: {message}"


def _result_path(options: RunOptions, tmp: str) -> Path:
    """Rank 0 writes the measurement here: in a temporary folder, or for an elastic job (whose
    rank 0 may be on any node) in the job folder, which all nodes share."""
    if not options.elastic:
        return Path(tmp) / "result.json"
    from autopar.executor import rendezvous  # torch: imported when an elastic job starts

    rendezvous.register()
    path = Path(options.elastic.checkpoint_dir) / "run" / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    return path


def launch(plan_path, model, model_args: dict, options: RunOptions) -> LaunchResult:
    """Run the plan's workers on this node and wait for them (a collective of all nodes).

    Ends within options.timeout_s: on a rank that stops beating for STALE_S (killed, then named), or at
    the deadline (naming the rank the others waited for). SIGINT/SIGTERM to the launcher end the
    workers and raise KeyboardInterrupt. No worker outlives this call."""
    from torch.distributed.elastic.multiprocessing.api import SignalException  # torch: heavy, imported on first use
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # torch: heavy, imported on first use
    from torch.distributed.elastic.rendezvous import RendezvousError  # torch: heavy, imported on first use
    from torch.distributed.run import get_args_parser, run  # torch: heavy, imported on first use

    if options.elastic:  # an elastic job re-plans for whatever world (or mix) it gets
        pass
    elif is_mixed_plan_file(plan_path):  # lanes over GPU groups: the ranks of every lane
        check_world(MixedPlan.load(plan_path), options.world_size, f"--nnodes {options.nnodes} x --nproc-per-node "
                    f"{options.nproc_per_node}")
    else:
        check_world_size(Plan.load(plan_path), options)
    started = time.perf_counter()
    logs = Path(tempfile.mkdtemp(prefix="autopar-run-logs-"))  # outlives the job when it failed (`_keep_logs`)
    with tempfile.TemporaryDirectory(prefix="autopar-run-") as tmp:
        result_path = _result_path(options, tmp)
        args = get_args_parser().parse_args(torchrun_argv(plan_path, model, model_args, options, result_path, logs))
        caller_pid = os.environ.get(LAUNCHER_PID)  # put back after the run: an in-process caller keeps its env
        os.environ[LAUNCHER_PID] = str(os.getpid())  # workers inherit it: see worker._die_with_launcher
        first = options.node_rank * options.nproc_per_node
        watch = _Watch(result_path, range(first, first + options.nproc_per_node), STALE_S)
        watch.start()

        def ended(outcome: str, error: str | None = None, result=None) -> LaunchResult:
            return _keep_logs(logs, LaunchResult(outcome, error, result, wall_s=time.perf_counter() - started),
                              watch.ranks)

        kills = oom_kills()  # a SIGKILL while this count rises is the kernel's OOM killer
        try:
            with _own_signal_handlers(), _agent_log(logs / "agent.log"), _deadline(options.timeout_s):
                run(args)
        except _JobTimeout:
            return ended("timeout", f"the job did not finish within --timeout {options.timeout_s:g} s; "
                                    f"{watch.slowest()}")
        except ChildFailedError as err:
            if watch.stopped:
                return ended("timeout", watch.stopped)
            return ended(*_failure(err, result_path, watch, kills))
        except SignalException:
            raise KeyboardInterrupt from None
        except RendezvousError as e:  # an elastic job whose store host is gone cannot meet again
            where = options.elastic.rdzv_endpoint if options.elastic else "?"
            return ended("error", f"the rendezvous at {where} failed ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); the agent hosting its store is "
                                  f"gone, which ends any torchrun job (docs/elastic.md)")
        finally:
            watch.done.set()
            watch.join()
            watch.kill_workers()
            if caller_pid is None:
                os.environ.pop(LAUNCHER_PID, None)
            else:
                os.environ[LAUNCHER_PID] = caller_pid
        result = _read_json(result_path)
        return ended("ok", result=result)
