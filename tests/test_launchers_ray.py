"""The Ray launcher (issue 43): `traces collect --launcher ray` and the measured Optuna search through
Ray Tune, on a local Ray cluster of 2 CPUs that this module starts."""

from __future__ import annotations

import json
import time

import optuna
import pytest

from autopar.cli import main
from autopar.executor.options import RunOptions
from autopar.traces.record import read_records
from launcher_runs import QUICK, TINY, check_records, tiny_plans


# The local cluster's settings (its processes inherit this process's environment at ray.init).
RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",  # token authentication writes its token under HOME
    # Ray Train's controller polls its workers every 2 s by default, so each job's start and end waited for
    # a poll; every 0.2 s, a job of the tiny plans took 17 s instead of 24 (one plan, timed side by side)
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
    # one actor process less per job (it watches for node drains, which a one-machine cluster never has)
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster (2 CPUs) in this process, with RAY_ENV's settings; the launchers join it."""
    import shutil
    import tempfile

    import ray

    with pytest.MonkeyPatch.context() as patch:  # the module's fixture: its settings undone after
        for variable, value in RAY_ENV.items():
            patch.setenv(variable, value)
        temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's sockets live under it
        started = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp, logging_level="ERROR")
        print(f"local Ray cluster started in {time.perf_counter() - started:.0f} s")
        yield
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.procs
def test_ray_collect_writes_the_local_launchers_records(ray_cluster, tmp_path):
    out = tmp_path / "traces.jsonl"
    started = time.perf_counter()
    assert main(["traces", "collect", *TINY, "--plans", "4", "--nproc", "2", "--launcher", "ray", *QUICK,
                 "-o", str(out)]) == 0
    print(f"ray collect of 4 plans: {time.perf_counter() - started:.0f} s")
    check_records(out, tiny_plans(4), "ray")


@pytest.mark.slow
@pytest.mark.procs
def test_a_measured_optuna_search_through_ray_tune_lands_every_trial_in_the_study(ray_cluster, tmp_path, capsys):
    out, db = tmp_path / "traces.jsonl", tmp_path / "study.db"
    started = time.perf_counter()
    # plans held to what runs in seconds: no torch.compile (inductor takes about a minute per plan on the CPU), no
    # DTensor (its Python dispatch per op); unheld, seed 0's first six trials drew three compiled plans
    cheap = ["--fix", "compile=false", "--fix", "tp=1"]
    assert main(["traces", "search", *TINY, "--trials", "6", "--nproc", "2", "--launcher", "ray", *QUICK, *cheap,
                 "--storage", f"sqlite:///{db}", "--study-name", "tune", "--plan-out", str(tmp_path / "best.json"),
                 "-o", str(out), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    print(f"ray tune search of 6 trials: {time.perf_counter() - started:.0f} s")
    study = optuna.load_study(study_name="tune", storage=f"sqlite:///{db}")
    trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(study.trials) == len(trials) == 6 and result["trials"] == 6
    records, problems = read_records(out)
    assert problems == [] and len(records) == 6
    assert all(r.plan["tp"] == 1 and not r.plan["compile"] for r in records)  # --fix held every trial's plan
    assert all(r.cluster["job"]["launcher"] == "ray" and r.cluster["job"]["id"].startswith("tune-") for r in records)
    # each trial's value is its run's measured step: the study holds what the trace file holds
    measured = sorted(r.measured["median_step_s"] for r in records if r.outcome == "ok")
    assert sorted(t.value for t in trials if t.value < 10 * RunOptions().timeout_s) == pytest.approx(measured)
    assert json.loads((tmp_path / "best.json").read_text()) == result["best"]["plan"]
