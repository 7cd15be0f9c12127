"""Elastic training: periodic DCP checkpoints, and a re-plan whenever the world size changes.

torchrun's elastic agent (`--nnodes MIN:MAX`) restarts the worker group with a new WORLD_SIZE
when a node leaves (the survivors' collectives fail) or joins (at the next checkpoint boundary:
`autopar.executor.rendezvous`). Each worker-group start reads the job folder: if the last
checkpoint was saved under a plan for another world size, rank 0 asks `replan(old_plan,
world_size)` for the plan to continue under (the planner side injects it: the executor imports
no planner), every rank applies that plan, DCP reshards the checkpoint into it, and training
continues from the checkpoint's step. Rank 0 records the re-plan (`ReplanRecord`).

A mixed plan (lanes over GPU groups, `autopar.executor.mixed`) runs elastic too: each rank declares
its node's group (`node_group`), rank 0 gathers them (`Mix`), and a start whose ranks per group
differ from the last checkpoint's asks `replan(old_mixed_plan, mix)` (a homogeneous plan of the
job is passed as a mixed plan of one lane on its group). The answer, a mixed plan or (one group
left) a homogeneous one, numbers its ranks group by group: the ranks join the default group again
in that order (`mesh.renumber`) before it is applied. Checkpoints of either kind hold the whole
model's names (`autopar.executor.state`), so each loads under the other.

The job folder (`checkpoint_dir`, shared by all nodes, as DCP needs) holds:
  step-NNNNNNNN/   the DCP checkpoint after step N (every one is kept);
  latest.json      the last complete checkpoint: its step, plan and world size, and a mixed job's
                   ranks per group (written after DCP);
  history.jsonl    the global-batch losses of each checkpointed interval, with its world size;
  progress.json    the step the running group has reached (for the steps a re-plan redoes);
  replans.jsonl    one `ReplanRecord` per re-plan.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.atomic import write_text_atomic
from autopar.errors import PlanError
from autopar.executor.measure import synchronize
from autopar.executor.mesh import init_distributed, renumber
from autopar.executor.mixed_layout import Mix, one_lane, plan_ranks, rank_labels
from autopar.executor.options import ElasticSpec
from autopar.executor.state import load_checkpoint, save_checkpoint
from autopar.executor.train_step import ParallelModel, apply
from autopar.mixed.plan import MixedPlan, is_mixed_plan_dict
from autopar.plan import Plan
from autopar.replan import ReplanDecision, ReplanRecord, mix_text

PARK_S = 120.0  # how long workers wait at a boundary for the agent to restart them for a joining node


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _json_lines(path: Path) -> list[dict]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line torn by a kill mid-write
            continue
    return out


class JobDir:
    """The files of an elastic job (module docstring). Only rank 0 writes."""

    def __init__(self, root):
        self.root = Path(root)

    def checkpoint(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def latest(self) -> dict | None:
        return _read_json(self.root / "latest.json")

    def progress(self) -> dict | None:
        return _read_json(self.root / "progress.json")

    def set_progress(self, step: int, world: int) -> None:
        write_text_atomic(self.root / "progress.json", json.dumps({"step": step, "world_size": world,
                                                                   "time": time.time()}))

    def commit(self, step: int, plan: Plan | MixedPlan, world: int, losses: list[float],
               mix: Mix | None = None) -> None:
        """After DCP saved `step`: its losses, then the pointer a restart resumes from."""
        self._append("history.jsonl", {"first_step": step - len(losses), "losses": losses, "world_size": world})
        latest = {"step": step, "world_size": world, "plan": plan.to_dict()}
        if mix is not None:
            latest["mix"] = mix.ranks()
        write_text_atomic(self.root / "latest.json", json.dumps(latest))

    def latest_plan(self) -> Plan | MixedPlan | None:
        latest = self.latest()
        if not latest:
            return None
        d = latest["plan"]
        return MixedPlan.from_dict(d) if is_mixed_plan_dict(d) else Plan.from_dict(d)

    def append_replan(self, record: ReplanRecord) -> None:
        self._append("replans.jsonl", record.to_dict())

    def replans(self) -> list[ReplanRecord]:
        return [ReplanRecord.from_dict(d) for d in _json_lines(self.root / "replans.jsonl")]

    def losses(self) -> dict[int, tuple[float, int]]:
        """{step: (loss, world size)} of every committed step, in step order (a redone interval: its last run)."""
        by_step: dict[int, tuple[float, int]] = {}
        for line in _json_lines(self.root / "history.jsonl"):
            for i, loss in enumerate(line["losses"]):
                by_step[line["first_step"] + i] = (loss, line["world_size"])
        return dict(sorted(by_step.items()))

    def _append(self, name: str, entry: dict) -> None:
        """One JSON line; after a line torn by a kill, on a line of its own."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / name, "a+b") as f:
            torn = f.tell() > 0 and f.seek(-1, 2) is not None and f.read(1) != b"\n"
            f.write(("\n" if torn else "").encode() + json.dumps(entry).encode() + b"\n")


