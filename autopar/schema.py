"""One schema per kind of data file autopar reads (plan, cluster, trace, workload spec, policy
metadata), checked at the boundary before any value is used.

Data files travel between teams: a schema checks types, ranges, finiteness, sizes and nesting
depth, and its error names the field's path (``coefficients.link_efficiency.ib``,
``layer_split[0]``), so a bad file is one clear line instead of a traceback deep in the cost
model or a silent "nan" plan. The plan schema is derived from the knob registry, so a knob added
later is checked without an edit here; the schemas of the cost coefficients
(`autopar/cost/coefficients.py`), of a stored profile (`autopar/profile/model_profile.py`) and of
a workload spec (`envs/workloads.py`) are derived from their dataclasses with `dataclass_schema`,
beside them (this module imports no other layer).
The limits below also bound the work a request can ask for (GPU count, global batch), so no
input makes autopar loop for hours. Standard library only: the executor loads plans with it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import types
import typing
from dataclasses import dataclass

from autopar import axes
from autopar.errors import AutoparError
from autopar.knobs import plan_fields

MAX_DEPTH = 32  # nesting of any JSON document autopar reads (its own files stay under 6)
MAX_ITEMS = 100_000  # entries of one list or object
MAX_STRING = 100_000  # characters of one string
MAX_INT = 2**53  # integers beyond this lose precision as JSON numbers elsewhere
MAX_GPUS = 131_072  # the largest cluster autopar plans for (nodes x GPUs per node)
MAX_GPUS_PER_NODE = 1024
MAX_GLOBAL_BATCH = 2**24  # samples per optimizer step
MAX_FILE_BYTES = 1 << 30  # a data file (trace files grow with every run)


class SchemaError(AutoparError):
    """A data file's value has the wrong type, range or size; the message names its path."""


# -- value specs -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Int:
    lo: int = 0
    hi: int = MAX_INT

    def check(self, value, path):
        if isinstance(value, bool) or not isinstance(value, int):
            _bad(path, f"must be an integer, got {_show(value)}")
        if not self.lo <= value <= self.hi:
            _bad(path, f"must be an integer in [{self.lo}, {self.hi}], got {_show(value)}")
        return value


@dataclass(frozen=True)
class Num:
    """A finite number (an integer is accepted) with `lo` < x (open) or <= x (closed) and x <= hi."""

    lo: float = 0.0
    hi: float = math.inf
    open_lo: bool = False
    finite: bool = True

    def check(self, value, path):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _bad(path, f"must be a number, got {_show(value)}")
        try:
            x = float(value)
        except OverflowError:
            _bad(path, f"must be a finite number, got an integer of {len(str(value))} digits")
        if math.isnan(x) and not self.finite:
            return x
        if not math.isfinite(x) and self.finite:
            _bad(path, f"must be a finite number, got {_show(value)}")
        if x < self.lo or (self.open_lo and x == self.lo) or x > self.hi:
            low = f"> {self.lo:g}" if self.open_lo else f">= {self.lo:g}"
            high = f" and <= {self.hi:g}" if math.isfinite(self.hi) else ""
            _bad(path, f"must be {low}{high}, got {_show(value)}")
        return x


@dataclass(frozen=True)
class Str:
    choices: tuple = ()
    max_len: int = MAX_STRING

    def check(self, value, path):
        if not isinstance(value, str):
            _bad(path, f"must be a string, got {_show(value)}")
        if len(value) > self.max_len:
            _bad(path, f"must be at most {self.max_len} characters, got {len(value)}")
        if self.choices and value not in self.choices:
            _bad(path, f"must be one of {list(self.choices)}, got {_show(value)}")
        return value


@dataclass(frozen=True)
class Bool:
    def check(self, value, path):
        if not isinstance(value, bool):
            _bad(path, f"must be true or false, got {_show(value)}")
        return value


@dataclass(frozen=True)
class Anything:
    """Any JSON value (sizes and depth still bounded by `check`)."""

    def check(self, value, path):
        return value


@dataclass(frozen=True)
class Opt:
    """`spec` or null."""

    spec: object

    def check(self, value, path):
        return None if value is None else self.spec.check(value, path)


@dataclass(frozen=True)
class List:
    item: object
    max_len: int = MAX_ITEMS

    def check(self, value, path):
        if not isinstance(value, (list, tuple)):
            _bad(path, f"must be a list, got {_show(value)}")
        if len(value) > self.max_len:
            _bad(path, f"must have at most {self.max_len} entries, got {len(value)}")
        return [self.item.check(v, f"{path}[{i}]") for i, v in enumerate(value)]


