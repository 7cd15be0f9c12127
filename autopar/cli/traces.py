"""`autopar traces`: import public measurement sets as traces, summarise a trace file, and
collect traces by running plans with the executor."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopar.atomic import check_output
from autopar.cli.common import add_fix_flag, add_model_flags, parse_model_args, print_json
from autopar.cli.launch_flags import add_launcher_flags, launcher_from_args
from autopar.errors import AutoparError
from autopar.executor.options import RunOptions, add_run_flags
from autopar.cluster import detect, load_cluster
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.search.fixed import parse_fixes, with_fixes
from autopar.traces.collect import backend_for, collect
from autopar.traces.launchers import RunSpec
from autopar.traces.launchers.search import measured_search
from autopar.workload import Workload
from autopar.traces.record import check_trace_file
from autopar.traces.summary import print_summary, summarize
from autopar.traces.vtrain import CLUSTER as VTRAIN_CLUSTER
from autopar.traces.vtrain import import_vtrain, write_records

COLLECT_RUN_FLAGS = ("steps", "warmup", "timeout_s", "backend")  # the run options `traces collect` takes


def add_parser(sub) -> None:
    p = sub.add_parser("traces", help="import, inspect and collect traces (measured runs)",
                       description="Traces are JSON Lines files with one measured run per line (schema: "
                                   "autopar/traces/record.py). They are what `autopar calibrate` fits.")
    tsub = p.add_subparsers(dest="traces_command", metavar="ACTION", required=True)

    imp = tsub.add_parser("import", help="convert a public measurement set into a trace file",
                          description="Convert a measurement set into trace records.")
    isub = imp.add_subparsers(dest="format", metavar="FORMAT", required=True)
    vt = isub.add_parser("vtrain", help="vTrain's ground-truth CSV (GPT on A100, Megatron-DeepSpeed)",
                         description="Import vTrain's ground_truth_single.csv / ground_truth_multi.csv "
                                     "(Bang et al., MICRO 2024): each row becomes a trace record with the "
                                     "Megatron-DeepSpeed configuration as a plan (full activation recompute, "
                                     "1F1B, fp16, no ZeRO, no gradient bucketing), on CLUSTER sized to the "
                                     "row's GPU count (8 GPUs per node). vTrain's own simulator: MAPE 8.37% "
                                     "single-node, 14.73% multi-node.")
    vt.add_argument("csv", metavar="FILE.csv", help="a vTrain ground-truth CSV")
    vt.add_argument("--cluster", default=VTRAIN_CLUSTER, metavar="PRESET|FILE.json",
                    help=f"the cluster the runs were on (default {VTRAIN_CLUSTER}: DGX A100 nodes with "
                         f"vTrain's 800 Gb/s per node)")
    vt.add_argument("-o", "--output", required=True, metavar="traces.jsonl", help="trace file to write")
    vt.add_argument("--vocab", type=int, default=51200,
                    help="vocabulary size (default 51200: GPT-2's 50257 padded as Megatron pads it at tp = 8)")
    vt.add_argument("--precision", choices=("fp16", "bf16"), default="fp16", help="training precision (default fp16)")
    vt.add_argument("--no-predict", action="store_true",
                    help="do not store the cost model's prediction in each record")
    vt.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    vt.set_defaults(func=run_import_vtrain)

    col = tsub.add_parser("collect", help="run K plans of a model with the executor and append their traces",
                          description="Pick K plans of MODEL (the cost model's best for each process count, then "
                                      "distinct structures at random), run each for a few steps through "
                                      "`autopar run` (torchrun; gloo on CPU, NCCL on GPUs) and append every "
                                      "record, failures included, to the trace file.")
    add_model_flags(col)
    col.add_argument("--plans", type=int, required=True, metavar="K", help="number of plans to run")
    col.add_argument("--global-batch", type=int, default=16, metavar="B", help="samples per step (default 16)")
    col.add_argument("--nproc", default="2,4", metavar="N,...",
                     help="process counts to spread the plans over (default 2,4)")
    col.add_argument("--cluster", metavar="PRESET|FILE.json",
                     help="cluster the plans are chosen for (default: the cpu preset on gloo, else detected)")
    col.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                     help="training precision (default fp32)")
    col.add_argument("--repeats", type=int, default=1, metavar="R",
                     help="runs of each plan, round by round (calibration takes their median; default 1)")
    add_run_flags(col, COLLECT_RUN_FLAGS)  # autopar/executor/options.py
    col.add_argument("--seed", type=int, default=0, help="plan sampling seed (default 0)")
    col.add_argument("-o", "--output", required=True, metavar="traces.jsonl", help="trace file to append to")
    col.add_argument("--json", action="store_true", help="print the runs as JSON")
    add_launcher_flags(col)  # autopar/cli/launch_flags.py
    col.set_defaults(func=run_collect)

    srch = tsub.add_parser("search", help="a measured Optuna search: each trial a real run, appended as a trace",
                           description="Search MODEL's plans on N ranks with Optuna (multivariate TPE), each trial "
                                       "a real run through the launcher; the study holds the measured step times "
                                       "(--storage: resumable, shared), every run is appended to the trace file. "
                                       "With --launcher ray the trials are Ray Tune trials, Optuna the search "
                                       "algorithm.")
    add_model_flags(srch)
    srch.add_argument("--trials", type=int, default=20, metavar="N",
                      help="complete trials the study holds at the end (default 20)")
    srch.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks per node (default 2)")
    srch.add_argument("--global-batch", type=int, default=16, metavar="B", help="samples per step (default 16)")
    srch.add_argument("--cluster", metavar="PRESET|FILE.json",
                      help="cluster the plans are made for (default: the cpu preset on gloo, else detected)")
    srch.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32",
                      help="training precision (default fp32)")
    add_run_flags(srch, COLLECT_RUN_FLAGS)
    add_fix_flag(srch, "; the study is one per set of held knobs")
    srch.add_argument("--storage", metavar="URL", help="Optuna storage of the study (sqlite:///f.db, postgresql://...)")
    srch.add_argument("--study-name", help="study name within the storage (default autopar-measured-<key>)")
    srch.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    srch.add_argument("-o", "--output", required=True, metavar="traces.jsonl", help="trace file to append to")
    srch.add_argument("--plan-out", metavar="plan.json", help="write the best measured plan here")
    srch.add_argument("--json", action="store_true", help="print the result as JSON")
    add_launcher_flags(srch, dry_run=False)
    srch.set_defaults(func=run_search)

    show = tsub.add_parser("show", help="summarise a trace file",
                           description="Records by outcome, cluster and model; measured step times; the "
                                       "stored predictions' error; malformed lines with their line numbers.")
    show.add_argument("file", metavar="FILE", help="a trace file (.jsonl)")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(func=run_show)


def run_import_vtrain(args) -> int:
    if args.vocab < 1:
        raise AutoparError(f"--vocab must be positive, got {args.vocab}")
    console = Console(stderr=True)
    with console.status("importing (one profile per model shape)"):
        records = import_vtrain(args.csv, args.cluster, vocab=args.vocab, precision=args.precision,
                                predict=not args.no_predict)
    write_records(args.output, records)
    shapes = sorted({(r.model["args"]["hidden"], r.model["args"]["layers"]) for r in records})
    sizes = sorted({(r.cluster["nodes"], r.cluster["gpus_per_node"]) for r in records})
    errors = [abs(r.predicted["iteration_time_s"] / r.measured["median_step_s"] - 1) for r in records if r.predicted]
    summary = {"input": args.csv, "output": args.output, "records": len(records), "model_shapes": len(shapes),
               "cluster_sizes": [f"{n}x{g}" for n, g in sizes],
               "uncalibrated_mape": sum(errors) / len(errors) if errors else None}
    if args.json:
        print_json(summary)
        return 0
    out = Console()
    out.print(f"wrote {len(records)} records to {args.output}: {len(shapes)} model shape(s) on "
              f"{', '.join(summary['cluster_sizes'])} (nodes x GPUs per node) of {args.cluster}")
    if errors:
        out.print(f"cost model with {args.cluster}'s coefficients (not calibrated): "
                  f"MAPE {summary['uncalibrated_mape']:.1%}")
    return 0


def run_show(args) -> int:
    check_trace_file(args.file)
    summary = summarize(args.file)
    if args.json:
        print_json(summary)
    else:
        print_summary(summary, Console())
    return 0


def run_collect(args) -> int:
    try:
        nprocs = [int(n) for n in args.nproc.split(",") if n.strip()]
    except ValueError:
        raise AutoparError(f"--nproc expects process counts like 2,4; got {args.nproc!r}") from None
    options = RunOptions.from_args(args, seed=0)  # --seed here samples the plans; the runs' weights use 0
    for flag in ("plans", "repeats", "global_batch"):
        if getattr(args, flag) < 1:
            raise AutoparError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    err = Console(stderr=True)
    say = lambda m: err.print(f"[dim]{m}[/dim]", markup=True, highlight=False)  # noqa: E731
    launcher = launcher_from_args(args, say)  # a bad launcher flag fails before profiling
    runs = collect(args.model, parse_model_args(args.model_arg, None), args.global_batch, args.plans, nprocs,
                   cluster=args.cluster, precision=args.precision, output=args.output, options=options,
                   seed=args.seed, repeats=args.repeats, progress=say, launcher=launcher, nodes=args.nodes,
                   dry_run=args.dry_run)
    if args.dry_run:
        for r in runs:
            print(f"# plan on {r['ranks']} ranks: {r['plan']}\n{r['script']}")
        return 0
    if args.json:
        print_json({"output": args.output, "runs": runs})
        return 0
    table = Table(title=f"appended {len(runs)} run(s) to {args.output}")
    for col in ("ranks", "plan", "outcome", "measured (ms)", "predicted (ms)"):
        table.add_column(col)
    for r in runs:
        table.add_row(str(r["ranks"]), r["plan"], r["outcome"],
                      f"{r['measured_s'] * 1e3:.1f}" if r["measured_s"] else "-",
                      f"{r['predicted_s'] * 1e3:.1f}" if r["predicted_s"] else "-")
    Console().print(table)
    return 0


def run_search(args) -> int:
    for flag in ("nproc", "global_batch"):
        if getattr(args, flag) < 1:
            raise AutoparError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.plan_out:
        check_output(args.plan_out, "--plan-out")
    err = Console(stderr=True)
    fixed = parse_fixes(args.fix)  # a bad --fix: one line before anything starts
    launcher = launcher_from_args(args, lambda m: err.print(f"[dim]{m}[/dim]", highlight=False))
    options = RunOptions.from_args(args, seed=0, nproc_per_node=args.nproc, nnodes=args.nodes)
    options = dataclasses.replace(options, backend=backend_for(options.backend, args.nproc, args.cluster, launcher))
    model_args = parse_model_args(args.model_arg, None)
    profile = profile_model(args.model, model_args, dtype=args.precision)
    base = load_cluster(args.cluster) if args.cluster else (load_cluster("cpu") if options.backend == "gloo"
                                                           else detect())
    workload = with_fixes(Workload(profile, base.with_nodes(args.nodes, args.nproc), args.global_batch), fixed)
    # absolute: a Ray Tune trial runs in its own folder (ray's RAY_CHDIR_TO_TRIAL_DIR), where a relative
    # trace file or model file would name another file
    model = str(Path(args.model).absolute()) if Path(args.model).exists() else str(args.model)
    spec = RunSpec(model, model_args, options, trace=str(Path(args.output).absolute()))
    out = measured_search(workload, spec, launcher, args.trials, storage=args.storage, study_name=args.study_name,
                          seed=args.seed, say=lambda m: err.print(f"[dim]{m}[/dim]", highlight=False))
    if args.plan_out and out["best"]:
        Plan.from_dict(out["best"]["plan"]).save(args.plan_out)
    if args.json:
        print_json(out)
        return 0
    table = Table(title=f"study {out['study']}: {out['trials']} trial(s); runs appended to {args.output}")
    for col in ("trial", "plan", "outcome", "measured (ms)"):
        table.add_column(col)
    for r in out["runs"]:
        table.add_row(str(r["trial"]), r["plan"], r["outcome"], f"{r['step_s'] * 1e3:.1f}" if r["step_s"] else "-")
    Console().print(table)
    best = out["best"]
    Console().print(f"best measured: {Plan.from_dict(best['plan']).describe()} at {best['step_s'] * 1e3:.1f} ms per step"
                    + (f"; written to {args.plan_out}" if args.plan_out else "") if best else "no trial ran a plan")
    return 0
