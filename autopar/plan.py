"""The Plan: the one contract between the planners and the executor.

A frozen dataclass that checks its own consistency on construction and its fit to a workload
in `validate`. JSON carries a schema version and rejects unknown keys, so a plan written by
one version of autopar is never silently misread by another. This module imports only the
standard library: the executor loads plans without the planner's dependencies.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from autopar.atomic import write_text_atomic
from autopar.capability import check_plan
from autopar.errors import PlanError
from autopar.schema import check_plan_dict, loads, read_file

PLAN_SCHEMA_VERSION = 1

AXES = ("pp", "dp", "tp")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE_MODES = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp32")
COMM_DTYPES = ("fp32", "bf16", "fp16")
ZERO_STAGES = (0, 1, 2, 3)


def balanced_split(num_blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage, as even as possible; the extra blocks go to the middle stages,
    because the first stage also holds the embedding and the last one the head."""
    if stages <= 0 or num_blocks < stages:
        raise PlanError(f"cannot split {num_blocks} blocks into {stages} pipeline stages: "
                        f"use at most {num_blocks} stages (pp x virtual stages)")
    base, extra = divmod(num_blocks, stages)
    split = [base] * stages
    # hand the remainder to the stages farthest from both ends first
    order = sorted(range(stages), key=lambda i: (-min(i, stages - 1 - i), i))
    for i in order[:extra]:
        split[i] += 1
    return tuple(split)


def device_blocks(split: tuple[int, ...], pp: int) -> tuple[int, ...]:
    """Blocks held by each pipeline rank: virtual stage i lives on rank i mod pp."""
    per_rank = [0] * pp
    for i, n in enumerate(split):
        per_rank[i % pp] += n
    return tuple(per_rank)


