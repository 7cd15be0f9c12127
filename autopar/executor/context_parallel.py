"""Context parallelism: every sequence split over the cp ranks, attention across them.

Causal load balancing cuts each sequence into 2 x cp chunks and gives cp rank i chunks i and
2cp-1-i (torch's `_HeadTailLoadBalancer`, Megatron's layout), so every rank has the same share of
the causal attention's work. Inputs and targets are cut so (`shard_sequence`); the model reads its
tokens' global positions and runs attention through autopar.zoo's helpers (`token_positions`,
`causal_sdpa`, `context_keys`), which read the `SequenceShard` set around each train step:

- on CUDA (NCCL), torch's `context_parallel` over the mesh's cp dimension replaces
  scaled_dot_product_attention with its ring attention (K/V all-gathered or rotated: torch's
  `_cp_options.rotate_method`, all-gather by default); the shard supplies the positions, which torch
  cuts from an arange the same way. Unverified: no GPU was lent while this was written;
- elsewhere (gloo), where torch 2.13 has no CPU sharding rule for SDPA, each rank all-gathers the
  K and V of every cp rank (an autograd function whose backward hands each rank the gradients of its
  own K and V) and masks the scores by global position: the same maths.

The loss of a rank is the mean over its tokens; the cp ranks reduce gradients with the dp ranks
(the weights are replicated over cp) and the global loss averages over both, as torchtitan does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from autopar.executor.mesh import Topology
from autopar.zoo import SequenceShard, sequence_shard


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of cp rank `rank`'s tokens: chunks rank and 2cp-1-rank of 2cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    size = seq_len // (2 * cp)
    first, second = rank * size, (2 * cp - 1 - rank) * size
    return torch.cat((torch.arange(first, first + size), torch.arange(second, second + size)))


def shard_sequence(batch, cp: int, rank: int):
    """This cp rank's tokens of a batch: every tensor with a sequence dimension (dim 1) cut to
    `chunk_positions` (tuples and lists of tensors alike)."""
    if isinstance(batch, torch.Tensor):
        if cp == 1 or batch.dim() < 2:
            return batch
        return batch.index_select(1, chunk_positions(batch.shape[1], cp, rank).to(batch.device))
    return type(batch)(shard_sequence(item, cp, rank) for item in batch)


class _GatherTokens(torch.autograd.Function):
    """All-gather along the token dimension (2) of (batch, heads, tokens, dim); backward sums every
    rank's gradient of the whole and keeps this rank's part. torch.distributed.nn.functional's
    all_gather does the same with a reduce-scatter, but its gloo fallback scatters from global
    ranks and fails in a sub-group (torch 2.13): an all-reduce works in any group, on any backend."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), t.shape[2]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(2, ctx.rank * ctx.size, ctx.size), None


def _gatherer(group: dist.ProcessGroup):
    return lambda t: _GatherTokens.apply(t, group)


@contextlib.contextmanager
def context_parallel_step(topo: Topology, cp: int, local_seq_len: int):
    """Around one train step (forward and backward): this rank's SequenceShard, and on CUDA torch's
    `context_parallel` over the cp dimension of the mesh."""
    if cp == 1:
        yield
        return
    rank, group = topo.rank("cp"), topo.group("cp")
    seq_len = local_seq_len * cp
    keys = torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)]).to(topo.device)
    if topo.device.type != "cuda":
        shard = SequenceShard(chunk_positions(seq_len, cp, rank).to(topo.device), keys, _gatherer(group))
        with sequence_shard(shard):
            yield
        return
    from torch.distributed.tensor.experimental import context_parallel  # CUDA only: torch's ring attention

    positions = torch.arange(seq_len, device=topo.device)
    ring = context_parallel(topo.mesh["cp"], buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions})
    # inside, torch has cut `positions` in place to this rank's (its head-tail layout, the one `shard_sequence` cuts)
    with ring, sequence_shard(SequenceShard(positions, keys, _gatherer(group), ring=True)):
        yield
