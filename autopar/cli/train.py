"""`autopar train`: train a planning policy (MaskablePPO) on sampled workloads, resumably."""

from __future__ import annotations

DEFAULT_TIMESTEPS = 100_000


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train an RL planning policy on the cost model",
                       description="Train a MaskablePPO policy that plans knob by knob, evaluating it against the "
                                   "exhaustive oracle as it goes. Writes policy.zip, its metadata sidecar "
                                   "policy.json and checkpoints in policy.zip.ckpt/ (--resume continues from them).")
    p.add_argument("--timesteps", type=int, default=DEFAULT_TIMESTEPS,
                   help=f"total environment steps (default {DEFAULT_TIMESTEPS:,})")
    p.add_argument("--workloads", default="1024", metavar="N|FILE.json",
                   help="training pool: a number of workloads drawn from the zoo sampler, or a JSON list of "
                        "workload specs (default 1024)")
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
    for flag in ("timesteps", "eval_every", "checkpoint_every", "n_steps"):
        if getattr(args, flag) < 1:
            raise AutoparError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    cfg = TrainConfig(timesteps=args.timesteps, workloads=args.workloads, output=args.output, seed=args.seed,
                      eval_every=args.eval_every, eval_workloads=args.eval_workloads,
                      checkpoint_every=args.checkpoint_every, resume=args.resume, n_steps=args.n_steps,
                      imitation_epochs=args.imitation_epochs, dagger_rounds=args.dagger_rounds)
    console = Console()
    meta = train(cfg, console)
    val = meta["eval"]["validation"]
    summary = f"policy written to {cfg.output} ({meta['timesteps']:,} timesteps, {meta['train_seconds']:.0f} s)"
    if val:
        summary += f"; validation ratio to the oracle: median {val['median']:.3f}, p5 {val['p5']:.3f}"
    console.print(summary, soft_wrap=True)
    return 0
