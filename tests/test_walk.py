"""The walker's two steps build the same walks: a few partial plans stepped in Python lists (`_grow_few`,
what the RL planner's small walks take), many grouped with numpy (the exhaustive enumeration); and the
choices a walk keeps for later walks (`memo`) are the knob's own, not what that walk narrowed them to."""

from __future__ import annotations

from unittest import mock

import numpy as np
from conftest import workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.knobs import knobs
from autopar.search import space as walker

WORKLOADS = [("gpt", "dgx-a100-80g", 2, 64), ("llama", "dgx-h100", 1, 32), ("gpt", "l40s-pcie", 3, 48)]


def _walks(w, pick) -> list[walker.Walk]:
    out = []
    for few in (0, walker.FEW, 10**9):  # grouped only, as shipped, lists only
        with mock.patch.object(walker, "FEW", few):
            out.append(walker.walk(w, pick))
    memo: dict = {}  # and with choices kept from a walk narrowed otherwise (what the RL planner's space keeps)
    walker.walk(w, {k: (lambda opts: opts[:1]) for k in pick}, memo)
    return out + [walker.walk(w, pick, memo)]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(WORKLOADS), narrowed=st.sets(st.sampled_from([k.name for k in knobs()]), max_size=6),
       stride=st.integers(2, 3))
def test_few_and_grouped_steps_build_the_same_walk(case, narrowed, stride):
    """Every knob narrowed or not, the three ways give the same values, codes and size: the small step numbers
    its choices as the grouped one does (in the order of the dependencies' codes); and choices memoised by an
    earlier walk, narrowed otherwise, narrow this one as asked."""
    family, cluster, nodes, batch = case
    w = workload(family, size="tiny", cluster=cluster, nodes=nodes, global_batch=batch)
    pick = {name: (lambda opts: opts[::stride]) for name in narrowed}
    grouped, shipped, lists, memoised = _walks(w, pick)
    assert grouped.size > 1
    for other in (shipped, lists, memoised):
        assert other.size == grouped.size and other.values == grouped.values
        assert other.codes.keys() == grouped.codes.keys()
        assert all(np.array_equal(other.codes[k], grouped.codes[k]) for k in grouped.codes)
