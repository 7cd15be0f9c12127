"""Growth at a checkpoint boundary: a rendezvous handler that defers torchrun's restart on a new node.

torchrun's elastic agent restarts its workers as soon as its rendezvous reports a node waiting
to join (`SimpleElasticAgent._invoke_run`: HEALTHY and `num_nodes_waiting() > 0`), which kills
them mid-interval and throws away every step since the last checkpoint. autopar's launcher
registers the rendezvous backend `autopar-c10d`: torch's own c10d rendezvous (same store, same
protocol, same flags), whose `num_nodes_waiting` first asks the workers to stop at a boundary:

1. the agent sees a node waiting: it sets GROWTH in the rendezvous store and reports 0;
2. rank 0 reads GROWTH after each checkpoint (`growth_requested`, every rank learns it by a
   collective); the workers then set BOUNDARY and wait, idle, with their state saved;
3. the agent sees BOUNDARY and reports the waiting node: torchrun restarts the group as usual
   (a membership change, not a failure: no `--max-restarts` is spent) with the new world size.

The new group's rank 0 clears both keys (`clear_growth`). A node that leaves needs nothing of
this: the survivors' collectives fail, and torchrun restarts them from the last checkpoint.
"""

from __future__ import annotations

import os
from datetime import timedelta

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

BACKEND = "autopar-c10d"  # torchrun's --rdzv-backend for autopar's elastic runs
_PREFIX = "autopar/elastic"


def growth_key(run_id: str) -> str:
    return f"{_PREFIX}/{run_id}/growth"


def boundary_key(run_id: str) -> str:
    return f"{_PREFIX}/{run_id}/boundary"


class DeferredGrowth(RendezvousHandler):
    """torch's c10d rendezvous handler, reporting waiting nodes only once the workers wait at a
    checkpoint boundary (module docstring). Everything else is the wrapped handler's."""

    def __init__(self, inner: RendezvousHandler, store: Store):
        self._inner, self._store = inner, store

    def num_nodes_waiting(self) -> int:
        waiting = self._inner.num_nodes_waiting()
        if waiting == 0:
            return 0
        run_id = self._inner.get_run_id()
        self._store.set(growth_key(run_id), str(waiting))
        return waiting if self._store.check([boundary_key(run_id)]) else 0

    def next_rendezvous(self):
        return self._inner.next_rendezvous()

    def get_backend(self) -> str:
        return BACKEND  # torchrun checks that the handler it made is the backend it asked for

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self):
        return self._inner.set_closed()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def __getattr__(self, name):  # anything else torch's agent asks of its handler
        return getattr(self._inner, name)


def _create(params: RendezvousParameters) -> RendezvousHandler:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend  # torch: heavy
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler  # torch: heavy

    backend, store = create_backend(params)
    return DeferredGrowth(create_handler(store, backend, params), store)


def register() -> None:
    """Make `--rdzv-backend autopar-c10d` known to torchrun in this process (idempotent).

    Also opts out of torch's sharing of one TCP store between the rendezvous and the workers
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE, torch's own switch): with sharing, the store's address
    is published once, at a node's first rendezvous, so a node that joins a running job waits
    for an address its peers never publish again and times out (torch 2.13,
    `DynamicRendezvousHandler.next_rendezvous`). Without it, rank 0 publishes it every round."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        rendezvous_handler_registry.register(BACKEND, _create)
    except ValueError:  # registered already, by an earlier launch in this process
        pass


class WorkerSide:
    """The workers' end of the protocol, on the rendezvous store (`connect`: a client of it)."""

    def __init__(self, store: Store, run_id: str):
        self.store, self.run_id = store, run_id

    @classmethod
    def connect(cls, endpoint: str, timeout_s: float = 60.0) -> WorkerSide:
        host, _, port = endpoint.rpartition(":")
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        return cls(store, os.environ.get("TORCHELASTIC_RUN_ID", "none"))

    def growth_requested(self) -> bool:
        return self.store.check([growth_key(self.run_id)])

    def at_boundary(self, step: int) -> None:
        self.store.set(boundary_key(self.run_id), str(step))

    def clear_growth(self) -> None:
        for key in (growth_key(self.run_id), boundary_key(self.run_id)):
            self.store.delete_key(key)
