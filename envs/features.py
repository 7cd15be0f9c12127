"""The observation: workload figures, the partial plan, the step, and the current knob's choices.

Everything is log-scaled and divided by a fixed range so that one policy reads a 100M-parameter
model on one GPU and a 1T-parameter model on 16,384 GPUs on the same scale; the most telling
figures are dimensionless ratios (model state over GPU memory, communication over compute time)
that transfer across model families and clusters. Per choice of the current knob the policy
also sees what the memory mask already computed: the least memory and the fastest time of the
choice's lean completions (see `autopar.envs.knobs`).
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from autopar import axes
from autopar.envs.knobs import MAX_ACTIONS, PlanSpace, StepInfo
from autopar.knobs import DTYPE_BYTES, LOG2_MAX_GPUS, PRECISIONS, STATE_BYTES_PER_PARAM, decisions, knobs

FEATURE_VERSION = 3
BOUND = 5.0  # every feature is clipped to [-BOUND, BOUND]
TIME_CLOSE = 0.05  # the fine time feature resolves choices within 5% of the fastest
SLOT_FEATURES = ("present", "allowed", "value", "relative", "memory", "time", "time_close", "fastest")
WORKLOAD_FEATURES = (
    "params", "layers", "flops_per_sample", "seq_len", "layer_params_spread", "ends_params_share",
    "layer_flops_spread", "boundary_bytes", "activation_pressure", "attention_share", "has_tp_plan", "max_tp",
    "state_per_gpu_memory", "state_per_cluster_memory", "layer_state_per_gpu_memory",
    "gpus", "nodes", "gpus_per_node", "gpu_memory", "peak_flops", "hbm_bandwidth", "node_ring_bandwidth",
    "cross_node_bandwidth", "nic_per_gpu", "nvswitch", "ideal_step_time", "dp_comm_over_compute",
    "tp_comm_over_compute", "samples_per_gpu", "global_batch", *(f"precision_{p}" for p in PRECISIONS),
)


def derived_counts() -> list[str]:
    """The derived integer knobs (dp, micro-batches): features once the decisions fix them."""
    return [k.name for k in knobs() if not k.decision and k.fields[0].kind is int]


def observation_size() -> int:
    n = len(decisions())
    return len(WORKLOAD_FEATURES) + 3 * n + len(derived_counts()) + n + MAX_ACTIONS * len(SLOT_FEATURES)


def _log2(x: float) -> float:
    return math.log2(max(x, 1e-30))


def workload_features(workload) -> np.ndarray:
    """Model-graph statistics, cluster topology figures and batch, scaled to about [-1, 1]."""
    profile, cluster, batch = workload.profile, workload.cluster, workload.global_batch
    graph = profile.graph()
    nodes = graph.nodes.values()
    layer = [d for d in nodes if d["kind"] not in ("embed", "head")]
    params = np.array([d["params"] for d in layer], dtype=float)
    flops = np.array([d["fwd_flops"] for d in layer], dtype=float)
    saved = sum(d["saved_bytes"] for d in nodes)
    boundary = max((d["bytes"] for _, _, d in graph.edges(data=True)), default=0.0)
    n, gpus_per_node = cluster.num_gpus, cluster.gpus_per_node
    memory = cluster.gpu.memory_bytes
    peak = cluster.gpu.peak_flops[workload.precision]
    node_ring = cluster.ring(gpus_per_node, 1).bandwidth if gpus_per_node > 1 else 0.0
    cross = cluster.ring(cluster.nodes, gpus_per_node).bandwidth if cluster.nodes > 1 else 0.0
    dp_bandwidth = min(b for b in (node_ring, cross, math.inf) if b > 0) if n > 1 else math.inf
    step_flops = 3 * profile.fwd_flops * batch  # forward + backward
    compute = step_flops / (n * peak)
    grad_bytes = profile.params * DTYPE_BYTES[workload.precision]
    tp_bytes = sum(b.tp_comm_bytes * b.count for b in profile.layers)
    state = profile.params * STATE_BYTES_PER_PARAM
    values = [
        (math.log10(profile.params) - 10) / 2, _log2(profile.num_layers) / 7,
        (math.log10(max(profile.fwd_flops, 1.0)) - 12) / 3, _log2(profile.seq_len) / LOG2_MAX_GPUS,
        _log2(params.max() / max(params.mean(), 1.0)), (profile.embed.params + profile.head.params) / profile.params,
        float(flops.std() / max(flops.mean(), 1.0)), _log2(boundary * batch / n / memory) / 10,
        _log2(saved * batch / n / memory) / 5,
        sum(b.attn_core_bytes * b.count for b in profile.layers) / max(saved, 1.0),
        float(profile.has_tp_plan), _log2(math.gcd(*profile.tp_units) if profile.tp_units else 1) / 7,
        _log2(state / memory) / 10, _log2(state / (n * memory)) / 5,
        _log2(params.max() * STATE_BYTES_PER_PARAM / memory) / 5,
        _log2(n) / LOG2_MAX_GPUS, _log2(cluster.nodes) / 11, _log2(gpus_per_node) / 3, _log2(memory / 1e9) / 8,
        math.log10(peak) - 14, math.log10(cluster.gpu.hbm_bytes_per_s) - 12,
        (math.log10(node_ring) - 10) if node_ring else -2.0, (math.log10(cross) - 10) if cross else -2.0,
        cluster.node.nics / gpus_per_node, float(cluster.node.intra == "nvswitch"),
        math.log10(compute) / 2, _log2(2 * grad_bytes / dp_bandwidth / compute) / 5 if n > 1 else -2.0,
        _log2(4 * tp_bytes * batch / n / (node_ring or dp_bandwidth) / compute) / 5 if gpus_per_node > 1 else -2.0,
        _log2(batch / n) / 7, _log2(batch) / LOG2_MAX_GPUS,
        *(float(workload.precision == p) for p in PRECISIONS),
    ]
    return np.clip(np.array(values, dtype=np.float32), -BOUND, BOUND)


def plan_features(space: PlanSpace, prefix: tuple) -> np.ndarray:
    """Per decision: chosen or not and its value features (`Knob.features`); then the derived
    counts (data-parallel degree, micro-batches) once the decisions fix them."""
    n = len(space.knobs)
    derived = derived_counts()
    out = np.zeros(3 * n + len(derived), dtype=np.float32)
    for s, value in enumerate(prefix):
        out[3 * s:3 * s + 3] = (1.0, *space.knobs[s].features(value, space.step(prefix[:s]).values))
    decided = space.decided(prefix)
    for j, name in enumerate(derived):
        if name in decided:
            out[3 * n + j] = _log2(decided[name]) / LOG2_MAX_GPUS
    return out


def slot_features(info: StepInfo, capacity: float) -> np.ndarray:
    """SLOT_FEATURES for each action slot of the current knob (zeros where no choice sits)."""
    out = np.zeros((MAX_ACTIONS, len(SLOT_FEATURES)), dtype=np.float32)
    knob = next(k for k in decisions() if k.name == info.knob)
    best = info.time[info.allowed].min() if info.allowed.any() else 1.0
    for slot, value, ok, memory, time in zip(info.slots, info.values, info.allowed, info.memory, info.time):
        slower = math.log(time / best) if ok else math.inf  # 0 for the fastest lean completion
        rel_memory = math.log2(memory / capacity) if np.isfinite(memory) else 1.0
        out[slot] = (1.0, float(ok), *knob.features(value, info.values), np.clip(rel_memory, -4, 1) / 4,
                     min(slower / math.log(8), 1.0), min(slower / TIME_CLOSE, 1.0), float(slower == 0))
    return out.reshape(-1)


def observation(space: PlanSpace, prefix: tuple, workload_vector: np.ndarray) -> np.ndarray:
    step = np.zeros(len(space.knobs), dtype=np.float32)
    step[len(prefix)] = 1.0
    info = space.step(prefix)
    obs = np.concatenate([workload_vector, plan_features(space, prefix), step, slot_features(info, space.capacity)])
    return np.clip(obs, -BOUND, BOUND).astype(np.float32)


def space_signature() -> str:
    """A digest of everything a trained policy depends on in the space: the decisions in order,
    their fields, slot tables and dependencies, the mesh orders, the action count and the
    observation layout. A policy trained under another signature would read its actions differently."""
    spec = {"knobs": [[k.name, [[f.name, f.kind.__name__, f.values] for f in k.fields], k.slots, k.depends,
                       k.decision, k.slot is not None] for k in knobs()],
            "mesh": axes.mesh_orders(), "max_actions": MAX_ACTIONS, "features": [FEATURE_VERSION, observation_size()]}
    return hashlib.sha256(json.dumps(spec, default=repr).encode()).hexdigest()[:16]
