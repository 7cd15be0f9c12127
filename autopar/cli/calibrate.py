"""`autopar calibrate`: fit the cost model's coefficients to measured traces (and/or all-reduce
tables), report held-out accuracy, and write a calibrated cluster JSON."""

from __future__ import annotations

import dataclasses
import sys

from rich.console import Console
from rich.table import Table

from autopar.calibrate.calibration import calibrate
from autopar.calibrate.cluster_profile import write_cluster
from autopar.calibrate.collectives import fit_allreduce, read_allreduce_table
from autopar.calibrate.fit import available_cpus, get_value, onto, param
from autopar.cli.common import add_trace_model_flags, model_sources, print_json
from autopar.cluster import load_cluster
from autopar.errors import AutoparError


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="fit the cost model to measured traces; write a cluster JSON",
                       description="Fit the cost model's efficiency coefficients (GEMM efficiency by size, "
                                   "elementwise traffic, link efficiency and latency, host overhead, overlap) "
                                   "to measured iteration times by robust least squares on log time, within "
                                   "physical bounds (efficiencies <= 1). Reports held-out error (MAPE, max "
                                   "error, Spearman) with --folds or --holdout (split by model, so no model is "
                                   "in both fit and test), and the same on --evaluate files the fit never saw. "
                                   "The cluster JSON written with -o works with every --cluster flag.")
    p.add_argument("traces", nargs="*", metavar="TRACES", help="trace files (.jsonl) to fit")
    p.add_argument("--cluster", required=True, metavar="PRESET|FILE.json",
                   help="the cluster the traces were measured on; its coefficients are the starting point")
    p.add_argument("-o", "--output", metavar="cluster.json", help="write the calibrated cluster JSON here")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--folds", type=int, metavar="K", help="K-fold cross-validation, folds split by model")
    split.add_argument("--holdout", type=float, metavar="FRACTION",
                       help="hold out whole models holding this fraction of the rows")
    p.add_argument("--evaluate", nargs="+", default=[], metavar="FILE",
                   help="other trace files to score with the final fit (never fitted)")
    p.add_argument("--allreduce", nargs="+", default=[], metavar="TABLE.csv",
                   help="all-reduce tables (nccl-tests CSV, rank count in the file name, or autopar's "
                        "bytes,ranks,seconds): fit link efficiency and latency from them first and keep them fixed")
    p.add_argument("--params", metavar="NAME,...",
                   help="fit exactly these coefficients (default: those the traces can identify)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fold / hold-out assignment (default 0)")
    p.add_argument("--jobs", type=int, default=available_cpus(), metavar="N",
                   help="fits run side by side (each fold's and the final one; default: the CPUs this "
                        "process may use)")
    p.add_argument("--worst", type=int, default=5, metavar="N", help="worst rows to list (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_trace_model_flags(p)
    p.set_defaults(func=run)


def run(args) -> int:
    if not args.traces and not args.allreduce:
        raise AutoparError("give trace files to fit, or --allreduce tables (or both)")
    if args.folds is not None and args.folds < 2:
        raise AutoparError(f"--folds must be at least 2, got {args.folds}")
    if args.holdout is not None and not 0 < args.holdout < 1:
        raise AutoparError(f"--holdout must be a fraction between 0 and 1, got {args.holdout}")
    if args.jobs < 1:
        raise AutoparError(f"--jobs must be at least 1, got {args.jobs}")
    if args.worst < 0:
        raise AutoparError(f"--worst must be >= 0, got {args.worst}")
    if not args.traces and (args.folds or args.holdout or args.evaluate):
        raise AutoparError("--folds, --holdout and --evaluate need trace files to fit")
    err = Console(stderr=True)
    params = [s.strip() for s in args.params.split(",") if s.strip()] if args.params else None
    if params:

        for name in params:
            param(name)  # unknown names fail before any work

    if not args.traces:
        return _collectives_only(args, err)

    progress = (lambda msg: err.print(f"[dim]{msg}[/dim]")) if not args.json else None
    result = calibrate(args.traces, args.cluster, folds=args.folds, holdout=args.holdout, evaluate=args.evaluate,
                       allreduce=args.allreduce, params=params, seed=args.seed, progress=progress,
                       models=model_sources(args), jobs=args.jobs)

    for problem in result.problems:  # one plain line each, never wrapped
        print(f"autopar: warning: skipped malformed trace line {problem}", file=sys.stderr)
    for note in result.notes:
        print(f"autopar: warning: {note}", file=sys.stderr)
    if args.output:

        write_cluster(result.cluster, args.output)
    out = _report(result, args)
    if args.json:
        print_json(_finite(out))
    else:
        _print(out, Console())
    return 0


def _finite(x):
    """NaN (e.g. Spearman of one row) as null, so the output is strict JSON."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _trim(figures: dict, worst: int) -> dict:
    out = dict(figures)
    out["worst"] = out.get("worst", [])[:worst]
    return out


def _report(result, args) -> dict:
    fit = result.fit
    start = result.start

    out = {
        "cluster": args.cluster,
        "rows": fit.rows,
        "fitted": fit.fitted(),
        "started_from": {n: get_value(start, n) for n in fit.names},
        "at_bound": fit.at_bound,
        "validation": result.validation["method"],
        **{k: v for k, v in _trim(result.validation, args.worst).items() if k != "method"},
        "evaluate": {path: _trim(fig, args.worst) for path, fig in result.evaluations.items()},
        "coefficients": result.cluster.coefficients,
        "output": args.output,
        "malformed": result.problems,
        "skipped": result.skipped,
        "stale_profiles": result.notes,
    }
    if result.collectives is not None:
        c = result.collectives
        out["collectives"] = {"kind": c.kind, "efficiency": c.efficiency, "latency_scale": c.latency_scale,
                              "collective_latency_s": c.collective_latency_s, "table_mape": c.mape, "rows": c.rows,
                              "busbw_gb_s": c.busbw_peak / 1e9}
    return out


def _print(out: dict, console) -> None:
    if "collectives" in out:
        c = out["collectives"]
        console.print(f"collectives ({c['rows']} all-reduce measurements): {c['kind']} efficiency "
                      f"{c['efficiency']:.3f} "
                      f"(bus bandwidth {c['busbw_gb_s']:.0f} GB/s), per-call latency "
                      f"{c['collective_latency_s'] * 1e6:.1f} us, latency scale {c['latency_scale']:.3g}; "
                      f"table MAPE {c['table_mape']:.1%}")
    table = Table(title=f"fitted coefficients ({out['rows']} rows)")
    for col in ("coefficient", "fitted", "started from", ""):
        table.add_column(col)
    for name, value in out["fitted"].items():
        table.add_row(name, f"{value:.4g}", f"{out['started_from'][name]:.4g}",
                      "at bound" if name in out["at_bound"] else "")
    console.print(table)
    _print_figures(console, out["validation"], out)
    for path, fig in out["evaluate"].items():
        _print_figures(console, f"{path} (never fitted)", fig)
    if out["output"]:
        console.print(f"wrote {out['output']} (use it with --cluster {out['output']})")


def _print_figures(console, title: str, fig: dict) -> None:
    console.print(f"[bold]{title}[/bold]: {fig['rows']} rows, MAPE {fig['mape']:.2%}, max error "
                  f"{fig['max_error']:.1%}, Spearman {fig['spearman']:.4f}")
    if fig.get("worst"):
        table = Table(title="worst rows")
        for col in ("source", "model", "GPUs", "plan", "measured (s)", "predicted (s)", "error"):
            table.add_column(col)
        for r in fig["worst"]:
            table.add_row(r["source"], r["model"], str(r["gpus"]), r["plan"], f"{r['measured_s']:.4g}",
                          f"{r['predicted_s']:.4g}", f"{r['error']:+.1%}")
        console.print(table)
    groups = [g for g in fig.get("groups", []) if g["runs"] > 1]
    if groups:
        ratios = [g["ratio"] for g in groups]
        console.print(f"best-pick ratio over {len(groups)} group(s) (measured time of the cost model's first-ranked "
                      f"run / the group's measured best): mean {sum(ratios) / len(ratios):.3f}, "
                      f"worst {max(ratios):.3f}")
        if len(groups) <= 12:
            table = Table()
            for col in ("group", "runs", "cost model's pick", "its time (s)", "measured best", "best time (s)",
                        "ratio"):
                table.add_column(col)
            for g in groups:
                table.add_row(g["group"], str(g["runs"]), g["pick_plan"], f"{g['pick_measured_s']:.4g}",
                              g["best_plan"], f"{g['best_measured_s']:.4g}", f"{g['ratio']:.3f}")
            console.print(table)


def _collectives_only(args, err) -> int:
    base = load_cluster(args.cluster)
    fitted = fit_allreduce([read_allreduce_table(p) for p in args.allreduce], base)  # starts from for_cluster
    coeffs = onto(base.coefficients, fitted.fitted())  # the three link coefficients, nothing else
    cluster = dataclasses.replace(base, name=f"{base.name}-calibrated", coefficients=coeffs)
    if args.output:
        write_cluster(cluster, args.output)
    out = {"cluster": args.cluster, "collectives": {"kind": fitted.kind, "efficiency": fitted.efficiency,
                                                     "latency_scale": fitted.latency_scale,
                                                     "collective_latency_s": fitted.collective_latency_s,
                                                     "table_mape": fitted.mape, "rows": fitted.rows,
                                                     "busbw_gb_s": fitted.busbw_peak / 1e9},
           "mape": fitted.mape, "coefficients": coeffs, "output": args.output}
    if args.json:
        print_json(out)
        return 0
    c = out["collectives"]
    console = Console()
    console.print(f"{c['kind']}: efficiency {c['efficiency']:.3f} (bus bandwidth {c['busbw_gb_s']:.0f} GB/s), "
                  f"per-call latency {c['collective_latency_s'] * 1e6:.1f} us, latency scale {c['latency_scale']:.3g}; "
                  f"MAPE {c['table_mape']:.1%} over {c['rows']} measurements")
    if args.output:
        console.print(f"wrote {args.output} (use it with --cluster {args.output})")
    return 0
