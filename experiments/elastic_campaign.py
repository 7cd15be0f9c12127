"""Elastic re-planning on localhost: two torchrun agents (`autopar run --elastic`) of 2 gloo ranks
each on a tiny GPT, meeting at one rendezvous endpoint with `--nnodes 1:2`.

* shrink: both agents run the 4-rank plan; once a checkpoint under 4 ranks exists and the job is
  mid-interval, the agent that does NOT host the rendezvous store is killed (SIGKILL; its workers
  die with it). The survivor's workers fail, torchrun restarts them with 2 ranks, rank 0
  re-plans, DCP reshards the last checkpoint, training continues.
* store-host-lost: the same, but the agent hosting the store is killed: the job ends.
* shrink-mixed: a mixed plan (a pipeline over two GPU groups, one agent of one rank each, `--node-group`);
  the agent that does not host the store is killed, the survivor re-plans onto its group alone, and
  every step's loss is compared with one process trained straight through (no reference resume).
* grow: one agent runs alone (2 ranks); after its first checkpoint the second agent starts. Its
  rendezvous join waits for the next checkpoint boundary (autopar.executor.rendezvous), then
  the group restarts with 4 ranks and re-plans.

shrink and grow then run the reference: the same checkpoint loaded directly under the new plan
(a copy of it in a fresh job folder whose latest.json names the new plan), and compares the
losses of every step after the resume. Prints one JSON object per scenario.

    python experiments/elastic_campaign.py [--scenario shrink grow store-host-lost shrink-mixed] [--steps N]
                                           [--every N] [--tolerance F] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autopar.executor.elastic import JobDir
from autopar.plan import Plan

PLAN4 = Plan(dp=4, micro_batch_size=2, num_micro_batches=1, precision="fp32")
PLAN2 = Plan(dp=2, micro_batch_size=4, num_micro_batches=1, precision="fp32")
WAIT_S = 240.0  # the most any phase of a scenario may take


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(plan, job: Path, port: int, steps: int, every: int, log: Path, nnodes: int = 2, nproc: int = 2,
           trace: Path | None = None, tolerance: float = 0.05, flags: tuple[str, ...] = ()) -> subprocess.Popen:
    """One `autopar run --elastic` of `nproc` ranks (a torchrun agent in its own process) of `plan` (a
    Plan or a MixedPlan); `flags` come last (a later --cluster replaces "cpu")."""
    plan_path = log.with_suffix(".plan.json")
    plan.save(plan_path)
    cmd = [sys.executable, "-m", "autopar", "run", str(plan_path), "gpt", "--model-arg", "size=tiny",
           "--nproc-per-node", str(nproc), "--nnodes", str(nnodes), "--backend", "gloo", "--elastic",
           "--checkpoint-dir", str(job), "--checkpoint-every", str(every), "--steps", str(steps), "--warmup", "0",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--cluster", "cpu", "--timeout", str(WAIT_S),
           "--replan-tolerance", str(tolerance)]
    cmd += ["--trace", str(trace)] if trace else []
    cmd += list(flags)
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log  # for the error that reports an agent's early end
    return proc


def _until(what: str, check, procs=()) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_S:g} s for {what}")
        for p in procs:
            if p.poll() is not None:
                raise AgentEnded(f"an agent ended (exit {p.returncode}) while waiting for {what}; "
                                 f"the end of its log:\n{_tail(p)}")
        time.sleep(0.05)


class AgentEnded(RuntimeError):
    """An agent process exited while the campaign waited for something."""


def _tail(proc: subprocess.Popen, chars: int = 3000) -> str:
    log = getattr(proc, "log", None)
    return log.read_text()[-chars:] if log and log.exists() else "(no log)"


def _kill(procs) -> None:
    """Each agent's whole process group (its torchrun workers too, which outlive an agent that died)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _two_agents(out: Path, job: Path, steps: int, every: int, ports, traced: bool = False, tolerance: float = 0.05,
                tries: int = 2, start=None):
    """Both agents of PLAN4 (or `start(port)`'s) started together, once one hosts the rendezvous store:
    (agents, host, other). An agent that dies before any store listens (the free port taken by another
    process meanwhile, as two suites on one machine can do) is a start-up failure, not the scenario's:
    start again on a fresh port, at most `tries` times in all; the last try's error carries its agent's log."""
    start = start or (lambda port: [_agent(PLAN4, job, port, steps, every, out / f"agent{i}.log", tolerance=tolerance,
                                           trace=out / f"trace{i}.jsonl" if traced else None) for i in range(2)])
    for attempt in range(tries):
        port = ports()
        agents = start(port)
        try:
            _until("the rendezvous store", lambda port=port, agents=agents: _listener(port, agents) is not None,
                   agents)
        except AgentEnded:
            _kill(agents)
            if attempt == tries - 1 or JobDir(job).progress():
                raise
            continue
        host = _listener(port, agents)
        return agents, host, next(a for a in agents if a is not host)
    raise AssertionError("unreachable")


