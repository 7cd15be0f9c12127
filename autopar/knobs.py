"""The knob registry: every field of a plan declared once.

A knob is a Plan field (or, for a value with two parts, two fields: recompute mode and blocks,
schedule and virtual stages) with its choices given the workload and the knobs decided before
it, its lean choices (among which the least memory of any completion lies: the RL memory masks
complete a partial plan with them), its label and words for tables, its CLI flag, its action
slots and observation features for the policy, and whether it makes plans distinct alternatives.
Each parallel axis of `autopar.axes` is a knob too (its degree), generated from the axis.

Everything that walks, encodes or shows the plan space reads `knobs()`: the Plan and its JSON,
the one walker of the space (`autopar.search.space`), the PlanArrays columns, the samplers,
the RL decision sequence, the Why table, `Plan.describe()` and the `estimate` flags. A new
knob is one `declare_knob` call. One name everywhere: the Plan field name is the JSON key, the
PlanArrays column, the decision name and (with dashes) the CLI flag. Standard library only:
the executor loads plans without the planner's dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from autopar import axes as _axes
from autopar.capability import (  # noqa: F401  (fp8_problem, comm_dtype_problem, compile_problem: re-exported)
    BLOCK_SCALED,
    FP8_RECIPES,
    ZERO_BUBBLE,
    Target,
    allowed,
    comm_dtype_problem,
    compile_problem,
    fp8_problem,
    refusal,
)
from autopar.errors import PlanError
from autopar.runtime import is_megatron

SCHEDULES = ("gpipe", "1f1b", "interleaved") + ZERO_BUBBLE
# ZERO_BUBBLE (autopar.capability): torch.distributed.pipelining's schedules that split the backward into
# input and weight gradients. zb: ScheduleInterleavedZeroBubble (ZB1P, 1 or more stages per rank); zbv:
# ScheduleZBVZeroBubble; dualpipev: ScheduleDualPipeV; the last two on exactly 2 stages per rank in a V (`stage_rank`)
V_SCHEDULES = ("zbv", "dualpipev")
RECOMPUTE_MODES = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
COMM_DTYPES = ("fp32", "bf16", "fp16")
# fp8 trains with bf16 weights, gradients and activations: only the GEMMs' inputs are cast to fp8
# (autopar/cost/precision.py prices the casts and the fp8 copies), so its storage dtype is bf16
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}
STORAGE_DTYPE = {"fp8": "bf16"}
# FP8_RECIPES (autopar.capability): torchao's float8 training recipes (per-tensor or per-row scales), and
# MXFP8 (a scale per 32 elements, Blackwell's tensor cores only); under runtime megatron, Transformer
# Engine's recipes of the same granularity (delayed / current per-tensor scaling, MXFP8)
ZERO_STAGES = (0, 1, 2, 3)
BUCKETS_MB = (5.0, 25.0, 100.0)
MAX_VIRTUAL_STAGES = 8
SCHEDULE_VALUES = ((("gpipe", 1), ("1f1b", 1)) + tuple(("interleaved", v) for v in range(2, MAX_VIRTUAL_STAGES + 1))
                   + tuple(("zb", v) for v in range(1, MAX_VIRTUAL_STAGES + 1)) + (("zbv", 2), ("dualpipev", 2)))
# 16-bit weights and gradients, fp32 master weights and two fp32 Adam moments (mixed-precision Adam)
STATE_BYTES_PER_PARAM = 16
LOG2_MAX_GPUS = 14.0  # 16,384 GPUs: the scale of degree and micro-batch features


@dataclass(frozen=True)
class Field:
    """One Plan field: its type (int, float, bool, str, tuple) and default; `values` makes it
    categorical (PlanArrays stores the index)."""

    name: str
    kind: type
    default: Any
    values: tuple | None = None


@dataclass(frozen=True)
class Knob:
    """One decision of the plan space (or, `decision=False`, a value derived from earlier ones).

    choices(workload, decided) -> the values allowed given `decided` (the values of `depends`,
    earlier knobs); a value is a scalar, or a tuple with one entry per field.
    """

    name: str
    fields: tuple[Field, ...]
    choices: Callable[[Any, dict], list]
    depends: tuple[str, ...] = ()
    label: str = ""  # the row of the plan and Why tables
    text: Callable[[Any], str] = str  # a value in words
    short: Callable[[Any], str | None] = lambda value: None  # its token in Plan.describe(), None: left out
    slots: tuple | None = None  # fixed action slot per value; None: position among the workload's choices
    slot: Callable[[Any, list], int] | None = None  # custom slot (overrides `slots`)
    lean: Callable[[list], list] = list  # the choices among which the least memory lies
    feature: Callable[[Any, tuple], tuple[float, float]] | None = None  # (absolute, relative) in about [0, 1]
    position: Callable[[Any, list], float] | None = None  # where a value lies in [0, 1] (Optuna's samplers)
    detail: bool = False  # plans differing only in details are not distinct alternatives
    decision: bool = True  # False: derived from earlier knobs (a single choice, never asked)
    flag_help: str = ""
    parse: Callable[[str], Any] | None = None  # CLI text -> value (default: the field's type)
    check: Callable[[Any], None] | None = None  # a rule on the whole plan (raises PlanError)
    # cost terms the core model does not know: (workload, PlanArrays, Coefficients) -> seconds or bytes
    # per plan (the coefficients the estimate runs with: calibrated ones reach the terms too)
    time_term: Callable | None = None
    memory_term: Callable | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def value_of(self, plan) -> Any:
        if len(self.fields) == 1:
            return getattr(plan, self.fields[0].name)
        return tuple(getattr(plan, f.name) for f in self.fields)

    def assign(self, value) -> dict[str, Any]:
        """Plan fields of a value."""
        if len(self.fields) == 1:
            return {self.fields[0].name: value}
        return dict(zip((f.name for f in self.fields), value))

    @property
    def default(self) -> Any:
        return self.fields[0].default if len(self.fields) == 1 else tuple(f.default for f in self.fields)

    def slot_of(self, value, choices: list) -> int:
        if self.slot is not None:
            return self.slot(value, choices)
        return (self.slots if self.slots is not None else choices).index(value)

    def features(self, value, choices: tuple) -> tuple[float, float]:
        if self.feature is not None:
            return self.feature(value, choices)
        if self.slots is not None:  # categorical: its slot, scaled
            return self.slots.index(value) / max(len(self.slots) - 1, 1), 0.0
        return _log_features(value, choices)

    def position_of(self, value, choices: list) -> float:
        if self.position is not None:
            return self.position(value, choices)
        if self.slots is not None:
            return self.slots.index(value) / max(len(self.slots) - 1, 1)
        return _log_share(value, min(choices), max(choices))


_declared: list[Knob] = []
AXES_DEPEND = "*axes"  # in `depends`: every declared axis


def depends_of(k: Knob) -> tuple[str, ...]:
    out: list[str] = []
    for name in k.depends:
        out += list(_axes.AXES) if name == AXES_DEPEND else [name]
    return tuple(out)


def declare_knob(knob: Knob) -> Knob:
    if any(k.name == knob.name for k in knobs()):
        raise ValueError(f"knob {knob.name!r} is declared twice")
    _declared.append(knob)
    _invalidate()
    return knob


def undeclare_knob(name: str) -> None:
    _declared[:] = [k for k in _declared if k.name != name]
    _invalidate()


def _invalidate() -> None:
    knobs.cache_clear()
    plan_fields.cache_clear()


_axes.on_change(_invalidate)


@cache
def knobs() -> tuple[Knob, ...]:
    """Every knob in decision order: the free axes, the derived axis, the folded axes (splits of
    the axes before them), then the declared knobs."""
    free = [_axis_knob(a) for a in _axes.AXES.values() if not a.derived]
    dp = _axes.AXES[_axes.derived_axis()]
    folded = [_folded_knob(f) for f in _axes.FOLDED.values()]
    return (_PRECISION, *free, _axis_knob(dp), *folded, *_declared)


def decisions() -> tuple[Knob, ...]:
    return tuple(k for k in knobs() if k.decision)


def knob(name: str) -> Knob:
    for k in knobs():
        if k.name == name:
            return k
    raise KeyError(name)


@cache
def plan_fields() -> tuple[Field, ...]:
    """The Plan's fields: axis degrees first (declaration order), then every knob's, then the
    mesh order and the explicit layer split."""
    by_name = {f.name: f for k in knobs() for f in k.fields}
    ordered = [by_name.pop(a) for a in _axes.AXES]
    return (*ordered, *by_name.values())


# -- helpers for declarations --------------------------------------------------------------------------
def _log_share(x: float, low: float, high: float) -> float:
    return math.log(x / low) / math.log(high / low) if high > low and x > 0 and low > 0 else 0.0


def _log_features(value, choices) -> tuple[float, float]:
    top = max(choices)
    return math.log2(max(value, 1e-30)) / LOG2_MAX_GPUS, (math.log(value) / math.log(top)) if top > 1 else 0.0


def _gloo(workload) -> bool:
    """CPU processes: gloo has no bf16 reductions, and the host is the device (no offload)."""
    return workload.cluster.node.intra == "shm"


@cache  # a few hundred (blocks, stages) pairs, asked thousands of times a search
def balanced_split(num_blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage, as even as possible; the extra blocks go to the middle stages,
    because the first stage also holds the embedding and the last one the head."""
    if stages <= 0 or num_blocks < stages:
        raise PlanError(f"cannot split {num_blocks} blocks into {stages} pipeline stages: "
                        f"use at most {num_blocks} stages (pp x virtual stages)")
    base, extra = divmod(num_blocks, stages)
    split = [base] * stages
    order = sorted(range(stages), key=lambda i: (-min(i, stages - 1 - i), i))
    for i in order[:extra]:
        split[i] += 1
    return tuple(split)


