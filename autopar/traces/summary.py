"""What a trace file holds, for `autopar traces show`: records by outcome, by cluster and by model,
the range of measured step times, how well the stored predictions matched, and the malformed
lines (each with its line number)."""

from __future__ import annotations

from collections import Counter, defaultdict

from rich.table import Table

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.traces.record import read_records


def _cluster(r) -> str:
    c = r.cluster
    return f"{c.get('name', '?')} ({c.get('nodes', '?')} x {c.get('gpus_per_node', '?')})"


def _model(r) -> str:
    dims = r.model.get("dims") or {}
    shape = " ".join(f"{k[0]}{dims[k]}" for k in ("hidden", "layers") if k in dims)
    return f"{r.model.get('name', '?')} {shape}".strip()


def summarize(path) -> dict:
    """A JSON-ready summary of one trace file."""
    records, problems = read_records(path)
    ok = [r for r in records if r.outcome == "ok"]
    times = [float(r.measured["median_step_s"]) for r in ok]
    by_model: dict[str, list] = defaultdict(list)
    for r in ok:
        by_model[_model(r)].append(r)
    errors = [r.predicted["iteration_time_s"] / r.measured["median_step_s"] - 1 for r in ok
              if r.predicted and r.predicted.get("iteration_time_s")]
    models = []
    for name, rs in sorted(by_model.items()):
        best = min(rs, key=lambda r: r.measured["median_step_s"])
        models.append({"model": name, "runs": len(rs), "clusters": sorted({_cluster(r) for r in rs}),
                       "best_step_s": best.measured["median_step_s"],
                       "best_plan": _describe(best.plan)})
    stamps = sorted(r.time for r in records)
    return {
        "path": str(path),
        "records": len(records),
        "outcomes": dict(Counter(r.outcome for r in records)),
        "clusters": dict(Counter(_cluster(r) for r in records)),
        "models": models,
        "step_time_s": {"min": min(times), "max": max(times)} if times else None,
        "stored_prediction": ({"rows": len(errors), "mape": sum(abs(e) for e in errors) / len(errors)}
                              if errors else None),
        "time_range": [stamps[0], stamps[-1]] if stamps else None,
        "malformed": [{"line": p.line, "message": p.message} for p in problems],
    }


def _describe(plan: dict) -> str:
    try:
        return Plan.from_dict(plan).describe()
    except (AutoparError, TypeError):
        return "(unreadable plan)"


def print_summary(summary: dict, console) -> None:
    s = summary
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(s["outcomes"].items())) or "none"
    console.print(f"[bold]{s['path']}[/bold]: {s['records']} record(s) ({outcomes})")
    if s["time_range"]:
        console.print(f"recorded {s['time_range'][0]} .. {s['time_range'][1]}")
    if s["step_time_s"]:
        console.print(f"measured step time {s['step_time_s']['min']:.4g} .. {s['step_time_s']['max']:.4g} s")
    if s["stored_prediction"]:
        p = s["stored_prediction"]
        console.print(f"stored cost-model predictions: MAPE {p['mape']:.1%} over {p['rows']} row(s) "
                      f"(with the coefficients in use when the records were written)")
    if s["clusters"]:
        table = Table(title="clusters")
        table.add_column("cluster (nodes x GPUs per node)")
        table.add_column("records", justify="right")
        for name, n in sorted(s["clusters"].items()):
            table.add_row(name, str(n))
        console.print(table)
    if s["models"]:
        table = Table(title="models (outcome ok)")
        for col in ("model", "runs", "clusters", "best step (s)", "best plan"):
            table.add_column(col, justify="right" if col in ("runs", "best step (s)") else "left")
        for m in s["models"]:
            table.add_row(m["model"], str(m["runs"]), ", ".join(m["clusters"]), f"{m['best_step_s']:.4g}",
                          m["best_plan"])
        console.print(table)
    if s["malformed"]:
        console.print(f"[yellow]{len(s['malformed'])} malformed line(s), skipped:[/yellow]")
        for p in s["malformed"][:20]:
            console.print(f"  line {p['line']}: {p['message']}")
        if len(s["malformed"]) > 20:
            console.print(f"  ... and {len(s['malformed']) - 20} more")
