"""Data for a plan: each data-parallel rank reads its share of the global batch.

Ranks of one dp group (its tp and pp peers) read the same samples; the share is the one
`DistributedSampler` gives (sample i goes to dp rank i mod dp), so a loader over a dataset and
slicing a global batch agree.

`make_loader` keeps the dataset's order by default: step k trains on samples [k G, (k+1) G) of
the dataset (G the global batch), the global batches a single process slicing the dataset trains
on, so a plan's first-step loss can be checked against one process (`--check-parity` compares
the same global batches, `autopar/executor/parity.py`). ``shuffle=True`` draws a seeded
permutation per epoch instead (call ``loader.sampler.set_epoch(epoch)``); a single-process
comparison must then read the batches in that permutation.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from autopar.executor.mesh import Topology
from autopar.plan import Plan


def make_loader(dataset: Dataset, plan: Plan, topo: Topology, *, shuffle: bool = False, seed: int = 0,
                **loader_kwargs) -> DataLoader:
    """A loader yielding this rank's local batches (micro_batch_size x num_micro_batches samples),
    in the dataset's order unless ``shuffle`` (module doc); call `loader.sampler.set_epoch(epoch)`
    each epoch when shuffling."""
    sampler = DistributedSampler(dataset, num_replicas=plan.dp, rank=topo.rank("dp"), shuffle=shuffle,
                                 seed=seed, drop_last=True)
    return DataLoader(dataset, batch_size=plan.micro_batch_size * plan.num_micro_batches, sampler=sampler,
                      drop_last=True, **loader_kwargs)


def local_share(batch, plan: Plan, dp_rank: int):
    """This dp rank's samples of a global batch (a tensor or nested tuples/lists of tensors)."""
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] != plan.global_batch:
            raise ValueError(f"batch has {batch.shape[0]} samples but the plan's global batch is "
                             f"{plan.global_batch}")
        return batch[dp_rank::plan.dp]
    return type(batch)(local_share(item, plan, dp_rank) for item in batch)