def stage_rank(stage: int, pp: int, schedule: str = "1f1b") -> int:
    """The pipeline rank that holds virtual stage `stage`: stage i on rank i mod pp (looped), or in a V
    (zbv, dualpipev: rank r holds stages r and 2pp-1-r, torch's `generate_stage_to_rank_mapping(style="v")`),
    so the first rank holds both the embedding's stage and the head's. The one placement the executor
    (`pipeline.stage_ids`) and the cost model (`SplitTable`) read."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def rank_stages(pp: int, virtual_stages: int, schedule: str, rank: int) -> list[int]:
    """Virtual stages held by pipeline rank `rank`, in pipeline order."""
    return [s for s in range(pp * virtual_stages) if stage_rank(s, pp, schedule) == rank]


def device_blocks(split: tuple[int, ...], pp: int, schedule: str = "1f1b") -> tuple[int, ...]:
    """Blocks held by each pipeline rank (`stage_rank` places the stages)."""
    per_rank = [0] * pp
    for i, n in enumerate(split):
        per_rank[stage_rank(i, pp, schedule)] += n
    return tuple(per_rank)


def _unique(values: list) -> list:
    return list(dict.fromkeys(values))


# -- the axes as knobs ------------------------------------------------------------------------------
def _axis_knob(axis: _axes.Axis) -> Knob:
    earlier = tuple(a for a in _axes.AXES if not _axes.AXES[a].derived)
    earlier = earlier[:earlier.index(axis.name)] if not axis.derived else earlier

    def choices(workload, decided) -> list[int]:
        return list(_axes.degree_choices(workload, axis.name, tuple((a, decided[a]) for a in earlier)))

    return Knob(axis.name, (Field(axis.name, int, 1),), choices, depends=earlier, label=f"{axis.label} parallel",
                text=lambda v: f"{axis.name}{v}", decision=not axis.derived, flag_help=axis.help,
                time_term=axis.time_term, memory_term=axis.memory_term, parse=int)


def _folded_knob(folded: _axes.FoldedAxis) -> Knob:
    """A folded axis's degree: the divisors of the ranks it splits that the model allows and the
    plan space offers (1 always). Its lean choice: the degree sharding the most (ep: the largest;
    HSDP's replicas: 1, ZeRO over all of dp x cp)."""

    def choices(workload, decided) -> list[int]:
        target = Target.of(workload)
        return [d for d in _axes.divisors(folded.whole(decided))
                if folded.allowed(workload, d) is None and refusal(folded.name, target, d, decided) is None
                and (folded.offered is None or folded.offered(workload, d, decided) is None)]

    def check(plan) -> None:
        folded.check({a: getattr(plan, a) for a in folded.within}, getattr(plan, folded.name))

    return Knob(folded.name, (Field(folded.name, int, 1),), choices, depends=folded.within + folded.reads,
                label=f"{folded.label} parallel", text=lambda v: f"{folded.name}{v}",
                short=lambda v: f"{folded.name}{v}" if v > 1 else None,
                lean=(lambda c: c[:1]) if folded.outer else (lambda c: c[-1:]),
                check=check, flag_help=folded.help, parse=int)


_PRECISION = Knob("precision", (Field("precision", str, "bf16", PRECISIONS),),
                  lambda w, d: [w.precision], label="precision", slots=PRECISIONS, decision=False,
                  flag_help="training precision (the workload's)",
                  short=lambda p: None if p in ("bf16", "fp8") else p)  # fp8: its recipe's token names it


def storage_dtype(precision: str) -> str:
    """The dtype weights, gradients and activations are kept in (and a model is profiled in)."""
    return STORAGE_DTYPE.get(precision, precision)


def default_precision(gpu) -> str:
    """The precision a workload trains in when none is asked for: mixed precision only where the
    device runs 16-bit matmuls faster than fp32 (bf16 first, then fp16, as V100 has only fp16 tensor
    cores); otherwise fp32, which autocast's casts and rounding would only slow and blur (the CPU)."""
    rate = gpu.peak_flops
    return next((p for p in ("bf16", "fp16") if rate.get(p, 0.0) > rate["fp32"]), "fp32")


# -- the knobs of today ------------------------------------------------------------------------------
def _micro_batch_choices(w, d) -> list[int]:
    return _axes.divisors(w.global_batch // d["dp"])


def _recompute_choices(w, d) -> list[tuple[str, int]]:
    """(mode, checkpointed blocks per pipeline rank): none, selective when the model has an
    attention core, and full recompute of 1 ... all blocks of the busiest rank (every count up to
    16, then a geometric grid, always including all). Interleaving needs blocks divisible by
    pp x v, so the busiest rank holds as many blocks whatever the schedule chosen later.
    Megatron-Core recomputes its core attention selectively whatever the model file's attention."""
    pp = d["pp"]
    out = [("none", 0)]
    if is_megatron(w.runtime) or any(b.attn_core_bytes > 0 for b in w.profile.layers):
        out.append(("selective", 0))
    most = max(device_blocks(balanced_split(w.profile.num_layers, pp), pp))
    counts = set(range(1, min(most, 16) + 1)) | {int(round(most * f / 16)) for f in range(1, 17)}
    return out + [("full", n) for n in sorted(c for c in counts if 1 <= c <= most)]


def _recompute_slot(value, choices) -> int:
    """Slot 0: none, 1: selective, 2 + i: full recompute of the i-th count."""
    if value[0] == "full":
        return 2 + [c for c in choices if c[0] == "full"].index(value)
    return RECOMPUTE_MODES.index(value[0])


def _recompute_features(value, choices) -> tuple[float, float]:
    mode, blocks = value
    most = max((c[1] for c in choices), default=1) or 1
    return RECOMPUTE_MODES.index(mode) / 2, blocks / most


def _recompute_position(value, choices) -> float:
    mode, blocks = value
    most = max((c[1] for c in choices), default=1) or 1
    return {"none": 0.0, "selective": 0.1}.get(mode, 1.0 - 0.8 * (1 - blocks / most))


def _lean_recompute(choices: list) -> list:
    """Memory is monotone in the number of recomputed blocks: the extremes of each mode suffice."""
    fulls = [c for c in choices if c[0] == "full"]
    return [c for c in choices if c[0] != "full"] + _unique(fulls[:1] + fulls[-1:])


def _recompute_text(value) -> str:
    mode, blocks = value
    full = f"full recompute of {blocks} block{'s' * (blocks != 1)}"
    return {"none": "no recompute", "selective": "selective recompute"}.get(mode, full)


def _parse_recompute(text: str):
    """none | selective | full (every block: resolved against the workload) | N blocks."""
    if text in ("none", "selective"):
        return (text, 0)
    if text == "full":
        return ("full", None)
    if not text.isdigit():
        raise PlanError(f"--recompute must be none, selective, full or a block count, got '{text}'")
    return ("full", int(text))


def _check_recompute(plan) -> None:
    if plan.recompute == "full":
        if plan.recompute_blocks < 1:
            raise PlanError("recompute 'full' needs recompute_blocks >= 1 (blocks checkpointed per "
                            "pipeline rank); use recompute 'none' for no recompute")
    elif plan.recompute_blocks != 0:
        raise PlanError(f"recompute_blocks={plan.recompute_blocks} only applies to recompute 'full'; "
                        f"set it to 0 or set recompute to 'full'")


STAGE_RECOMPUTE_HELP = "'none', 'selective' or 'full:K' (the stage's first K >= 1 blocks fully recomputed)"


def stage_full_blocks(entry: str) -> int:
    """K of a per-stage entry 'full:K'; 0 for 'none' and 'selective'."""
    return int(entry[5:]) if entry.startswith("full:") else 0


def _check_stage_entry(entry) -> None:
    ok = entry in ("none", "selective") or (isinstance(entry, str) and entry.startswith("full:")
                                            and entry[5:].isdigit() and entry[5:].isascii() and int(entry[5:]) >= 1)
    if not ok:
        raise PlanError(f"stage_recompute entry {entry!r} is not {STAGE_RECOMPUTE_HELP}")


def _parse_stage_recompute(text: str) -> tuple[str, ...]:
    """none,full:2,selective,... : one entry per virtual stage, in pipeline order."""
    entries = tuple(e.strip() for e in text.split(","))
    for e in entries:
        _check_stage_entry(e)
    return entries


def _check_stage_recompute(plan) -> None:
    """Per-stage recompute replaces the uniform one: one valid entry per virtual stage (block counts
    are checked by `check_stage_blocks` where the split is known)."""
    if not plan.stage_recompute:
        return
    if plan.recompute != "none" or plan.recompute_blocks != 0:
        raise PlanError(f"recompute '{plan.recompute}' and stage_recompute both given; give either recompute "
                        f"(every pipeline rank alike) or stage_recompute (one entry per stage), not both")
    if len(plan.stage_recompute) != plan.pp * plan.virtual_stages:
        raise PlanError(f"stage_recompute has {len(plan.stage_recompute)} entries but pp x virtual_stages = "
                        f"{plan.pp * plan.virtual_stages}; give one entry per virtual stage")
    for e in plan.stage_recompute:
        _check_stage_entry(e)


def check_stage_blocks(entries: tuple[str, ...], split: tuple[int, ...]) -> None:
    """Each stage recomputes at most the blocks it holds; a stage of no block recomputes nothing."""
    for i, (e, n) in enumerate(zip(entries, split)):
        if n == 0 and e != "none":
            raise PlanError(f"stage {i} holds no transformer block but stage_recompute[{i}] is '{e}'; "
                            f"use 'none' for a stage of 0 blocks")
        if stage_full_blocks(e) > n:
            raise PlanError(f"stage_recompute[{i}] is '{e}' but stage {i} holds {n} blocks; use full:K "
                            f"with K <= {n}")


def check_split_entries(split: tuple[int, ...], pp: int) -> None:
    """A layer split: every stage holds a block, but the first and the last may hold none (only the
    embedding, or only the norm, head and loss) when there is a pipeline (pp >= 2)."""
    if any(n < 0 for n in split) or any(n < 1 for n in split[1:-1]):
        raise PlanError(f"layer_split {list(split)} has an empty middle stage; only the first and the last "
                        f"stage may hold 0 blocks (embedding-only, head-only)")
    if split and (split[0] < 1 or split[-1] < 1) and pp < 2:
        raise PlanError(f"layer_split {list(split)} has a stage of 0 blocks, which needs pp >= 2")


def _stage_recompute_text(entries) -> str:
    return "per stage: " + ", ".join(entries) if entries else "uniform"


def _stage_recompute_short(entries) -> str | None:
    if not entries:
        return None
    return "ac=" + "/".join({"none": "-", "selective": "sel"}.get(e, e[5:]) for e in entries)


def _schedule_choices(w, d) -> list[tuple[str, int]]:
    """(schedule, virtual stages). Interleaving needs micro-batches divisible by pp and an even
    number of blocks per chunk, as Megatron-LM's interleaved schedule does. The zero-bubble schedules
    where the runtime runs them (`autopar.capability`): zb on 1 or 2 stages per rank (torchtitan's
    default; any other count may be named), zbv and dualpipev on 2 in a V, under the same block and
    micro-batch rules (dualpipev: 2 x pp micro-batches, as torch's ScheduleDualPipeV asks)."""
    pp, nmb = d["pp"], d["num_micro_batches"]
    if pp == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1)]
    if nmb >= pp:
        out.append(("1f1b", 1))
        layers = w.profile.num_layers
        if nmb % pp == 0:
            out += [("interleaved", v) for v in range(2, MAX_VIRTUAL_STAGES + 1) if layers % (pp * v) == 0]
        selective = d["recompute"][0] == "selective" or "selective" in d["stage_recompute"]
        zero_bubble = [("zb", 1)] if nmb % pp == 0 and not selective else []
        if layers % (2 * pp) == 0 and not selective:
            zero_bubble += ([("zb", 2)] if nmb % pp == 0 else []) + [("zbv", 2)]
            zero_bubble += [("dualpipev", 2)] if nmb >= 2 * pp else []
        target = Target.of(w)
        out += [c for c in zero_bubble if refusal("schedule", target, c[0], d) is None]
    return out


