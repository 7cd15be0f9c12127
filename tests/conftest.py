"""Shared fixtures: workloads built from the bundled models with profiles cached per session."""

from __future__ import annotations

import atexit
import functools
import importlib
import multiprocessing.process
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

import autopar.profile as profile_package

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
    # torch.compile's cache (else /tmp/torchinductor_$USER, shared by every run on the machine: a compile
    # killed mid-write there left a truncated .so that failed the next run's compile test)
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    # temporary files and folders (Python's tempfile, torchrun's logs): what a killed or failed run keeps
    # (its log folder, by design) goes with the scratch folder, not into the machine's /tmp
    "TMPDIR": "tmp",
}
SCRATCH: Path | None = None


SHARED_SCRATCH = "AUTOPAR_TEST_SCRATCH"  # the controller's scratch, inherited by pytest-xdist's workers


def pytest_configure(config):
    """Tests never read or write the user's home (set before collection, since test modules build
    workloads at import, and before anything imports matplotlib). Under pytest-xdist (`-n 2`, as
    .ci/run runs) the workers use the controller's folder: one profile cache for the session, one
    HOME for the check below, removed once by the controller."""
    global SCRATCH
    # One intra-op thread per test process (unless the caller chose): under `-n 2` on 2 cores each worker's
    # torch and OpenMP pools of 2 threads oversubscribe the cores beside the other worker and its launched
    # ranks (which torchrun and the spawned jobs already hold to one thread). Measured side by side, five
    # in-process files (policy, rl planner, env, hf, stage solver) under -n 2: 96 s wall, 121 CPU-s with the
    # default; 81 s, 115 CPU-s with one. Set before collection, which imports torch; workers inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(SHARED_SCRATCH):
        SCRATCH = Path(os.environ[SHARED_SCRATCH])
        return
    SCRATCH = Path(tempfile.mkdtemp(prefix="autopar-test-"))
    for variable, folder in SCRATCH_ENV.items():
        (SCRATCH / folder).mkdir()
        os.environ[variable] = str(SCRATCH / folder)
    os.environ[SHARED_SCRATCH] = str(SCRATCH)
    tempfile.tempdir = None  # tempfile read TMPDIR above (for SCRATCH itself): read it again
    for folder in (SCRATCH, SCRATCH / "tmp"):  # others may pass through, not list: a server run as its own user
        folder.chmod(0o711)  # (tests/test_optuna_storage.py's PostgreSQL) reaches its folder under tmp
    atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)
    try:  # matplotlib's first font lookup runs fc-list, a process: its font cache is built here, once, not inside a
        importlib.import_module("matplotlib.font_manager")  # quick-tier test (test_plots.py alone failed the rule below)
    except ImportError:
        pass


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when a test (or a package it runs) wrote under HOME: name the caller's
    variable to point it elsewhere, as SCRATCH_ENV does."""
    written = sorted(str(p.relative_to(SCRATCH / "home")) for p in (SCRATCH / "home").rglob("*"))
    if written:
        print(f"\ntests wrote under HOME: {', '.join(written[:10])}; point them at a scratch folder "
              f"(tests/conftest.py)")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# -- the quick tier (`python -m pytest -m "not slow"`) launches no process ---------------------------------

class LaunchedProcess(BaseException):  # not an Exception: a CLI's `except Exception` cannot turn it into exit 2
    """A test not marked slow started a process."""


LAUNCHERS = {  # module -> attribute: every way a test starts a process (torchrun and the CLI go through subprocess;
    # torch.multiprocessing.spawn, Pool and ProcessPoolExecutor through BaseProcess.start)
    subprocess.Popen: ("_execute_child",),
    multiprocessing.process.BaseProcess: ("start",),
    os: ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"),
}


IMPLY_SLOW = ("trains", "heavy")  # training a policy, an in-process check of seconds: out of the quick tier too


PROCS = "procs"  # the xdist group of the tests marked procs (pyproject.toml)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """`-m "not slow"` leaves out the markers that imply slow (IMPLY_SLOW). Under `-n 2` (`--dist loadgroup`,
    pyproject.toml) the tests marked `procs` (each starts several busy processes at once: a 4-rank job, a Ray
    or Slurm collect) run one after another in one worker, every other test with its module's tests: two
    4-rank jobs at once put 8 busy processes on 2 cores, which, measured side by side, cost each job 60% more
    CPU time (context switches) and both more wall-clock time than running them in turn. All the launching
    tests in one group took 2.2x the other worker's time, hence the narrower group."""
    for item in items:
        if any(item.get_closest_marker(m) for m in IMPLY_SLOW) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        item.add_marker(pytest.mark.xdist_group(PROCS if item.get_closest_marker(PROCS) else
                                                item.nodeid.split("::")[0]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test not marked slow (its fixtures included) that starts a process fails, naming the marker, in every
    run: the full suite catches a forgotten marker, and the quick tier really launches nothing."""
    if item.get_closest_marker("slow"):
        return (yield)
    launched = item.stash.setdefault(LAUNCHED, [])
    saved = [(owner, name, getattr(owner, name)) for owner, names in LAUNCHERS.items() for name in names
             if hasattr(owner, name)]

    def refuse(what):
        def launch(*args, **kwargs):
            launched.append(what)
            raise LaunchedProcess(f"{item.nodeid} starts a process ({what}) and is not marked slow: add "
                                  f"@pytest.mark.slow (or trains, for a policy's training) so the quick tier "
                                  f"(-m \"not slow\") leaves it out")
        return launch

    for owner, name, _ in saved:
        setattr(owner, name, refuse(f"{getattr(owner, '__name__', owner)}.{name}"))
    saved.append((profile_package, "profile_isolated", profile_package.profile_isolated))
    profile_package.profile_isolated = functools.partial(profile_zoo_here, profile_package.profile_isolated)
    try:
        return (yield)
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


LAUNCHED = pytest.StashKey[list]()


def profile_zoo_here(isolated, path, model_args, dtype, timeout):
    """The CLI profiles a model.py in a child process (autopar/profile/isolated.py), which guards against
    model files that exit or hang; the zoo's models are the project's own code, so a test not marked slow
    profiles them in this process, into the same cache. Any other file still goes to the child (and the
    test must be marked slow); the child itself is tested by the slow tests that run the CLI as a process."""
    named = ZOO / f"{path}.py"  # a zoo model by name, as `autopar search gpt`
    if not (Path(path).resolve().parent == ZOO or (not Path(path).exists() and named.is_file())):
        return isolated(path, model_args, dtype, timeout)
    from autopar.profile.profiler import profile_model as measure

    return measure(path, model_args, dtype=dtype)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A launch the code under test caught (`except BaseException`) still fails the test."""
    report = yield
    launched = item.stash.get(LAUNCHED, [])
    if launched and report.passed:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} starts a process ({launched[0]}) and is not marked slow: add "
                           f"@pytest.mark.slow so the quick tier (-m \"not slow\") leaves it out")
    launched.clear()  # reported in the phase that launched, not again in the next
    return report