def _listener(port: int, procs: list[subprocess.Popen]) -> subprocess.Popen | None:
    """The process among `procs` that listens on `port` (the agent hosting the rendezvous store)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    for proc in procs:
        fds = Path(f"/proc/{proc.pid}/fd")
        try:
            if any(os.readlink(fd) in inodes for fd in fds.iterdir()):
                return proc
        except OSError:
            continue
    return None


def _finish(proc: subprocess.Popen, log: Path) -> str:
    try:
        proc.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"agent exited {proc.returncode}:\n{text[-3000:]}")
    return text


def reference(job: Path, out: Path, record: dict, steps: int, every: int, port: int) -> list[float]:
    """The job's resumed checkpoint loaded directly under the new plan, trained to `steps`."""
    step, plan = record["resumed_step"], Plan.from_dict(record["new_plan"])
    ref = out / "reference"
    shutil.rmtree(ref, ignore_errors=True)
    shutil.copytree(JobDir(job).checkpoint(step), JobDir(ref).checkpoint(step))
    (ref / "latest.json").write_text(json.dumps({"step": step, "world_size": plan.world_size,
                                                 "plan": plan.to_dict()}))
    log = out / "reference.log"
    _finish(_agent(plan, ref, port, steps, every, log, nnodes=1, nproc=plan.world_size), log)
    return [loss for s, (loss, _) in JobDir(ref).losses().items() if s >= step]


def _compare(job: Path, out: Path, record: dict, steps: int, every: int, started: float, port: int) -> dict:
    losses = JobDir(job).losses()
    after = [loss for s, (loss, _) in losses.items() if s >= record["resumed_step"]]
    worlds = [world for _, world in losses.values()]
    ref = reference(job, out, record, steps, every, port)
    diff = max(abs(a - b) for a, b in zip(after, ref, strict=True))
    return {"replan": {k: record[k] for k in ("world_before", "world_after", "decision", "reason", "resumed_step",
                                              "steps_lost", "global_batch_before", "global_batch_after",
                                              "planning_s", "checkpoint_load_s", "downtime_s")},
            "old_plan": Plan.from_dict(record["old_plan"]).describe(),
            "new_plan": Plan.from_dict(record["new_plan"]).describe(),
            "world_size_per_step": worlds, "losses_after_resume": after, "reference_losses": ref,
            "max_abs_loss_diff": diff, "within_1e-5": diff <= 1e-5, "wall_s": round(time.monotonic() - started, 1)}


