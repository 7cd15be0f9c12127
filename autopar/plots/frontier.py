"""The time/cost picture of `autopar search --inventory`: every choice of nodes as a point (hours and dollars
for the tokens to train, or per million tokens without them), the frontier joined, the choice starred and
the deadline drawn. matplotlib through `figures.pyplot` (imported on first use)."""

from __future__ import annotations

from autopar.plots.figures import BASE_COLORS, pyplot, save


def frontier_figure(options, front, chosen, goal, path) -> None:
    """Write the picture to `path` (PNG, atomically). `options`: every planned choice (inventory.Option);
    `front`: the frontier among those meeting the goal; `chosen`: the answer; `goal`: inventory.Goal."""
    plt = pyplot()
    tokens = goal.train_tokens

    def point(o):
        if tokens:
            return o.hours(tokens), o.dollars(tokens)
        return 1e6 / o.tokens_per_s / 3600, o.dollars_per_mtoken

    fig, ax = plt.subplots(figsize=(8, 5.5), layout="constrained")
    met = [o for o in options if goal.meets(o)]
    missed = [o for o in options if not goal.meets(o)]
    if missed:
        ax.scatter(*zip(*map(point, missed)), s=22, facecolors="none", edgecolors="#8C8C8C",
                   label="misses the budget or deadline")
    if met:
        ax.scatter(*zip(*map(point, met)), s=22, color="#8C8C8C", label="meets it")
    xs, ys = zip(*map(point, front))
    ax.plot(xs, ys, "-o", color=BASE_COLORS[0], markersize=6, label="frontier")
    for o, x, y in zip(front, xs, ys):
        ax.annotate(o.label, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=7)
    cx, cy = point(chosen)
    ax.scatter([cx], [cy], marker="*", s=260, color=BASE_COLORS[3], zorder=5, label=f"chosen: {chosen.label}")
    if goal.deadline_hours is not None:
        ax.axvline(goal.deadline_hours, color="black", linestyle="--", linewidth=1,
                   label=f"deadline {goal.deadline_hours:g} h")
    ax.set_xscale("log")  # choices span orders of magnitude in time, less in cost
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.4g}"))
    if tokens:
        ax.set_xlabel(f"hours to train {tokens:,.4g} tokens")
        ax.set_ylabel("dollars")
    else:
        ax.set_xlabel("hours per million tokens")
        ax.set_ylabel("dollars per million tokens")
    budget = "" if goal.budget_per_hour is None else f", budget ${goal.budget_per_hour:,.2f}/hour"
    ax.set_title(f"choices of nodes: time against cost (objective {goal.objective}{budget})", loc="left",
                 fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    save(fig, path)