@dataclass(frozen=True)
class Plan:
    """A complete parallel training plan. Degrees multiply to the world size; the global batch
    is dp x micro_batch_size x num_micro_batches."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_micro_batches: int
    mesh_order: tuple[str, ...] = AXES  # outermost axis first; the last one is innermost
    zero: int = 0  # 0: DDP, 1: sharded optimizer, 2: + sharded grads, 3: FSDP2 fully_shard
    bucket_mb: float = 25.0  # DDP gradient bucket (fusion buffer) size
    recompute: str = "none"  # none | selective (attention core) | full (whole blocks)
    recompute_blocks: int = 0  # full recompute: checkpointed blocks per pipeline rank
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    layer_split: tuple[int, ...] = ()  # blocks per virtual stage in pipeline order
    sequence_parallel: bool = False
    precision: str = "bf16"
    grad_comm_dtype: str = "fp32"  # dtype of the data-parallel gradient reduction
    offload_optimizer: bool = False  # optimizer state and step on the CPU (FSDP2 offload)

    def __post_init__(self):
        object.__setattr__(self, "mesh_order", tuple(self.mesh_order))
        object.__setattr__(self, "layer_split", tuple(int(n) for n in self.layer_split))
        for name in ("dp", "tp", "pp", "micro_batch_size", "num_micro_batches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"plan field '{name}' must be a positive integer, got {value!r}")
        if sorted(self.mesh_order) != sorted(AXES):
            raise PlanError(f"mesh_order must be a permutation of {list(AXES)}, got {list(self.mesh_order)}")
        if self.zero not in ZERO_STAGES:
            raise PlanError(f"zero must be one of {list(ZERO_STAGES)}, got {self.zero!r}")
        if not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb > 0):
            raise PlanError(f"bucket_mb must be a positive number of megabytes, got {self.bucket_mb!r}")
        _choice("recompute", self.recompute, RECOMPUTE_MODES)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("grad_comm_dtype", self.grad_comm_dtype, COMM_DTYPES)
        if self.recompute == "full":
            if self.recompute_blocks < 1:
                raise PlanError("recompute 'full' needs recompute_blocks >= 1 (blocks checkpointed per "
                                "pipeline rank); use recompute 'none' for no recompute")
        elif self.recompute_blocks != 0:
            raise PlanError(f"recompute_blocks={self.recompute_blocks} only applies to recompute 'full'; "
                            f"set it to 0 or set recompute to 'full'")
        if self.schedule == "interleaved":
            if self.pp < 2 or self.virtual_stages < 2:
                raise PlanError("the interleaved schedule needs pp >= 2 and virtual_stages >= 2; "
                                "use schedule '1f1b' otherwise")
            if self.num_micro_batches % self.pp:
                raise PlanError(f"the interleaved schedule needs num_micro_batches ({self.num_micro_batches}) "
                                f"divisible by pp ({self.pp}); change the micro-batch size or pp")
        elif self.virtual_stages != 1:
            raise PlanError(f"virtual_stages={self.virtual_stages} needs schedule 'interleaved'")
        if self.pp > 1 and self.num_micro_batches < self.pp and self.schedule != "gpipe":
            raise PlanError(f"1F1B with pp={self.pp} needs at least {self.pp} micro-batches, got "
                            f"{self.num_micro_batches}; lower the micro-batch size or use schedule 'gpipe'")
        if self.sequence_parallel and self.tp < 2:
            raise PlanError("sequence_parallel needs tp >= 2; set tp >= 2 or drop sequence_parallel")
        if self.offload_optimizer and self.zero < 2:
            raise PlanError("offload_optimizer runs through FSDP2's CPU offload and needs zero 2 or 3")
        if self.layer_split and len(self.layer_split) != self.pp * self.virtual_stages:
            raise PlanError(f"layer_split has {len(self.layer_split)} entries but pp x virtual_stages = "
                            f"{self.pp * self.virtual_stages}; give one block count per virtual stage")
        if any(n < 1 for n in self.layer_split):
            raise PlanError(f"layer_split {list(self.layer_split)} has an empty stage; every stage needs a block")

    # -- derived -----------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch_size * self.num_micro_batches

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    def split_for(self, num_blocks: int) -> tuple[int, ...]:
        """The layer split, balanced when the plan leaves it open."""
        return self.layer_split or balanced_split(num_blocks, self.stages)

    def strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each mesh axis (innermost axis: 1)."""
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        stride, out = 1, {}
        for axis in reversed(self.mesh_order):
            out[axis] = stride
            stride *= sizes[axis]
        return out

    def with_(self, **changes) -> Plan:
        return replace(self, **changes)

    # -- checks against a workload ----------------------------------------------------------
    def validate(self, workload) -> None:
        """Raise PlanError naming the failed constraint and a fix; return None when valid."""
        gpus = workload.cluster.num_gpus
        if self.world_size != gpus:
            raise PlanError(f"dp x tp x pp = {self.dp} x {self.tp} x {self.pp} = {self.world_size} but the "
                            f"cluster has {gpus} GPUs; choose degrees whose product is {gpus}")
        if self.global_batch != workload.global_batch:
            raise PlanError(f"dp x micro_batch_size x num_micro_batches = {self.global_batch} but the global "
                            f"batch is {workload.global_batch}; set num_micro_batches = "
                            f"{workload.global_batch / (self.dp * self.micro_batch_size):g}")
        profile = workload.profile
        if self.tp > 1:
            if not profile.has_tp_plan:
                raise PlanError(f"tp={self.tp} but {profile.tp_note or 'the model has no tensor-parallel plan'}")
            bad = [u for u in profile.tp_units if u % self.tp]
            if bad:
                raise PlanError(f"tp={self.tp} does not divide {bad} (heads / sharded dims of the model); "
                                f"use a tp that divides {math.gcd(*profile.tp_units)}")
        check_plan(self, profile)
        layers = profile.num_layers
        if self.stages > layers:
            raise PlanError(f"pp x virtual_stages = {self.stages} exceeds the model's {layers} blocks; "
                            f"use fewer pipeline stages")
        if self.layer_split and sum(self.layer_split) != layers:
            raise PlanError(f"layer_split sums to {sum(self.layer_split)} but the model has {layers} blocks")
        if self.recompute == "full":
            most = max(device_blocks(self.split_for(layers), self.pp))
            if self.recompute_blocks > most:
                raise PlanError(f"recompute_blocks={self.recompute_blocks} exceeds the {most} blocks on the "
                                f"busiest pipeline rank; use at most {most}")

    # -- presentation and JSON -----------------------------------------------------------------
    @property
    def micro_batching(self) -> str:
        """The one notation of micro-batching in every output: size x count, per data-parallel rank."""
        return f"{self.micro_batch_size}x{self.num_micro_batches}"

    def describe(self) -> str:
        """Every knob away from its default, so two distinct plans never read the same."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"mb {self.micro_batching}"]
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.recompute == "selective":
            parts.append("ac=sel")
        elif self.recompute == "full":
            parts.append(f"ac={self.recompute_blocks}")
        if self.pp > 1:
            parts.append(self.schedule if self.virtual_stages == 1 else f"interleaved:{self.virtual_stages}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.grad_comm_dtype != "fp32":
            parts.append(f"comm={self.grad_comm_dtype}")
        if self.offload_optimizer:
            parts.append("offload")
        if self.bucket_mb != type(self).__dataclass_fields__["bucket_mb"].default:
            parts.append(f"bucket={self.bucket_mb:g}MB")
        if self.mesh_order != AXES:
            parts.append("mesh=" + ",".join(self.mesh_order))
        if self.layer_split:
            parts.append("split=" + "/".join(map(str, self.layer_split)))
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mesh_order"] = list(self.mesh_order)
        d["layer_split"] = list(self.layer_split)
        return {"schema_version": PLAN_SCHEMA_VERSION, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("schema_version", None)
        if version != PLAN_SCHEMA_VERSION:
            raise PlanError(f"plan schema_version is {version!r}, this autopar reads version "
                            f"{PLAN_SCHEMA_VERSION}; re-create the plan with `autopar search`")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"unknown plan key(s) {unknown}; valid keys are {sorted(known)}")
        missing = [k for k in ("dp", "tp", "pp", "micro_batch_size", "num_micro_batches") if k not in d]
        if missing:
            raise PlanError(f"plan is missing required key(s) {missing}")
        return cls(**check_plan_dict(d, cls, PlanError))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(loads(text, "plan", PlanError))

    @classmethod
    def load(cls, path) -> Plan:
        text = read_file(path, "plan file", PlanError)
        try:
            return cls.from_json(text)
        except PlanError as e:
            raise PlanError(f"{path}: {e}") from None

    def save(self, path) -> None:
        """Write atomically, so an interrupted write never leaves half a plan."""
        write_text_atomic(path, self.to_json() + "\n")


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise PlanError(f"{name} must be one of {list(allowed)}, got {value!r}")
