"""The matplotlib figure of a plan: its iteration timeline per pipeline rank and its memory per GPU
(`plan_figure`). Uses the Agg backend: no display needed."""

from __future__ import annotations

import colorsys

from autopar.atomic import atomic_path
from autopar.cost import Coefficients
from autopar.cost.model import memory_parts, time_parts
from autopar.errors import AutoparError
from autopar.knobs import knobs
from autopar.plots.schedule import BACKWARD, IDLE, from_estimate

# the first colours of every part list (seaborn's "deep"); parts beyond them get hues spread by the golden ratio
BASE_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C", "#CCB974",
               "#64B5CD")
IDLE_COLOR = "#E5E5E5"
WORDS = {"dp_comm": "dp comm (exposed)", IDLE: "pp bubble (idle)", "overhead": "overhead (host, step)"}


def palette(n: int) -> list[str]:
    """n distinct colours: BASE_COLORS, then golden-ratio hues, so a part declared later gets its own."""
    extra = [colorsys.hsv_to_rgb((0.12 + 0.618034 * i) % 1.0, 0.55, 0.85) for i in range(max(n - len(BASE_COLORS), 0))]
    return [*BASE_COLORS, *("#%02x%02x%02x" % tuple(round(255 * c) for c in rgb) for rgb in extra)][:n]


def colors(parts) -> dict[str, str]:
    """A colour per part, by its place in its registry list (time_parts() or memory_parts()), so a part
    keeps its colour from plot to plot; the bubble is idle grey."""
    parts = list(parts)
    return {p: IDLE_COLOR if p == IDLE else c for p, c in zip(parts, palette(len(parts)))}


def shade(color: str, factor: float = 0.7) -> str:
    """A darker tone of `color` (a part's backward pass)."""
    rgb = [int(color[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c * factor):02x}" for c in rgb)


def label(part: str) -> str:
    """A part in words: the table's name, with the axis's or knob's label for its own terms (`cp`,
    `cp_memory`: context parallel)."""
    words = WORDS.get(part, part.replace("_", " "))
    for k in knobs():
        if part == k.name and k.time_term is not None or part == f"{k.name}_memory" and k.memory_term is not None:
            return f"{words} ({k.label})"
    return words


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


def plan_figure(workload, plan, est, path, headroom_bytes: float = 0.0, coeffs: Coefficients | None = None) -> None:
    """Timeline per pipeline rank (left) and memory of the most loaded GPU by component (right);
    `coeffs`: those the estimate ran with (default: the cluster's, as `estimate` takes them)."""
    save(figure(workload, plan, est, headroom_bytes, coeffs), path)


def figure(workload, plan, est, headroom_bytes: float = 0.0, coeffs: Coefficients | None = None):
    """The matplotlib figure of `plan_figure`: every part of the estimate's time breakdown in the
    timeline and every part of its memory in the bar, each with its own colour and legend entry."""
    plt = pyplot()
    c = coeffs or Coefficients.for_cluster(workload.cluster, workload.runtime)  # as the estimate ran
    segments = from_estimate(plan, est, forward_share(workload.profile), c.step_overhead_s)
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(14, max(3.4, 1.8 + 0.45 * plan.pp)), width_ratios=(3.2, 1),
                                  layout="constrained")
    _timeline(plt, ax, plan, est, segments)
    _memory(mem, est, headroom_bytes)
    return fig


def _timeline(plt, ax, plan, est, segments) -> None:
    tint = colors(dict.fromkeys([*time_parts(), *est.breakdown]))
    end = max(s.start + s.duration for s in segments)
    ms = 1e3
    for r in range(plan.pp):
        ax.broken_barh([(0, end * ms)], (r - 0.4, 0.8), facecolors=tint[IDLE])
    drawn: dict[str, str] = {}  # legend label -> colour, in drawing order
    for part in est.breakdown:
        for backward in (False, True):
            mine = [s for s in segments if s.kind == part and (s.phase == BACKWARD) == backward]
            if not mine:
                continue
            color = shade(tint[part]) if backward and part == "compute" else tint[part]
            for r in range(plan.pp):
                bars = [(s.start * ms, s.duration * ms) for s in mine if s.rank == r]
                ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.3)
            phase = (", backward" if backward else ", forward") if part == "compute" else ""
            drawn[label(part) + phase] = color
    if est.breakdown.get(IDLE, 0) > 0:
        drawn[label(IDLE)] = tint[IDLE]
    ax.set_yticks(range(plan.pp), [f"rank {r}" for r in range(plan.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("ms (every rank at the slowest rank's pace, as the cost model's pipeline is)")
    ax.set_xlim(0, end * ms)
    ax.set_title(f"{plan.describe()}: iteration {est.iteration_time_s * ms:,.1f} ms, pipeline bubble "
                 f"{est.breakdown[IDLE] * ms:,.1f} ms (cost model)", loc="left", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color) for color in drawn.values()]
    rows = -(-len(drawn) // 7)
    ax.legend(handles, list(drawn), ncols=-(-len(drawn) // rows), loc="upper center",
              bbox_to_anchor=(0.5, -0.25 - 0.1 * rows / plan.pp), fontsize=8, frameon=False)


def _memory(mem, est, headroom_bytes: float) -> None:
    tint = colors(dict.fromkeys([*memory_parts(), *est.memory]))
    gb = 1e9
    bottom = 0.0
    for name, value in est.memory.items():
        if value > 0:
            mem.bar(0, value / gb, bottom=bottom, color=tint[name], label=label(name), width=0.6)
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


def save(fig, path) -> None:
    """Through the atomic writer: an interrupted run never leaves half a PNG."""

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    fig.clear()
    import matplotlib.pyplot as plt  # matplotlib: heavy, imported on first use

    plt.close(fig)
