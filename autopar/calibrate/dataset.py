"""Trace records as a calibration data set: measured times, and the cost model's predictions for
any coefficients, computed group by group so that one prediction of every row is a handful of
vectorised `evaluate` calls.

Rows are grouped by (model profile, cluster size): the cost model's iteration time does not
depend on the workload's global batch except through each plan's micro-batch count, which the
plan carries, so one Workload and one PlanArrays serve every plan of a group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from autopar.cluster import Cluster, load_cluster
from autopar.cost import PlanArrays, evaluate
from autopar.cost.arrays import DTYPE_BYTES_BY_CODE
from autopar.errors import AutoparError
from autopar.plan import RECOMPUTE_MODES, Plan
from autopar.traces.models import ModelSources, stale_note
from autopar.traces.record import check_trace_file, read_records
from autopar.workload import Workload


@dataclass
class Group:
    workload: object  # Workload
    plans: object  # PlanArrays
    rows: np.ndarray  # indices into the data set's rows


@dataclass
class Dataset:
    """Measured rows (outcome ok) with what the cost model needs to predict them."""

    measured: np.ndarray  # seconds per iteration
    groups: list[Group]
    labels: list[dict]  # per row: model, shape, gpus, nodes, plan text, source
    base_cluster: object = None  # the Cluster the rows were sized from
    skipped: list[str] = field(default_factory=list)  # why some records were not used
    notes: list[str] = field(default_factory=list)  # records priced from an older profiler's stored profile

    def __len__(self) -> int:
        return len(self.measured)

    def predict(self, coeffs) -> np.ndarray:
        """Iteration time the cost model predicts for every row with these coefficients."""

        out = np.empty(len(self.measured))
        for g in self.groups:
            out[g.rows] = evaluate(g.workload, g.plans, coeffs)["iteration_time"]
        return out

    def subset(self, index) -> Dataset:
        """The rows at `index` (indices or a boolean mask), in that order."""
        index = np.flatnonzero(index) if np.asarray(index).dtype == bool else np.asarray(index, dtype=int)
        where = np.full(len(self.measured), -1)
        where[index] = np.arange(len(index))
        groups = []
        for g in self.groups:
            keep = np.flatnonzero(where[g.rows] >= 0)
            if len(keep):
                groups.append(Group(g.workload, g.plans.take(keep), where[g.rows[keep]]))
        return Dataset(self.measured[index], groups, [self.labels[i] for i in index], self.base_cluster)

    def group_key(self, i: int) -> str:
        """Runs of one model on one cluster size: the unit for 'which plan is best'."""
        lab = self.labels[i]
        return f"{lab['model']} on {lab['gpus']} GPUs, batch {lab['global_batch']}"

    def max_block_flops(self) -> float:
        """The largest forward FLOPs of one pipeline block (a layer: embedding and head excluded) on
        one GPU for one micro-batch, over all rows."""
        best = 0.0
        for g in self.groups:
            pa = g.plans
            for b in g.workload.profile.layers:
                per = b.tp_fwd_flops / pa.tp + (b.fwd_flops - b.tp_fwd_flops)
                best = max(best, float((pa.micro_batch_size * per).max(initial=0.0)))
        return best

    def max_buckets(self) -> int:
        """The most gradient buckets any data-parallel row reduces in (an upper estimate:
        the whole model's gradient over the model-parallel degrees)."""

        most = 0
        for g in self.groups:
            pa = g.plans
            dp = pa.dp > 1
            if dp.any():
                grads = g.workload.profile.params * DTYPE_BYTES_BY_CODE[pa.grad_comm_dtype] / (pa.tp * pa.pp)
                most = max(most, int(np.ceil(grads / (pa.bucket_mb * 2**20))[dp].max()))
        return most

    def tensor_parallel(self) -> bool:
        """Whether some row runs tensor parallelism (and so DTensor's dispatch on its host)."""
        return any(bool((g.plans.tp > 1).any()) for g in self.groups)

    def selective(self) -> bool:
        """Whether some row recomputes selectively."""

        return any(bool((g.plans.recompute == RECOMPUTE_MODES.index("selective")).any()) for g in self.groups)

    def sharded_optimizer(self) -> bool:
        """Whether some rows shard the optimizer step over data-parallel ranks and others do not."""
        sharded = np.concatenate([(g.plans.zero >= 1) & (g.plans.dp > 1) for g in self.groups])
        return bool(sharded.any() and not sharded.all())

    def link_kinds(self) -> set[str]:
        """Link kinds that some row's tensor-, data- or pipeline-parallel group communicates over."""
        kinds = set()
        for g in self.groups:
            cluster, pa = g.workload.cluster, g.plans
            strides = {}
            for i in range(len(pa)):
                plan = pa.plan(i)
                strides = plan.strides()
                for axis, size in (("tp", plan.tp), ("dp", plan.dp)):
                    if size > 1:
                        kinds.add(cluster.ring(size, strides[axis]).kind)
                if plan.pp > 1:
                    kinds.add(cluster.p2p(strides["pp"]).kind)
        return kinds


def model_label(model: dict) -> str:
    dims = model.get("dims") or {}
    if {"hidden", "layers"} <= set(dims):
        return f"{model.get('name', 'model')} h{dims['hidden']} l{dims['layers']}"
    return str(model.get("name", "model"))


def check_sources(records, sources: list[str] | None = None, models=None) -> None:
    """Refuse, before any profiling, a record with outcome "ok" whose model profile can come from
    nowhere (`ModelSources.check`): the error comes before any progress line, not minutes later."""
    models = models or ModelSources()
    for n, record in enumerate(records):
        if record.outcome == "ok":
            models.check(record.model, sources[n] if sources else f"record {n + 1}")


def build_dataset(records, cluster, sources: list[str] | None = None, models=None) -> Dataset:
    """A Dataset of the records with outcome "ok" on `cluster` (a Cluster, or a preset name / cluster
    JSON path), each sized to its record's nodes and GPUs per node. Records of the same plan of the
    same workload (repeated runs) make one row: the median of their times, labelled with the first
    record's source and the number of runs. Profiles are loaded once per model and precision, from
    the record or the code `models` (a ModelSources) allows: a trace never names code to run."""

    models = models or ModelSources()
    base = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    profiles: dict[tuple, object] = {}
    clusters: dict[tuple, object] = {}
    buckets: dict[tuple, dict] = {}
    samples, labels, skipped, notes = [], [], [], []  # per row: the measured seconds of each run of its plan
    rows_of: dict[tuple, int] = {}
    for n, record in enumerate(records):
        source = sources[n] if sources else f"record {n + 1}"
        if record.outcome != "ok":
            skipped.append(f"{source}: outcome {record.outcome}")
            continue
        model = record.model
        plan = Plan.from_dict(record.plan)
        key = (str(model.get("path") or model.get("name")), json.dumps(model.get("args"), sort_keys=True),
               str(model.get("digest")), plan.precision)
        if key not in profiles:
            profiles[key] = models.profile(model, plan.precision, source)
            if (note := stale_note(profiles[key], source)) is not None:
                notes.append(note)
        size = (int(record.cluster.get("nodes", 1)), int(record.cluster.get("gpus_per_node", base.gpus_per_node)))
        if size not in clusters:
            clusters[size] = base.with_nodes(*size)
        batch = int(record.workload["global_batch"])
        # what ran the plan (autopar.runtime): records without these keys ran autopar's executor
        runtime, switches = record.workload.get("runtime", "torch"), record.workload.get("switches") or ()
        switches = (switches,) if isinstance(switches, str) else tuple(map(str, switches))
        try:
            workload = Workload(profiles[key], clusters[size], batch, runtime=str(runtime), switches=switches)
            plan.validate(workload)
        except AutoparError as e:
            raise AutoparError(f"{source}: {e}") from None
        seconds = float(record.measured["median_step_s"])
        run = key + size + (workload.runtime, workload.switches, batch, json.dumps(record.plan, sort_keys=True))
        if run in rows_of:  # the same plan measured again: one row, the median of its runs
            samples[rows_of[run]].append(seconds)
            continue
        rows_of[run] = len(samples)
        bucket = buckets.setdefault(key + size + (workload.runtime, workload.switches),
                                    {"workload": workload, "plans": [], "rows": []})
        bucket["plans"].append(plan)
        bucket["rows"].append(len(samples))
        samples.append([seconds])
        dims = model.get("dims") or {}
        labels.append({"model": model_label(model), "params": model.get("params"), "gpus": size[0] * size[1],
                       "nodes": size[0], "global_batch": batch, "plan": plan.describe(), "source": source,
                       "shape": dims.get("hidden"), "layers": dims.get("layers")})
    for label, times in zip(labels, samples):
        label["runs"] = len(times)
    groups = [Group(b["workload"], PlanArrays.from_plans(b["plans"], b["workload"].profile), np.array(b["rows"]))
              for b in buckets.values()]
    return Dataset(np.array([float(np.median(t)) for t in samples]), groups, labels, base, skipped, notes)


def load_traces(paths, strict: bool = False):
    """(records, per-record source "file:line", problems) of trace files; problems are malformed
    lines (reported, not fatal: the other lines are used)."""

    records, sources, problems = [], [], []
    for path in paths:
        check_trace_file(path)
        recs, probs = _read_with_lines(path, read_records)
        records += [r for r, _ in recs]
        sources += [f"{path}:{line}" for _, line in recs]
        problems += probs
    return records, sources, problems


def _read_with_lines(path, read_records):
    """read_records, plus the line number of each good record (for messages naming rows)."""
    records, problems = read_records(path)
    bad = {p.line for p in problems}
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [n for n, text in enumerate(f.read().splitlines(), start=1) if text.strip() and n not in bad]
    if len(lines) != len(records):  # should not happen; fall back to record numbers
        lines = list(range(1, len(records) + 1))
    return list(zip(records, lines)), problems


def job_mix(paths, cluster, models=None) -> list[tuple[object, int]]:
    """(Workload, runs) for each distinct workload (model profile, cluster size, global batch) the
    trace files describe: the job mix a policy trained for this cluster should cover (for
    `autopar train traces`). `cluster` is usually the calibrated cluster JSON."""

    records, sources, _ = load_traces(paths)
    ds = build_dataset(records, cluster, sources, models)
    mix: dict[tuple, list] = {}
    for g in ds.groups:
        for i in g.rows:
            batch = ds.labels[i]["global_batch"]
            key = (g.workload.profile.digest, g.workload.cluster.nodes, g.workload.cluster.gpus_per_node, batch)
            if key not in mix:
                mix[key] = [Workload(g.workload.profile, g.workload.cluster, batch), 0]
            mix[key][1] += 1
    return [(w, n) for w, n in mix.values()]