def _schedule_text(value) -> str:
    name, v = value
    return name if v == 1 or name in V_SCHEDULES else f"{name}:{v}"


def _parse_schedule(text: str):
    """gpipe | 1f1b | interleaved:V | zb[:V] | zbv | dualpipev (the V-shaped ones run 2 stages per rank)."""
    name, _, v = text.partition(":")
    if v and not v.isdigit():
        raise PlanError(f"--schedule {name}:V needs an integer V, got '{v}'")
    return (name, int(v or (2 if name in V_SCHEDULES else 1)))


def _check_v(plan) -> None:
    """zbv and dualpipev: 2 stages per rank in a V; DualPipeV a micro-batch per stage (torch's rule)."""
    if plan.pp < 2 or plan.virtual_stages != 2:
        raise PlanError(f"the {plan.schedule} schedule runs exactly 2 stages per rank in a V on pp >= 2 "
                        f"ranks, got pp={plan.pp}, virtual_stages={plan.virtual_stages}; set virtual_stages 2")
    if plan.schedule == "dualpipev" and plan.num_micro_batches < 2 * plan.pp:
        raise PlanError(f"dualpipev with pp={plan.pp} needs at least {2 * plan.pp} micro-batches (one per "
                        f"stage), got {plan.num_micro_batches}; lower the micro-batch size or use schedule 'zbv'")


