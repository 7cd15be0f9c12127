"""Shared fixtures: workloads built from the bundled models with profiles cached per session."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

ZOO = Path(__file__).resolve().parent.parent / "autopar" / "zoo"
VTRAIN = Path(__file__).resolve().parent.parent / "data" / "vtrain"  # copied from vTrain (MIT), see SOURCE.md


# The suite draws the same examples on every run, so CI cannot fail by chance on a clean clone;
# HYPOTHESIS_PROFILE=default explores fresh examples each run.
settings.register_profile("ci", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


SCRATCH_ENV = {  # variable -> scratch subfolder; subprocesses (torchrun, the CLI) inherit them
    "AUTOPAR_CACHE_DIR": "autopar",  # profiles, oracle and measured-reward caches (else ~/.cache/autopar)
    "MPLCONFIGDIR": "matplotlib",  # matplotlib's config and font cache (else ~/.config, ~/.cache/matplotlib)
    "HOME": "home",  # anything else that writes under ~ lands here, and the session fails (below)
}
SCRATCH: Path | None = None


def pytest_configure(config):
    """Tests never read or write the user's home (set before collection, since test modules build
    workloads at import, and before anything imports matplotlib)."""
    global SCRATCH
    SCRATCH = Path(tempfile.mkdtemp(prefix="autopar-test-"))
    for variable, folder in SCRATCH_ENV.items():
        (SCRATCH / folder).mkdir()
        os.environ[variable] = str(SCRATCH / folder)
    atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when a test (or a package it runs) wrote under HOME: name the caller's
    variable to point it elsewhere, as SCRATCH_ENV does."""
    written = sorted(str(p.relative_to(SCRATCH / "home")) for p in (SCRATCH / "home").rglob("*"))
    if written:
        print(f"\ntests wrote under HOME: {', '.join(written[:10])}; point them at a scratch folder "
              f"(tests/conftest.py)")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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


def free_port() -> int:
    """A port nothing on this machine listens on now (the rendezvous of a test's process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefix_before(space, name: str) -> tuple:
    """A plan-space prefix up to knob `name`, each earlier decision its first allowed value."""
    import numpy as np

    prefix = space.advance(())
    while space.names[len(prefix)] != name:
        info = space.step(prefix)
        prefix = space.advance(prefix + (info.values[int(np.flatnonzero(info.allowed)[0])],))
    return prefix


def assert_exports_degree(plan, label: str, megatron_flag: str, torchtitan_flag: str, degree: int) -> None:
    """An axis's degree (`label`, e.g. "cp=2") goes to Megatron's and torchtitan's flags; DeepSpeed
    and accelerate, which cannot express it, name it in their unexpressed line."""
    from autopar.export import export_plan

    for target, flag in (("megatron", megatron_flag), ("torchtitan", torchtitan_flag)):
        args = export_plan(plan, target).text.split()
        assert args[args.index(flag) + 1] == str(degree), target
    for target in ("deepspeed", "accelerate"):
        assert label in export_plan(plan, target).unexpressed_line(), target


FAKE_TP = 2  # ranks of `fake_tp_mesh`


@pytest.fixture(scope="module")
def fake_tp_mesh():
    """A tensor-parallel mesh of FAKE_TP ranks on torch's fake process group, in this process: DTensor
    issues every collective with its real shapes and nothing is communicated (this process is rank 0)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_TP)
    yield init_device_mesh("cpu", (FAKE_TP,))
    dist.destroy_process_group()
