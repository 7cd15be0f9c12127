"""A measured Optuna search: each trial runs its plan through a launcher, the study holds the
measured step times, and every run's record is appended to the trace file.

A trial walks the plan space as the cost-model Optuna search does (`optuna_search.trial_plan`: one
position in [0, 1] per knob, the valid choice nearest to it), so its parameters keep one
distribution across trials. Its value is the measured median step time; a run that did not end `ok` (or a plan the
executor refused) scores FAILED_S, worse than any run within the run's --timeout, with its
outcome kept as the trial's user attribute. The study's budget is `trials` complete trials, so
rerunning a search on a stored study runs only those still missing. With the local and Slurm
launchers Optuna drives the trials itself (one at a time); with Ray each trial is a Ray Tune
trial and Optuna is Tune's search algorithm (`OptunaSearch` on the same study), so the trials
land in the study either way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import tempfile
import warnings
from pathlib import Path

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.search.optuna_search import _storage_failed, trial_plan
from autopar.search.sampling import check_space
from autopar.search.study_storage import open_storage, shown
from autopar.traces.launchers import Launcher, RunSpec, node_record, run_argv, with_job
from autopar.traces.launchers.ray_cluster import RayLauncher, connect

METRIC = "step_s"  # the trial's value: measured median seconds per step


def score(record: dict | None, failed_s: float) -> tuple[float, str]:
    """(the trial's value, the run's outcome): the measured median step, or failed_s."""
    if record is None:
        return failed_s, "refused"
    if record["outcome"] == "ok":
        return float(record["measured"]["median_step_s"]), "ok"
    return failed_s, record["outcome"]


def study_key(workload, spec: RunSpec) -> str:
    """What a measured study's values depend on: the model, the run's ranks and options."""
    text = json.dumps([workload.profile.digest, workload.global_batch, spec.options.nnodes, spec.options.nproc_per_node,
                       spec.options.steps, spec.options.warmup, spec.options.backend,
                       spec.options.timeout_s,  # a failed trial scores 10 x the timeout: one study per timeout
                       [[name, repr(value)] for name, value in workload.fixed]],  # --fix: a narrower space
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def open_study(workload, spec: RunSpec, storage: str | None, study_name: str | None, seed: int):
    """Create or load the measured study ("autopar-measured-<key>" by default); its storage object."""
    import optuna  # optuna: heavy, imported on first use

    from sqlalchemy.exc import SQLAlchemyError  # sqlalchemy: heavy, imported on first use

    name = study_name or f"autopar-measured-{study_key(workload, spec)}"
    try:
        store = open_storage(storage) if storage else optuna.storages.InMemoryStorage()
        study = optuna.create_study(storage=store, study_name=name, load_if_exists=True, direction="minimize",
                                    sampler=optuna.samplers.TPESampler(multivariate=True, seed=seed))
    except SQLAlchemyError as e:  # a server down or unreachable, a database refused
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise AutoparError(f"cannot open Optuna storage {shown(storage)}: {first_line}") from None
    made_for = study.user_attrs.get("measured_key")
    if made_for is None and not study.trials:
        study.set_user_attr("measured_key", study_key(workload, spec))
    elif made_for != study_key(workload, spec):
        raise AutoparError(f"study {name!r} was made for another measured search ({made_for or 'not autopar'}); "
                           f"use another --study-name")
    return study, store


def complete(study) -> list:
    import optuna  # optuna: heavy, imported on first use

    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def measured_search(workload, spec: RunSpec, launcher: Launcher, trials: int, *, storage: str | None = None,
                    study_name: str | None = None, seed: int = 0, say=lambda msg: None) -> dict:
    """Run the study to `trials` complete trials; the best measured plan and the study's trials."""
    import optuna  # optuna: heavy, imported on first use

    if trials < 1:
        raise AutoparError(f"--trials must be at least 1, got {trials}")
    check_space(workload)
    failed_s = 10 * spec.options.timeout_s  # worse than any run that ended within its --timeout
    study, store = open_study(workload, spec, storage, study_name, seed)
    missing = trials - len(complete(study))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        _run_trials(workload, spec, launcher, study, store, missing, failed_s, seed, say)
    except Exception as e:
        _storage_failed(storage, e)  # the database lost mid-search: one line
        raise
    done = complete(study)
    ok = [t for t in done if t.value < failed_s]
    best = min(ok, key=lambda t: t.value) if ok else None
    return {"study": study.study_name, "trials": len(done),
            "best": None if best is None else {"plan": best.user_attrs["plan"], "step_s": best.value,
                                               "trial": best.number},
            "runs": [{"trial": t.number, "plan": Plan.from_dict(t.user_attrs["plan"]).describe(),
                      "outcome": t.user_attrs.get("outcome", "ok" if t.value < failed_s else "failed"),
                      "step_s": t.value if t.value < failed_s else None} for t in done]}