def _check_schedule(plan) -> None:
    zero_bubble = plan.schedule in ZERO_BUBBLE
    selective = plan.recompute == "selective" or "selective" in plan.stage_recompute
    if zero_bubble and selective:  # no runtime runs it: Megatron-Core has no zero-bubble schedule
        raise PlanError(f"schedule {plan.schedule} with selective recompute: torch's selective checkpoint allows one "
                        "backward per region and zero-bubble runs two (input, then weight gradients); use recompute "
                        "none or full")
    if plan.schedule in ("interleaved", "zb"):
        if plan.pp < 2 or plan.virtual_stages < (2 if plan.schedule == "interleaved" else 1):
            raise PlanError(f"the {plan.schedule} schedule needs pp >= 2"
                            + (" and virtual_stages >= 2" if plan.schedule == "interleaved" else "")
                            + "; use schedule '1f1b' otherwise")
        if plan.num_micro_batches % plan.pp:
            raise PlanError(f"the {plan.schedule} schedule needs num_micro_batches ({plan.num_micro_batches}) "
                            f"divisible by pp ({plan.pp}); change the micro-batch size or pp")
    elif plan.schedule in ("zbv", "dualpipev"):  # V_SCHEDULES (a literal: the plan's own rule, not what runs it)
        _check_v(plan)
    elif plan.virtual_stages != 1:
        raise PlanError(f"virtual_stages={plan.virtual_stages} needs schedule 'interleaved', 'zb', 'zbv' or "
                        "'dualpipev'")
    if plan.pp > 1 and plan.num_micro_batches < plan.pp and plan.schedule != "gpipe":
        raise PlanError(f"1F1B with pp={plan.pp} needs at least {plan.pp} micro-batches, got "
                        f"{plan.num_micro_batches}; lower the micro-batch size or use schedule 'gpipe'")