def error_lines(err: str) -> list[str]:
    """stderr's lines but the profiler's wait notice (`autopar.profile.isolated.PROGRESS`), which a model file
    profiled in a child prints after 5 s: on a loaded machine (the suite on both cores) even a failing
    profile can take that long, and the notice is part of autopar's output, not of the error."""
    from autopar.profile.isolated import PROGRESS

    return [line for line in err.splitlines() if line.strip() and not line.startswith(PROGRESS)]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """`autopar ARGV...` in this process (arguments stringified): its exit code, stdout and stderr."""
    from autopar.cli import main

    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def collected(request, test: str, *args: str) -> list:
    """The parameters (`args` of `test`, in the requesting module) of the cases this run collected, after -k and
    -m deselection: a module's process job then runs only those. One value per case for one arg, else tuples."""
    items = [item for item in request.session.items if item.module is request.module and item.originalname == test]
    values = [tuple(item.callspec.params[a] for a in args) for item in items]
    return [v[0] for v in values] if len(args) == 1 else values


def is_collected(request, test: str) -> bool:
    """Whether this run collected `test` (unparametrised) of the requesting module."""
    return any(item.module is request.module and item.originalname == test for item in request.session.items)


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


def run_stages(stages, tokens):
    """The stages of a cut model run one after another on `tokens` (what a pipeline computes in one process)."""
    h = (tokens,)
    for stage in stages:
        out = stage(*h)
        h = out if isinstance(out, tuple) else (out,)
    return h[0]
