"""`autopar train traces`: a policy specialised for one cluster and the job mix its traces describe.

    1. calibrate the cluster's cost model on the traces (`autopar.calibrate.calibrate`, as
       `autopar calibrate` does; all rows are fitted);
    2. the job mix: each distinct (model shape, cluster size, global batch) of the traces
       (`autopar.calibrate.job_mix`), on the calibrated cluster;
    3. split it by model shape (`autopar.calibrate.folds.group_holdout`, seeded): whole shapes
       are held out, so no shape is both trained on and evaluated;
    4. expand the training shapes to every cluster size and every global batch seen in the traces
       (the variations the traces justify), keeping the workloads some plan fits, and add
       `replay` workloads of the shipped policy's own training distribution (rehearsal);
    5. train with `autopar.policies.train.train` (imitation of the calibrated oracle, DAgger,
       MaskablePPO on the calibrated cost model), starting from the shipped policy's weights
       when its plan-space signature matches (fine-tuning), from chance otherwise;
    6. evaluate the greedy (top-1) plan of every held-out trace workload against the calibrated
       exhaustive oracle, and write the policy, its sidecar (calibration figures, trace digests,
       split, held-out figures, command) and the calibrated cluster JSON next to it.

It lives with the policies rather than in `autopar.calibrate` because it drives RL training
(torch, stable-baselines3): calibration stays importable with NumPy and SciPy alone, and the
dependency runs one way, policies -> calibrate.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from autopar.atomic import write_text_atomic
from autopar.calibrate import calibrate, job_mix
from autopar.calibrate.cluster_profile import write_cluster
from autopar.calibrate.folds import group_holdout
from autopar.envs.rewards import CostModelReward
from autopar.envs.workloads import feasible, training_workloads
from autopar.errors import AutoparError
from autopar.policies.files import numpy_actor, sidecar_path
from autopar.policies.load import PolicyError, check_signature, default_policy_path, load_policy, read_meta
from autopar.policies.train import greedy_ratios, train
from autopar.traces.record import check_trace_file
from autopar.workload import Workload

DEFAULT_TIMESTEPS = 10_000  # fine-tuning from the shipped policy: the imitation does most of the work
MIN_SHAPES = 2  # one to train on, one to hold out
REPLAY = 128  # rehearsal: fine-tuning on a narrow job mix alone forgets what lies outside it


@dataclass
class TraceTrainConfig:
    traces: list
    cluster: str  # preset name or cluster JSON: what the traces were measured on
    holdout: float = 0.2  # fraction of the trace workloads held out, by model shape
    allreduce: list = field(default_factory=list)  # all-reduce tables for the calibration
    params: list | None = None  # coefficients to fit (default: those the traces identify)
    from_scratch: bool = False  # do not start from the shipped policy's weights
    replay: int = REPLAY  # workloads of the shipped policy's training distribution mixed into the pool
    models: object = None  # autopar.traces.models.ModelSources: the model code records may be profiled with


def file_digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def shape_key(profile) -> str:
    """A model shape: the model file's name and its arguments (hidden, heads, layers, ...), which is
    the profile's name; precision is not part of it."""
    return profile.name


def cluster_path(output) -> Path:
    """Where the calibrated cluster JSON of a policy file goes: policy.zip -> policy.cluster.json."""
    return Path(output).with_suffix(".cluster.json")


def split_mix(mix: list, holdout: float, seed: int) -> tuple[list, list]:
    """(training, held-out) workloads of a job mix, whole shapes on one side."""

    keys = [shape_key(w.profile) for w, _ in mix]
    if len(set(keys)) < MIN_SHAPES:
        raise AutoparError(f"the traces describe {len(set(keys))} model shape(s); training with a held-out "
                           f"evaluation needs at least {MIN_SHAPES} (whole shapes are held out)")
    train_rows, test_rows = group_holdout(keys, holdout, seed)
    return [mix[i][0] for i in train_rows], [mix[i][0] for i in test_rows]


def expand(workloads: list, mix: list) -> list:
    """Each training workload's shape at every cluster size and global batch of the job mix (as
    traced, plus the combinations the traces did not happen to run) whose samples per GPU lie
    within the range the traces ran (no 1,536 samples on 2 GPUs because a 512-GPU run used that
    batch), feasible ones only."""

    sizes = sorted({(w.cluster.nodes, w.cluster.gpus_per_node) for w, _ in mix})
    batches = sorted({w.global_batch for w, _ in mix})
    per_gpu = [w.global_batch / w.cluster.num_gpus for w, _ in mix]
    low, high = min(per_gpu), max(per_gpu)
    base = {(w.cluster.nodes, w.cluster.gpus_per_node): w.cluster for w, _ in mix}
    seen, out = set(), []
    profiles = {w.profile.digest: w.profile for w in workloads}
    for w in workloads:  # the traced workloads first, as they are
        seen.add((w.profile.digest, w.cluster.nodes, w.cluster.gpus_per_node, w.global_batch))
        out.append(w)
    for digest, profile in profiles.items():
        for size in sizes:
            for batch in batches:
                key = (digest, *size, batch)
                if key in seen or not low <= batch / (size[0] * size[1]) <= high:
                    continue
                seen.add(key)
                w = Workload(profile, base[size], batch)
                if feasible(w):
                    out.append(w)
    return out