def _comm_choices(w, d) -> list[str]:
    """fp32, and the training dtype where the backend reduces in it (gloo has no bf16 reductions)."""
    if d["dp"] == 1:
        return ["fp32"]
    own = [p for p in (storage_dtype(w.precision),) if p != "fp32"]
    return ["fp32"] + allowed("grad_comm_dtype", Target.of(w), own, d)


def _mesh_choices(w, d) -> list[tuple[str, ...]]:
    """The default order; the data-parallel-innermost one only where it changes the groups (and
    the runtime lays it out: autopar.capability)."""
    orders = _axes.mesh_orders()
    innermost = orders[0][-1]
    return allowed("mesh_order", Target.of(w), list(orders) if d[_axes.derived_axis()] > 1 and d.get(innermost, 1) > 1
                   else [orders[0]], d)


def _bool_text(name: str) -> Callable[[bool], str]:
    return lambda v: f"{name} {'on' if v else 'off'}"


def _zero_text(z: int) -> str:
    return {0: "DDP (ZeRO-0)", 1: "ZeRO-1 (sharded optimizer)", 2: "ZeRO-2 (+ sharded gradients)",
            3: "ZeRO-3 (FSDP2, sharded parameters)"}[z]


def _check_zero(plan) -> None:
    if plan.dp_replicate > 1 and plan.zero == 0:
        raise PlanError(f"dp_replicate={plan.dp_replicate} (HSDP) shards ZeRO's states within each replica and "
                        f"needs zero 1, 2 or 3; set zero >= 1 or dp_replicate 1")


