"""GPT as Megatron-LM trains it, for cost-modelling measured Megatron runs (vTrain's traces).

The zoo's GPT (`autopar/zoo/gpt.py`: learned positions, pre-LayerNorm, GeLU MLP), with two
differences:
- the output projection's weight is the word embedding's (tied), as Megatron-DeepSpeed's GPT ties
  them (`GPTModelPipe`: `TiedLayerSpec('embed', ..., tied_weight_attr='word_embeddings_weight')`
  for the embedding and the head; Megatron-LM's `GPTModel` likewise unless
  `--untie-embeddings-and-output-weights`): one weight to reduce and update without pipeline
  parallelism, a copy on the last stage whose gradient is all-reduced with the first stage's with it;
- its tensor-parallel plan keeps the logits sharded over the vocabulary (the head column-parallel),
  because Megatron-LM computes the cross-entropy on the sharded logits (its vocab-parallel
  cross-entropy all-reduces only a per-token maximum and sum). The zoo's GPT instead all-gathers
  the logits before the loss, as autopar's executor does, which costs b x s x vocab x 2 bytes per
  micro-batch that a Megatron run never sends.

This file describes a Megatron run to the profiler and the cost model. It is not meant for
`autopar run` with tp > 1: the plain loss function would see only a shard of the vocabulary.
"""

from autopar.zoo import gpt
from autopar.zoo.gpt import BLOCK_TP_PLAN, DEFAULT_SIZE, SIZES, blocks, config, example_batch  # noqa: F401


def build_model(size: str = DEFAULT_SIZE, **overrides) -> gpt.GPT:
    model = gpt.build_model(size, **overrides)
    model.output.weight = model.tok_embeddings.tok.weight  # tied, as Megatron's GPT
    return model


def tp_plan(model):
    return {"tok_embeddings.tok": "vocab", **BLOCK_TP_PLAN, "output": "colwise"}
