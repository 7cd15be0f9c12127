"""This machine's own figures, as `autopar profile-cluster` measured them on CPU workers, cached.

The `cpu` preset's figures are nominal (50 GFLOP/s and 5 GB/s per process): bf16 runs on this
repository's 2-core host measured 50-70x off its predictions. `profile-cluster` on CPU stores its measured GPU spec (matmul
FLOP/s, memory bandwidth), shm link (all-reduce) and coefficients here, keyed by this machine;
`load_cluster("cpu")` then uses them, and the cost model's notes call a CPU estimate rough unless
its cluster carries this machine's measurement. Nothing is measured automatically: without the
cache (always so under tests, which point AUTOPAR_CACHE_DIR at scratch) the preset stays nominal.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from autopar.atomic import write_text_atomic

CPU_GPU_NAMES = ("cpu-process", "cpu-process (profiled)")  # the cpu preset's worker, profile-cluster's


def machine_key() -> str:
    """This machine: host name, CPU model and core count (a copy of the cache on another host,
    or the same host with other cores, is not its measurement)."""
    model = ""  # (platform.processor() runs `uname -p`: no process for a key)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{platform.node()}|{platform.machine()}|{model}|{os.cpu_count()}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measurement_path() -> Path:
    """Where this machine's measurement is cached (beside the model profiles' cache)."""
    env = os.environ.get("AUTOPAR_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "autopar"
    return root / "machines" / f"{machine_key()}.json"


def store_measurement(cluster) -> Path:
    """Cache a CPU cluster measured by profile-cluster on this machine (atomically)."""
    d = cluster.to_dict()
    doc = {"machine": machine_key(), "gpu": d["gpu"], "links": {"shm": d["links"]["shm"]},
           "coefficients": d.get("coefficients", {})}
    path = measurement_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(doc, indent=1))
    return path


def measurement() -> dict | None:
    """This machine's cached measurement (gpu, links, coefficients as cluster-JSON overrides), or None
    when absent, unreadable or another machine's."""
    try:
        doc = json.loads(measurement_path().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("machine") != machine_key():
        return None
    if not all(isinstance(doc.get(k), dict) for k in ("gpu", "links", "coefficients")):
        return None
    return {k: doc[k] for k in ("gpu", "links", "coefficients")}


def is_cpu(cluster) -> bool:
    """Whether the cluster's "GPU" is a CPU worker process (the cpu preset or a profiled one)."""
    return cluster.gpu.name in CPU_GPU_NAMES


def measured_here(cluster) -> bool:
    """Whether a CPU cluster carries this machine's cached measurement (its GPU spec is the one
    profile-cluster measured here)."""
    m = measurement()
    return m is not None and cluster.gpu.to_dict() == m["gpu"]