def _check_offload(plan) -> None:
    if plan.offload_optimizer and plan.zero < 2:
        raise PlanError("offload_optimizer runs through FSDP2's CPU offload and needs zero 2 or 3")


def _check_sp(plan) -> None:
    if plan.sequence_parallel and plan.tp < 2:
        raise PlanError("sequence_parallel needs tp >= 2; set tp >= 2 or drop sequence_parallel")


def _sp_choices(w, d) -> list[bool]:
    """Off and on under tensor parallelism, as far as the runtime runs them for this model
    (autopar.capability: not for an MoE model under autopar's executor)."""
    return allowed("sequence_parallel", Target.of(w), [False, True] if d["tp"] > 1 else [False], d)


def _zero_choices(w, d) -> list[int]:
    """Every stage the runtime runs with this ep (autopar.capability: no ZeRO-1 beside expert
    parallelism in autopar's executor); only ZeRO-0 without data parallelism, no ZeRO-0 under HSDP."""
    if d["dp"] == 1:
        return [0]
    stages = list(ZERO_STAGES) if d.get("dp_replicate", 1) == 1 else [z for z in ZERO_STAGES if z >= 1]
    return allowed("zero", Target.of(w), stages, d)


def _offload_choices(w, d) -> list[bool]:
    return [False, True] if d["zero"] >= 2 and not _gloo(w) else [False]


