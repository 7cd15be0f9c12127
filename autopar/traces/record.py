"""Trace records: one JSON line per measured run, the raw material of calibration.

A trace file is JSON Lines, one object per line, appended by `autopar run` and the measured
reward backend. Schema version 1, every key always present:

    schema_version  int     TRACE_SCHEMA_VERSION; readers refuse other versions
    time            str     ISO 8601 UTC time the run ended, e.g. "2025-01-31T12:00:00+00:00"
    cluster         object  name, nodes, gpus_per_node, gpu (device name, "cpu" on CPU), backend;
                            and `job` when a scheduler ran it (`autopar.traces.launchers`): launcher
                            ("slurm" or "ray"), id (the scheduler's job or run id), requeues (times
                            the job was preempted and requeued before this record)
    model           object  name, path, digest (sha256 of model.py and its args), dims (hidden,
                            heads, layers, vocab, ... as known), params (parameter count)
    workload        object  global_batch (samples per step), seq_len (tokens per sample, 1 when
                            the model has no sequence axis)
    plan            object  Plan.to_dict(), the plan's own versioned JSON
    measured        object  step_times_s (seconds of each timed step, after warm-up),
                            median_step_s, tokens_per_s (samples/s when seq_len is 1),
                            peak_memory_bytes (one entry per rank: CUDA max_memory_allocated, or
                            the process RSS high-water mark on CPU), losses (global-batch mean
                            loss of every step, warm-up included); empty when no step finished
    predicted       object|null  the cost model's iteration_time_s and peak_memory_gb for the
                            same workload and plan, when it was available
    outcome         str     "ok", "oom" (out of device memory), "timeout" (the job passed its time
                            bound, or a rank stopped beating), "rank_failed" (a rank raised, exited
                            or was killed; `error` names it), "preempted" (the scheduler took the
                            job's nodes back and it was not requeued again), or "error" (the launch
                            itself failed)
    error           str|null  the failure message, null when outcome is "ok"
    versions        object  autopar, torch, python, backend

Appends are atomic: each record is written with a single `os.write` on a descriptor opened with
O_APPEND and held under an exclusive `flock`, so concurrent writers never interleave and a
killed writer leaves either the whole line or nothing. `read_records` checks every line against
`autopar.schema.TRACE_SCHEMA` (and its plan against the plan schema), reports each malformed,
torn or mistyped line with its line number and still returns the good ones, so one bad line
never costs a calibration run its data.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import stat
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from importlib import metadata
from typing import Any

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.schema import TRACE_SCHEMA, check, loads, read_file
from autopar.traces.models import model_digest

TRACE_SCHEMA_VERSION = 1
OUTCOMES = ("ok", "oom", "timeout", "rank_failed", "preempted", "error")


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def current_versions(backend: str = "") -> dict[str, str]:
    """Software versions of this process, stamped on every record."""
    return {"autopar": _package_version("autopar"), "torch": _package_version("torch"),
            "python": platform.python_version(), "backend": backend}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class TraceRecord:
    """One measured run. See the module docstring for the meaning of each field."""

    cluster: dict[str, Any]
    model: dict[str, Any]
    workload: dict[str, Any]
    plan: dict[str, Any]
    outcome: str
    measured: dict[str, Any] = field(default_factory=dict)
    predicted: dict[str, Any] | None = None
    error: str | None = None
    versions: dict[str, str] = field(default_factory=current_versions)
    time: str = field(default_factory=_now)
    schema_version: int = TRACE_SCHEMA_VERSION

    def __post_init__(self):
        if self.outcome not in OUTCOMES:
            raise AutoparError(f"trace outcome must be one of {list(OUTCOMES)}, got {self.outcome!r}")
        if self.outcome == "ok" and "median_step_s" not in self.measured:
            raise AutoparError("a trace record with outcome 'ok' needs measured.median_step_s")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: Any) -> TraceRecord:
        if not isinstance(d, dict):
            raise AutoparError(f"a trace record must be a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if version != TRACE_SCHEMA_VERSION:
            raise AutoparError(f"trace schema_version is {version!r}, this autopar reads version "
                               f"{TRACE_SCHEMA_VERSION}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise AutoparError(f"unknown trace key(s) {unknown}")
        missing = sorted(names - set(d))
        if missing:
            raise AutoparError(f"trace record is missing key(s) {missing}")
        d = check(d, TRACE_SCHEMA, "trace record")
        Plan.from_dict(d["plan"])  # a record whose plan cannot be read is skipped like any bad line
        return cls(**d)


@dataclass(frozen=True)
class TraceProblem:
    """A line of a trace file that could not be read, and why."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def model_entry(model_file, model_args: dict, profile) -> dict[str, Any]:
    """A record's `model`: what identifies the model, and its profile (calibration reads the
    profile and runs no code). `model_file`: a loaded `autopar.modelfile.ModelFile`."""
    params = sum(p.numel() for p in model_file.build(**model_args).parameters())  # meta: free
    return {"name": model_file.name, "path": str(model_file.path), "digest": model_digest(model_file.path, model_args),
            "args": model_args, "dims": dict(profile.dims) if profile else {}, "params": params,
            "profile": profile.to_dict() if profile else None}


