"""GPT as Megatron-LM trains it, for cost-modelling measured Megatron runs (vTrain's traces).

The zoo's GPT (`autopar/zoo/gpt.py`: learned positions, pre-LayerNorm, GeLU MLP, untied head),
with one difference in its tensor-parallel plan: the output projection is column-parallel and its
logits stay sharded over the vocabulary, because Megatron-LM computes the cross-entropy on the
sharded logits (its vocab-parallel cross-entropy all-reduces only a per-token maximum and sum).
The zoo's GPT instead all-gathers the logits before the loss, as autopar's executor does, which
costs b x s x vocab x 2 bytes per micro-batch that a Megatron run never sends.

This file describes a Megatron run to the profiler and the cost model. It is not meant for
`autopar run` with tp > 1: the plain loss function would see only a shard of the vocabulary.
"""

from autopar.zoo.gpt import BLOCK_TP_PLAN, SIZES, blocks, build_model, config, example_batch  # noqa: F401


def tp_plan(model):
    return {"tok_embeddings.tok": "vocab", **BLOCK_TP_PLAN, "output": "colwise"}
