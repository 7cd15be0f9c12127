"""`autopar run`: train a plan for a few steps through torchrun, measure it, record a trace.

Prints the median step time, throughput, peak memory per rank and the loss curve beside the
cost model's prediction for the same plan, and appends one trace record (`--trace`). A plan
for another world size is refused before anything starts. The exit status is 0 only when
the run finished; the trace records oom / timeout / error outcomes too.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from autopar.cli.common import add_model_flags, add_profile_timeout_flag, add_seq_len_flag, parse_model_args
from autopar.cli.elastic import add_elastic_flags, elastic_spec, show_replans
from autopar.errors import AutoparError
from autopar.executor.mixed_layout import is_mixed_plan_file
from autopar.executor.options import RunOptions, add_run_flags


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="train a plan for a few steps, measure it and record a trace",
                       description="Launch PLAN on MODEL with torchrun, train on the model's example batch, "
                                   "and print measured step time, throughput, peak memory and losses beside "
                                   "the cost model's prediction.")
    p.add_argument("plan", metavar="plan.json", help="a plan file, as `autopar search -o` writes (a mixed plan "
                   "runs on gloo ranks labelled with their group; give its --cluster PRESET:NODES,PRESET:NODES)")
    add_model_flags(p)
    add_seq_len_flag(p)
    p.add_argument("--trace", metavar="traces.jsonl", help="append the run's trace record here")
    p.add_argument("--cluster", metavar="PRESET|FILE.json|PRESET:NODES,...",
                   help="the cluster to record and predict for (default: detected from this machine); a mixed "
                        "plan's mixed cluster, whose groups its lanes name")
    add_run_flags(p)  # autopar/executor/options.py: steps, warm-up, ranks, backend, timeout, ...
    add_profile_timeout_flag(p)
    add_elastic_flags(p)
    p.set_defaults(func=run)


def _parity_failed(m: dict | None) -> bool:
    """The ranks ran, but their losses left the single process's by more than the precision allows."""
    return bool(m) and not m.get("parity_ok", True)


def _title(launched, m: dict | None, mixed: str = "") -> str:
    outcome = "ran, parity check failed" if launched.outcome == "ok" and _parity_failed(m) else launched.outcome
    return f"autopar run{mixed}: {outcome} in {launched.wall_s:.1f} s"


def _parity_exit(m: dict) -> int:
    """1 with one line on stderr when the parity check failed (the table's row says by how much), else 0."""
    if not _parity_failed(m):
        return 0
    print(f"autopar: parity check failed: {m.get('parity_verdict', 'losses differ from one process')}",
          file=sys.stderr, flush=True)
    return 1


def _show(console, record, launched, note: str) -> None:
    m, pred = record.measured, record.predicted
    title = _title(launched, m)
    if m:
        table = Table(title=title, title_justify="left")
        table.add_column("")
        table.add_column("measured", justify="right")
        table.add_column("predicted", justify="right")
        tokens = record.workload["global_batch"] * record.workload["seq_len"]
        unit = "tokens/s" if record.workload["seq_len"] > 1 else "samples/s"
        table.add_row("median step", f"{m['median_step_s'] * 1e3:,.1f} ms",
                      f"{pred['iteration_time_s'] * 1e3:,.1f} ms" if pred else "-")
        table.add_row(f"throughput ({unit})", f"{m['tokens_per_s']:,.0f}",
                      f"{tokens / pred['iteration_time_s']:,.0f}" if pred else "-")
        table.add_row("peak memory (max rank)", f"{max(m['peak_memory_bytes']) / 1e9:.3f} GB",
                      f"{pred['peak_memory_gb']:.3f} GB" if pred else "-")
        table.add_row("peak memory per rank", " ".join(f"{b / 1e9:.2f}" for b in m["peak_memory_bytes"]) + " GB", "")
        table.add_row("loss per step", " ".join(f"{x:.4f}" for x in m["losses"]), "")
        if "parity_max_rel_diff" in m:
            table.add_row(f"parity vs 1 process ({m.get('parity_reference', 'cpu fp32')})",
                          m.get("parity_verdict", f"max rel. diff {m['parity_max_rel_diff']:.1e}"), "")
        console.print(table)
    else:
        console.print(title, style="bold")
    if note:
        console.print(note, style="yellow", markup=False)
    if launched.error:
        console.print(launched.error, style="red", markup=False, highlight=False)


