"""The matplotlib figure of a plan: its iteration timeline per pipeline rank and its memory per GPU
(`plan_figure`). Uses the Agg backend: no display needed."""

from __future__ import annotations

from autopar.atomic import atomic_path
from autopar.cost import Coefficients
from autopar.errors import AutoparError
from autopar.plots.schedule import KINDS, from_estimate

COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "recompute": "#C44E52", "comm": "#8172B3",
          "dp_comm": "#937860", "optimizer": "#55A868", "bubble": "#E5E5E5"}
MEMORY_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3")


def pyplot():
    """matplotlib's pyplot on the Agg backend, or one clear line saying how to install it."""
    try:
        import matplotlib  # matplotlib: heavy, imported on first use
    except ImportError:
        raise AutoparError("plots need matplotlib: pip install 'autopar[plots]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: heavy, imported on first use

    return plt


def forward_share(profile) -> float:
    fwd = sum(b.fwd_flops * getattr(b, "count", 1) for b in profile.blocks)
    bwd = sum(b.bwd_flops * getattr(b, "count", 1) for b in profile.blocks)
    return fwd / (fwd + bwd) if fwd + bwd > 0 else 1 / 3


def plan_figure(workload, plan, est, path, headroom_bytes: float = 0.0) -> None:
    """Timeline per pipeline rank (left) and memory of the most loaded GPU by component (right)."""
    plt = pyplot()

    step = Coefficients.for_cluster(workload.cluster, workload.runtime).step_overhead_s  # as the estimate ran
    segments = from_estimate(plan, est, forward_share(workload.profile), step)
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(14, max(3.4, 1.8 + 0.45 * plan.pp)), width_ratios=(3.2, 1),
                                  layout="constrained")
    end = max(s.start + s.duration for s in segments)
    ms = 1e3
    for r in range(plan.pp):
        ax.broken_barh([(0, end * ms)], (r - 0.4, 0.8), facecolors=COLORS["bubble"])
    for kind in KINDS:
        for r in range(plan.pp):
            mine = [(s.start * ms, s.duration * ms) for s in segments if s.kind == kind and s.rank == r]
            if mine:
                ax.broken_barh(mine, (r - 0.4, 0.8), facecolors=COLORS[kind], edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(plan.pp), [f"rank {r}" for r in range(plan.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("ms (every rank at the slowest rank's pace, as the cost model's pipeline is)")
    ax.set_xlim(0, end * ms)
    ax.set_title(f"{plan.describe()}: iteration {est.iteration_time_s * ms:,.1f} ms, pipeline bubble "
                 f"{est.breakdown['pp_bubble'] * ms:,.1f} ms (cost model)", loc="left", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in (*KINDS, "bubble")]
    labels = ["forward", "backward", "recompute", "tp / pp comm", "dp comm (exposed)", "optimizer + step",
              "bubble (idle)"]
    ax.legend(handles, labels, ncols=7, loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.1 / plan.pp),
              fontsize=8, frameon=False)

    gb = 1e9
    bottom = 0.0
    for (name, value), color in zip(est.memory.items(), MEMORY_COLORS):
        if value > 0:
            mem.bar(0, value / gb, bottom=bottom, color=color, label=name.replace("_", " "), width=0.6)
            bottom += value / gb
    capacity = est.gpu_memory_bytes / gb
    mem.axhline(capacity, color="black", linewidth=1)
    mem.text(0.35, capacity, f" GPU {capacity:.0f} GB", va="bottom", fontsize=8)
    if headroom_bytes:
        usable = capacity - headroom_bytes / gb
        mem.axhline(usable, color="black", linestyle="--", linewidth=1)
        mem.text(0.35, usable, f" usable {usable:.0f} GB", va="top", fontsize=8)
    mem.set_xlim(-0.5, 1.2)
    mem.set_ylim(0, capacity * 1.08)
    mem.set_xticks([])
    mem.set_ylabel("GB per GPU")
    mem.set_title(f"memory {est.peak_memory_bytes / gb:.1f} GB", loc="left", fontsize=10)
    mem.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    save(fig, path)


def save(fig, path) -> None:
    """Through the atomic writer: an interrupted run never leaves half a PNG."""

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    fig.clear()
    import matplotlib.pyplot as plt  # matplotlib: heavy, imported on first use

    plt.close(fig)
