"""The mixture-of-experts figures of a block (`BlockProfile.experts` ... `dispatch_bytes`).

A MoE layer is any module with ``moe_shape()`` returning experts, top_k, hidden, expert_ffn,
shared_ffn and capacity_factor (the zoo's `autopar.zoo.moe.MoE`; `autopar.hf` gives transformers'
MoE blocks the same method). The FLOPs of the router and the routed experts are the matmuls those
shapes imply; they are part of the block's measured ``fwd_flops`` (the meta-device run routes
force-balanced), and `tests/test_moe_profile.py` checks the two agree.
"""

from __future__ import annotations

SWIGLU_MATMULS = 3  # w1, w3 (hidden -> ffn) and w2 (ffn -> hidden)


def moe_layers(modules) -> list:
    """The MoE layers among `modules`."""
    return [m for m in modules if callable(getattr(m, "moe_shape", None))]


def moe_fields(modules, seq_len: int, dtype_bytes: int) -> dict:
    """BlockProfile's MoE fields for a block made of `modules` ({} for a dense block)."""
    layers = moe_layers(modules)
    if not layers:
        return {}
    out = {"experts": 0, "top_k": 0, "expert_params": 0, "shared_params": 0, "expert_ffn": 0,
           "router_flops": 0.0, "expert_flops": 0.0, "dispatch_bytes": 0.0}
    for layer in layers:
        s = layer.moe_shape()
        routed = seq_len * s["top_k"]  # token copies sent to experts per sample (dropless)
        out["experts"] = max(out["experts"], s["experts"])
        out["top_k"] = max(out["top_k"], s["top_k"])
        out["expert_ffn"] = max(out["expert_ffn"], s["expert_ffn"])
        out["expert_params"] += sum(p.numel() for p in layer.experts.parameters())
        out["shared_params"] += SWIGLU_MATMULS * s["hidden"] * s["shared_ffn"]
        out["router_flops"] += 2.0 * seq_len * s["hidden"] * s["experts"]
        out["expert_flops"] += 2.0 * routed * SWIGLU_MATMULS * s["hidden"] * s["expert_ffn"]
        out["dispatch_bytes"] += float(routed * s["hidden"] * dtype_bytes)
    return out


def routing_settings(modules) -> dict:
    """The model's capacity factor, node limit and gate (ModelProfile fields), from its first MoE layer."""
    layers = moe_layers(modules)
    if not layers:
        return {}
    s = layers[0].moe_shape()
    return {"capacity_factor": float(s.get("capacity_factor", 0.0)), "node_limit": int(s.get("node_limit", 0)),
            "gate": str(s.get("gate", "learned"))}
