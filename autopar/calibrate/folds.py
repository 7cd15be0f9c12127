"""Train/test splits that keep every group of related rows on one side.

Rows of one model shape share most of their error (the same GEMMs, the same kernels), so a split
that puts some runs of a shape in the fit and others in the test measures interpolation, not
prediction for a model the fit never saw. These splits deal whole groups (e.g. (hidden, layers))
to folds, deterministically for a seed.
"""

from __future__ import annotations

import numpy as np

from autopar.errors import AutoparError


def _shuffled_keys(keys, seed: int) -> list:
    unique = sorted(set(keys), key=repr)
    order = np.random.default_rng(seed).permutation(len(unique))
    return [unique[i] for i in order]


def group_kfold(keys, k: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(train rows, test rows) for k folds; each group of equal keys lands in exactly one test
    fold. Groups are shuffled with `seed`, then each goes to the fold with the fewest rows so far
    (ties to the lowest fold), so folds are balanced in rows and no fold is empty."""
    keys = list(keys)
    unique = _shuffled_keys(keys, seed)
    if k < 2:
        raise AutoparError(f"--folds must be at least 2, got {k}")
    if len(unique) < k:
        raise AutoparError(f"cannot make {k} folds from {len(unique)} group(s) of runs "
                           f"(folds split by model, so a model is never in both fit and test); "
                           f"use --folds {max(2, len(unique))} or fewer" if len(unique) >= 2 else
                           f"cross-validation needs runs of at least 2 different models, found {len(unique)}")
    size = {u: keys.count(u) for u in unique}
    fold_of, load = {}, [0] * k
    for u in sorted(unique, key=lambda u: -size[u]):  # stable: shuffled order breaks equal sizes
        f = int(np.argmin(load))
        fold_of[u] = f
        load[f] += size[u]
    assignment = np.array([fold_of[key] for key in keys])
    return [(np.flatnonzero(assignment != f), np.flatnonzero(assignment == f)) for f in range(k)]


def group_holdout(keys, fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows) with whole groups held out until at least `fraction` of the rows
    are in the test set (at least one group, never all of them)."""
    if not 0 < fraction < 1:
        raise AutoparError(f"--holdout must be a fraction between 0 and 1, got {fraction}")
    keys = list(keys)
    unique = _shuffled_keys(keys, seed)
    if len(unique) < 2:
        raise AutoparError(f"a held-out test needs runs of at least 2 different models, found {len(unique)}")
    test, rows = set(), 0
    for u in unique[:-1]:
        if rows >= fraction * len(keys):
            break
        test.add(u)
        rows += keys.count(u)
    held = np.array([key in test for key in keys])
    return np.flatnonzero(~held), np.flatnonzero(held)
