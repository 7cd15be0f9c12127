"""`autopar train`: train a planning policy (MaskablePPO) on sampled workloads, resumably."""

from __future__ import annotations

from autopar.cli.common import add_trace_model_flags

DEFAULT_TIMESTEPS = 100_000
TRACES_TIMESTEPS = 10_000
REPLAY = 128  # autopar.policies.traces.REPLAY (not imported here: --help stays instant)


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train an RL planning policy on the cost model",
                       description="Train a MaskablePPO policy that plans knob by knob, evaluating it against the "
                                   "exhaustive oracle as it goes. Writes policy.zip, its metadata sidecar "
                                   "policy.json and checkpoints in policy.zip.ckpt/ (--resume continues from them).")
    p.add_argument("--timesteps", type=int, default=None,
                   help=f"total environment steps (default {DEFAULT_TIMESTEPS:,}; with --traces "
                        f"{TRACES_TIMESTEPS:,}, fine-tuning the shipped policy)")
    p.add_argument("--workloads", default=None, metavar="N|FILE.json",
                   help="training pool: a number of workloads drawn from the zoo sampler, or a JSON list of "
                        "workload specs (default 1024)")
    t = p.add_argument_group("training on traces", "calibrate the cost model on measured traces, train on the job "
                             "mix they describe (model shapes, GPU counts, batches), evaluate on held-out shapes; "
                             "writes policy.cluster.json (the calibrated cluster) next to the policy")
    t.add_argument("--traces", nargs="*", metavar="FILE.jsonl", help="trace files to calibrate and train on")
    t.add_argument("--cluster", metavar="PRESET|FILE.json", help="the cluster the traces were measured on")
    t.add_argument("--holdout", type=float, default=0.2, metavar="FRACTION",
                   help="fraction of the trace workloads held out for evaluation, whole model shapes (default 0.2)")
    t.add_argument("--allreduce", nargs="+", default=[], metavar="TABLE.csv",
                   help="all-reduce tables for the calibration (as `autopar calibrate --allreduce`)")
    add_trace_model_flags(t)
    t.add_argument("--from-scratch", action="store_true",
                   help="do not start from the shipped policy's weights")
    t.add_argument("--replay", type=int, default=None, metavar="N",
                   help="add N workloads of the shipped policy's training distribution to the pool, so that "
                        f"fine-tuning keeps what it knows outside the traces' job mix (default {REPLAY})")
    m = p.add_argument_group("training on measured rewards", "--reward measured MODEL: fine-tune the shipped policy "
                             "(the cost-model prior) with rewards from real `autopar run` runs on this machine, over "
                             "a restricted plan space (at most 100 plans), each distinct plan measured once and "
                             "cached (autopar/policies/measured.py)")
    m.add_argument("--reward", choices=("cost", "measured"), default="cost",
                   help="cost: the cost model against the exhaustive oracle (default); measured: real runs")
    m.add_argument("model", nargs="?", metavar="MODEL", help="with --reward measured: a model.py or zoo name")
    m.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for build_model/example_batch (repeatable)")
    m.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="ranks of the one node measured (default: the cluster's)")
    m.add_argument("--global-batch", type=int, default=8, metavar="B", help="samples per step (default 8)")
    m.add_argument("--budget", type=int, default=40, metavar="RUNS",
                   help="distinct plans measured at most, cached ones included (default 40)")
    m.add_argument("--restrict", action="append", default=[], metavar="KNOB=V1,V2",
                   help="values a knob (a plan field) may take (repeatable; KNOB=* frees it). Defaults: "
                        "zero=0,1,3 offload_optimizer=false recompute=none,full schedule=1f1b "
                        "sequence_parallel=false grad_comm_dtype=fp32 bucket_mb=25 mesh_order=first; "
                        "dp/pp/tp and micro_batch_size vary")
    m.add_argument("--steps", type=int, default=20,
                   help="timed steps per run; their median is the reward (default 20: runs cost their start-up)")
    m.add_argument("--warmup", type=int, default=3, help="untimed steps per run (default 3)")
    m.add_argument("--cache", default=None, metavar="FILE.json",
                   help="measurement cache (default: measured-rewards.json in the autopar cache directory)")
    p.add_argument("-o", "--output", default="policy.zip", metavar="policy.zip", help="where to write the policy")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of --output")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload pool and of PPO (default 0)")
    p.add_argument("--eval-every", type=int, default=20_000, metavar="STEPS",
                   help="evaluate against the oracle every STEPS (default 20,000)")
    p.add_argument("--eval-workloads", type=int, default=24, metavar="N",
                   help="validation workloads, drawn apart from the pool (default 24; 0: none)")
    p.add_argument("--checkpoint-every", type=int, default=20_000, metavar="STEPS",
                   help="write a checkpoint every STEPS (default 20,000)")
    p.add_argument("--n-steps", type=int, default=2048, metavar="STEPS",
                   help="environment steps per PPO rollout (default 2048)")
    p.add_argument("--imitation-epochs", type=int, default=50, metavar="N",
                   help="epochs of behaviour cloning of the oracle's plans before PPO (default 50; 0: none)")
    p.add_argument("--dagger-rounds", type=int, default=2, metavar="N",
                   help="after imitation, rounds of labelling the policy's own decisions with the best completion "
                        "(default 2)")
    p.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console

    from autopar.errors import AutoparError
    from autopar.policies.files import sidecar_path
    from autopar.policies.train import TrainConfig, train

    sidecar_path(args.output)  # -o pol.json would clash with its sidecar: refuse before any work
    for flag in ("imitation_epochs", "dagger_rounds"):
        if getattr(args, flag) < 0:
            raise AutoparError(f"--{flag.replace('_', '-')} must be 0 or more, got {getattr(args, flag)}")
    traces = args.traces is not None
    if args.reward == "measured":
        return _run_measured(args)
    if args.model:
        raise AutoparError(f"unexpected argument {args.model!r}: a MODEL goes with --reward measured")
    if traces and not args.traces:
        raise AutoparError("--traces needs at least one trace file (.jsonl, as `autopar traces import` or "
                           "`autopar traces collect` write them)")
    if traces and args.workloads is not None:
        raise AutoparError("give --traces or --workloads, not both (with --traces the traces are the workloads)")
    if not traces and (args.cluster or args.allreduce or args.from_scratch or args.replay is not None):
        raise AutoparError("--cluster, --allreduce, --from-scratch and --replay go with --traces")
    if args.replay is None:
        args.replay = REPLAY
    if args.replay < 0:
        raise AutoparError(f"--replay must be 0 or more, got {args.replay}")
    if traces and not args.cluster:
        raise AutoparError("--traces needs --cluster: the preset or cluster JSON the traces were measured on")
    if args.timesteps is None:
        args.timesteps = TRACES_TIMESTEPS if traces else DEFAULT_TIMESTEPS
    for flag in ("timesteps", "eval_every", "checkpoint_every", "n_steps"):
        if getattr(args, flag) < 1:
            raise AutoparError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    cfg = TrainConfig(timesteps=args.timesteps, workloads=args.workloads or "1024", output=args.output,
                      seed=args.seed,
                      eval_every=args.eval_every, eval_workloads=args.eval_workloads,
                      checkpoint_every=args.checkpoint_every, resume=args.resume, n_steps=args.n_steps,
                      imitation_epochs=args.imitation_epochs, dagger_rounds=args.dagger_rounds)
    console = Console()
    if traces:
        return _run_traces(args, cfg, console)
    meta = train(cfg, console)
    val = meta["eval"]["validation"]
    summary = f"policy written to {cfg.output} ({meta['timesteps']:,} timesteps, {meta['train_seconds']:.0f} s)"
    if val:
        summary += f"; validation ratio to the oracle: median {val['median']:.3f}, p5 {val['p5']:.3f}"
    console.print(summary, soft_wrap=True)
    return 0