@dataclass
class ElasticRun:
    """What this worker group did: the plan it ran, from which step, its step times, its re-plan."""

    par: ParallelModel  # or a mixed plan's rank (`autopar.executor.mixed`)
    plan: Plan | MixedPlan
    first_step: int
    step_times: list[float]
    replan: ReplanRecord | None


def _from_rank0(fn: Callable[[], ReplanDecision], what: str) -> ReplanDecision:
    """Rank 0 decides, every rank learns the answer (or the one-line error, raised everywhere)."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - every rank must raise it, not wait for rank 0
            box[0] = ("error", f"{type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise PlanError(f"{what} failed: {value}")
    return value


def _agreed(flag: bool, device) -> bool:
    """Rank 0's flag, on every rank."""
    t = torch.tensor([int(flag) if dist.get_rank() == 0 else 0], device=device)
    dist.all_reduce(t)
    return bool(t.item())


def train_elastic(plan: Plan | MixedPlan, build_model, optimizer, loss_fn, batch: Callable[[int, int], tuple], *,
                  checkpoint_dir, steps: int, checkpoint_every: int = ElasticSpec.checkpoint_every,
                  replan: Callable | None = None, growth=None, on_step: Callable[[int], None] | None = None,
                  node_group: str | None = None, tp_plan=None, blocks=None, seed: int = 0, backend: str = "auto",
                  timeout_s: float | None = None) -> ElasticRun:
    """Train to step `steps` under `plan` (or the checkpoint's plan, or a re-plan), resuming from
    `checkpoint_dir` and checkpointing every `checkpoint_every` steps and at the end.

    batch(step, global_batch) -> (inputs, targets): the step's global batch, the same under any
        plan (a re-plan may change the global batch: see `autopar.search.replan`);
    replan(old_plan, world_size) -> ReplanDecision: called on rank 0 when the world size is not
        the last plan's; without it such a start fails with one line. With `node_group` (a mixed
        job: this rank's group) it is replan(old_mixed_plan, mix) (`autopar.mixed.replan`), called
        when the ranks per group are not the last checkpoint's;
    growth: `autopar.executor.rendezvous.WorkerSide` under `autopar run --elastic` (joins wait
        for a boundary), or None;
    on_step(step): called before each step (the worker's heartbeat says where a rank is).
    The other arguments are `apply`'s. Call it on every rank, under torchrun."""
    init_distributed(backend, timeout_s)  # the world size decides the plan, before apply
    world = dist.get_world_size()
    job = JobDir(checkpoint_dir)
    latest, progress = job.latest(), job.progress()
    previous = job.latest_plan() or plan
    mix = _declared(node_group) if node_group else None
    before = None
    if mix is not None:
        before = (latest or {}).get("mix") or _mix_of(previous)
        changed, was, now = mix.ranks() != before, mix_text(before), mix.describe()
    elif isinstance(previous, MixedPlan):
        raise PlanError(f"the last checkpoint of {checkpoint_dir} was saved under a mixed plan; continue the job with "
                        f"the mixed plan and each node's group (autopar run mixed.json --node-group GROUP)")
    else:
        changed, was, now = previous.world_size != world, str(previous.world_size), str(world)
    decision = None
    if changed:
        if replan is None:
            raise PlanError(f"the last plan is for {was} ranks but {now} are running and no replan function was "
                            f"given; pass replan=... (autopar run --elastic does)")
        asked = (_as_mixed(previous, before), mix) if mix is not None else (previous, world)
        decision = _from_rank0(lambda: replan(*asked), f"re-planning for {now} ranks")
        plan = decision.plan
    else:
        plan = previous
    kwargs = {"tp_plan": tp_plan, "blocks": blocks, "seed": seed, "backend": backend, "timeout_s": timeout_s}
    if mix is not None:
        par = _apply_on_groups(plan, mix, build_model, optimizer, loss_fn, kwargs)
    else:
        par = apply(plan, build_model, optimizer, loss_fn, **kwargs)
    rank = dist.get_rank()
    step, load_s = 0, 0.0
    if latest:
        started = time.perf_counter()
        step = load_checkpoint(par, job.checkpoint(latest["step"]))
        load_s = time.perf_counter() - started
    record = None
    if decision is not None:
        reached = progress["step"] if progress and progress["step"] >= step else step
        record = ReplanRecord(
            world_before=previous.world_size, world_after=world, old_plan=previous.to_dict(),
            new_plan=plan.to_dict(), decision=decision.decision, reason=decision.reason, resumed_step=step,
            steps_lost=reached - step, global_batch_before=previous.global_batch,
            global_batch_after=plan.global_batch, planning_s=decision.planning_s, checkpoint_load_s=load_s,
            downtime_s=time.time() - progress["time"] if progress else None,
            predicted_old_s=decision.predicted_old_s, predicted_new_s=decision.predicted_new_s,
            mix_before=before, mix_after=mix.ranks() if mix else None)
    if rank == 0:
        if growth is not None:
            growth.clear_growth()
        if record is not None:
            job.append_replan(record)
    times = _train(par, plan, mix, job, batch, step, steps, checkpoint_every, growth, on_step or (lambda s: None))
    return ElasticRun(par, plan, step, times, record)