def run_record(plan: Plan, options, cluster, model: dict, predicted: dict | None, launched,
               job: dict | None = None) -> TraceRecord:
    """The trace record of one run of `plan`: `options` the RunOptions it ran with, `cluster` the
    Cluster it is recorded for, `model` a `model_entry`, `predicted` the cost model's figures, and
    `launched` how the launch ended (outcome, error, and rank 0's result: measured, seq_len,
    backend, device). What `autopar run` and the measured reward append alike; `job`: the
    scheduler's job that ran it (cluster.job), when one did."""
    result = launched.result or {}
    backend = result.get("backend", options.backend)
    return TraceRecord(
        cluster={"name": cluster.name, "nodes": options.nnodes, "gpus_per_node": options.nproc_per_node,
                 "gpu": result.get("device", cluster.gpu.name), "backend": backend, **({"job": job} if job else {})},
        model=model, workload={"global_batch": plan.global_batch,
                               "seq_len": result.get("seq_len", model["dims"].get("seq_len"))},
        plan=plan.to_dict(), outcome=launched.outcome, measured=result.get("measured", {}),
        predicted=predicted, error=launched.error, versions=current_versions(backend))


def append_record(path, record: TraceRecord) -> None:
    """Append one record as one whole line, safe against crashes and concurrent writers."""
    data = (record.to_json() + "\n").encode("utf-8")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # as for every output (`check_output`)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise AutoparError(f"cannot append to trace file {path}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise AutoparError(f"trace file {path} is not a regular file; give the path of a .jsonl file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = os.fstat(fd).st_size
        # a writer that died mid-line (disk full) must not glue its fragment to this record
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        written = os.write(fd, data)
        if written != len(data):
            raise AutoparError(f"short write to trace file {path}: {written} of {len(data)} bytes "
                               f"(disk full?)")
    finally:
        os.close(fd)  # closing releases the lock


def check_trace_file(path) -> None:
    """Before any work: the trace file exists and is a regular file (reading a FIFO would block)."""
    if not os.path.exists(path):
        raise AutoparError(f"trace file {path} not found")
    if not os.path.isfile(path):
        raise AutoparError(f"trace file {path} is not a regular file; give the path of a .jsonl file")


def read_records(path, *, strict: bool = False) -> tuple[list[TraceRecord], list[TraceProblem]]:
    """The records of a trace file and the problems of its malformed lines (1-based numbers).

    With strict=True, any problem raises AutoparError listing every bad line instead.
    """
    lines = read_file(path, "trace file", AutoparError).decode("utf-8", errors="replace").splitlines()
    records, problems = [], []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            records.append(TraceRecord.from_dict(loads(text, "", AutoparError)))
        except AutoparError as e:  # a torn line (a writer killed mid-line), a mistyped field: skip it
            problems.append(TraceProblem(str(path), number, str(e)))
    if strict and problems:
        raise AutoparError(f"{len(problems)} malformed trace line(s): " + "; ".join(map(str, problems)))
    return records, problems
