"""What each pass of a block sends over its tensor-parallel group, as the runtime runs it.

Inside a transformer layer the backward pass mirrors the forward: Megatron's regions (and
autopar's colwise / rowwise pairs) all-reduce the output of each row-wise GEMM in forward and
the input gradient of each region's column-wise GEMMs in backward, the same bytes. The ends
do not mirror:

* the embedding all-reduces its output in forward and sends nothing in backward (its input,
  token ids, has no gradient);
* a vocab-sharded head all-gathers its logits for the loss in forward (autopar's executor:
  `ColwiseParallel(output_layouts=Replicate())`; HF's `colwise_rep` lm_head) and all-reduces
  its input's gradient, the hidden states, in backward. Megatron's vocab-parallel cross-entropy
  (runtime megatron, or the `megatron_cross_entropy` switch) never gathers the logits: it
  all-reduces three fp32 values per token (the maximum, the target's logit, the sum of
  exponentials; `_VocabParallelCrossEntropy`) and, in backward, the hidden states' gradient. So
  does any head the file leaves sharded (column-wise, no gather): its loss must reduce per token.

Under sequence parallelism the same bytes move as an all-gather and a reduce-scatter, split
between the passes differently (the embedding's backward all-gathers, the head's forward gathers
its input); they are priced by their total, as all-reduces.

A file that writes q, k and v (or gate and up) as separate column-wise linears sends the same:
autopar's executor sums their input gradients before the region's collective
(executor/tensor_parallel.py `RegionInput`; tests/test_tp_collectives.py records both passes).
"""

from __future__ import annotations

import numpy as np

from autopar.cost import cross_entropy
from autopar.cost.collectives import all_gather_time, all_reduce_time

LOSS_ALL_REDUCES = 3  # the vocab-parallel loss's all-reduces in forward: max, target logit, sum of exp
LOSS_BYTES_PER_TOKEN = 4  # each of one fp32 value per token


def pass_bytes(k: dict[str, np.ndarray], workload) -> dict[str, np.ndarray]:
    """Per sample and block kind (K,): bytes all-reduced and all-gathered in forward, all-reduced in
    backward, and the loss's small all-reduces per call (bytes, head only)."""
    reduce_f, gather_f = k["tp_comm_bytes"].copy(), k["tp_gather_bytes"].copy()
    reduce_b = reduce_f + gather_f  # a layer's backward mirrors its forward
    reduce_b[0] = 0.0  # the embedding's input has no gradient
    head_split = k["tp_fwd_flops"][-1] > 0  # the head's GEMM is column-split: its input gradient is partial
    reduce_b[-1] = k["out_bytes"][-2] if head_split else 0.0  # the hidden states that enter the head
    loss = np.zeros_like(reduce_f)
    if head_split and reduce_f[-1] == 0 and (gather_f[-1] == 0 or cross_entropy.vocab_parallel(workload)):
        gather_f[-1] = 0.0  # the logits stay sharded over the vocabulary: the loss reduces per token
        loss[-1] = LOSS_BYTES_PER_TOKEN * workload.profile.seq_len
    return {"reduce_f": reduce_f, "gather_f": gather_f, "reduce_b": reduce_b, "loss": loss}


def pass_times(k: dict[str, np.ndarray], workload, b, act_scale, t, bw, lat, base, layer_fwd=1.0):
    """Seconds of tensor-parallel collectives per micro-batch and block kind (G, K), forward and
    backward: `b` samples per rank, activations scaled by `act_scale`, a ring of `t` ranks at
    `bw` / `lat` plus `base` per call, the layers' forward bytes by `layer_fwd` (G, 1) (fp8 gathers,
    cost/precision.py `tp_forward_scale`). A kind that sends nothing costs nothing."""
    sent = pass_bytes(k, workload)
    sent["reduce_f"] = sent["reduce_f"] * np.where(k["is_layer"] > 0, layer_fwd, 1.0)

    def timed(collective, nbytes, calls=1):
        return np.where((t > 1) & (nbytes > 0), calls * collective(nbytes, t, bw, lat, base), 0.0)

    fwd = (timed(all_reduce_time, b * act_scale * sent["reduce_f"])
           + timed(all_gather_time, b * act_scale * sent["gather_f"])
           + timed(all_reduce_time, b * sent["loss"], LOSS_ALL_REDUCES))
    return fwd, timed(all_reduce_time, b * act_scale * sent["reduce_b"])