def _declared(group: str) -> Mix:
    """Every rank's declared group and its node's rank count, by rank (a collective)."""
    mine = (group, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return Mix(tuple(g for g, _ in every), tuple(n for _, n in every))


def _mix_of(plan: Plan | MixedPlan) -> dict[str, int] | None:
    """The ranks per group a mixed plan runs on (None for a homogeneous plan: its group is not in it)."""
    if not isinstance(plan, MixedPlan):
        return None
    return dict(Counter(label.group for label in rank_labels(plan)))


def _as_mixed(plan: Plan | MixedPlan, mix: dict[str, int] | None) -> MixedPlan:
    """What a mixed job's re-planner starts from: a homogeneous plan as one lane on the group it ran on."""
    if isinstance(plan, MixedPlan):
        return plan
    if not mix or len(mix) != 1:
        raise PlanError("a homogeneous plan joins an elastic mixed job only once it ran on one group; start the "
                        "job from a mixed plan, or run the homogeneous plan without --node-group")
    return one_lane(plan, next(iter(mix)))


def _apply_on_groups(plan: Plan | MixedPlan, mix: Mix, build_model, optimizer, loss_fn, kwargs):
    """Apply a mixed job's plan: the ranks numbered group by group as the plan needs (`renumber` where
    torchrun numbered them otherwise), then `apply_mixed` (or `apply`: one group left)."""
    from autopar.executor.mixed import apply_mixed  # pulls the mixed executor only for mixed jobs

    if not isinstance(plan, MixedPlan):
        return apply(plan, build_model, optimizer, loss_fn, **kwargs)
    order = plan_ranks([label.group for label in rank_labels(plan)], mix.groups)
    if order != list(range(len(order))):
        renumber(order[dist.get_rank()], kwargs["backend"], kwargs["timeout_s"])
    return apply_mixed(plan, build_model, optimizer, loss_fn, **kwargs)


def _train(par, plan, mix: Mix | None, job: JobDir, batch, step: int, steps: int, every: int, growth,
           on_step) -> list[float]:
    """Steps from `step` to `steps`, checkpointing; returns each step's time on this rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    times, interval = [], []
    while step < steps:
        on_step(step)
        inputs, targets = par.local_batch(*batch(step, plan.global_batch))
        synchronize(par.device)
        started = time.perf_counter()
        interval.append(par.train_step(inputs, targets))
        synchronize(par.device)
        times.append(time.perf_counter() - started)
        step += 1
        if rank == 0:
            job.set_progress(step, world)
        if step % every and step < steps:
            continue
        save_checkpoint(par, job.checkpoint(step), step)
        losses = par.global_losses(interval)
        interval = []
        if rank == 0:
            job.commit(step, plan, world, losses, mix)
        if step < steps and growth is not None and _agreed(rank == 0 and growth.growth_requested(), par.device):
            _park(growth, step)
    return times


def _park(growth, step: int) -> None:
    """A node waits to join: say so to the agents and wait, state saved, to be restarted. If no
    restart comes (the node left again), go on training."""
    if dist.get_rank() == 0:
        growth.at_boundary(step)
    time.sleep(PARK_S)
    if dist.get_rank() == 0:
        growth.clear_growth()
    dist.barrier()
