"""Parallel axes, declared once, and the degrees of one plan (`ParallelDims`).

In the spirit of torchtitan's `ParallelDims` and Megatron-Core's rank generator: an axis is a
name, a position in the device mesh (outermost first; tensor parallelism innermost, as
Megatron's default order), a rule for the degrees a workload allows and, for axes the core
cost model does not know, the time and memory terms it adds. Everything that deals in degrees
(the Plan, the plan space, the cost model's process groups, the executor's device mesh) reads
this registry, so a new axis is one `declare_axis` call.

Data parallelism is the derived axis: its degree is the world size over the product of the
others. A *folded* axis (`FoldedAxis`) is not one more axis to permute but a second split of
some axes' ranks: expert parallelism carves ep ranks out of dp (x cp), and HSDP splits dp into
replicate x shard, as torchtitan and Megatron-Core do. Folded axes have no mesh position of
their own; they are declared with the axes they split: ep, expert parallelism, within dp (x cp
where a cp axis is declared; the innermost ranks), and dp_replicate, HSDP's replicas, within dp
(its outermost ranks: ZeRO shards over the rest of dp x cp, torchtitan's dp_shard_cp).

Mesh orders are the few that matter, declared (`mesh_orders`), not every permutation: the
default (axes by mesh position) and the one with data parallelism innermost. This module
imports the standard library and the contract modules beside it (capability, errors, runtime;
torch only inside `ParallelDims.build_mesh`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from autopar.capability import Target, context_parallel_offered, refusal
from autopar.errors import PlanError
from autopar.runtime import vocab_padding

Check = Callable[[Any, int], "str | None"]  # (workload, degree) -> None when allowed, else why not


@dataclass(frozen=True)
class Axis:
    """One parallel axis. `allowed(workload, degree)` returns None or the reason a degree is not
    allowed (with the fix); `derived` marks the axis whose degree is the world size over the rest."""

    name: str
    label: str  # in words, for tables
    mesh_position: int  # smaller: further out in the device mesh
    allowed: Check = lambda workload, degree: None
    derived: bool = False
    help: str = ""
    # cost terms the core model does not know: (workload, PlanArrays) -> seconds or bytes per plan
    time_term: Callable | None = None
    memory_term: Callable | None = None
    # the plan space's narrower rule: degrees `allowed` (a plan may name them) but not searched
    offered: Check | None = None
    # its ranks hold the same weights and different tokens, so they reduce gradients together
    # (and ZeRO / FSDP shard over them): dp, and cp as torchtitan's dp_cp mesh
    reduces_gradients: bool = False


@dataclass(frozen=True)
class FoldedAxis:
    """A second split of the ranks of `within` (expert parallelism within dp x cp; HSDP's replicas
    within dp): its degree divides the product of their degrees and its ranks are the innermost
    ones of that product (`outer`: the outermost, as HSDP's replicas), so it adds no mesh order."""

    name: str
    label: str
    within: tuple[str, ...]
    help: str = ""
    allowed: Check = lambda workload, degree: None  # the model's rule on the degree (ep divides the experts)
    outer: bool = False  # its ranks are the outermost of `within` (the rest stays on the fast links)
    # the plan space's narrower rule, (workload, degree, decided) -> None or why not searched; `reads`:
    # the other knobs it (and the axis's capability rule) reads, decided before it
    offered: Callable[[Any, int, dict], str | None] | None = None
    reads: tuple[str, ...] = ()

    def whole(self, degrees: dict[str, int]) -> int:
        """The ranks it splits: the product of the degrees of `within`."""
        return math.prod(degrees.get(a, 1) for a in self.within)

    def check(self, degrees: dict[str, int], degree: int) -> None:
        whole = self.whole(degrees)
        if degree < 1 or whole % degree:
            raise PlanError(f"{self.name}={degree} must divide {' x '.join(self.within)} = {whole}; "
                            f"use a {self.name} that divides {whole}")

    def stride(self, dims: ParallelDims, degree: int = 1) -> int:
        """Rank distance between neighbours along the folded axis of this `degree`: that of the
        innermost axis it splits, times the ranks inside it when its ranks are the outer ones."""
        strides = dims.strides()
        inner = self.whole(dims.degrees) // degree if self.outer else 1
        return min(strides[a] for a in self.within) * inner


AXES: dict[str, Axis] = {}
FOLDED: dict[str, FoldedAxis] = {}
_listeners: list[Callable[[], None]] = []  # caches built from the registry (knobs, order tables)


def declare_axis(axis: Axis) -> Axis:
    if axis.name in AXES:
        raise ValueError(f"axis {axis.name!r} is declared twice")
    if axis.derived and any(a.derived for a in AXES.values()):
        raise ValueError("only one axis can be derived from the world size")
    AXES[axis.name] = axis
    _changed()
    return axis


def declare_folded(folded: FoldedAxis) -> FoldedAxis:
    unknown = [a for a in folded.within if a not in AXES]
    if unknown or folded.name in FOLDED or folded.name in AXES:
        raise ValueError(f"folded axis {folded.name!r}: unknown axes {unknown} or name taken")
    FOLDED[folded.name] = folded
    _changed()
    return folded


def attach_terms(name: str, *, time_term: Callable | None = None, memory_term: Callable | None = None) -> None:
    """Give a declared axis the cost terms its own module in the cost layer supplies (the axis is
    declared here, in the contract layer, which cannot import the cost model)."""
    AXES[name] = replace(AXES[name], time_term=time_term, memory_term=memory_term)
    _changed()


def undeclare(name: str) -> None:
    """Remove an axis or folded axis (tests declaring a throwaway axis clean up with this)."""
    AXES.pop(name, None)
    FOLDED.pop(name, None)
    _changed()


def on_change(listener: Callable[[], None]) -> None:
    _listeners.append(listener)


def _changed() -> None:
    _feasible_memo.clear()
    for listener in _listeners:
        listener()


def axis_names() -> tuple[str, ...]:
    """Declaration order (the Plan's field order)."""
    return tuple(AXES)


def gradient_axes() -> tuple[str, ...]:
    """The axes whose ranks reduce gradients together, in declaration order (dp first)."""
    return tuple(a for a, axis in AXES.items() if axis.reduces_gradients)


def derived_axis() -> str:
    return next(a.name for a in AXES.values() if a.derived)


def default_order() -> tuple[str, ...]:
    """Axes by mesh position, outermost first (the innermost last)."""
    return tuple(sorted(AXES, key=lambda a: AXES[a].mesh_position))


def mesh_orders() -> tuple[tuple[str, ...], ...]:
    """The declared mesh orders: the default, and the default with the derived (data-parallel)
    axis innermost, which puts the gradient reduction on the fastest links instead of tp."""
    base = default_order()
    dp = derived_axis()
    dp_inner = tuple(a for a in base if a != dp) + (dp,)
    return (base,) if dp_inner == base else (base, dp_inner)


def complete_order(order, degrees: dict[str, int]) -> tuple[str, ...]:
    """A mesh order naming every declared axis: axes it leaves out (an older plan's, written
    before an axis existed) must have degree 1 and go to their default position."""
    order = tuple(order)
    missing = [a for a in default_order() if a not in order]
    if len(set(order)) != len(order) or set(order) - set(AXES) or any(degrees.get(a, 1) != 1 for a in missing):
        raise PlanError(f"mesh_order must be a permutation of {list(AXES)}, got {list(order)}")
    if not missing:
        return order
    out = list(order)
    for a in missing:
        out.insert(min(default_order().index(a), len(out)), a)
    return tuple(out)


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one plan along every declared axis, in a mesh order (outermost first)."""

    degrees: dict[str, int]
    order: tuple[str, ...] = field(default_factory=default_order)

    def __post_init__(self):
        for name, degree in self.degrees.items():
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise PlanError(f"plan field '{name}' must be a positive integer, got {degree!r}")
        if sorted(self.order) != sorted(self.degrees):
            raise PlanError(f"mesh_order must be a permutation of {list(AXES)}, got {list(self.order)}")

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values())

    def product_text(self) -> str:
        names = " x ".join(self.degrees)
        values = " x ".join(str(d) for d in self.degrees.values())
        return f"{names} = {values} = {self.world_size}"

    def check_world(self, world: int, have: str, fix: str, needs: str = "") -> None:
        """The one world-size check: `have` says what provides `world` ranks, `fix` how to match
        (`needs`: "the plan needs " where the product is in ranks)."""
        if self.world_size != world:
            unit = " ranks" if needs else ""
            raise PlanError(f"{needs}{self.product_text()}{unit} but {have}; {fix}")

    def strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each axis (innermost axis: 1)."""
        stride, out = 1, {}
        for axis in reversed(self.order):
            out[axis] = stride
            stride *= self.degrees[axis]
        return out

    def check_workload(self, workload) -> None:
        """Every axis's own rule on its degree (divides the heads, at most the blocks, ...)."""
        for name, degree in self.degrees.items():
            why = AXES[name].allowed(workload, degree)
            if why:
                raise PlanError(why)

    def gradient_group(self) -> tuple[int, int]:
        """(size, stride) of the group that reduces gradients (dp x cp): one stride when its axes
        are adjacent in the mesh order, else the innermost one's (the ring then spans further)."""
        names = [a for a in gradient_axes() if self.degrees[a] > 1]
        size = math.prod(self.degrees[a] for a in names)
        strides = self.strides()
        return size, min((strides[a] for a in names), default=1)

    def build_mesh(self, device_type: str):
        """torch's DeviceMesh with one named dimension per axis, in this order."""
        from torch.distributed.device_mesh import init_device_mesh  # torch: heavy, imported on first use

        shape = tuple(self.degrees[a] for a in self.order)
        return init_device_mesh(device_type, shape, mesh_dim_names=self.order)


def divisors(n: int) -> list[int]:
    """The divisors of n in increasing order, found up to sqrt(n) (n may be a large batch)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


_feasible_memo: dict[tuple, list] = {}  # feasible assignments, and degree choices given others


def feasible_degrees(workload, unchecked: tuple[str, ...] = ()) -> list[dict[str, int]]:
    """Every assignment of degrees the plan space offers: product = world size, each axis's rule
    and its `offered` narrowing (but those of `unchecked`). Memoised per workload: every step of the walker asks."""
    return [dict(d) for d in _feasible_rows(workload, unchecked)]


def _feasible_key(workload, unchecked: tuple[str, ...]) -> tuple:
    return id(workload), workload.world_size, workload.global_batch, workload.profile.digest, tuple(AXES), unchecked


def _feasible_rows(workload, unchecked: tuple[str, ...] = ()) -> list[dict[str, int]]:
    """feasible_degrees' memo itself (not copies): for readers that do not keep what they read."""
    key = _feasible_key(workload, unchecked)
    if key not in _feasible_memo:
        if len(_feasible_memo) > 1024:
            _feasible_memo.clear()
        _feasible_memo[key] = _feasible(workload, unchecked)
    return _feasible_memo[key]


def degree_choices(workload, name: str, given: tuple[tuple[str, int], ...]) -> list[int]:
    """The degrees of axis `name` among the feasible assignments that have the `given` degrees of other
    axes, ascending. Memoised with feasible_degrees: the walker asks it for every row of every walk."""
    key = (_feasible_key(workload, ()), name, given)
    if key not in _feasible_memo:
        rows = _feasible_rows(workload)  # first: it may clear the memo
        if len(_feasible_memo) > 4096:
            _feasible_memo.clear()
            rows = _feasible_rows(workload)
        _feasible_memo[key] = sorted({d[name] for d in rows if all(d[a] == v for a, v in given)})
    return _feasible_memo[key]


def _searched(axis: Axis, workload, degree: int) -> bool:
    return axis.allowed(workload, degree) is None and (axis.offered is None or axis.offered(workload, degree) is None)


def _feasible(workload, unchecked: tuple[str, ...]) -> list[dict[str, int]]:
    world = workload.world_size
    free = [a for a in AXES.values() if not a.derived]
    dp = derived_axis()
    out: list[dict[str, int]] = []

    def assign(i: int, rest: int, chosen: dict[str, int]) -> None:
        if i == len(free):
            if dp in unchecked or _searched(AXES[dp], workload, rest):
                out.append({a: (rest if a == dp else chosen[a]) for a in AXES})
            return
        for d in divisors(rest):
            if free[i].name in unchecked or _searched(free[i], workload, d):
                assign(i + 1, rest // d, {**chosen, free[i].name: d})

    assign(0, world, {})
    return out


# -- the axes of today ------------------------------------------------------------------------------
def _pp_allowed(workload, pp: int) -> str | None:
    layers = workload.profile.num_layers
    why = refusal("pp", Target.of(workload), pp)  # what the runtime cannot pipeline
    return why or (None if pp <= layers else f"pp={pp} exceeds the model's {layers} blocks; use fewer pipeline stages")


def _dp_allowed(workload, dp: int) -> str | None:
    batch = workload.global_batch
    return None if batch % dp == 0 else (f"dp={dp} does not divide the global batch {batch}; choose degrees "
                                         f"whose data-parallel part divides it")


def padded_vocab(vocab: int, tp: int, elements: int = 8) -> int:
    """The smallest vocabulary at least `vocab` whose slice on each of tp ranks is a multiple of
    `elements`: 8 16-bit elements are the 16 bytes cuBLAS's tensor-core kernels align to
    (autopar/cost/vocabulary.py); Megatron-LM pads the same way, to 128 x tp."""
    return -(-vocab // (elements * tp)) * elements * tp  # ceil, for NumPy arrays of tp too


def tp_units(workload, vocab: bool = True) -> tuple[int, ...]:
    """What tp must divide (heads, sharded widths, the vocabulary); without the vocabulary where the
    runtime pads it itself, or when asked (cost/vocabulary.py: what the rest of the model allows).
    Only the embedding's and head's vocabulary leaves: a layer's width equal to it stays."""
    profile = workload.profile
    v = (profile.dims or {}).get("vocab")
    if v is None or vocab and not vocab_padding(workload):
        return profile.tp_units
    last = len(profile.blocks) - 1
    return tuple(sorted({u for i, b in enumerate(profile.blocks) for u in b.tp_units
                         if not (u == v and i in (0, last))}))


def _tp_allowed(workload, tp: int) -> str | None:
    profile = workload.profile
    if tp == 1:
        return None
    why = refusal("tp", Target.of(workload), tp)  # a tp_plan, and a sequence-parallel setting that runs
    if why:
        return why
    vocab = (profile.dims or {}).get("vocab")
    units = tp_units(workload)
    bad = [u for u in units if u % tp]
    if bad:
        common = math.gcd(*units)
        fix = f"use a tp that divides {common}" if common > 1 else "only tp=1 divides them all"
        if vocab in bad:  # Megatron-LM pads it (--make-vocab-size-divisible-by); a model file can too
            fix += f", or pad the vocabulary to {padded_vocab(vocab, tp):,}"
        return f"tp={tp} does not divide {bad} (heads / sharded dims of the model); {fix}"
    return None


def _cp_allowed(workload, cp: int) -> str | None:
    return refusal("cp", Target.of(workload), cp)  # attention to split, and a runtime that splits it


# declaration order is the Plan's field order and the decision order (the derived dp last);
# mesh positions outermost first, as torchtitan's ParallelDims: pp, dp, cp, tp
declare_axis(Axis("dp", "data", 1, _dp_allowed, derived=True, help="data-parallel degree", reduces_gradients=True))
declare_axis(Axis("tp", "tensor", 3, _tp_allowed, help="tensor-parallel degree"))
declare_axis(Axis("pp", "pipeline", 0, _pp_allowed, help="pipeline-parallel degree"))
declare_axis(Axis("cp", "context", 2, _cp_allowed, reduces_gradients=True,
                  offered=context_parallel_offered,
                  help="context-parallel degree: the sequence split over cp ranks (docs/context-parallel.md)"))


def _ep_allowed(workload, ep: int) -> str | None:
    profile = workload.profile
    experts = getattr(profile, "num_experts", 0)
    if ep == 1:
        return None
    if not experts:
        return (f"ep={ep} but {profile.name} is a dense model (no experts to shard); use ep 1, or an MoE model "
                f"for expert parallelism")
    if experts % ep:
        return f"ep={ep} does not divide the model's {experts} experts; use an ep that divides {experts}"
    return None


# expert parallelism: the innermost ranks of dp (x cp, when a context-parallel axis is declared) hold
# experts / ep experts each, as Megatron-Core's and torchtitan's EP; expert-data-parallel = dp x cp / ep
declare_folded(FoldedAxis("ep", "expert", ("dp",) + tuple(a for a in ("cp",) if a in AXES),
                          help="expert-parallel degree (MoE): experts sharded over ep ranks carved out of dp",
                          allowed=_ep_allowed))
# what runs the plan may not combine ep with the axes it splits (autopar's executor splits dp alone and
# reduces expert gradients over it): autopar.capability's rule for ep


def _shard_group_offered(workload, replicas: int, decided: dict) -> str | None:
    """HSDP in the plan space: the shard group (dp x cp / replicas ranks) spanning exactly one node
    with its tp ranks (in the default mesh order a shard group and its tp ranks are contiguous), of
    two ranks or more: ZeRO's collectives on the node's links, the replicas' all-reduce across
    nodes, as torchtitan's and the FSDP papers' HSDP runs. One degree per dp keeps the space within
    about twice its size without HSDP (every power of two of nodes made it 3-4x and the exhaustive
    search as much slower); a plan may name any divisor of dp (`--dp-replicate`)."""
    if replicas == 1:
        return None
    shard = decided.get("dp", 1) * decided.get("cp", 1) // replicas
    span = shard * decided.get("tp", 1)
    if shard < 2 or span != workload.cluster.gpus_per_node:
        return (f"dp_replicate={replicas} leaves shard groups of {shard} ranks over {span} GPUs; the plan space "
                f"offers a shard group of one node ({workload.cluster.gpus_per_node} GPUs with its tp ranks)")
    return None


# HSDP (FSDP2's 2-D mesh, torchtitan's data_parallel_replicate_degree): the outermost ranks of dp are
# replicas, each sharding ZeRO's states over dp x cp / dp_replicate ranks on the faster links
declare_folded(FoldedAxis("dp_replicate", "replicated data", ("dp",), outer=True,
                          offered=_shard_group_offered, reads=("tp", "cp", "ep"),
                          help="HSDP replicas: ZeRO shards within dp x cp / dp_replicate ranks, gradients are "
                               "all-reduced across the replicas (needs zero >= 1)"))