def _bucket_choices(w, d) -> list[float]:
    return list(BUCKETS_MB) if d["dp"] > 1 and d["zero"] <= 1 else [BUCKETS_MB[1]]


def _bucket_features(value, choices) -> tuple[float, float]:
    return _log_share(value, BUCKETS_MB[0], BUCKETS_MB[-1]), 0.0


def _parse_bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "on", "off", "1", "0"):
        raise PlanError(f"expected true or false, got '{text}'")
    return text.lower() in ("true", "on", "1")


def _fp8_recipe_choices(w, d) -> list[str]:
    """None but under fp8; then every recipe the GPU's tensor cores run."""
    if d["precision"] != "fp8":
        return ["none"]
    return allowed("fp8_recipe", Target.of(w), list(FP8_RECIPES), d)


def _check_fp8_recipe(plan) -> None:
    if (plan.precision == "fp8") != (plan.fp8_recipe != "none"):
        raise PlanError(f"fp8_recipe '{plan.fp8_recipe}' with precision {plan.precision}: precision fp8 takes "
                        f"one of {', '.join(FP8_RECIPES)}, any other precision 'none'")


def _compile_choices(w, d) -> list[bool]:
    """torch.compile of each block where the runtime runs it (autopar.capability)."""
    return allowed("compile", Target.of(w), [False, True], d)


def _cuda_graphs_choices(w, d) -> list[bool]:
    """CUDA graphs where the runtime captures them (autopar.capability): Megatron-Core's own, or
    torch.compile's mode="reduce-overhead" on the compiled blocks; CUDA only."""
    return allowed("cuda_graphs", Target.of(w), [False, True], d)


def _parse_order(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(","))


