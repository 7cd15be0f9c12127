"""`autopar train cost|traces|measured`: train a planning policy (MaskablePPO), resumably.

cost: on sampled workloads against the cost model's exhaustive oracle (how the shipped policy is
made); traces: calibrate on measured traces and fine-tune for their cluster and job mix;
measured: fine-tune on real runs of this machine over a restricted plan space. The old flag form
(`autopar train --traces ...`, `autopar train --reward measured ...`, `autopar train
--workloads ...`) still works: `modernize` rewrites it with a one-line note.
"""

from __future__ import annotations

import sys

from rich.console import Console

from autopar.atomic import check_output
from autopar.cli.common import add_model_flags, add_trace_model_flags, model_sources, parse_model_args
from autopar.cli.launch_flags import add_launcher_flags, launcher_from_args
from autopar.envs.restricted import DEFAULT_RESTRICT, restrictable
from autopar.errors import AutoparError
from autopar.executor.options import RunOptions, add_run_flags
from autopar.plan import ALIASES
from autopar.policies.files import sidecar_path
from autopar.policies.traces import REPLAY, TraceTrainConfig, cluster_path, train_on_traces
from autopar.traces.measured_cache import default_cache, read_cache
from autopar.policies.train import TrainConfig, train

DEFAULT_TIMESTEPS = 100_000
TRACES_TIMESTEPS = 10_000
MODES = ("cost", "traces", "measured")
MEASURED_RUN_FLAGS = ("steps", "warmup", "timeout_s")  # the run options `train measured` takes (gloo runs)
# the default restricted space of `train measured`, as --help shows it (written from DEFAULT_RESTRICT)
RESTRICT_HELP = (" ".join(f"{k}={','.join(v)}" for k, v in DEFAULT_RESTRICT.items())
                 + "; dp/pp/tp and micro_batch_size vary")


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train an RL planning policy: on the cost model, on traces, or on real runs",
                       description="Train a MaskablePPO policy that plans knob by knob. MODE cost: on sampled "
                                   "workloads against the cost model's exhaustive oracle; traces: calibrated on "
                                   "measured traces, for their cluster and job mix; measured: fine-tuned on real "
                                   "runs of this machine. Writes policy.zip and its metadata sidecar policy.json.")
    modes = p.add_subparsers(dest="train_command", metavar="MODE", required=True)
    cost = modes.add_parser("cost", help="train on the cost model against the exhaustive oracle",
                            description="Train a MaskablePPO policy on sampled workloads, evaluating it against the "
                                        "exhaustive oracle as it goes. Writes policy.zip, its metadata sidecar "
                                        "policy.json and checkpoints in policy.zip.ckpt/ (--resume continues from "
                                        "them).")
    cost.add_argument("--workloads", default="1024", metavar="N|FILE.json",
                      help="training pool: a number of workloads drawn from the zoo sampler, or a JSON list of "
                           "workload specs (default 1024)")
    _add_training_flags(cost, DEFAULT_TIMESTEPS)
    cost.set_defaults(func=run_cost)

    t = modes.add_parser("traces", help="calibrate on measured traces and fine-tune for their cluster and job mix",
                         description="Calibrate the cost model on measured traces, train on the job mix they "
                                     "describe (model shapes, GPU counts, batches), evaluate on held-out shapes; "
                                     "writes policy.cluster.json (the calibrated cluster) next to the policy.")
    t.add_argument("traces", nargs="*", metavar="FILE.jsonl", help="trace files to calibrate and train on")
    t.add_argument("--cluster", metavar="PRESET|FILE.json", help="the cluster the traces were measured on (required)")
    t.add_argument("--holdout", type=float, default=0.2, metavar="FRACTION",
                   help="fraction of the trace workloads held out for evaluation, whole model shapes (default 0.2)")
    t.add_argument("--allreduce", nargs="+", default=[], metavar="TABLE.csv",
                   help="all-reduce tables for the calibration (as `autopar calibrate --allreduce`)")
    add_trace_model_flags(t)
    t.add_argument("--from-scratch", action="store_true", help="do not start from the shipped policy's weights")
    t.add_argument("--replay", type=int, default=REPLAY, metavar="N",
                   help="add N workloads of the shipped policy's training distribution to the pool, so that "
                        f"fine-tuning keeps what it knows outside the traces' job mix (default {REPLAY})")
    _add_training_flags(t, TRACES_TIMESTEPS)
    t.set_defaults(func=run_traces)

    m = modes.add_parser("measured", help="fine-tune the shipped policy on real runs of this machine",
                         description="Fine-tune the shipped policy (the cost-model prior) with rewards from real runs "
                                     "(as `autopar run` makes them, on gloo) over a restricted plan space (at most "
                                     "100 plans), each distinct plan measured once and cached "
                                     "(policies/measured.py).")
    add_model_flags(m, optional=True)
    m.add_argument("--cluster", default="cpu", metavar="PRESET|FILE.json",
                   help="the cluster the plans are made for and recorded on (default cpu)")
    m.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="ranks of the one node measured (default: the cluster's)")
    m.add_argument("--global-batch", type=int, default=8, metavar="B", help="samples per step (default 8)")
    m.add_argument("--budget", type=int, default=40, metavar="RUNS",
                   help="distinct plans measured at most, cached ones included (default 40)")
    m.add_argument("--restrict", action="append", default=[], metavar="KNOB=V1,V2",
                   help=f"values a knob (a plan field) may take (repeatable; KNOB=* frees it). Defaults: {RESTRICT_HELP}")
    add_run_flags(m, MEASURED_RUN_FLAGS)  # autopar/executor/options.py
    add_launcher_flags(m, dry_run=False, nodes=False)  # each plan on one node: local, a Slurm job or a Ray job
    m.add_argument("--cache", default=None, metavar="FILE.json",
                   help="measurement cache (default: measured-rewards.json in the autopar cache directory)")
    _add_output_flags(m)
    m.set_defaults(func=run_measured)


