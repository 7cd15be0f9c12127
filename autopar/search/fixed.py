"""Knobs held at one value (`autopar search --fix KNOB=VALUE`): parsed and checked before any work.

A held knob narrows the plan space itself (`Workload.fixed`, read by `autopar.search.space`), so
every planner, the RL environment's masks and the Why table see one plan space. `parse_fixes`
checks what needs no model (the knob exists, is a decision, the value parses and is one the space
can offer); `check_fixes` what needs the workload (a plan of its space has every held value), and
names the first held value that leaves none, with the values the space offers instead.
"""

from __future__ import annotations

import dataclasses

from autopar import axes
from autopar.cluster.io import spec_identity
from autopar.errors import AutoparError, PlanError
from autopar.knobs import knobs
from autopar.plan import ALIASES
from autopar.search.space import walk

DERIVED = {  # decisions no plan makes freely: what fixes them instead
    "precision": "precision is the workload's: use --precision",
    "num_micro_batches": "num_micro_batches is global batch / (dp x micro_batch_size): fix micro_batch_size",
}


def parse_fix(text: str) -> tuple[str, object]:
    """KNOB=VALUE -> (knob name, value), the value as `estimate`'s flag of that knob reads it."""
    name, sep, raw = text.partition("=")
    name = name.strip().replace("-", "_")
    name = ALIASES.get(name, name)
    if not sep or not name or not raw.strip():
        raise AutoparError(f"--fix expects KNOB=VALUE (e.g. --fix compile=false), got '{text}'")
    by_name = {k.name: k for k in knobs()}
    if name == axes.derived_axis():
        raise AutoparError(f"--fix {text}: {name} is derived (the GPU count over the other degrees); fix "
                           f"{', '.join(a for a in axes.AXES if a != name)} or change --nodes / --gpus-per-node")
    if name in DERIVED:
        raise AutoparError(f"--fix {text}: {DERIVED[name]}")
    if name not in by_name or not by_name[name].decision:
        choices = ", ".join(k.name for k in knobs() if k.decision)
        raise AutoparError(f"--fix {text}: unknown knob '{name}'; knobs: {choices}")
    k = by_name[name]
    raw = raw.strip()
    try:
        value = k.parse(raw) if k.parse else k.fields[0].kind(raw)
    except PlanError as e:
        raise AutoparError(f"--fix {text}: {e}") from None
    except ValueError:
        raise AutoparError(f"--fix {text}: {name} takes {'an integer' if k.fields[0].kind is int else 'a number'}, "
                           f"got '{raw}'") from None
    problem = _static_problem(k, value)
    if problem:
        raise AutoparError(f"--fix {text}: {problem}")
    return name, value


def _static_problem(k, value) -> str | None:
    """What no workload's plan space offers: a degree below 1, a value outside the knob's declared set."""
    parts = value if isinstance(value, tuple) else (value,)
    for f, v in zip(k.fields, parts):
        if v is None:
            continue
        if f.kind is int and f.values is None:
            least = min(1, f.default)  # a count whose default is 0 (recompute_blocks of none, selective) may be 0
            if isinstance(v, bool) or v < least:
                return f"{f.name} must be a {'positive' if least else 'non-negative'} integer"
        if f.values is not None and f.kind is not tuple and v not in f.values:
            return f"{f.name} must be one of {', '.join(map(str, f.values))}"
    if k.slots is not None and value not in k.slots and not (isinstance(value, tuple) and None in value):
        return f"the plan space offers {k.name} only as one of {', '.join(map(_text, k.slots))}"
    if k.name == "mesh_order" and value not in axes.mesh_orders():
        return f"the plan space offers the mesh orders {' or '.join(','.join(o) for o in axes.mesh_orders())}"
    return None


def _text(value) -> str:
    """A value as --fix writes it: true, 25, 5, interleaved:2, 3 (full recompute of 3 blocks), pp,dp,cp,tp."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if isinstance(value, tuple):
        mode, n = value
        if mode == "full":
            return "full" if n is None else str(n)
        return mode if n in (0, 1) else f"{mode}:{n}"
    return str(value)


def parse_fixes(texts: list[str]) -> tuple[tuple[str, object], ...]:
    """Every --fix, in order; one knob held at two values is refused."""
    out: dict = {}
    for text in texts:
        name, value = parse_fix(text)
        if name in out and out[name] != value:
            raise AutoparError(f"--fix holds {name} at two values ({_text(out[name])} and {_text(value)}); give one")
        out[name] = value
    return tuple(out.items())


def with_fixes(workload, fixed: tuple[tuple[str, object], ...]):
    """The workload with these knobs held, checked: one line naming the first held value no plan of
    its space has (beside the ones before it), and what the space offers instead."""
    held = dataclasses.replace(workload, fixed=tuple(fixed))
    if not fixed:
        return held
    try:
        if walk(held).size:
            return held
    except AutoparError:  # a space too large to enumerate: the planner checks as it samples
        return held
    for i, (name, value) in enumerate(fixed):
        before = dataclasses.replace(workload, fixed=tuple(fixed[:i]))
        if walk(dataclasses.replace(workload, fixed=tuple(fixed[:i + 1]))).size:
            continue
        offered = walk(before).values.get(name, [])
        why = axes.AXES[name].allowed(workload, value) if name in axes.AXES else None
        beside = f" beside {', '.join(f'{n}={_text(v)}' for n, v in fixed[:i])}" if i else ""
        raise AutoparError(f"--fix {name}={_text(value)}: {why or 'no plan of this workload has it' + beside}; "
                           f"the plan space offers {name} = {', '.join(map(_text, offered)) or 'nothing'}"
                           f"{beside and ' there'}")
    return held


def searched(plan, fixed: tuple[tuple[str, object], ...], cluster: str | None = None):
    """The plan as `search -o` writes it: the knobs held (`fixed`) and the value it chose for every
    decision (`searched`), so an elastic re-plan keeps the held knobs and any edited by hand; and the
    cluster it was searched for (`--cluster`: a file by its absolute path), which `explain` and `estimate`
    compare with theirs."""
    values = plan.to_dict()
    chosen = {f.name: values[f.name] for k in knobs() if k.decision for f in k.fields}
    return plan.recorded(fixed=tuple(name for name, _ in fixed), searched=chosen,
                         cluster=None if cluster is None else spec_identity(cluster))