def _run_traces(args, cfg, console) -> int:
    from autopar.cli.common import model_sources
    from autopar.policies.traces import TraceTrainConfig, cluster_path, train_on_traces

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


def _run_measured(args) -> int:
    from rich.console import Console

    from autopar.errors import AutoparError

    if not args.model:
        raise AutoparError("--reward measured needs a MODEL (a model.py or zoo name)")
    if args.traces is not None or args.workloads is not None:
        raise AutoparError("--reward measured does not take --traces or --workloads")
    if args.budget < 1:
        raise AutoparError(f"--budget must be at least 1 real run, got {args.budget}")
    for flag in ("steps", "global_batch"):
        if getattr(args, flag) < 1:
            raise AutoparError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.warmup < 0 or (args.gpus_per_node is not None and args.gpus_per_node < 1):
        raise AutoparError("--warmup must be 0 or more and --gpus-per-node positive")
    from autopar.cli.common import parse_model_args
    from autopar.policies.measured import parse_restrictions, train_measured

    restrict = parse_restrictions(args.restrict)  # an unknown knob fails here, before any profiling
    console = Console()
    meta = train_measured(args.model, parse_model_args(args.model_arg, None), cluster=args.cluster or "cpu",
                          gpus_per_node=args.gpus_per_node, global_batch=args.global_batch, restrict=restrict,
                          budget=args.budget, steps=args.steps, warmup=args.warmup, cache=args.cache,
                          output=args.output, seed=args.seed, console=console)
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
