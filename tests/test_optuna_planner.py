"""The Optuna planner: its encoding reaches every plan, it comes near the oracle, proposes only
plans that fit, resumes a killed study without losing trials, and fails with one clear line."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ZOO, workload

from autopar.cli import main
from autopar.cost import estimate
from autopar.errors import AutoparError, NoValidPlanError
from autopar.search import get_planner, optuna_search
from autopar.search.sampling import nearest
from autopar.search.simplicity import TIE, defaults, tie_buckets
from autopar.search.space import sample

optuna = pytest.importorskip("optuna")
TESTS = Path(__file__).resolve().parent


def optuna_planner(**options):
    return get_planner("optuna", progress=False, **options)


@pytest.mark.parametrize("model", [{"size": "tiny", "nodes": 2, "global_batch": 24},
                                   {"size": "175b", "nodes": 16, "global_batch": 512},
                                   {"model": "llama", "size": "small", "nodes": 3, "global_batch": 96}])
def test_every_valid_choice_has_its_own_position_in_0_1(model):
    """So a suggestion of exactly that position picks it: Optuna can reach every plan."""
    w, rng = workload(**model), np.random.default_rng(0)

    def check(knob, choices):
        positions = np.array([knob.position_of(c, choices) for c in choices])
        assert len(set(positions)) == len(positions), knob.name
        assert ((positions >= 0) & (positions <= 1)).all(), knob.name
        i = int(rng.integers(len(positions)))
        assert nearest(positions, positions[i]) == i, knob.name
        return i

    for _ in range(300):
        sample(w, check)


@pytest.mark.heavy
def test_optuna_comes_near_the_oracle():
    """TPE is a sampler: the claim is about its typical run, so three seeds, their median near the
    oracle (one seed alone can settle in a local optimum: 0.69-0.75 on this workload). 150 trials: the
    space grew by HSDP's replicas and the zero-bubble schedules, and at 100 two seeds of three stayed at 0.70."""
    w = workload(size="gpt2-small", vocab=50304, global_batch=64)
    oracle = estimate(w, get_planner("exhaustive").propose(w, 1)[0]).iteration_time_s
    ratios = []
    for seed in range(3):
        planner = optuna_planner(trials=150, seed=seed)
        ratios.append(oracle / estimate(w, planner.propose(w, 1)[0]).iteration_time_s)
        # the trials, then rounds of simpler variants of the best plans (one per knob away from its
        # default, and all), each round setting at least one more knob back to its default
        assert 150 <= planner.evaluations <= 150 + (len(defaults()) + 1) ** 2
    assert float(np.median(ratios)) >= 0.95 and min(ratios) >= 0.5, ratios


def test_proposes_only_distinct_plans_that_fit_best_first():
    w = workload(size="gpt3-13b", cluster="dgx-a100-40g", global_batch=64)  # 4% of the plans fit
    # seed 3: with cp's dimension in the study seed 0 draws no fitting plan in 60 trials (4% fit), seeds 1, 3, 4 do
    plans = optuna_planner(trials=60, seed=3).propose(w, 4)
    estimates = [estimate(w, p) for p in plans]
    assert len(set(plans)) == len(plans) >= 2
    assert all(e.fits for e in estimates)
    times = [e.iteration_time_s for e in estimates]
    assert all(b <= a * (1 + TIE) for a, b in zip(times[1:], times))  # best first; the simplest first among ties
    with pytest.raises(NoValidPlanError, match="none of the 10 plans optuna tried .* use more --trials"):
        optuna_planner(trials=10).propose(workload(size="1t", nodes=1, global_batch=8))


CHILD = """
import sys, time
sys.path.insert(0, {tests!r})
import autopar.search.optuna_search as optuna_search
from conftest import workload

evaluate = optuna_search.evaluate
optuna_search.evaluate = lambda *a, **k: (time.sleep(0.1), evaluate(*a, **k))[1]  # slow enough to kill mid-way
optuna_search.OptunaPlanner(trials={trials}, storage={url!r}, progress=False).propose(workload(size="tiny"), 1)
"""


