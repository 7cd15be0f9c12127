"""The calibration procedure behind `autopar calibrate`: read traces, optionally fit collectives
from all-reduce tables, estimate held-out error by group-wise cross-validation or a hold-out
split, fit on every row, and score other trace files the fit never saw.

Protocol (what the reported figures mean):
  1. Collectives: with all-reduce tables, the link efficiency of their link kind, latency_scale
     and collective_latency_s are fitted to them and then held fixed.
  2. Held-out error: rows are grouped by model (name and dims); with --folds K each group is in
     exactly one test fold and the coefficients are refitted on the other folds; with --holdout F
     whole groups holding at least a fraction F of the rows are held out. Traces of one model
     only are split by run (each run is a different plan) instead. The figures (MAPE, max
     error, Spearman, worst rows, best-pick ratios) are computed on test rows only.
  3. The coefficients written to the cluster JSON are fitted on all rows.
  4. --evaluate files are predicted with those coefficients; nothing in them is fitted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import numpy as np

from autopar.calibrate import metrics
from autopar.calibrate.collectives import fit_allreduce, read_allreduce_table
from autopar.calibrate.dataset import Dataset, build_dataset, check_sources, load_traces
from autopar.calibrate.fit import FitResult, default_parameters, fit_all, needed_rows, onto, with_values
from autopar.calibrate.folds import group_holdout, group_kfold
from autopar.cluster import Cluster, load_cluster
from autopar.cost.coefficients import HOST_COEFFICIENTS, Coefficients
from autopar.errors import AutoparError

COLLECTIVE_PARAMS = ("latency_scale", "collective_latency_s")


@dataclass
class CalibrationResult:
    fit: FitResult
    cluster: object  # the calibrated Cluster
    start: object  # Coefficients the fit started from
    validation: dict  # how the held-out figures were obtained, and the figures
    evaluations: dict = field(default_factory=dict)  # path -> figures
    collectives: object = None  # CollectiveFit, when all-reduce tables were given
    problems: list = field(default_factory=list)  # malformed trace lines (file:line: message)
    skipped: list = field(default_factory=list)  # records not used (outcome not ok)
    # per row, for plots: (Dataset, predicted seconds) of the held-out (or fitted) rows and of
    # each --evaluate file
    rows: tuple = ()
    evaluated_rows: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)  # records priced from an older profiler's stored profile


def _row(ds: Dataset, i: int, predicted: float) -> dict:
    lab = ds.labels[i]
    return {"source": lab["source"], "model": lab["model"], "gpus": lab["gpus"], "plan": lab["plan"],
            "measured_s": float(ds.measured[i]), "predicted_s": float(predicted),
            "error": float(predicted / ds.measured[i] - 1)}


def score(ds: Dataset, predicted: np.ndarray, worst: int = 5) -> dict:
    """MAPE, max error, Spearman, the worst rows and the per-group best-pick ratios."""
    keys = [ds.group_key(i) for i in range(len(ds))]
    out = metrics.summary(predicted, ds.measured, keys)
    out["worst"] = [_row(ds, i, predicted[i]) for i in metrics.worst(predicted, ds.measured, worst)]
    for g in out["groups"]:
        g["pick_plan"] = ds.labels[g["pick"]]["plan"]
        g["best_plan"] = ds.labels[g["best"]]["plan"]
        g["pick"] = ds.labels[g["pick"]]["source"]
        g["best"] = ds.labels[g["best"]]["source"]
    return out


def calibrate(traces, cluster, *, folds: int | None = None, holdout: float | None = None, evaluate=(),
              allreduce=(), params=None, seed: int = 0, progress=None, models=None, jobs: int = 1) -> CalibrationResult:
    """Calibrate `cluster` (preset name, cluster JSON path or Cluster) on trace files; `models` (a
    ModelSources) says which model code the records' profiles may be rebuilt with; `jobs` worker
    processes run the folds' fits and the final one side by side (fit.fit_all)."""

    say = progress or (lambda msg: None)
    base = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    if folds is not None and holdout is not None:
        raise AutoparError("give --folds or --holdout, not both")
    records, sources, problems = load_traces(traces)
    if not records:
        first = "; ".join(map(str, problems[:3])) + ("; ..." if len(problems) > 3 else "")
        raise AutoparError(f"no readable trace records in {', '.join(map(str, traces))}"
                           + (f" ({len(problems)} malformed line(s): {first})" if problems else " (empty)"))
    check_sources(records, sources, models)  # an untrusted model file: one line, before the progress line
    runs = {json.dumps([r.model.get("path") or r.model.get("name"), r.model.get("args"), r.model.get("digest"),
                        r.cluster, r.workload, r.plan], sort_keys=True, default=str)
            for r in records if r.outcome == "ok"}
    if len(runs) < needed_rows(1):  # at least as many as the dataset's rows: refused only where the fit would be
        raise AutoparError(f"too few measured rows to calibrate: {len(runs)} distinct run(s) with outcome ok, but "
                           f"fitting even one coefficient needs {needed_rows(1)}; collect more traces (autopar "
                           f"traces collect)")
    say(f"{len(records)} trace records; profiling their models")
    ds = build_dataset(records, base, sources, models)
    runtimes = sorted({g.workload.runtime for g in ds.groups})
    if len(runtimes) > 1:  # one set of coefficients prices one runtime's kernels (Coefficients.for_cluster)
        raise AutoparError(f"the traces hold runs of {len(runtimes)} runtimes ({', '.join(runtimes)}); one calibrated "
                           f"cluster prices one runtime's kernels: calibrate each runtime's traces separately")
    # the coefficients the cost model uses on this cluster under the traces' runtime: the GPU type's
    # fit (docs/hardware.md) under the cluster's own; what the rows cannot identify keeps these
    start = Coefficients.for_cluster(base, runtimes[0] if runtimes else "torch")

    collectives, fixed = None, []
    if allreduce:

        tables = [read_allreduce_table(p) for p in allreduce]
        collectives = fit_allreduce(tables, base, start)
        link = collectives.fitted()
        start = with_values(start, link.keys(), link.values())
        fixed = [f"link_efficiency.{collectives.kind}", *COLLECTIVE_PARAMS]
        say(f"collectives from {len(tables)} all-reduce table(s): {collectives.kind} efficiency "
            f"{collectives.efficiency:.3f}, per-call latency {collectives.collective_latency_s * 1e6:.1f} us "
            f"(table MAPE {collectives.mape:.1%})")

    keys = [ds.labels[i]["model"] for i in range(len(ds))]
    unit = "model"
    if len(set(keys)) == 1:  # one model: hold out whole runs (each run is a different plan)
        keys, unit = [ds.labels[i]["source"] for i in range(len(ds))], "run (the traces hold one model)"
    splits = []
    if folds or holdout:

        splits = group_kfold(keys, folds, seed) if folds else [group_holdout(keys, holdout, seed)]
    # as many coefficients as the smallest fit (a training fold, or all rows) supports
    smallest = min([len(train) for train, _ in splits] + [len(ds)])
    names = list(params) if params else default_parameters(ds, start, fixed, rows=smallest)
    if HOST_COEFFICIENTS & set(names):  # a fitted host time replaces the default launch cost, as read back
        start = dataclasses.replace(start, launch_s=0.0)
    if smallest < needed_rows(len(names)):
        where = "" if smallest == len(ds) else f" ({smallest} in the smallest training fold)"
        raise AutoparError(f"too few measured rows to calibrate: {len(ds)} usable row(s) (outcome ok){where}, but "
                           f"fitting {len(names)} coefficients needs at least {needed_rows(len(names))} "
                           f"(2 per coefficient); collect more traces (autopar traces collect) or fit fewer "
                           f"coefficients (--params)")

    for n, (train, test) in enumerate(splits, start=1):
        if len(train) < needed_rows(len(names)):
            raise AutoparError(f"too few rows to fit in fold {n}: {len(train)}, need {needed_rows(len(names))}")
    # the final fit on all rows and every fold's, side by side when jobs > 1 (the largest first)
    tasks = [(ds, start, names)] + [(ds.subset(train), start, names) for train, _ in splits]
    processes = min(jobs, len(tasks))
    say(f"fitting {len(names)} coefficients on all {len(ds)} rows"
        + (f" and on each of {len(splits)} training folds" if splits else "")
        + (f", {processes} fits at a time" if processes > 1 else ""))

    def done(i, result):
        if i > 0:
            train, test = splits[i - 1]
            say(f"fold {i}/{len(splits)} fitted on {len(train)} rows; testing on {len(test)} rows of "
                f"{len(set(keys[j] for j in test))} held-out {unit.split()[0]}(s)")

    fits = fit_all(tasks, jobs, done)
    final = fits[0]

    if splits:
        predicted = np.full(len(ds), np.nan)
        per_fold = []
        for n, ((train, test), result) in enumerate(zip(splits, fits[1:]), start=1):
            test_ds = ds.subset(test)
            predicted[test] = test_ds.predict(result.coefficients)
            per_fold.append({"fold": n, "held_out": sorted(set(keys[i] for i in test)), "rows": int(len(test)),
                             "mape": metrics.mape(predicted[test], ds.measured[test])})
        held = np.flatnonzero(~np.isnan(predicted))
        held_ds = ds.subset(held)
        validation = {"method": f"{folds}-fold cross-validation by {unit}" if folds else
                      f"hold-out of {holdout:g} of the rows, by {unit}",
                      "seed": seed, "folds": per_fold, **score(held_ds, predicted[held])}
        rows = (held_ds, predicted[held])
    else:
        rows = (ds, ds.predict(final.coefficients))
        validation = {"method": "in-sample (no --folds or --holdout: these rows were fitted)", **score(*rows)}

    # what was fitted, over the cluster's own coefficients: read back under the traces' runtime it
    # prices exactly as `final` does, and the rest still follows the GPU type's fit
    written = onto(base.coefficients, {**(collectives.fitted() if collectives else {}), **final.fitted()})
    calibrated = dataclasses.replace(base, name=f"{base.name}-calibrated", coefficients=written)
    evaluations, evaluated_rows = {}, {}
    for path in evaluate:
        recs, srcs, probs = load_traces([path])
        problems += probs
        if not recs:
            raise AutoparError(f"--evaluate {path}: no readable trace records")
        other = build_dataset(recs, base, srcs, models)
        say(f"evaluating {len(other)} rows of {path}")
        evaluated_rows[str(path)] = (other, other.predict(final.coefficients))
        evaluations[str(path)] = score(*evaluated_rows[str(path)])
    return CalibrationResult(final, calibrated, start, validation, evaluations, collectives,
                             [str(p) for p in problems], ds.skipped, rows, evaluated_rows,
                             # one line per stale record, also when a file is both fitted and evaluated
                             list(dict.fromkeys(ds.notes + [n for path in evaluate
                                                            for n in evaluated_rows[str(path)][0].notes])))