@dataclass(frozen=True)
class Map:
    """An object with free keys (limited to `keys` when given) and values of one spec."""

    value: object
    keys: tuple = ()

    def check(self, value, path):
        if not isinstance(value, dict):
            _bad(path, f"must be a JSON object, got {_show(value)}")
        for k in value:
            if self.keys and k not in self.keys:
                _bad(_join(path, k), f"is not a known key; use one of {list(self.keys)}")
        return {k: self.value.check(v, _join(path, k)) for k, v in value.items()}


@dataclass(frozen=True)
class Obj:
    """An object with named fields; `extra` admits other keys unchecked."""

    fields: dict
    required: tuple = ()
    extra: bool = False

    def check(self, value, path):
        if not isinstance(value, dict):
            _bad(path, f"must be a JSON object, got {_show(value)}")
        for k in self.required:
            if k not in value:
                _bad(_join(path, k), "is missing")
        out = dict(value)
        for k, v in value.items():
            if k in self.fields:
                out[k] = self.fields[k].check(v, _join(path, k))
            elif not self.extra:
                _bad(_join(path, k), f"is not a known key; use one of {sorted(self.fields)}")
        return out


class _Bad(Exception):
    pass


def _bad(path: str, message: str):
    raise _Bad(path, message)


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


# -- checking --------------------------------------------------------------------------------------------

