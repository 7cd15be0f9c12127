"""Rich tables for plans and estimates: what `autopar search` and `autopar estimate` print."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autopar import axes
from autopar.cost import Estimate
from autopar.explain import Reason, bottleneck
from autopar.knobs import knobs
from autopar.plan import Plan, degrees_text
from autopar.search.simplicity import TIE


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def params_text(n: float) -> str:
    """Parameters in M below a billion, in B above: "0.42 M", "124 M", "175 B"."""
    if n < 1e9:
        return f"{n / 1e6:.3g} M" if n < 1e8 else f"{n / 1e6:.0f} M"
    return f"{n / 1e9:.4g} B"


def _tflops(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f}" if x < 100 else f"{x * 1e3:,.0f}"


SHOWN = ("micro_batch_size", "num_micro_batches", "mesh_order")  # in the degrees and micro-batching rows


def plan_table(plan: Plan) -> Table:
    """One row for the degrees of every axis, then one per knob (`autopar.knobs`), in its words."""
    t = Table(title="Plan", show_header=False, title_justify="left")
    t.add_column("knob", style="bold")
    t.add_column("value")
    degrees = degrees_text({a: getattr(plan, a) for a in axes.AXES})
    rows = [(" / ".join(axes.AXES[a].label for a in axes.AXES),
             f"{degrees}; mesh {','.join(plan.mesh_order)}, {plan.mesh_order[-1]} innermost"),
            ("micro-batching", f"{plan.micro_batching} (size x count, per data-parallel rank)")]
    rows += [(k.label, k.text(k.value_of(plan))) for k in knobs() if k.name not in axes.AXES and k.name not in SHOWN]
    if plan.layer_split:
        rows.append(("layer split", " ".join(map(str, plan.layer_split))))
    for k, v in rows:
        t.add_row(k, v)
    return t


def summary(est: Estimate) -> str:
    """The estimate in one line, printed on its own (a table caption would wrap it to the table's width)."""
    return (f"iteration {est.iteration_time_s * 1e3:,.1f} ms; {_tflops(est.tflops_per_gpu)} TFLOP/s per GPU (model "
            f"FLOPs), {_tflops(est.hw_tflops_per_gpu)} with recompute; MFU {est.mfu:.1%}; {est.tokens_per_s:,.0f} "
            f"tokens/s; memory {_gb(est.peak_memory_bytes)} of {_gb(est.usable_memory_bytes)} GB usable "
            f"({'fits' if est.fits else 'DOES NOT FIT'})")


def estimate_tables(est: Estimate) -> tuple[Table, Table]:
    time = Table(title="Iteration time", title_justify="left")
    time.add_column("time", style="bold")
    time.add_column("ms", justify="right")
    time.add_column("share", justify="right")
    for name, sec in est.breakdown.items():
        if sec > 0:
            time.add_row(name.replace("_", " "), _ms(sec), f"{sec / est.iteration_time_s:.1%}")
    for name, sec in (est.hidden or {}).items():  # overlapped by the runtime: not in the iteration
        if sec > 0:
            time.add_row(f"{name.replace('_', ' ')} hidden ({est.runtime})", _ms(sec), "overlapped", style="dim")
    mem = Table(title="Memory per GPU (most loaded)", title_justify="left")
    mem.add_column("memory", style="bold")
    mem.add_column("GB", justify="right")
    for name, b in est.memory.items():
        if b > 0:
            mem.add_row(name.replace("_", " "), _gb(b))
    mem.add_row("total", _gb(est.peak_memory_bytes), style="bold")
    headroom = est.gpu_memory_bytes - est.usable_memory_bytes
    mem.add_row(f"headroom ({headroom / est.gpu_memory_bytes:.0%}, --memory-headroom)", _gb(headroom), style="dim")
    mem.add_row("GPU memory", _gb(est.gpu_memory_bytes), style="dim")
    return time, mem


def alternatives_table(best: Estimate, alternatives: list[tuple[Plan, Estimate]]) -> Table:
    """The planner's ranking: plans within the tie tolerance of each other rank simplest first, so a
    runner-up may be faster than the plan above it (or than the chosen one, a negative 'vs best');
    the caption says so whenever a row is out of time order, where it would otherwise read as a bug."""
    times = [best.iteration_time_s] + [est.iteration_time_s for _, est in alternatives]
    tie = any(later < earlier for earlier, later in zip(times, times[1:]))
    t = Table(title="Runners-up", title_justify="left", caption_justify="left",
              caption=f"not in time order: plans within the {TIE:.1%} tie tolerance of each other rank simplest "
                      "first, as the planner chose (a faster row below a slower one, or a negative 'vs best', is "
                      "such a tie)" if tie else None)
    for col in ("#", "plan", "iteration ms", "vs best", "TFLOP/s", "MFU", "memory GB"):
        t.add_column(col, justify="left" if col == "plan" else "right")
    for i, (plan, est) in enumerate(alternatives, start=2):
        t.add_row(str(i), plan.describe(), _ms(est.iteration_time_s),
                  f"{est.iteration_time_s / best.iteration_time_s - 1:+.1%}", _tflops(est.tflops_per_gpu),
                  f"{est.mfu:.1%}", _gb(est.peak_memory_bytes))
    return t


def why_table(est: Estimate, reasons: list[Reason]) -> Table:
    t = Table(title="Why", title_justify="left", caption=f"bottleneck: {bottleneck(est.breakdown)}",
              caption_justify="left")
    t.add_column("choice", style="bold")
    t.add_column("instead")
    for r in reasons:
        t.add_row(r.chosen, r.text)
    return t


def print_estimate(console: Console, plan: Plan, est: Estimate) -> None:
    console.print(plan_table(plan))
    for table in estimate_tables(est):
        console.print(table)
    console.print(summary(est), highlight=False)
