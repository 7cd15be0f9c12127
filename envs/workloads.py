"""Workloads to train and evaluate policies on: a sampler over the zoo, and a fixed held-out set.

Training draws the zoo's named sizes (GPT, Llama, BERT, ViT, ResNet, MoE) at several sequence lengths
on five cluster presets, single nodes of 1-8 GPUs or 2-64 nodes (non-powers of two included),
with global batches of 1/8 to 32 samples per GPU (at least 16). Node counts are capped so that the exhaustive
oracle, which the reward needs once per workload, stays around a second.

The held-out set is what no training run sees: model shapes drawn off the zoo's ratios (other
hidden/heads/layers proportions, head sizes, GQA ratios, vocabularies, sequence lengths, image and
patch sizes, ResNet depths), on presets that are not trained on (dgx-h200, l40s-pcie) or trained
presets at node counts that are not (5, 7, 10, 20, 24, 40, 96). It is deterministic from its seed.
A second held-out set holds mixtures of experts only (`heldout_moe_specs`: expert counts, top-k and
expert widths off the zoo's), drawn the same way.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from rich.progress import track

from autopar.cluster import GPUS, PRESETS, load_cluster
from autopar.envs.knobs import PlanSpace
from autopar.knobs import STATE_BYTES_PER_PARAM  # to size clusters to models
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

TRAIN_CLUSTERS = ("dgx-v100", "dgx-a100-40g", "dgx-a100-80g", "dgx-h100", "pcie-4090x8")
HELDOUT_CLUSTERS = ("dgx-h200", "l40s-pcie")
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
    # mixtures of experts (autopar/zoo/moe.py): their plans add the expert-parallel degree
    "moe": (("small", "mixtral-8x7b", "qwen3-30b-a3b", "gpt-oss-120b", "deepseek-v3"), (2048, 4096)),
}


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
        profile = profile_model(self.model, dict(self.model_args), dtype=self.precision)
        cluster = load_cluster(self.cluster, nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        return Workload(profile=profile, cluster=cluster, global_batch=self.global_batch)

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
        "global_batch": Int(1, MAX_GLOBAL_BATCH), "precision": Str(("bf16", "fp16", "fp32")),
    }, required=("model",))

def feasible(workload) -> bool:
    """Some plan of the space fits in memory (the first step's mask is exact about that)."""

    return bool(PlanSpace(workload).step(()).allowed.any())


# -- sampling ---------------------------------------------------------------------------------------
def _approx_params(spec: WorkloadSpec) -> float:
    return profile_model(spec.model, dict(spec.model_args), dtype=spec.precision).params


def _precision(rng: np.random.Generator, cluster: str) -> str:
    if GPUS[PRESETS[cluster]["gpu"]].peak_flops["bf16"] < GPUS[PRESETS[cluster]["gpu"]].peak_flops["fp16"]:
        return str(rng.choice(["fp16", "fp32"], p=[0.9, 0.1]))  # no bf16 tensor cores (V100)
    return str(rng.choice(["bf16", "fp16", "fp32"], p=[0.8, 0.15, 0.05]))


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


def sample_training_spec(rng: np.random.Generator) -> WorkloadSpec | None:
    """One draw from the training distribution (None when the draw admits no cluster size)."""
    family = list(TRAIN_MODELS)[rng.integers(len(TRAIN_MODELS))]
    sizes, seq_lens = TRAIN_MODELS[family]
    args = {"size": sizes[rng.integers(len(sizes))]}
    if seq_lens:
        args["seq_len"] = int(seq_lens[rng.integers(len(seq_lens))])
    cluster = TRAIN_CLUSTERS[rng.integers(len(TRAIN_CLUSTERS))]
    spec = WorkloadSpec(family, tuple(sorted(args.items())), cluster, precision=_precision(rng, cluster))
    return _size_cluster(rng, spec, _approx_params(spec), TRAIN_NODES, MAX_TRAIN_GPUS)


def _collect(sample, n: int, seed: int, progress: bool) -> list:
    """n distinct feasible (spec, workload) pairs drawn by `sample(rng)`, deterministic from seed."""
    rng = np.random.default_rng(seed)
    seen, out = set(), []

    for _ in track(range(50 * n), description="sampling workloads", disable=not progress, transient=True):
        if len(out) == n:
            break
        spec = sample(rng)
        if spec is None or spec in seen:
            continue
        seen.add(spec)
        workload = spec.build()
        if feasible(workload):
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
                "vocab": vocab, "seq_len": int(_pick(rng, (1536, 3072, 6144))),
                "ffn": hidden * int(_pick(rng, (3, 5, 6))) // 2 * 2}
    if family == "llama":
        heads = int(_pick(rng, (20, 24, 28, 40, 48, 56, 80, 96)))
        ratio = int(_pick(rng, [r for r in (2, 5, 6, 7, 10, 12) if heads % r == 0] or [2]))
        hidden = heads * int(_pick(rng, (64, 96, 128)))
        ffn = 256 * round(hidden * float(_pick(rng, (2.5, 3.0, 3.5, 4.0))) / 256)
        return {"size": "small", "hidden": hidden, "heads": heads, "kv_heads": heads // ratio, "ffn": ffn,
                "layers": int(rng.integers(16, 100)), "vocab": vocab, "seq_len": int(_pick(rng, (1536, 3072, 6144)))}
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
    return {"size": "resnet50", "depths": (3, int(rng.integers(3, 11)), int(rng.integers(5, 41)), 3),
            "width": int(_pick(rng, (32, 48, 96, 128))), "wide": int(_pick(rng, (1, 2, 3))),
            "image": int(_pick(rng, (128, 160, 192, 256))), "classes": int(_pick(rng, (100, 10_000)))}


def sample_heldout_spec(rng: np.random.Generator) -> WorkloadSpec | None:
    family = str(_pick(rng, ("gpt", "gpt", "llama", "llama", "bert", "vit", "resnet")))
    return _heldout_sized(rng, family, _heldout_shape(rng, family))


def _heldout_sized(rng: np.random.Generator, family: str, shape: dict) -> WorkloadSpec | None:
    """A held-out shape on a held-out preset, or on a trained preset at a node count training never uses."""
    if rng.random() < 0.5:
        cluster, node_counts = str(_pick(rng, HELDOUT_CLUSTERS)), TRAIN_NODES + HELDOUT_NODES
    else:
        cluster, node_counts = str(_pick(rng, TRAIN_CLUSTERS)), HELDOUT_NODES
    spec = WorkloadSpec(family, tuple(sorted(shape.items())), cluster, precision=_precision(rng, cluster))
    sized = _size_cluster(rng, spec, _approx_params(spec), node_counts, max_gpus=1024)
    if sized is None or (cluster in TRAIN_CLUSTERS and sized.nodes not in HELDOUT_NODES):
        return None  # a trained preset is held out only at a node count training never uses
    return sized


def heldout_specs(seed: int = HELDOUT_SEED, n: int = HELDOUT_SIZE, progress: bool = False) -> list[WorkloadSpec]:
    return [spec for spec, _ in _collect(sample_heldout_spec, n, seed, progress)]


def heldout_workloads(seed: int = HELDOUT_SEED, n: int = HELDOUT_SIZE, progress: bool = False) -> list:
    """The fixed held-out set: shapes and clusters no training run sees."""
    return [w for _, w in _collect(sample_heldout_spec, n, seed, progress)]


# -- the held-out mixtures of experts ------------------------------------------------------------------
HELDOUT_MOE_SEED = 20_261_201
HELDOUT_MOE_SIZE = 32


def _heldout_moe_shape(rng: np.random.Generator) -> dict:
    """MoE arguments off the zoo's shapes (autopar/zoo/moe.py): expert counts, top-k, expert widths,
    shared experts and leading dense layers drawn independently of the named sizes."""
    heads = int(_pick(rng, (16, 24, 40, 48, 64)))
    hidden = heads * int(_pick(rng, (64, 96, 128)))
    experts = int(_pick(rng, (24, 32, 48, 96, 160, 192)))
    dense = int(_pick(rng, (0, 0, 1, 2)))
    return {"size": "small", "hidden": hidden, "heads": heads, "kv_heads": heads // int(_pick(rng, (2, 4, 8))),
            "layers": int(rng.integers(12, 64)), "experts": experts,
            "top_k": int(_pick(rng, [k for k in (2, 3, 4, 6, 8) if k < experts])),
            "expert_ffn": 128 * max(1, round(hidden * float(_pick(rng, (0.25, 0.4, 0.75, 1.5, 3.5))) / 128)),
            "shared_experts": int(_pick(rng, (0, 0, 1, 2))), "dense_layers": dense,
            "dense_ffn": 256 * round(hidden * 3.5 / 256) if dense else 0,
            "vocab": int(_pick(rng, (32_000, 100_352, 151_936))), "seq_len": int(_pick(rng, (2048, 3072, 4096)))}


def sample_heldout_moe_spec(rng: np.random.Generator) -> WorkloadSpec | None:
    """One held-out MoE workload, placed as `sample_heldout_spec` places the dense ones."""
    return _heldout_sized(rng, "moe", _heldout_moe_shape(rng))


def heldout_moe_specs(seed: int = HELDOUT_MOE_SEED, n: int = HELDOUT_MOE_SIZE,
                      progress: bool = False) -> list[WorkloadSpec]:
    """The fixed held-out MoE set (issue 14 asks the RL planner's quality on 32 of them)."""
    return [spec for spec, _ in _collect(sample_heldout_moe_spec, n, seed, progress)]

