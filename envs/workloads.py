"""Workloads to train and evaluate policies on: a sampler over the zoo, and a fixed held-out set.

Training draws the zoo's named sizes (GPT, Llama, BERT, ViT, ResNet, and any family the zoo
adds, by its named sizes) at several sequence lengths on the training presets, single nodes of
1-8 GPUs or 2-64 nodes (non-powers of two included), with global batches of 1/8 to 32 samples per
GPU (at least 16), in every precision of `autopar.knobs.PRECISIONS` the preset's GPU runs fast; a
quarter of the draws are lanes of mixed jobs: one group of GPUs at a share of a larger job's batch,
what the mixed search (issue 42) asks the policy (`_as_lane`).
Node counts are capped so that the exhaustive oracle, which the reward needs once per workload,
stays around a second.

The held-out set is what no training run sees: model shapes drawn off the zoo's ratios (other
hidden/heads/layers proportions, head sizes, GQA ratios, vocabularies, sequence lengths, image and
patch sizes, ResNet depths; a family without such a rule: its named sizes with another depth and
sequence length), on the presets whose GPU no training preset has (derived from the preset
registry: today dgx-h200, gb200-nvl72, l40s-pcie) or trained presets at node counts that are not
(5, 7, 10, 20, 24, 40, 96). It is deterministic from its seed; `family=` restricts it to one zoo
family (the MoE set of issue 14). New axes and knobs need nothing here: the plan space is the
registry's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import cache

import numpy as np
from rich.progress import track

from autopar.cluster import GPUS, PRESETS, load_cluster
from autopar.cluster.presets import PUBLISHED_RUN_PRESETS
from autopar.envs.knobs import PlanSpace
from autopar.envs.rewards import OracleCache
from autopar.errors import AutoparError
from autopar.knobs import PRECISIONS, STATE_BYTES_PER_PARAM, storage_dtype  # sizes clusters to models
from autopar.mixed.shares import quantum  # the grid the mixed search prices a lane's shares on
from autopar.profile import profile_model
from autopar.schema import (
    MAX_GLOBAL_BATCH,
    MAX_GPUS,
    MAX_GPUS_PER_NODE,
    Anything,
    Int,
    Map,
    Obj,
    Opt,
    Str,
    dataclass_schema,
)
from autopar.workload import Workload

TRAIN_CLUSTERS = ("dgx-v100", "dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "dgx-b200", "pcie-4090x8")


def _heldout_clusters() -> tuple[str, ...]:
    """Every GPU preset whose GPU no training preset has (the CPU preset is no GPU; nor are the presets
    of published runs' machines, PUBLISHED_RUN_PRESETS, planning targets)."""
    trained = {PRESETS[c]["gpu"] for c in TRAIN_CLUSTERS}
    return tuple(name for name, p in PRESETS.items() if p["gpu"] not in trained and p["node"]["intra"] != "shm"
                 and name not in PUBLISHED_RUN_PRESETS)


HELDOUT_CLUSTERS = _heldout_clusters()
TRAIN_NODES = (2, 3, 4, 6, 8, 12, 16, 32, 48, 64)
HELDOUT_NODES = (5, 7, 10, 20, 24, 40, 96)
SINGLE_NODE_GPUS = tuple(range(1, 9))
MAX_TRAIN_GPUS = 512
HELDOUT_SEED = 20_251_129
HELDOUT_SIZE = 64
MIN_BATCH = 16

TRAIN_MODELS = {  # family -> (named sizes, sequence lengths; None: fixed by the model)
    "gpt": (("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-350m", "gpt3-760m", "gpt3-1.3b",
             "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "1.7b", "3.6b", "7.5b", "18.4b", "22b", "39.1b", "76.1b",
             "145.6b", "175b"), (1024, 2048, 4096)),
    "llama": (("small", "llama-7b", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b"),
              (2048, 4096, 8192)),
    "bert": (("bert-base", "bert-large", "megatron-bert-1.3b", "megatron-bert-3.9b"), (128, 512)),
    "vit": (("vit-b16", "vit-l16", "vit-h14", "vit-g14", "vit-G14", "vit-22b"), None),
    "resnet": (("resnet50", "resnet101", "resnet152", "wide_resnet50_2", "wide_resnet101_2", "resnet152x4"), None),
}
OTHER_SEQ_LENS = (2048, 4096, 8192)  # a zoo family not listed above, when its sizes have a sequence length
HELDOUT_SEQ_LENS = (1536, 3072, 6144, 12288)
TEST_SIZES = ("tiny",)  # the zoo's sizes for tests: no workload to plan
# share of draws per precision; a precision the registry adds (fp8) gets NEW_PRECISION_SHARE
PRECISION_SHARE = {"bf16": 0.8, "fp16": 0.15, "fp32": 0.05}
NEW_PRECISION_SHARE = 0.3
LANE_SHARE = 0.25  # of the draws: a group's lane of a mixed job (issue 42), as the mixed search poses it
LANE_JOB = (1.5, 2.0, 3.0, 4.0)  # the job's batch over the group's drawn batch


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload by name: what `autopar search` takes on the command line, as data."""

    model: str  # zoo name or model.py path
    model_args: tuple = ()  # sorted (key, value) pairs
    cluster: str = "dgx-a100-80g"
    nodes: int = 1
    gpus_per_node: int | None = None
    global_batch: int = 512
    precision: str = "bf16"

    def build(self):
        profile = profile_model(self.model, dict(self.model_args), dtype=storage_dtype(self.precision))
        cluster = load_cluster(self.cluster, nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        return Workload(profile=profile, cluster=cluster, global_batch=self.global_batch, fp8=self.precision == "fp8")

    @property
    def num_gpus(self) -> int:
        return self.nodes * (self.gpus_per_node or PRESETS[self.cluster]["gpus_per_node"])

    def to_dict(self) -> dict:
        return {**asdict(self), "model_args": dict(self.model_args)}

    @classmethod
    def from_dict(cls, d: dict) -> WorkloadSpec:
        return cls(**{**d, "model_args": tuple(sorted(d.get("model_args", {}).items()))})



def workload_spec_schema() -> Obj:
    """A workloads file's entry (`autopar train --workloads FILE`), derived from WorkloadSpec's fields."""
    return dataclass_schema(WorkloadSpec, {
        "model": Str(max_len=4096), "model_args": Map(Anything()), "cluster": Str(max_len=4096),
        "nodes": Int(1, MAX_GPUS), "gpus_per_node": Opt(Int(1, MAX_GPUS_PER_NODE)),
        "global_batch": Int(1, MAX_GLOBAL_BATCH), "precision": Str(PRECISIONS),
    }, required=("model",))

def feasible(workload) -> bool:
    """Some plan of the space fits in memory (the first step's mask is exact about that)."""

    return bool(PlanSpace(workload).step(()).allowed.any())


def has_oracle(workload) -> bool:
    """The exhaustive oracle, the reward's reference, can enumerate the space (at most
    `autopar.search.space.MAX_PLANS` plans; a 175B GPT on 48 B200 nodes with cp, fp8 and compile
    has more). Its answer is cached on disk, so the training's oracle pass reads it back."""
    try:
        OracleCache().best(workload)
    except AutoparError:
        return False
    return True


# -- sampling ---------------------------------------------------------------------------------------
def _approx_params(spec: WorkloadSpec) -> float:
    return profile_model(spec.model, dict(spec.model_args), dtype=storage_dtype(spec.precision)).params


def _precisions(cluster: str) -> list[str]:
    """The precisions of the registry the preset's GPU runs faster than fp32 (and fp32)."""
    peak = GPUS[PRESETS[cluster]["gpu"]].peak_flops
    return [p for p in PRECISIONS if p == "fp32" or peak.get(p, 0.0) > peak["fp32"]]


def _precision(rng: np.random.Generator, cluster: str) -> str:
    options = _precisions(cluster)
    share = np.array([PRECISION_SHARE.get(p, NEW_PRECISION_SHARE) for p in options])
    return str(rng.choice(options, p=share / share.sum()))


def _size_cluster(rng, spec: WorkloadSpec, params: float, node_counts, max_gpus: int) -> WorkloadSpec | None:
    """Pick a node count (or a single node of 1-8 GPUs) that can hold the model's training state
    (down to half of it: memory pressure is part of the problem) and a global batch."""
    preset = PRESETS[spec.cluster]
    memory = GPUS[preset["gpu"]].memory_bytes
    need = params * STATE_BYTES_PER_PARAM / memory
    options = [(1, g) for g in SINGLE_NODE_GPUS] + [(n, None) for n in node_counts]
    options = [(n, g) for n, g in options
               if need / 2 <= n * (g or preset["gpus_per_node"]) <= min(max_gpus, max(8, 64 * need))]
    if not options:
        return None
    nodes, gpus_per_node = options[rng.integers(len(options))]
    n = nodes * (gpus_per_node or preset["gpus_per_node"])
    per_gpu = 2.0 ** rng.integers(-3, 6)
    # mostly a whole number of samples per GPU; sometimes a power of two whatever the GPU count
    batch = n * per_gpu if rng.random() < 0.75 else 2.0 ** round(math.log2(n * per_gpu))
    batch = int(min(8192, max(MIN_BATCH, round(batch))))
    return WorkloadSpec(spec.model, spec.model_args, spec.cluster, nodes, gpus_per_node, batch, spec.precision)


@cache
def families() -> tuple[str, ...]:
    """The zoo's model families (a family the zoo adds is trained and held out without an edit here)."""
    from autopar.zoo import MODELS  # torch: the zoo's model files import it

    return tuple(MODELS)


@cache
def family_sizes(family: str) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    """The named sizes training draws for a family, and its sequence lengths (None: fixed by the
    model): TRAIN_MODELS's, or every named size of the zoo's file but the test ones."""
    if family in TRAIN_MODELS:
        return TRAIN_MODELS[family]
    sizes = _zoo_sizes(family)
    names = tuple(name for name in sizes if name not in TEST_SIZES)
    return names, OTHER_SEQ_LENS if all("seq_len" in sizes[n] for n in names) else None


def _zoo_sizes(family: str) -> dict:
    from autopar.modelfile import load_model_file  # torch: loading a model file imports it

    return dict(getattr(load_model_file(family).module, "SIZES", {}))


def sample_training_spec(rng: np.random.Generator, family: str | None = None) -> WorkloadSpec | None:
    """One draw from the training distribution (None when the draw admits no cluster size); a share
    (LANE_SHARE) of them are lanes of mixed jobs (`_as_lane`)."""
    family = family or str(_pick(rng, families()))
    sizes, seq_lens = family_sizes(family)
    args = {"size": sizes[rng.integers(len(sizes))]}
    if seq_lens:
        args["seq_len"] = int(seq_lens[rng.integers(len(seq_lens))])
    cluster = TRAIN_CLUSTERS[rng.integers(len(TRAIN_CLUSTERS))]
    spec = WorkloadSpec(family, tuple(sorted(args.items())), cluster, precision=_precision(rng, cluster))
    spec = _size_cluster(rng, spec, _approx_params(spec), TRAIN_NODES, MAX_TRAIN_GPUS)
    return _as_lane(rng, spec) if spec is not None and rng.random() < LANE_SHARE else spec


def _as_lane(rng: np.random.Generator, spec: WorkloadSpec) -> WorkloadSpec:
    """The workload the mixed search (`autopar.mixed.search`) asks the policy about for one group of a
    job over several GPU types: the group's GPUs (the draw's cluster) at a share of the job's batch, k of
    its grid units (`autopar.mixed.shares.quantum`), k = all of them being the group alone. The job's
    batch is the group's times LANE_JOB (the other groups' part), so a lane's batch need not follow its
    GPU count."""
    job = max(MIN_BATCH, int(round(spec.global_batch * float(rng.choice(LANE_JOB)))))
    q = quantum(job)
    share = q * int(rng.integers(1, job // q + 1))
    return WorkloadSpec(spec.model, spec.model_args, spec.cluster, spec.nodes, spec.gpus_per_node, share,
                        spec.precision)


def _collect(sample, n: int, seed: int, progress: bool) -> list:
    """n distinct feasible (spec, workload) pairs drawn by `sample(rng)`, deterministic from seed."""
    rng = np.random.default_rng(seed)
    seen, out = set(), []

    for _ in track(range(50 * n), description="sampling workloads", disable=not progress, transient=True):
        if len(out) == n:
            break
        try:
            spec = sample(rng)
            if spec is None or spec in seen:
                continue
            seen.add(spec)
            workload = spec.build()
        except (AutoparError, ValueError):
            continue  # a draw the registry refuses (a precision its GPU lacks): not a workload
        if feasible(workload) and has_oracle(workload):
            out.append((spec, workload))
    return out


def training_specs(n: int = 512, seed: int = 0, progress: bool = False) -> list[WorkloadSpec]:
    return [spec for spec, _ in _collect(sample_training_spec, n, seed, progress)]


def training_workloads(n: int = 512, seed: int = 0, progress: bool = False) -> list:
    """n distinct feasible workloads from the training distribution, deterministic from seed."""
    return [w for _, w in _collect(sample_training_spec, n, seed, progress)]


# -- the held-out set ---------------------------------------------------------------------------------
def _pick(rng, values):
    return values[rng.integers(len(values))]


def _heldout_shape(rng: np.random.Generator, family: str) -> dict:
    """Model arguments off the zoo's proportions (every ratio drawn independently)."""
    vocab = int(_pick(rng, (32_000, 65_024, 100_352, 151_936, 256_000)))
    if family == "gpt":
        heads = int(_pick(rng, (20, 28, 36, 44, 52, 60, 72, 88)))
        hidden = heads * int(_pick(rng, (64, 80, 96, 128)))
        return {"size": "gpt2-small", "hidden": hidden, "heads": heads, "layers": int(rng.integers(10, 90)),
                "vocab": vocab, "seq_len": int(_pick(rng, HELDOUT_SEQ_LENS)),
                "ffn": hidden * int(_pick(rng, (3, 5, 6))) // 2 * 2}
    if family == "llama":
        heads = int(_pick(rng, (20, 24, 28, 40, 48, 56, 80, 96)))
        ratio = int(_pick(rng, [r for r in (2, 5, 6, 7, 10, 12) if heads % r == 0] or [2]))
        hidden = heads * int(_pick(rng, (64, 96, 128)))
        ffn = 256 * round(hidden * float(_pick(rng, (2.5, 3.0, 3.5, 4.0))) / 256)
        return {"size": "small", "hidden": hidden, "heads": heads, "kv_heads": heads // ratio, "ffn": ffn,
                "layers": int(rng.integers(16, 100)), "vocab": vocab, "seq_len": int(_pick(rng, HELDOUT_SEQ_LENS))}
    if family == "bert":
        heads = int(_pick(rng, (10, 14, 18, 20, 28)))
        return {"size": "bert-base", "heads": heads, "hidden": heads * int(_pick(rng, (64, 96, 128))),
                "layers": int(rng.integers(8, 60)), "vocab": int(_pick(rng, (28_996, 50_265, 119_547))),
                "seq_len": int(_pick(rng, (256, 384, 1024)))}
    if family == "vit":
        heads = int(_pick(rng, (10, 14, 18, 20, 24)))
        hidden = heads * int(_pick(rng, (64, 96, 128)))
        patch = int(_pick(rng, (8, 14, 16, 32)))
        return {"size": "vit-b16", "heads": heads, "hidden": hidden, "ffn": hidden * int(_pick(rng, (3, 5))),
                "layers": int(rng.integers(10, 60)), "patch": patch, "image": patch * int(rng.integers(10, 25))}
    if family == "resnet":
        return {"size": "resnet50", "depths": (3, int(rng.integers(3, 11)), int(rng.integers(5, 41)), 3),
                "width": int(_pick(rng, (32, 48, 96, 128))), "wide": int(_pick(rng, (1, 2, 3))),
                "image": int(_pick(rng, (128, 160, 192, 256))), "classes": int(_pick(rng, (100, 10_000)))}
    return _other_heldout_shape(rng, family)


def _other_heldout_shape(rng: np.random.Generator, family: str) -> dict:
    """A family without a rule above: one of its named sizes at another depth (and sequence length)."""
    sizes = _zoo_sizes(family)
    name = str(_pick(rng, family_sizes(family)[0]))
    shape = {"size": name}
    if "layers" in sizes[name]:
        shape["layers"] = max(2, round(sizes[name]["layers"] * float(_pick(rng, (0.5, 0.75, 1.25, 1.5)))))
    if "seq_len" in sizes[name]:
        shape["seq_len"] = int(_pick(rng, HELDOUT_SEQ_LENS))
    return shape


HELDOUT_WEIGHT = {"gpt": 2, "llama": 2}  # draws per family in the held-out set (others: 1)


def sample_heldout_spec(rng: np.random.Generator, family: str | None = None) -> WorkloadSpec | None:
    family = family or str(_pick(rng, [f for f in families() for _ in range(HELDOUT_WEIGHT.get(f, 1))]))
    shape = _heldout_shape(rng, family)
    if rng.random() < 0.5:
        cluster, node_counts = str(_pick(rng, HELDOUT_CLUSTERS)), TRAIN_NODES + HELDOUT_NODES
    else:
        cluster, node_counts = str(_pick(rng, TRAIN_CLUSTERS)), HELDOUT_NODES
    spec = WorkloadSpec(family, tuple(sorted(shape.items())), cluster, precision=_precision(rng, cluster))
    sized = _size_cluster(rng, spec, _approx_params(spec), node_counts, max_gpus=1024)
    if sized is None or (cluster in TRAIN_CLUSTERS and sized.nodes not in HELDOUT_NODES):
        return None  # a trained preset is held out only at a node count training never uses
    return sized


def _heldout(seed: int, n: int, progress: bool, family: str | None) -> list:
    if family is not None and family not in families():
        raise AutoparError(f"unknown model family {family!r}; choose one of {', '.join(families())}")
    return _collect(lambda rng: sample_heldout_spec(rng, family), n, seed, progress)


def heldout_specs(seed: int = HELDOUT_SEED, n: int = HELDOUT_SIZE, progress: bool = False,
                  family: str | None = None) -> list[WorkloadSpec]:
    return [spec for spec, _ in _heldout(seed, n, progress, family)]


def heldout_workloads(seed: int = HELDOUT_SEED, n: int = HELDOUT_SIZE, progress: bool = False,
                      family: str | None = None) -> list:
    """The fixed held-out set: shapes and clusters no training run sees (of one family, if given)."""
    return [w for _, w in _heldout(seed, n, progress, family)]