for _k in (
    Knob("micro_batch_size", (Field("micro_batch_size", int, 1),), _micro_batch_choices, ("dp",),
         label="micro-batch", text=lambda m: f"micro-batch {m}", lean=lambda c: c[:1], parse=int,
         flag_help="samples per micro-batch per data-parallel rank"),
    Knob("num_micro_batches", (Field("num_micro_batches", int, 1),),
         lambda w, d: [w.global_batch // (d["dp"] * d["micro_batch_size"])], ("dp", "micro_batch_size"),
         label="micro-batches", decision=False, parse=int),
    Knob("zero", (Field("zero", int, 0, ZERO_STAGES),), _zero_choices, ("dp", "ep", "dp_replicate"), label="ZeRO",
         text=_zero_text, short=lambda z: f"zero{z}" if z else None, slots=ZERO_STAGES,
         detail=True, parse=int, check=_check_zero,
         flag_help="0: DDP, 1: sharded optimizer, 2: + sharded gradients, 3: FSDP2"),
    Knob("recompute", (Field("recompute", str, "none", RECOMPUTE_MODES), Field("recompute_blocks", int, 0)),
         _recompute_choices, ("pp",), label="recompute", text=_recompute_text,
         short=lambda v: {"none": None, "selective": "ac=sel"}.get(v[0], f"ac={v[1]}"), slot=_recompute_slot,
         lean=_lean_recompute, feature=_recompute_features, position=_recompute_position,
         parse=_parse_recompute, check=_check_recompute,
         flag_help="activation recompute: none, selective, full (all blocks) or N blocks per pipeline rank"),
    Knob("stage_recompute", (Field("stage_recompute", tuple, ()),), lambda w, d: [()], label="recompute per stage",
         text=_stage_recompute_text, short=_stage_recompute_short, decision=False, parse=_parse_stage_recompute,
         check=_check_stage_recompute,
         flag_help="per-stage activation recompute (instead of --recompute), one entry per virtual stage in "
                   f"pipeline order, comma-separated: {STAGE_RECOMPUTE_HELP}"),
    Knob("bucket_mb", (Field("bucket_mb", float, 25.0),), _bucket_choices, ("dp", "zero"), label="gradient buckets",
         text=lambda b: f"{b:g} MB buckets", short=lambda b: f"bucket={b:g}MB" if b != BUCKETS_MB[1] else None,
         slots=BUCKETS_MB, lean=lambda c: c[:1], feature=_bucket_features,
         detail=True, parse=float,
         flag_help="DDP gradient bucket (fusion buffer) size in MB"),
    Knob("schedule", (Field("schedule", str, "1f1b", SCHEDULES), Field("virtual_stages", int, 1)),
         _schedule_choices, ("pp", "num_micro_batches", "dp", "cp", "zero", "recompute", "stage_recompute"),
         label="pipeline schedule", text=_schedule_text,
         short=_schedule_text, slots=SCHEDULE_VALUES,
         feature=lambda v, c: (SCHEDULES.index(v[0]) / (len(SCHEDULES) - 1), (v[1] - 1) / (MAX_VIRTUAL_STAGES - 1)),
         parse=_parse_schedule, check=_check_schedule,
         flag_help="gpipe | 1f1b | interleaved:V | zb[:V] | zbv | dualpipev (zero-bubble: torch's schedules)"),
    Knob("sequence_parallel", (Field("sequence_parallel", bool, False),),
         _sp_choices, ("tp",), label="sequence parallel",
         text=_bool_text("sequence parallel"), short=lambda v: "sp" if v else None, slots=(False, True),
         lean=lambda c: c[-1:], parse=_parse_bool, check=_check_sp,
         flag_help="shard the activations outside tensor-parallel regions over tp"),
    Knob("grad_comm_dtype", (Field("grad_comm_dtype", str, "fp32", COMM_DTYPES),), _comm_choices, ("dp",),
         label="gradient reduction dtype", text=lambda c: f"gradients reduced in {c}",
         short=lambda c: f"comm={c}" if c != "fp32" else None, slots=COMM_DTYPES,
         lean=lambda c: sorted(c, key=DTYPE_BYTES.get)[:1], detail=True,  # (none where a held value rules all out)
         flag_help="dtype of the data-parallel gradient reduction"),
    Knob("offload_optimizer", (Field("offload_optimizer", bool, False),), _offload_choices, ("zero",),
         label="optimizer offload", text=_bool_text("CPU offload"), short=lambda v: "offload" if v else None,
         slots=(False, True), detail=True, parse=_parse_bool,
         check=_check_offload, flag_help="optimizer state and step on the CPU (FSDP2 offload; zero 2 or 3)"),
    Knob("fp8_recipe", (Field("fp8_recipe", str, "none", ("none",) + FP8_RECIPES),), _fp8_recipe_choices,
         ("precision",), label="fp8 scaling", text=lambda r: "no fp8" if r == "none" else f"fp8 {r} scaling",
         short=lambda r: None if r == "none" else f"fp8={r}", slots=("none",) + FP8_RECIPES, detail=True,
         check=_check_fp8_recipe, flag_help="fp8 scaling recipe: tensorwise | rowwise | mxfp8 (Blackwell)"),
    Knob("compile", (Field("compile", bool, False),), _compile_choices, ("tp", "pp"), label="torch.compile",
         text=_bool_text("torch.compile of each block"), short=lambda v: "compiled" if v else None,
         slots=(False, True), detail=True, parse=_parse_bool,
         flag_help="torch.compile each transformer block (fuses elementwise ops; fp8 pays off only compiled)"),
    Knob("cuda_graphs", (Field("cuda_graphs", bool, False),), _cuda_graphs_choices, ("compile",), label="CUDA graphs",
         text=_bool_text("CUDA graphs of the blocks"), short=lambda v: "graphs" if v else None,
         slots=(False, True), detail=True, parse=_parse_bool,
         flag_help="replay the blocks' kernels as CUDA graphs (no per-kernel launch): torch.compile "
                   "mode='reduce-overhead' on the compiled blocks under torch, --enable-cuda-graph under megatron; "
                   "CUDA only"),
    Knob("mesh_order", (Field("mesh_order", tuple, None),), _mesh_choices, (AXES_DEPEND, "dp_replicate"),
         label="mesh order",
         text=lambda o: "mesh (" + ", ".join(o) + ")", slot=lambda o, c: _axes.mesh_orders().index(o),
         short=lambda o: None if o == _axes.default_order() else "mesh=" + ",".join(o),
         feature=lambda o, c: (_axes.mesh_orders().index(o), 0.0), lean=lambda c: c[:1],
         position=lambda o, c: float(_axes.mesh_orders().index(o)),
         detail=True, parse=_parse_order,
         flag_help="mesh axes, outermost first (default: by mesh position, tp innermost)"),
):
    declare_knob(_k)
