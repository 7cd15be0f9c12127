"""Shared fixtures: workloads built from the bundled models with profiles cached per session."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

ZOO = Path(__file__).resolve().parent.parent / "autopar" / "zoo"


def pytest_configure(config):
    """Tests never read or write the user's caches (set before collection, since test modules
    build workloads at import)."""
    path = tempfile.mkdtemp(prefix="autopar-test-cache-")
    os.environ["AUTOPAR_CACHE_DIR"] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def profile(model: str = "gpt", dtype: str = "bf16", **model_args):
    from autopar.profile import profile_model

    return profile_model(ZOO / f"{model}.py", model_args, dtype=dtype)


def workload(model="gpt", cluster="dgx-a100-80g", nodes=1, gpus_per_node=None, global_batch=64, dtype="bf16",
             **model_args):
    from autopar.cluster import load_cluster
    from autopar.workload import Workload

    return Workload(profile(model, dtype, **model_args),
                    load_cluster(cluster, nodes=nodes, gpus_per_node=gpus_per_node), global_batch)