def check_depth(value, limit: int = MAX_DEPTH) -> None:
    """Refuse documents nested deeper than `limit` (iteratively: no RecursionError)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list, tuple)):
            if depth > limit:
                raise _Bad("", f"is nested more than {limit} levels deep")
            children = v.values() if isinstance(v, dict) else v
            stack.extend((c, depth + 1) for c in children)


def check(value, spec, where: str, error: type[AutoparError] = SchemaError):
    """`value` checked against `spec` (ints given for floats become floats); raises `error` with
    "where: path message" in one line."""
    try:
        check_depth(value)
        return spec.check(value, "")
    except _Bad as e:
        path, message = e.args
        raise error(f"{where}: {path} {message}" if path else f"{where} {message}") from None


def read_file(path, what: str, error: type[AutoparError] = SchemaError, max_bytes: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a data file the user named; a FIFO, device or directory is refused before it
    is opened (reading a FIFO would block for good), and so is a file over `max_bytes`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{what} {path} is not a regular file; give the path of a file")
        if info.st_size > max_bytes:
            raise error(f"{what} {path} is {info.st_size:,} bytes; autopar reads at most {max_bytes:,}")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None
    finally:
        os.close(fd)


def loads(text: str | bytes, where: str, error: type[AutoparError] = SchemaError):
    """Parse JSON text; malformed or pathologically nested text is one `error` line."""
    prefix = f"{where}: " if where else ""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{prefix}not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise error(f"{prefix}nested more than {MAX_DEPTH} levels deep") from None
    except UnicodeDecodeError as e:
        raise error(f"{prefix}not UTF-8 text ({e.reason} at byte {e.start})") from None


def load_document(path, what: str, parse, error: type[AutoparError] = SchemaError):
    """`parse` of the JSON document in the data file at `path` (`what`: "plan", "mixed plan"): a file that
    cannot be read, is not JSON, or that `parse` refuses is one `error` line naming the file."""
    text = read_file(path, f"{what} file", error)
    try:
        return parse(loads(text, what, error))
    except error as e:
        raise error(f"{path}: {e}") from None


# -- schemas derived from dataclasses --------------------------------------------------------------------

def _spec_for(hint, default=dataclasses.MISSING):
    """The spec of a dataclass field from its type (and, for numbers, its default's sign)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        spec = _spec_for(inner[0], default) if len(inner) == 1 else Anything()
        return Opt(spec) if type(None) in args else spec
    if hint is bool:
        return Bool()
    if hint is int:
        return Int()
    if hint is float:  # >= 0; a positive default (a rate, a size) needs a positive value
        return Num(open_lo=isinstance(default, (int, float)) and default > 0)
    if hint is str:
        return Str()
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return List(_spec_for(args[0]))
    if hint is tuple or origin is tuple:
        return List(Anything())
    if hint is dict or origin is dict:
        return Map(Anything())
    return Anything()


def dataclass_schema(cls, overrides: dict | None = None, required: tuple = ()) -> Obj:
    """An Obj spec with one field per dataclass field, typed from its annotation; `overrides`
    replaces the derived spec of some fields (tighter ranges, choices)."""
    hints = typing.get_type_hints(cls)
    specs = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
        specs[f.name] = _spec_for(hints[f.name], default)
    specs.update(overrides or {})
    return Obj(specs, required=required)


# -- the schemas of autopar's data files -----------------------------------------------------------------

_POSITIVE_INT = Int(1, MAX_INT)
FIELD_RANGES = {  # fields whose range is narrower than their type's, besides the degrees of the axes
    "micro_batch_size": Int(1, MAX_GLOBAL_BATCH), "num_micro_batches": Int(1, MAX_GLOBAL_BATCH),
    "virtual_stages": Int(1, MAX_GPUS), "recompute_blocks": Int(0, MAX_ITEMS),
    "bucket_mb": Num(0.1, 1e7), "layer_split": List(Int(0, MAX_ITEMS), max_len=MAX_GPUS),
    "schema_version": Int(),
    "mesh_order": List(Str()),  # no null: a plan leaves the field out for the default order
}
PLAN_RANGES: dict = {}  # FIELD_RANGES and every axis's and folded axis's degree, kept current by the axes registry


def _plan_ranges() -> None:
    """Every degree of `autopar.axes` (a plan of a declared axis is checked without an edit here) and FIELD_RANGES."""
    PLAN_RANGES.clear()
    PLAN_RANGES.update({a: Int(1, MAX_GPUS) for a in (*axes.AXES, *axes.FOLDED)}, **FIELD_RANGES)


axes.on_change(_plan_ranges)
_plan_ranges()


def _field_spec(f):
    """The spec of a Plan field from its declared kind (`autopar.knobs.Field`); tuple fields hold
    names (a mesh order); a field whose default is None may be null."""
    spec = List(Str()) if f.kind is tuple else _spec_for(f.kind, f.default)
    return Opt(spec) if f.default is None else spec


def plan_schema() -> Obj:
    """The plan file: every field of the knob registry (`autopar.knobs.plan_fields`), typed from its
    declared kind, so a knob declared later is checked without an edit here."""
    specs = {f.name: _field_spec(f) for f in plan_fields()}
    specs["layer_split"] = List(Anything())
    return Obj({**specs, **PLAN_RANGES})


def check_plan_dict(d: dict, error: type[AutoparError]) -> dict:
    return check(d, plan_schema(), "plan", error)


def check_gpus(nodes: int, gpus_per_node: int, where: str = "the cluster") -> None:
    """A cluster autopar can plan for in bounded time."""
    if gpus_per_node > MAX_GPUS_PER_NODE:
        raise AutoparError(f"{where} has {gpus_per_node} GPUs per node; autopar plans for at most "
                           f"{MAX_GPUS_PER_NODE} per node")
    if nodes * gpus_per_node > MAX_GPUS:
        raise AutoparError(f"{where} has {nodes} x {gpus_per_node} = {nodes * gpus_per_node} GPUs; autopar plans "
                           f"for at most {MAX_GPUS} GPUs")


def check_global_batch(batch: int, flag: str = "--global-batch") -> None:
    if batch is None or isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise AutoparError(f"{flag} must be a positive integer, got {batch}")
    if batch > MAX_GLOBAL_BATCH:
        raise AutoparError(f"{flag} is {batch}; autopar plans for global batches up to {MAX_GLOBAL_BATCH} samples")


_NUMBERS = List(Num(-math.inf, finite=False))  # losses: any sign, may diverge to nan/inf (measured, not configured)
TRACE_SCHEMA = Obj({
    "schema_version": Int(),
    "time": Str(max_len=64),
    "cluster": Obj({"name": Str(), "nodes": Int(1, MAX_GPUS), "gpus_per_node": Int(1, MAX_GPUS_PER_NODE),
                    "gpu": Str(), "backend": Str()}, extra=True),
    "model": Obj({"name": Str(), "path": Opt(Str()), "digest": Opt(Str()), "args": Opt(Map(Anything())),
                  "dims": Opt(Map(Anything())), "params": Opt(Int()), "profile": Opt(Map(Anything()))},
                 extra=True),
    "workload": Obj({"global_batch": Int(1, MAX_GLOBAL_BATCH), "seq_len": Opt(Int(1, MAX_INT))},
                    required=("global_batch",), extra=True),
    "plan": Map(Anything()),  # Plan.from_dict checks it against the plan schema where it is used
    "measured": Obj({"step_times_s": List(Num()), "median_step_s": Num(open_lo=True), "tokens_per_s": Num(),
                     "peak_memory_bytes": List(Num()), "losses": _NUMBERS}, extra=True),
    "predicted": Opt(Obj({"iteration_time_s": Num(), "peak_memory_gb": Num()}, extra=True)),
    "outcome": Str(),
    "error": Opt(Str()),
    "versions": Map(Str()),
})


POLICY_META_SCHEMA = Obj({"format": Str(), "space_signature": Str(), "observation_size": Int(1, MAX_ITEMS),
                          "max_actions": Int(1, MAX_ITEMS)}, required=("format", "space_signature"), extra=True)


__all__ = [
    "MAX_DEPTH",
    "MAX_GLOBAL_BATCH",
    "MAX_GPUS",
    "MAX_GPUS_PER_NODE",
    "POLICY_META_SCHEMA",
    "TRACE_SCHEMA",
    "SchemaError",
    "check",
    "check_global_batch",
    "check_gpus",
    "load_document",
    "loads",
    "plan_schema",
    "read_file",
]