def heldout_figures(actor, workloads: list, reward) -> dict:
    """Median, 5th percentile and least top-1 ratio to the oracle, with one row per workload."""

    ratios = greedy_ratios(actor, workloads, reward)
    rows = [{"workload": w.describe(), "shape": shape_key(w.profile), "gpus": w.cluster.num_gpus,
             "global_batch": w.global_batch, "oracle_s": reward.oracle.time(w), "ratio": float(r)}
            for w, r in zip(workloads, ratios)]
    return {"workloads": len(workloads), "median": float(np.median(ratios)),
            "p5": float(np.percentile(ratios, 5)), "min": float(ratios.min()), "rows": rows}


def calibration_summary(result) -> dict:
    v = result.validation
    out = {"rows": result.fit.rows, "fitted": result.fit.fitted(), "validation": v["method"],
           "mape": v["mape"], "max_error": v["max_error"], "spearman": v["spearman"]}
    if result.collectives is not None:
        c = result.collectives
        out["collectives"] = {"kind": c.kind, "efficiency": c.efficiency, "collective_latency_s":
                              c.collective_latency_s, "table_mape": c.mape}
    return out


def train_on_traces(tcfg: TraceTrainConfig, cfg, console) -> dict:
    """Calibrate, build the job mix, train, evaluate on held-out shapes, write everything.
    `cfg` is the `TrainConfig` (output, timesteps, seed, imitation ...). Returns the metadata."""

    if not tcfg.traces:
        raise AutoparError("--traces needs at least one trace file (.jsonl; `autopar traces import` or "
                           "`autopar traces collect` writes them)")
    if not 0 < tcfg.holdout < 1:
        raise AutoparError(f"--holdout must be a fraction between 0 and 1, got {tcfg.holdout}")
    for path in tcfg.traces:
        check_trace_file(path)
    started = time.perf_counter()

    def say(msg: str) -> None:
        console.print(f"[dim]{msg}[/dim]", soft_wrap=True)

    result = calibrate(tcfg.traces, tcfg.cluster, allreduce=tcfg.allreduce, params=tcfg.params, seed=cfg.seed,
                       progress=say, models=tcfg.models)
    for problem in result.problems:  # the rest of the file is used
        console.print(f"autopar: warning: skipped malformed trace line {problem}", markup=False, soft_wrap=True)
    calibrated = result.cluster
    cal = calibration_summary(result)
    say(f"calibrated on {cal['rows']} rows: in-sample MAPE {cal['mape']:.2%}, Spearman {cal['spearman']:.4f}")

    mix = job_mix(tcfg.traces, calibrated, tcfg.models)
    train_set, heldout = split_mix(mix, tcfg.holdout, cfg.seed)
    pool = expand(train_set, mix)
    train_shapes = sorted({shape_key(w.profile) for w in train_set})
    heldout_shapes = sorted({shape_key(w.profile) for w in heldout})
    say(f"job mix: {len(mix)} workloads of {len(train_shapes) + len(heldout_shapes)} shapes; training on "
        f"{len(train_set)} of {len(train_shapes)} shapes, expanded to {len(pool)}; holding out {len(heldout)} "
        f"of {len(heldout_shapes)} shapes")

    start_from = None
    if not tcfg.from_scratch and not cfg.resume:
        try:
            check_signature(read_meta(default_policy_path()), default_policy_path())
            start_from = default_policy_path()
        except PolicyError as e:
            say(f"training from scratch: {e}")

    if tcfg.replay:  # rehearsal: keep what the policy knows outside the traces' job mix

        pool = pool + training_workloads(tcfg.replay, seed=cfg.seed)
        say(f"plus {tcfg.replay} workloads of the shipped policy's training distribution (--replay)")

    reward = CostModelReward()  # coefficients from each workload's (calibrated) cluster
    before = heldout_figures(load_policy(start_from), heldout, reward) if start_from else None
    if before:
        say(f"shipped policy on the held-out workloads: median {before['median']:.4f}, p5 {before['p5']:.4f}, "
            f"min {before['min']:.4f}")

    def finish(model) -> dict:
        figures = heldout_figures(numpy_actor(model), heldout, reward)
        return {"traces": {
            "files": [{"path": str(p), "sha256": file_digest(p)} for p in tcfg.traces],
            "cluster": tcfg.cluster, "allreduce": [{"path": str(p), "sha256": file_digest(p)} for p in tcfg.allreduce],
            "calibrated_cluster": cluster_path(cfg.output).name, "calibration": cal,
            "coefficients": calibrated.coefficients,
            "split": {"by": "model shape", "holdout": tcfg.holdout, "seed": cfg.seed, "train_shapes": train_shapes,
                      "heldout_shapes": heldout_shapes, "train_workloads": len(train_set),
                      "train_pool": len(pool), "replay": tcfg.replay, "heldout_workloads": len(heldout)},
            "heldout": figures, "heldout_before": {k: v for k, v in before.items() if k != "rows"} if before else None,
        }, "cluster": calibrated.to_dict()}

    Path(cfg.output).parent.mkdir(parents=True, exist_ok=True)
    write_cluster(calibrated, cluster_path(cfg.output))
    # the held-out workloads are the validation set: progress figures only, nothing is selected on them
    meta = train(cfg, console, pool=pool, validation=heldout, start_from=start_from, finish=finish)
    meta["traces"]["wall_seconds"] = time.perf_counter() - started
    write_text_atomic(sidecar_path(cfg.output), json.dumps(meta, indent=1) + "\n")
    return meta
