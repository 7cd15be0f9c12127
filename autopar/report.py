"""Rich tables for plans and estimates: what `autopar search` and `autopar estimate` print."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autopar.cost import Estimate
from autopar.explain import Reason, bottleneck
from autopar.plan import Plan


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def _ms(x: float) -> str:
    return f"{x * 1e3:,.1f}" if x < 100 else f"{x * 1e3:,.0f}"


def plan_table(plan: Plan) -> Table:
    t = Table(title="Plan", show_header=False, title_justify="left")
    t.add_column("knob", style="bold")
    t.add_column("value")
    order = "(" + ", ".join(plan.mesh_order) + ")  innermost last"
    rows = [
        ("data / tensor / pipeline", f"dp={plan.dp}  tp={plan.tp}  pp={plan.pp}  (mesh {order})"),
        ("micro-batches", f"{plan.num_micro_batches} x {plan.micro_batch_size} samples per data-parallel rank"),
        ("ZeRO", {0: "0 (DDP)", 1: "1 (sharded optimizer)", 2: "2 (+ sharded gradients)",
                  3: "3 (FSDP2, sharded parameters)"}[plan.zero]
         + ("  + CPU offload" if plan.offload_optimizer else "")),
        ("gradient buckets", f"{plan.bucket_mb:g} MB, reduced in {plan.grad_comm_dtype}"),
        ("recompute", {"none": "none", "selective": "selective (attention core)"}.get(
            plan.recompute, f"full, {plan.recompute_blocks} block(s) per pipeline rank")),
        ("pipeline schedule", "-" if plan.pp == 1 else (
            plan.schedule if plan.virtual_stages == 1 else f"interleaved 1F1B, {plan.virtual_stages} chunks per rank")),
        ("sequence parallel", "on" if plan.sequence_parallel else "off"),
        ("precision", plan.precision),
    ]
    if plan.layer_split:
        rows.append(("layer split", " ".join(map(str, plan.layer_split))))
    for k, v in rows:
        t.add_row(k, v)
    return t


def estimate_tables(est: Estimate) -> tuple[Table, Table]:
    time = Table(title=f"Iteration {est.iteration_time_s * 1e3:,.1f} ms", title_justify="left",
                 caption=f"{est.tflops_per_gpu:.0f} TFLOP/s per GPU (model FLOPs), {est.hw_tflops_per_gpu:.0f} "
                         f"(hardware, recompute counted); MFU {est.mfu:.1%}; {est.tokens_per_s:,.0f} tokens/s",
                 caption_justify="left")
    time.add_column("time", style="bold")
    time.add_column("ms", justify="right")
    time.add_column("share", justify="right")
    for name, sec in est.breakdown.items():
        if sec > 0:
            time.add_row(name.replace("_", " "), _ms(sec), f"{sec / est.iteration_time_s:.1%}")
    fits = "fits" if est.fits else "DOES NOT FIT"
    mem = Table(title=f"Memory {_gb(est.peak_memory_bytes)} / {_gb(est.gpu_memory_bytes)} GB ({fits})",
                title_justify="left")
    mem.add_column("memory", style="bold")
    mem.add_column("GB", justify="right")
    for name, b in est.memory.items():
        if b > 0:
            mem.add_row(name.replace("_", " "), _gb(b))
    return time, mem


def alternatives_table(best: Estimate, alternatives: list[tuple[Plan, Estimate]]) -> Table:
    t = Table(title="Runners-up", title_justify="left")
    for col in ("#", "plan", "iteration ms", "vs best", "TFLOP/s", "MFU", "memory GB"):
        t.add_column(col, justify="left" if col == "plan" else "right")
    for i, (plan, est) in enumerate(alternatives, start=2):
        t.add_row(str(i), plan.describe(), _ms(est.iteration_time_s),
                  f"{est.iteration_time_s / best.iteration_time_s - 1:+.1%}", f"{est.tflops_per_gpu:.0f}",
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
