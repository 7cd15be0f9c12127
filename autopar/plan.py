"""The Plan: the one contract between the planners and the executor.

An immutable record of the knobs of `autopar.knobs` (one field per knob field, axis degrees
first), that checks its own consistency on construction and its fit to a workload in
`validate`. JSON carries a schema version and rejects unknown keys, so a plan written by
one version of autopar is never silently misread by another. Besides the standard-library
registries (`autopar.axes`, `autopar.knobs`) it imports only `autopar.capability` and
`autopar.schema`, all standard library: reading a plan needs neither torch nor the planners.
"""

from __future__ import annotations

import json
from typing import Any

from autopar import axes, capability
from autopar.atomic import write_text_atomic
from autopar.errors import PlanError
from autopar.knobs import (  # noqa: F401  (re-exported: the names plans are made of)
    COMM_DTYPES,
    PRECISIONS,
    RECOMPUTE_MODES,
    SCHEDULES,
    ZERO_STAGES,
    balanced_split,
    check_split_entries,
    check_stage_blocks,
    device_blocks,
    fp8_problem,
    knobs,
    plan_fields,
)
from autopar.schema import check_plan_dict, load_document, loads

PLAN_SCHEMA_VERSION = 2  # 2: layer_split may hold 0 at its ends; stage_recompute
READ_VERSIONS = (1, 2)  # a version-1 plan reads as the same plan (it has neither)
REQUIRED = ("dp", "tp", "pp", "micro_batch_size", "num_micro_batches")  # every schema-1 plan has them
# names older autopar versions wrote or accepted in plan JSON -> the one name used now
ALIASES = {"micro_batch": "micro_batch_size", "mbs": "micro_batch_size", "comm_dtype": "grad_comm_dtype",
           "sp": "sequence_parallel", "offload": "offload_optimizer", "bucket": "bucket_mb"}


def _check_mesh_order(order) -> None:
    """A mesh order names every axis; only an axis declared after the plan format's first axes (cp,
    which older plans could not name) may be left out, at degree 1 (`axes.complete_order`)."""
    if order is None:
        return
    missing = [a for a in REQUIRED[:3] if a not in order]
    if missing:
        raise PlanError(f"mesh_order {','.join(order)} leaves out {', '.join(missing)}; give every axis, outermost "
                        f"first, e.g. {','.join(axes.default_order())}")