def run(args) -> int:
    from autopar.traces.run_plan import run_plan  # pulls torch: imported on first use

    # a bad flag is refused before anything starts
    options = RunOptions.from_args(args, elastic=elastic_spec(args))
    model_args = parse_model_args(args.model_arg, args.seq_len)
    if is_mixed_plan_file(args.plan):  # lanes over GPU groups (issue 42)
        return _run_mixed(args, options, model_args)
    if args.node_group:
        raise AutoparError(f"--node-group names this node's group of a mixed plan's cluster, and {args.plan} is "
                           f"not a mixed plan; leave --node-group out")
    ran = run_plan(args.plan, args.model, model_args, options, cluster=args.cluster,
                   profile_timeout=args.profile_timeout, trace=args.trace)

    console, launched, record = Console(), ran.launched, ran.record
    if record is not None:
        _show(console, record, launched, ran.note)
        show_replans(console, record.measured)
    else:
        console.print(f"node {options.node_rank}: {launched.outcome}")
    logs = f"; every rank's output and the launcher's log: {launched.logs}" if launched.logs else ""
    if launched.outcome != "ok":  # the last line: the failing rank and its own error, and where the ranks' output is
        print(f"autopar: run failed ({launched.outcome}): {launched.error}{logs}", file=sys.stderr, flush=True)
        return 1
    if logs:
        print(f"autopar: note: ranks wrote to stderr{logs}", file=sys.stderr, flush=True)
    return _parity_exit(record.measured) if record is not None else 0


def _run_mixed(args, options: RunOptions, model_args: dict) -> int:
    """A mixed plan: its ranks by group, the measurement and the parity check; no trace record."""
    from autopar.traces.run_mixed import run_mixed  # pulls torch: imported on first use

    ran = run_mixed(args.plan, args.model, model_args, options, cluster=args.cluster,
                    profile_timeout=args.profile_timeout, trace=args.trace)
    console, launched = Console(), ran.launched
    result = launched.result or {}
    m = result.get("measured")
    table = Table(title=_title(launched, m, " (mixed plan)"), title_justify="left")
    table.add_column("")
    table.add_column("measured", justify="right")
    table.add_column("predicted", justify="right")
    pred = ran.predicted
    for label in result.get("ranks", []):
        console.print(f"rank {label['rank']}: group {label['group']}, lane {label['lane'] + 1}, segment "
                      f"{label['segment'] + 1}, stage {label['stage']}, tp rank {label['tp_rank']}", highlight=False)
    if m:
        unit = "tokens/s" if result.get("seq_len", 1) > 1 else "samples/s"
        table.add_row("median step", f"{m['median_step_s'] * 1e3:,.1f} ms",
                      f"{pred['iteration_time_s'] * 1e3:,.1f} ms" if pred else "-")
        table.add_row(f"throughput ({unit})", f"{m['tokens_per_s']:,.0f}", f"{pred['tokens_per_s']:,.0f}" if pred else "-")
        table.add_row("loss per step", " ".join(f"{x:.4f}" for x in m["losses"]), "")
        if "parity_max_rel_diff" in m:
            table.add_row(f"parity vs 1 process ({m.get('parity_reference', 'cpu fp32')})", m["parity_verdict"], "")
    console.print(table)
    if m:
        show_replans(console, m)
    if pred:
        given = ", for the plan given (before its re-plans)" if m and m.get("replans") else ""
        console.print(f"predicted: on {args.cluster}{given} (the ranks ran on this machine, "
                      f"{result.get('backend', '?')})", highlight=False, markup=False)
    if ran.note:
        console.print(ran.note, style="yellow", markup=False)
    logs = f"; every rank's output and the launcher's log: {launched.logs}" if launched.logs else ""
    if launched.outcome != "ok":
        print(f"autopar: run failed ({launched.outcome}): {launched.error}{logs}", file=sys.stderr, flush=True)
        return 1
    return _parity_exit(m)