def complete_trials(db: Path) -> int:
    try:
        with sqlite3.connect(db, timeout=5) as con:
            return con.execute("SELECT COUNT(*) FROM trials WHERE state = 'COMPLETE'").fetchone()[0]
    except sqlite3.OperationalError:  # not created yet
        return 0


@pytest.mark.slow
def test_killed_study_resumes_without_losing_a_trial(tmp_path):
    db, trials = tmp_path / "study.db", 30
    url = f"sqlite:///{db}"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD.format(tests=str(TESTS), trials=trials, url=url)))
    child = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while complete_trials(db) < 5 and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL, child.stderr.read().decode()[-2000:]

    w = workload(size="tiny")
    (name,) = optuna.get_all_study_names(url)
    before = {t.number: (t.params, t.value) for t in optuna.load_study(study_name=name, storage=url).trials
              if t.state == optuna.trial.TrialState.COMPLETE}
    assert 5 <= len(before) < trials
    planner = optuna_planner(trials=trials, storage=url)  # the default study name is the workload's
    plan = planner.propose(w, 1)[0]
    # the resumed planner found the killed study by its workload's key (seen once under load: 5 == 30 below, as if it
    # had filled a study of another name; this says which)
    assert optuna.get_all_study_names(url) == [name], (name, optuna_search._study_key(w))
    done = [t for t in optuna.load_study(study_name=name, storage=url).trials
            if t.state == optuna.trial.TrialState.COMPLETE]
    after = {t.number: (t.params, t.value) for t in done}
    # the new trials only, then the simpler variants of the best plan and of every plan tied with it
    fitted = np.array([t.value for t in done if t.constraints[optuna_search.CONSTRAINT] <= 0])
    ranked = int(np.sum(tie_buckets(fitted) == 0))  # the best is in bucket 0 too
    assert len(after) == trials and 0 <= planner.evaluations - (trials - len(before)) <= ranked * (len(defaults()) + 1) ** 2
    assert all(after[n] == v for n, v in before.items())
    assert estimate(w, plan).fits
    states = [t.state for t in optuna.load_study(study_name=name, storage=url).trials]
    assert optuna.trial.TrialState.RUNNING not in states  # the killed trial was failed (and retried)


@pytest.mark.slow
def test_two_processes_on_one_study_complete_exactly_the_budget(tmp_path):
    db, trials = tmp_path / "study.db", 40
    url = f"sqlite:///{db}"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD.format(tests=str(TESTS), trials=trials, url=url)))
    children = [subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE) for _ in range(2)]
    for child in children:
        assert child.wait(timeout=300) == 0, child.stderr.read().decode()[-2000:]
    assert complete_trials(db) == trials


def test_storage_errors_are_one_line(tmp_path):
    w = workload(size="tiny")
    for url in (f"sqlite:///{tmp_path}/no/such/dir/study.db", "nosuchdb://x"):
        with pytest.raises(AutoparError, match="cannot open Optuna storage") as e:
            optuna_planner(trials=2, storage=url).propose(w)
        assert "\n" not in str(e.value)
    url = f"sqlite:///{tmp_path}/study.db"
    optuna_planner(trials=2, storage=url, study_name="mine").propose(w)
    with pytest.raises(AutoparError, match="study 'mine' .* was made for another search"):
        optuna_planner(trials=2, storage=url, study_name="mine").propose(workload(size="tiny", global_batch=32))


def test_cli_search_with_optuna(capsys, tmp_path):
    argv = ["search", str(ZOO / "gpt.py"), "--model-arg", "size=tiny", "--global-batch", "64", "--method", "optuna",
            "--trials", "20", "--storage", f"sqlite:///{tmp_path}/study.db", "--top-k", "2", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    variants = first["cost_model_evaluations"] - 20  # rounds of simpler variants of the 2 best plans
    assert first["method"] == "optuna" and 0 <= variants <= 2 * (len(defaults()) + 1) ** 2 and first["estimate"]["fits"]
    assert main(argv) == 0  # the study is complete: no trial more to run, the same answer
    again = json.loads(capsys.readouterr().out)
    assert again["cost_model_evaluations"] == variants and again["plan"] == first["plan"]