def shrink(out: Path, steps: int = 30, every: int = 4, tolerance: float = 0.05, ports=free_port) -> dict:
    """4 ranks on two agents; the agent that does not host the store is killed mid-interval.
    With a large `tolerance` the old plan, dp rescaled, is kept (decision "kept"). `ports()`: a free port."""
    started, job = time.monotonic(), out / "job"
    agents, host, other = _two_agents(out, job, steps, every, ports, traced=True, tolerance=tolerance)
    d = JobDir(job)

    def mid_interval_at_4() -> bool:
        latest, progress = d.latest(), d.progress()
        return bool(latest and progress and latest["world_size"] == 4 and latest["step"] >= every
                    and progress["world_size"] == 4 and latest["step"] < progress["step"] < steps)

    _until("a checkpoint under 4 ranks, then a step past it", mid_interval_at_4, [host, other])
    killed_at = d.progress()["step"]
    os.kill(other.pid, signal.SIGKILL)  # the agent only: its workers die with it (parent-death signal)
    other.wait()
    i = agents.index(host)
    _finish(host, out / f"agent{i}.log")
    record = JobDir(job).replans()[-1]
    result = _compare(job, out, record.to_dict(), steps, every, started, ports())
    trace = [json.loads(line) for line in (out / f"trace{i}.jsonl").read_text().splitlines()]
    result.update(killed_at_step=killed_at, trace_outcome=trace[-1]["outcome"],
                  trace_plan=Plan.from_dict(trace[-1]["plan"]).describe(),
                  trace_replans=[(r["world_before"], r["world_after"], Plan.from_dict(r["old_plan"]).describe(),
                                  Plan.from_dict(r["new_plan"]).describe()) for r in trace[-1]["measured"]["replans"]])
    return result


MIXED_CLUSTER, GROUPS = "dgx-a100-80g:1,dgx-h100:1", ("dgx-a100-80g", "dgx-h100")


def mixed_pipeline():
    """A pipeline over two groups of one rank each (1F1B, 2 blocks a stage), fp32: a lane spanning segments.
    Its first stage is on the second agent's group: where torchrun numbers the first agent's rank 0 (the
    rendezvous sorts nodes by host and pid), the ranks are numbered again group by group."""
    from autopar.mixed.plan import Lane, MixedPlan, Segment

    return MixedPlan((Lane((Segment(GROUPS[1], 1, 1), Segment(GROUPS[0], 1, 1)),
                           Plan(pp=2, micro_batch_size=2, num_micro_batches=2, precision="fp32")),))


def straight_losses(steps: int, global_batch: int) -> list[float]:
    """One process trained on every step's batch of an elastic run (`autopar.executor.worker.step_batch`):
    the tiny GPT without dropout, AdamW at autopar run's defaults (lr 1e-3, seed 0)."""
    import torch

    from autopar.executor.parity import reference_losses, without_dropout
    from autopar.executor.worker import step_batch
    from autopar.modelfile import load_model_file

    model, args = load_model_file("gpt"), {"size": "tiny"}
    return reference_losses(lambda: without_dropout(model.build(**args)), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                            model.loss_fn, [step_batch(model, args, 0, s, global_batch) for s in range(steps)])


def shrink_mixed(out: Path, steps: int = 12, every: int = 2, ports=free_port) -> dict:
    """A mixed plan's pipeline on two agents of one rank, each of its own group (--node-group); the agent
    that does not host the store is killed mid-interval. The survivor's rank re-plans onto its group
    alone (a homogeneous plan), loads the pipeline's checkpoint and finishes; every step's loss is
    compared with one process trained straight through."""
    started, job = time.monotonic(), out / "job"
    plan = mixed_pipeline()

    def start(port):
        return [_agent(plan, job, port, steps, every, out / f"agent{i}.log", nproc=1,
                       flags=("--cluster", MIXED_CLUSTER, "--node-group", group, "--no-dropout"))
                for i, group in enumerate(GROUPS)]

    agents, host, other = _two_agents(out, job, steps, every, ports, start=start)
    d = JobDir(job)

    def mid_interval() -> bool:
        latest, progress = d.latest(), d.progress()
        return bool(latest and progress and latest["world_size"] == 2 and latest["step"] >= every
                    and progress["world_size"] == 2 and latest["step"] < progress["step"] < steps)

    _until("a checkpoint under the mixed plan, then a step past it", mid_interval, agents)
    killed_at = d.progress()["step"]
    os.kill(other.pid, signal.SIGKILL)
    other.wait()
    i = agents.index(host)
    _finish(host, out / f"agent{i}.log")
    record = d.replans()[-1]
    losses = d.losses()
    straight = straight_losses(steps, plan.global_batch)
    return {"replan": record.to_dict(), "group_left": GROUPS[i], "killed_at_step": killed_at,
            "new_plan": Plan.from_dict(record.new_plan).describe(), "loss_steps": list(losses),
            "world_size_per_step": [w for _, w in losses.values()], "losses": [l for l, _ in losses.values()],
            "straight_losses": straight,
            "max_abs_loss_diff": max(abs(l - r) for (l, _), r in zip(losses.values(), straight, strict=True)),
            "wall_s": round(time.monotonic() - started, 1)}


