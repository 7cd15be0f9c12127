"""`autopar train`: train a planning policy (MaskablePPO) on sampled workloads, resumably."""

from __future__ import annotations

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
    t.add_argument("--from-scratch", action="store_true",
                   help="do not start from the shipped policy's weights")
    t.add_argument("--replay", type=int, default=None, metavar="N",
                   help="add N workloads of the shipped policy's training distribution to the pool, so that "
                        f"fine-tuning keeps what it knows outside the traces' job mix (default {REPLAY})")
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
    from autopar.policies.train import TrainConfig, train

    for flag in ("imitation_epochs", "dagger_rounds"):
        if getattr(args, flag) < 0:
            raise AutoparError(f"--{flag.replace('_', '-')} must be 0 or more, got {getattr(args, flag)}")
    traces = args.traces is not None
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
    from autopar.policies.traces import TraceTrainConfig, cluster_path, train_on_traces

    tcfg = TraceTrainConfig(traces=args.traces, cluster=args.cluster, holdout=args.holdout,
                            allreduce=args.allreduce, from_scratch=args.from_scratch, replay=args.replay)
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