def _add_output_flags(p) -> None:
    p.add_argument("-o", "--output", default="policy.zip", metavar="policy.zip", help="where to write the policy")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload pool and of training (default 0)")


def _add_training_flags(p, timesteps: int) -> None:
    """The flags of the PPO pipeline (imitation, DAgger, PPO, evaluation, checkpoints) that cost and
    traces share."""
    p.add_argument("--timesteps", type=int, default=timesteps, help=f"total environment steps (default {timesteps:,})")
    _add_output_flags(p)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of --output")
    p.add_argument("--eval-every", type=int, default=20_000, metavar="STEPS",
                   help="evaluate against the oracle every STEPS (default 20,000)")
    p.add_argument("--eval-workloads", type=int, default=TrainConfig.eval_workloads, metavar="N",
                   help=f"validation workloads, drawn apart from the pool (default {TrainConfig.eval_workloads}; "
                        f"0: none)")
    p.add_argument("--checkpoint-every", type=int, default=20_000, metavar="STEPS",
                   help="write a checkpoint every STEPS (default 20,000)")
    p.add_argument("--n-steps", type=int, default=2048, metavar="STEPS",
                   help="environment steps per PPO rollout (default 2048)")
    p.add_argument("--imitation-epochs", type=int, default=50, metavar="N",
                   help="epochs of behaviour cloning of the oracle's plans before PPO (default 50; 0: none)")
    p.add_argument("--dagger-rounds", type=int, default=2, metavar="N",
                   help="after imitation, rounds of labelling the policy's own decisions with the best completion "
                        "(default 2)")


def modernize(argv: list[str]) -> list[str]:
    """The old flag form of `autopar train` as a sub-command, with a one-line note on stderr:
    `--reward measured` -> `measured`, `--traces FILES` -> `traces FILES`, otherwise `cost`."""
    rest = argv[1:]
    if not rest or rest[0] in MODES or rest[0] in ("-h", "--help"):
        return argv
    if "--reward" in rest:
        i = rest.index("--reward")
        mode = rest[i + 1] if i + 1 < len(rest) else ""
        if mode not in ("cost", "measured"):
            raise AutoparError(f"--reward takes cost or measured, got {mode!r}; use `autopar train cost|measured ...`")
        del rest[i:i + 2]
    elif "--traces" in rest:
        mode = "traces"
        rest.remove("--traces")  # the files that followed it are the sub-command's positional arguments
    else:
        mode = "cost"
    print(f"autopar: note: this form of `autopar train` is deprecated; it runs as `autopar train {mode} ...`",
          file=sys.stderr)
    return [argv[0], mode, *rest]


def parse_restrictions(items: list[str] | None, defaults: dict | None = None) -> dict[str, tuple[str, ...]]:
    """`--restrict KNOB=V1,V2,...` items over the defaults (`KNOB=*`: every value of that knob)."""

    out = dict(DEFAULT_RESTRICT if defaults is None else defaults)
    for item in items or []:
        knob, sep, values = item.partition("=")
        knob = knob.strip().replace("-", "_")
        knob = ALIASES.get(knob, knob)
        if not sep or not values.strip():
            raise AutoparError(f"--restrict takes KNOB=VALUE[,VALUE...], got {item!r}")
        if knob not in restrictable():
            raise AutoparError(f"--restrict: unknown knob {knob!r}; choose from {', '.join(restrictable())}")
        vals = tuple(v.strip().lower() for v in values.split(",") if v.strip())
        if vals == ("*",):
            out.pop(knob, None)
        else:
            out[knob] = vals
    return out


def _check_training(args) -> None:
    sidecar_path(args.output)  # -o pol.json would clash with its sidecar: refuse before any work
    for flag in ("imitation_epochs", "dagger_rounds"):
        if getattr(args, flag) < 0:
            raise AutoparError(f"--{flag.replace('_', '-')} must be 0 or more, got {getattr(args, flag)}")
    for flag in ("timesteps", "eval_every", "checkpoint_every", "n_steps"):
        if getattr(args, flag) < 1:
            raise AutoparError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")


