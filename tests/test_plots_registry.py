"""The plot draws the cost model's registries, not a hand list: every part of an estimate's time
breakdown (`autopar.cost.model.time_parts`: the core's, and the terms of declared axes and knobs
such as cp's K/V exchange) is a timeline segment with its own legend entry and the breakdown's
seconds, and every memory part (`memory_parts`: expert weights and optimizer state, dispatch
buffers, cp's buffers) a bar with its own legend entry. Plans with ep and with cp make those
parts non-zero; calibrated-style coefficients make the host overhead non-zero."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import workload

from autopar.cost import Coefficients, estimate
from autopar.cost.model import memory_parts, time_parts
from autopar.plan import Plan
from autopar.plots.figures import colors, label, palette
from autopar.plots.schedule import IDLE, from_estimate

pytest.importorskip("matplotlib")
# matplotlib builds its font cache on first use, running fc-list: at collection, not inside a test (tests not marked
# slow may start no process, tests/conftest.py)
pytest.importorskip("matplotlib.font_manager")

EP_PLAN = Plan(dp=2, tp=2, pp=2, ep=2, micro_batch_size=1, num_micro_batches=8, recompute="full", recompute_blocks=1)
CP_PLAN = Plan(dp=2, tp=1, pp=2, cp=2, micro_batch_size=1, num_micro_batches=8, recompute="full", recompute_blocks=1)


@pytest.fixture(scope="module")
def drawn():
    """(workload, plan, coefficients, estimate) of an ep plan of the zoo's MoE and a cp plan of its GPT, 8 CPU ranks,
    with a per-step and per-layer host overhead."""
    out = []
    for model, plan in (("moe", EP_PLAN), ("gpt", CP_PLAN)):
        w = workload(model, cluster="cpu", gpus_per_node=8, global_batch=16, size="tiny")
        c = replace(Coefficients.for_cluster(w.cluster, w.runtime), step_overhead_s=2e-3, block_host_s=2e-3)
        out.append((w, plan, c, estimate(w, plan, c)))
    return out


def test_the_plans_make_every_part_non_zero(drawn):
    """The two plans together exercise every registered part (else the tests below would prove little)."""
    assert {p for *_, est in drawn for p, v in est.breakdown.items() if v > 0} == set(time_parts())
    assert {p for *_, est in drawn for p, v in est.memory.items() if v > 0} == set(memory_parts())
    assert {"cp", "ep_comm"} <= set(time_parts())
    assert {"expert_weights", "expert_optimizer", "dispatch_buffers", "cp_memory"} <= set(memory_parts())


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_every_time_and_memory_part_is_in_the_legends(drawn):
    from matplotlib import pyplot as plt

    from autopar.plots.figures import figure

    for w, plan, c, est in drawn:
        fig = figure(w, plan, est, coeffs=c)
        timeline, memory = fig.axes
        time_labels, memory_labels = _legend(timeline), _legend(memory)
        for part, seconds in est.breakdown.items():
            named = [t for t in time_labels if t.startswith(label(part))]
            assert bool(named) == (seconds > 0), (part, time_labels)
        for part, nbytes in est.memory.items():
            assert (label(part) in memory_labels) == (nbytes > 0), (part, memory_labels)
        assert len(set(memory_labels)) == len(memory_labels)  # one entry, one colour per part
        plt.close(fig)


def test_the_timeline_holds_each_parts_seconds(drawn):
    """Every rank runs at the slowest rank's pace: on each rank, the segments of each part add up to
    the breakdown's seconds, and each rank idles at least the bubble."""
    from autopar.plots.figures import forward_share

    for w, plan, c, est in drawn:
        segments = from_estimate(plan, est, forward_share(w.profile), c.step_overhead_s)
        end = max(s.start + s.duration for s in segments)
        for r in range(plan.pp):
            mine = [s for s in segments if s.rank == r]
            for part, seconds in est.breakdown.items():
                if part != IDLE:
                    assert sum(s.duration for s in mine if s.kind == part) == pytest.approx(seconds, rel=1e-9), part
            # the stages differ (the ends hold the embedding and head), so the simulated bubble, paced by the
            # slowest rank, is at least the cost model's
            assert end - sum(s.duration for s in mine) >= est.breakdown[IDLE] * (1 - 1e-9) > 0
        assert end >= est.iteration_time_s * (1 - 1e-9)


def test_a_part_declared_later_gets_a_colour_of_its_own():
    names = [f"part{i}" for i in range(40)]
    assert len(set(palette(40))) == 40 and len(colors(names)) == 40
    assert colors(["a", "b"])["a"] == colors(["a", "b", "c"])["a"]  # a part keeps its colour as the list grows


def test_labels_name_an_axis_own_term_and_leave_core_parts_plain():
    assert label("cp") == "cp (context parallel)" and label("cp_memory") == "cp memory (context parallel)"
    assert label("recompute") == "recompute" and label("ep_comm") == "ep comm"  # a core part, though a knob's name