def _tune(workload, spec: RunSpec, launcher, study, store, trials: int, failed_s: float, seed: int) -> None:
    """`trials` Ray Tune trials, Optuna (OptunaSearch on this study) as the search algorithm. A
    trial of one node runs its `autopar run` in the trial itself; of several, as a Ray Train job."""
    import optuna  # optuna: heavy, imported on first use
    from ray import tune  # ray: heavy, imported on first use
    from ray.tune.search.optuna import OptunaSearch  # ray: heavy, imported on first use

    connect(launcher.address)
    with warnings.catch_warnings():  # Optuna: "heartbeat ... supposed to be used with Study.optimize" (Tune asks)
        warnings.simplefilter("ignore")
        searcher = OptunaSearch(space=TrialSpace(workload), metric=METRIC, mode="min", study_name=study.study_name,
                                storage=store,
                                sampler=optuna.samplers.TPESampler(multivariate=True, seed=seed + len(study.trials)))
    o = spec.options
    resources = {"GPU" if o.backend == "nccl" else "CPU": o.nproc_per_node if o.nnodes == 1 else 0}
    trainable = tune.with_resources(tune.with_parameters(_trial, spec=spec, failed_s=failed_s), resources)
    tuner = tune.Tuner(trainable, tune_config=tune.TuneConfig(search_alg=searcher, num_samples=trials,
                                                              max_concurrent_trials=1, reuse_actors=True),
                       run_config=tune.RunConfig(storage_path=launcher.storage, name="autopar-measured-search",
                                                 verbose=0))
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr):  # Tune's tables: not on --json's stdout
        warnings.simplefilter("ignore")
        tuner.fit()


class TrialSpace:
    """OptunaSearch's define-by-run space: the trial's plan (Tune pickles its searcher's state)."""

    def __init__(self, workload):
        self.workload = workload

    def __call__(self, trial) -> dict:
        return {"plan": trial_plan(trial, self.workload).to_dict()}


def _trial(config: dict, spec: RunSpec, failed_s: float) -> None:
    """One Ray Tune trial: its plan's run, the measured step reported to Tune (and so to Optuna)."""
    from ray import tune  # ray: heavy, imported on first use

    plan = Plan.from_dict(config["plan"])
    trial_id = tune.get_context().get_trial_id()
    if spec.options.nnodes == 1:  # one node: `autopar run` in this trial, on the resources Tune gave it
        with tempfile.TemporaryDirectory(prefix="autopar-tune-") as tmp:
            plan_path, trace_tmp = Path(tmp) / "plan.json", Path(tmp) / "trace.jsonl"
            plan.save(plan_path)
            record, _ = node_record(run_argv(plan_path, spec, trace_tmp), trace_tmp, spec.options.timeout_s)
        record = record and with_job(record, {"launcher": "ray", "id": f"tune-{trial_id}"}, spec.trace)
    else:  # several nodes: a Ray Train job of its own
        record = RayLauncher().measure(plan, spec)
    value, outcome = score(record, failed_s)
    tune.report({METRIC: value, "outcome": outcome})


def _run_trials(workload, spec: RunSpec, launcher: Launcher, study, store, missing: int, failed_s: float, seed: int,
                say) -> None:
    """The missing trials: Ray Tune trials under the ray launcher, else Optuna's own loop."""
    if missing > 0 and launcher.name == "ray":
        _tune(workload, spec, launcher, study, store, missing, failed_s, seed)
    elif missing > 0:
        def objective(trial) -> float:
            plan = trial_plan(trial, workload)
            say(f"trial {trial.number}: {plan.describe()}")
            value, outcome = score(launcher.measure(plan, spec), failed_s)
            trial.set_user_attr("outcome", outcome)
            return value

        study.optimize(objective, n_trials=missing)