def _config(args, workloads: str):
    return TrainConfig(timesteps=args.timesteps, workloads=workloads, output=args.output, seed=args.seed,
                       eval_every=args.eval_every, eval_workloads=args.eval_workloads,
                       checkpoint_every=args.checkpoint_every, resume=args.resume, n_steps=args.n_steps,
                       imitation_epochs=args.imitation_epochs, dagger_rounds=args.dagger_rounds)


def run_cost(args) -> int:
    _check_training(args)
    cfg = _config(args, args.workloads)
    console = Console()
    meta = train(cfg, console)
    val = meta["eval"]["validation"]
    summary = f"policy written to {cfg.output} ({meta['timesteps']:,} timesteps, {meta['train_seconds']:.0f} s)"
    if val:
        summary += f"; validation ratio to the oracle: median {val['median']:.3f}, p5 {val['p5']:.3f}"
    console.print(summary, soft_wrap=True)
    return 0


def run_traces(args) -> int:
    _check_training(args)
    if not args.traces:
        raise AutoparError("autopar train traces needs at least one trace file (.jsonl, as `autopar traces import` "
                           "or `autopar traces collect` write them)")
    if args.replay < 0:
        raise AutoparError(f"--replay must be 0 or more, got {args.replay}")
    if not args.cluster:
        raise AutoparError("autopar train traces needs --cluster: the preset or cluster JSON the traces were "
                           "measured on")
    cfg, console = _config(args, "0"), Console()
    tcfg = TraceTrainConfig(traces=args.traces, cluster=args.cluster, holdout=args.holdout,
                            allreduce=args.allreduce, from_scratch=args.from_scratch, replay=args.replay,
                            models=model_sources(args))
    meta = train_on_traces(tcfg, cfg, console)
    t = meta["traces"]
    h, before = t["heldout"], t["heldout_before"]
    console.print(f"held-out trace workloads ({h['workloads']}, {len(t['split']['heldout_shapes'])} shape(s) never "
                  f"trained on): top-1 ratio to the calibrated oracle median {h['median']:.4f}, p5 {h['p5']:.4f}, "
                  f"min {h['min']:.4f}"
                  + (f" (shipped policy before fine-tuning: median {before['median']:.4f}, p5 {before['p5']:.4f}, "
                     f"min {before['min']:.4f})" if before else ""), soft_wrap=True)
    console.print(f"policy written to {cfg.output} ({meta['timesteps']:,} timesteps, {t['wall_seconds']:.0f} s), "
                  f"calibrated cluster to {cluster_path(cfg.output)}; plan with `autopar search MODEL --method rl "
                  f"--policy {cfg.output} --cluster {cluster_path(cfg.output)} ...`", soft_wrap=True)
    return 0


def run_measured(args) -> int:
    sidecar_path(args.output)
    args.cache = args.cache or default_cache()
    read_cache(check_output(args.cache, "--cache"))  # a corrupt cache or a folder: one line before torch loads
    from autopar.policies.measured import train_measured  # pulls torch: imported on first use

    if not args.model:
        raise AutoparError("autopar train measured needs a MODEL (a model.py or zoo name)")
    if args.budget < 1:
        raise AutoparError(f"--budget must be at least 1 real run, got {args.budget}")
    if args.global_batch < 1:
        raise AutoparError(f"--global-batch must be positive, got {args.global_batch}")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise AutoparError(f"--gpus-per-node must be positive, got {args.gpus_per_node}")
    options = RunOptions.from_args(args, backend="gloo")  # the measured ranks share this machine's CPUs
    restrict = parse_restrictions(args.restrict)  # an unknown knob fails here, before any profiling
    launcher = launcher_from_args(args)  # and a bad launcher flag
    console = Console()
    meta = train_measured(args.model, parse_model_args(args.model_arg, None), cluster=args.cluster,
                          gpus_per_node=args.gpus_per_node, global_batch=args.global_batch, restrict=restrict,
                          budget=args.budget, options=options, cache=args.cache, output=args.output, seed=args.seed,
                          console=console, launcher=launcher)
    m = meta["measured"]
    pick, prior = m["pick"], m["prior_pick"]
    console.print(f"restricted space: {m['space']['plans']} plans, varying "
                  + ", ".join(f"{k} {{{'/'.join(v)}}}" for k, v in m["space"]["varying"].items()), soft_wrap=True)
    console.print(f"cost-model prior (shipped policy) picks {prior['describe']}: "
                  f"{_s(prior['measured_s'])}", soft_wrap=True)
    console.print(f"fine-tuned policy picks {pick['describe']}: {_s(pick['measured_s'])}; budget used "
                  f"{m['budget_used']}/{m['budget']} ({m['runs_now']} run now, {m['from_cache']} from the cache)",
                  soft_wrap=True)
    console.print(f"policy written to {args.output}", soft_wrap=True)
    return 0


def _s(seconds) -> str:
    return f"{seconds:.4f} s per step measured" if seconds is not None else "failed"