def grow(out: Path, steps: int = 200, every: int = 10, ports=free_port) -> dict:
    """2 ranks on one agent; a second agent starts after the first checkpoint (its launcher takes
    seconds to reach the rendezvous: enough steps for it to join mid-run)."""
    started, job, port = time.monotonic(), out / "job", ports()
    first = _agent(PLAN2, job, port, steps, every, out / "first.log", trace=out / "trace.jsonl")
    d = JobDir(job)
    _until("a checkpoint under 2 ranks", lambda: bool((latest := d.latest()) and latest["step"] >= every), [first])
    joined_at = d.progress()["step"]
    second = _agent(PLAN2, job, port, steps, every, out / "second.log")
    _finish(first, out / "first.log")
    _finish(second, out / "second.log")
    record = JobDir(job).replans()[-1]
    result = _compare(job, out, record.to_dict(), steps, every, started, ports())
    result.update(joined_at_step=joined_at, at_boundary=record.resumed_step % every == 0 and record.steps_lost == 0)
    return result


def store_host_lost(out: Path, steps: int = 30, every: int = 4, ports=free_port) -> dict:
    """The same two agents; this time the agent that hosts the rendezvous store is killed: the
    other cannot meet anyone again, and the job ends (docs/elastic.md, the store-host caveat)."""
    started, job = time.monotonic(), out / "job"
    agents, host, other = _two_agents(out, job, steps, every, ports)
    d = JobDir(job)
    _until("a checkpoint", lambda: bool((latest := d.latest()) and latest["step"] >= every), agents)
    killed = time.monotonic()
    os.kill(host.pid, signal.SIGKILL)
    host.wait()
    try:
        other.wait(WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()
    last = [line for line in (out / f"agent{agents.index(other)}.log").read_text().splitlines() if line.strip()]
    return {"survivor_exit": other.returncode, "survivor_ended_after_s": round(time.monotonic() - killed, 1),
            "survivor_last_line": last[-1][:300] if last else "", "steps_done": d.progress()["step"],
            "replans": len(d.replans()), "wall_s": round(time.monotonic() - started, 1)}


SCENARIOS = {"shrink": shrink, "grow": grow, "store-host-lost": store_host_lost, "shrink-mixed": shrink_mixed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", nargs="+", choices=list(SCENARIOS), default=["shrink", "grow"])
    ap.add_argument("--steps", type=int, help="steps of each job (default: shrink 30, grow 200, shrink-mixed 12)")
    ap.add_argument("--every", type=int, help="steps between checkpoints (default: shrink 4, grow 10, shrink-mixed 2)")
    ap.add_argument("--tolerance", type=float, help="shrink: --replan-tolerance (default 0.05; 0.9 keeps the plan)")
    ap.add_argument("--out", type=Path, default=None, help="keep the job folders and logs here")
    args = ap.parse_args()
    base = args.out or Path(tempfile.mkdtemp(prefix="autopar-elastic-"))
    for name in args.scenario:
        out = base / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        options = {k: v for k, v in (("steps", args.steps), ("every", args.every)) if v is not None}
        if args.tolerance is not None and name == "shrink":
            options["tolerance"] = args.tolerance
        print(json.dumps({"scenario": name, **SCENARIOS[name](out, **options)}), flush=True)


if __name__ == "__main__":
    main()