class Plan:
    """A complete parallel training plan. Degrees multiply to the world size; the global batch
    is dp x micro_batch_size x num_micro_batches. Fields are those of the knob registry
    (`autopar.knobs.plan_fields()`) plus `layer_split` (blocks per virtual stage in pipeline
    order; empty: balanced; with pp >= 2 its first and last entries may be 0: a stage holding only
    the embedding, or only the norm, head and loss); a field left out takes its declared default.
    `stage_recompute` (one entry per virtual stage) replaces `recompute` when given."""

    __slots__ = ("_values", "_record")

    def __init__(self, **values):
        known = {f.name: f for f in plan_fields()}
        unknown = sorted(set(values) - set(known) - {"layer_split"})
        if unknown:
            raise PlanError(f"unknown plan field(s) {unknown}; valid fields are {sorted(known) + ['layer_split']}")
        out = {}
        for name, f in known.items():
            out[name] = values[name] if name in values else f.default
        degrees = {a: out[a] for a in axes.AXES}
        dims = axes.ParallelDims(degrees, axes.complete_order(out["mesh_order"] or axes.default_order(), degrees))
        _check_mesh_order(out["mesh_order"])  # after complete_order, which names duplicates and unknown axes
        out["mesh_order"] = dims.order
        out["layer_split"] = tuple(int(n) for n in values.get("layer_split", ()))
        if not isinstance(out["stage_recompute"], (tuple, list)):
            raise PlanError(f"stage_recompute must be a list of per-stage entries, got {out['stage_recompute']!r}")
        out["stage_recompute"] = tuple(out["stage_recompute"])
        for name in REQUIRED[3:] + ("virtual_stages",):
            value = out[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"plan field '{name}' must be a positive integer, got {value!r}")
        for name, f in known.items():
            if f.values is not None and out[name] not in f.values:
                raise PlanError(f"{name} must be one of {list(f.values)}, got {out[name]!r}")
        if not (isinstance(out["bucket_mb"], (int, float)) and not isinstance(out["bucket_mb"], bool)
                and out["bucket_mb"] > 0):
            raise PlanError(f"bucket_mb must be a positive number of megabytes, got {out['bucket_mb']!r}")
        object.__setattr__(self, "_values", out)
        object.__setattr__(self, "_record", {})  # what it was searched under (`recorded`): not part of the plan
        for k in knobs():
            if k.check is not None:
                k.check(self)
        if self.layer_split and len(self.layer_split) != self.pp * self.virtual_stages:
            raise PlanError(f"layer_split has {len(self.layer_split)} entries but pp x virtual_stages = "
                            f"{self.pp * self.virtual_stages}; give one block count per virtual stage")
        check_split_entries(self.layer_split, self.pp)
        if self.layer_split and self.stage_recompute:
            check_stage_blocks(self.stage_recompute, self.layer_split)

    def __getattr__(self, name: str):
        try:
            return object.__getattribute__(self, "_values")[name]
        except KeyError:
            raise AttributeError(f"Plan has no field {name!r}") from None

    def __setattr__(self, name, value):
        raise AttributeError("a Plan is immutable; use plan.with_(...)")

    def __eq__(self, other) -> bool:
        return isinstance(other, Plan) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __repr__(self) -> str:
        return "Plan(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    def __reduce__(self):
        return (_from_fields, (dict(self._values), self._record))

    # -- derived -----------------------------------------------------------------------
    @property
    def dims(self) -> axes.ParallelDims:
        return axes.ParallelDims({a: self._values[a] for a in axes.AXES}, self.mesh_order)

    @property
    def world_size(self) -> int:
        return self.dims.world_size

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
        return self.dims.strides()

    def with_(self, **changes) -> Plan:
        return Plan(**{**self._values, **changes}).recorded(**self._record)

    # -- what it was searched under: the knobs an elastic re-plan keeps (docs/elastic.md) --------------
    def recorded(self, fixed=(), searched=None, cluster: str | None = None) -> Plan:
        """This plan, recording the knobs the search held (`search --fix`) and the values it chose for
        every decision (`searched`, JSON values by field), so that a re-plan can tell an edit from them,
        and the cluster it was searched for (`--cluster` as given; a file's absolute path), so that pricing
        it on another says so."""
        out = object.__new__(Plan)  # the same (immutable) values, already checked
        object.__setattr__(out, "_values", self._values)
        record = {"fixed": tuple(fixed), "searched": dict(searched or {}), "cluster": cluster}
        object.__setattr__(out, "_record", {k: v for k, v in record.items() if v})
        return out

    @property
    def fixed(self) -> tuple[str, ...]:
        return self._record.get("fixed", ())

    @property
    def searched_on(self) -> str | None:
        """The cluster the search planned it for (None: not recorded)."""
        return self._record.get("cluster")

    def kept(self) -> tuple[str, ...]:
        """The knobs a re-plan must keep at this plan's values: the ones the search held, and any whose
        value is not what the search chose (set by hand in plan.json). A plan without a search record
        keeps only what it lists as fixed."""
        searched, mine = self._record.get("searched", {}), self.to_dict()
        edited = [k.name for k in knobs() if k.name not in self.fixed
                  and any(f.name in searched and searched[f.name] != mine[f.name] for f in k.fields)]
        return self.fixed + tuple(edited)

    def fields(self) -> dict[str, Any]:
        return dict(self._values)

    @staticmethod
    def defaults() -> dict[str, Any]:
        """Every field at its declared default, in field order (the mesh order: the default one)."""
        out = {f.name: f.default for f in plan_fields()}
        out.update(mesh_order=axes.default_order(), layer_split=())
        return out

    # -- checks against a workload ----------------------------------------------------------
    def validate(self, workload) -> None:
        """Raise PlanError naming the failed constraint and a fix; return None when valid."""
        gpus = workload.cluster.num_gpus
        self.dims.check_world(gpus, f"the cluster has {gpus} GPUs", f"choose degrees whose product is {gpus}")
        if self.global_batch != workload.global_batch:
            per_step = self.dp * self.micro_batch_size
            fix = (f"set num_micro_batches = {workload.global_batch // per_step}"
                   if workload.global_batch % per_step == 0 else
                   f"dp x micro_batch_size = {per_step} does not divide it: change micro_batch_size or the global "
                   f"batch (or plan it with `autopar search`)")
            raise PlanError(f"dp x micro_batch_size x num_micro_batches = {self.global_batch} but the global "
                            f"batch is {workload.global_batch}; {fix}")
        self.validate_parts(workload)

    def validate_parts(self, workload) -> None:
        """Every check of `validate` but the world size and the global batch: what each segment of a
        mixed cluster's lane across groups passes (it holds only its own stages' ranks)."""
        layers = workload.profile.num_layers
        empty_ends = sum(1 for n in self.layer_split if n == 0)
        if self.stages - empty_ends > layers:
            raise PlanError(f"pp x virtual_stages = {self.stages} exceeds the model's {layers} blocks; "
                            f"use fewer pipeline stages")
        self.dims.check_workload(workload)
        for folded in axes.FOLDED.values():  # ep: divides the experts, 1 for a dense model
            why = folded.allowed(workload, getattr(self, folded.name))
            if why:
                raise PlanError(why)
        capability.check(self, capability.Target.of(workload))  # what the workload's runtime runs on its cluster
        if self.layer_split and sum(self.layer_split) != layers:
            raise PlanError(f"layer_split sums to {sum(self.layer_split)} but the model has {layers} blocks")
        if self.recompute == "full":
            most = max(device_blocks(self.split_for(layers), self.pp, self.schedule))
            if self.recompute_blocks > most:
                raise PlanError(f"recompute_blocks={self.recompute_blocks} exceeds the {most} blocks on the "
                                f"busiest pipeline rank; use at most {most}")
        if self.stage_recompute:
            check_stage_blocks(self.stage_recompute, self.split_for(layers))

    # -- presentation and JSON -----------------------------------------------------------------
    @property
    def micro_batching(self) -> str:
        """The one notation of micro-batching in every output: size x count, per data-parallel rank."""
        return f"{self.micro_batch_size}x{self.num_micro_batches}"

    def describe(self) -> str:
        """One line: the degrees (every axis above 1, and dp tp pp always), the micro-batching, then
        each knob's token where it is away from its default (`Knob.short`), so two distinct plans
        never read the same."""
        parts = [degrees_text({a: self._values[a] for a in axes.AXES})]
        parts.append(f"mb {self.micro_batching}")
        for k in knobs():
            if k.name == "schedule" and self.pp == 1:
                continue
            token = k.short(k.value_of(self))
            if token:
                parts.append(token)
        if self.layer_split:
            parts.append("split=" + "/".join(map(str, self.layer_split)))
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self._values.items()}
        record = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self._record.items()}
        return {"schema_version": PLAN_SCHEMA_VERSION, **d, **record}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        if not isinstance(d, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("schema_version", None)
        if "mixed_plan_version" in d:  # autopar.mixed.plan's document: lanes over GPU groups
            raise PlanError("this is a mixed-cluster plan (lanes over GPU groups), which only `autopar run` and "
                            "`autopar estimate --plan` read; for this command plan one cluster with `autopar search "
                            "--cluster PRESET`")
        if version is None:
            keys = ", ".join(sorted(map(str, d))[:6]) or "none"
            raise PlanError(f"not an autopar plan: it has no schema_version (its keys: {keys}); write one with "
                            f"`autopar search ... -o plan.json`")
        if version not in READ_VERSIONS:
            raise PlanError(f"plan schema_version is {version!r}, this autopar reads versions "
                            f"{', '.join(map(str, READ_VERSIONS))}; re-create the plan with `autopar search`")
        for old, new in ALIASES.items():
            if old in d and new not in d:
                d[new] = d.pop(old)
        fixed, searched, cluster = d.pop("fixed", []), d.pop("searched", {}), d.pop("cluster", None)
        if cluster is not None and (not isinstance(cluster, str) or not cluster):
            raise PlanError(f"plan key 'cluster' must be the --cluster the plan was searched for, got {cluster!r}")
        known = {f.name for f in plan_fields()} | {"layer_split"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"unknown plan key(s) {unknown}; valid keys are "
                            f"{sorted(known | {'fixed', 'searched', 'cluster'})}")
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise PlanError(f"plan is missing required key(s) {missing}")
        return cls(**check_plan_dict(d, PlanError)).recorded(_fixed_names(fixed), _searched_fields(searched), cluster)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(loads(text, "plan", PlanError))

    @classmethod
    def load(cls, path) -> Plan:
        return load_document(path, "plan", cls.from_dict, PlanError)

    def save(self, path) -> None:
        """Write atomically, so an interrupted write never leaves half a plan."""
        write_text_atomic(path, self.to_json() + "\n")


def degrees_text(degrees: dict[str, int]) -> str:
    """"dp4 tp2 pp1": dp, tp and pp always, any other axis where it is above 1."""
    return " ".join(f"{a}{d}" for a, d in degrees.items() if a in REQUIRED or d > 1)


def _from_fields(values: dict, record: dict | None = None) -> Plan:
    return Plan(**values).recorded(**(record or {}))


def _fixed_names(names) -> tuple[str, ...]:
    """A plan file's `fixed`: names of decisions (a knob or a degree; not dp, derived from the GPU count)."""
    decisions = [k.name for k in knobs() if k.decision]
    if not isinstance(names, list) or any(not isinstance(n, str) or n not in decisions for n in names):
        raise PlanError(f"plan key 'fixed' must be a list of knob names from {decisions}, got {names!r}")
    return tuple(dict.fromkeys(names))


def _searched_fields(values) -> dict[str, Any]:
    """A plan file's `searched`: plan fields and the values the search chose, checked as plan fields are."""
    if not isinstance(values, dict) or set(values) - {f.name for f in plan_fields()}:
        raise PlanError(f"plan key 'searched' must map plan fields to the values the search chose, got {values!r}")
    return check_plan_dict(values, PlanError)
