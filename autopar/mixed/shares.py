"""The batch shares of data-parallel lanes on a grid, solved exactly (issue 42, the mixed search).

Each used group runs one lane on all its GPUs; a lane's step time at share s is its group's best
homogeneous plan at s, so the mixed step is the slowest lane's time plus the cross-lane gradient
all-reduce, which depends only on which groups take part. Shares are multiples of a quantum q
(`quantum`: the smallest divisor of the batch leaving at most `parts` units), and for a set of used
groups the shares minimising the slowest lane are a min-max knapsack over units, solved by a dynamic
programme over groups (`best_shares`, O(groups x units^2)); `brute_force_shares` is its check.
"""

from __future__ import annotations

import itertools
import math

GRID = 8  # at most this many units of the global batch per group (shares: multiples of `quantum`, batch / 8 for
# a batch of 256; a batch with no divisor leaving 2..8 units, e.g. a prime, has one unit: no data-parallel lanes)


def quantum(batch: int, parts: int = GRID) -> int:
    """The smallest divisor of `batch` that leaves at most `parts` units (the share grid's step)."""
    return next(d for d in range(1, batch + 1) if batch % d == 0 and batch // d <= parts)


def best_shares(times: list[list[float]], units: int) -> tuple[float, tuple[int, ...]]:
    """The units per group (each >= 1, summing to `units`) minimising the largest `times[g][k]`, and that
    largest time; (inf, ()) when none is finite. `times[g][k]` is group g's lane time at k units (index 0
    unused; inf where the group has no plan or was not priced). Ties keep the earliest-found split."""
    n = len(times)
    if n == 0 or units < n:
        return math.inf, ()
    # best[s]: the least slowest-lane time of the groups so far holding s units; pick[i][s]: group i's units
    best = [math.inf] * (units + 1)
    for k in range(1, units + 1):
        best[k] = times[0][k]
    picks = [[k for k in range(units + 1)]]
    for g in range(1, n):
        new, pick = [math.inf] * (units + 1), [0] * (units + 1)
        for s in range(g + 1, units + 1):
            for k in range(1, s - g + 1):
                t = max(best[s - k], times[g][k])
                if t < new[s]:
                    new[s], pick[s] = t, k
        best = new
        picks.append(pick)
    if not math.isfinite(best[units]):
        return math.inf, ()
    split, s = [], units
    for g in range(n - 1, 0, -1):
        split.append(picks[g][s])
        s -= picks[g][s]
    split.append(s)
    return best[units], tuple(reversed(split))


def brute_force_shares(times: list[list[float]], units: int) -> float:
    """`best_shares`'s optimum by trying every split (tests only: exponential)."""
    n = len(times)
    out = math.inf
    for split in itertools.product(range(1, units + 1), repeat=n):
        if sum(split) == units:
            out = min(out, max(times[g][k] for g, k in enumerate(split)))
    return out
