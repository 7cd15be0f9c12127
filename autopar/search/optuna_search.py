"""The Optuna baseline: a multivariate TPE study over the plan space, one cost-model
evaluation per trial.

A trial walks the space knob by knob (`autopar.search.space.sample`): for every decision it
suggests a position in [0, 1] and the walk takes the valid choice nearest to it
(`Knob.position_of`), so each parameter keeps one distribution across trials and every trial
is a valid plan. Every
trial suggests every knob, including the ones its plan ignores, so multivariate TPE models
the knobs jointly. Plans that do not fit in memory are infeasible through a constraint (peak
memory minus GPU memory). With a storage URL (SQLite's file, or a PostgreSQL server that
processes on several machines share: autopar/search/study_storage.py) the study is resumable:
`trials` is the study's total budget, so rerunning a killed search runs only the trials still
missing, and processes sharing one study stop together at exactly the budget. Trials beat a
heartbeat on the storage: one left RUNNING by a killed process is failed after GRACE_S and retried
with its parameters (Optuna's RetryHeartbeatStaleTrialCallback, which replaced
RetryFailedTrialCallback in 4.9).
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from contextlib import contextmanager

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autopar.axes import FOLDED
from autopar.cost import PlanArrays, evaluate
from autopar.errors import AutoparError
from autopar.knobs import decisions, knob
from autopar.plan import Plan
from autopar.search.base import Planner
from autopar.search.sampling import best_distinct, check_space, nearest
from autopar.search.space import sample
from autopar.search.study_storage import GRACE_S, HEARTBEAT_S, RETRIES, open_storage, shown

CONSTRAINT = "memory_over_gb"  # peak memory per GPU minus GPU memory: feasible when <= 0
OPEN_ATTEMPTS = 5  # opening a storage that another process is creating at the same moment
ORPHAN_S = 20  # a trial RUNNING this long that never beat was killed before its first heartbeat


class OptunaPlanner(Planner):
    name = "optuna"

    def __init__(self, trials: int = 200, storage: str | None = None, study_name: str | None = None,
                 seed: int | None = 0, progress: bool = True):
        super().__init__()
        if trials < 1:
            raise AutoparError(f"--trials must be at least 1, got {trials}")
        self.trials, self.storage, self.study_name, self.seed = trials, storage, study_name, seed
        self.progress = progress

    def propose(self, workload, k: int = 1) -> list[Plan]:
        optuna = _import_optuna()
        check_space(workload)
        self.evaluations = 0
        with _quiet(optuna):
            study = self._study(optuna, workload)
            complete = (optuna.trial.TrialState.COMPLETE,)
            done = len(study.get_trials(deepcopy=False, states=complete))
            with _progress_bar(self.progress, done, self.trials) as advance:
                try:
                    self._fill_budget(study, lambda trial: self._objective(trial, workload), advance)
                except Exception as e:
                    _storage_failed(self.storage, e)
                    raise
            trials = study.get_trials(deepcopy=False, states=complete)
        plans = [Plan.from_dict(t.user_attrs["plan"]) for t in trials]
        result = {"iteration_time": [t.value for t in trials],
                  "fits": [t.constraints[CONSTRAINT] <= 0 for t in trials],
                  "peak_memory": [t.user_attrs["peak_memory"] for t in trials]}
        best, extra = best_distinct(workload, plans, result, k, "optuna")
        self.evaluations += extra
        return best

    def _fill_budget(self, study, objective, advance) -> None:
        """Run trials until the study holds `trials` complete ones. When none can start because
        the missing ones are RUNNING elsewhere, wait: another process finishes them, or they
        belonged to a killed process and go stale after GRACE_S, fail, and are retried here."""
        from optuna.storages import fail_stale_trials  # optuna: heavy, imported on first use
        from optuna.trial import TrialState  # optuna: heavy, imported on first use

        idle_since, watched = None, {}
        while True:
            fail_stale_trials(study)  # a no-op without heartbeats (an in-memory study)
            done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
            if done >= self.trials:
                return
            study.optimize(objective, n_trials=self.trials - done, callbacks=[advance])
            if len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) > done:
                idle_since = None
                continue
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > ORPHAN_S + GRACE_S:
                return  # the other processes' trials never finished nor went stale
            _fail_orphans(study, watched)
            time.sleep(HEARTBEAT_S / 2)

    def _objective(self, trial, workload) -> float:
        _within_budget(trial, self.trials)
        if self.storage and self.seed is not None:
            # a stored study draws each trial from the seed and its number: processes sharing the study
            # with one --seed would otherwise draw the same plans, and a resumed run replay the first's
            import optuna  # optuna: heavy, imported on first use

            trial.study.sampler = optuna.samplers.TPESampler(multivariate=True, seed=self.seed + trial.number)

        plan = trial_plan(trial, workload)
        res = evaluate(workload, PlanArrays.from_plans([plan], workload.profile))
        self.evaluations += 1
        peak = float(res["peak_memory"][0])
        trial.set_user_attr("peak_memory", peak)
        trial.set_constraint(CONSTRAINT, (peak - workload.memory_budget) / 1e9)
        return float(res["iteration_time"][0])

    def _study(self, optuna, workload):
        """Create the study, or load it when the storage has it (checking it is this workload's)."""
        from sqlalchemy.exc import SQLAlchemyError  # Optuna's RDB storage is SQLAlchemy

        key = _study_key(workload)
        name = self.study_name or (f"autopar-{key}" if self.storage else None)
        for attempt in range(OPEN_ATTEMPTS):
            try:
                storage = self.storage and open_storage(self.storage)
                study = optuna.create_study(storage=storage, study_name=name, load_if_exists=True,
                                            direction="minimize")
                break
            except SQLAlchemyError as e:  # a bad URL or file, a server that refuses the connection
                first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
                # processes started together on a new database race to create its tables and version row
                # ("already exists", "UNIQUE constraint failed", "locked"): the loser retries
                if attempt + 1 < OPEN_ATTEMPTS:
                    time.sleep(0.2 * (attempt + 1))
                    continue
                raise AutoparError(f"cannot open Optuna storage {shown(self.storage)}: {first_line}") from None
        made_for = study.user_attrs.get("workload_key")
        if made_for is None and not study.trials:
            study.set_user_attr("workload_key", key)
            study.set_user_attr("workload", workload.describe())
        elif made_for != key or study.direction != optuna.study.StudyDirection.MINIMIZE:
            raise AutoparError(f"study {name!r} in {shown(self.storage)} was made for another search "
                               f"({study.user_attrs.get('workload', 'not autopar')}); use another --study-name")
        study.sampler = optuna.samplers.TPESampler(multivariate=True, seed=self.seed)
        return study


def _fail_orphans(study, watched: dict[int, float]) -> None:
    """Fail and retry trials this process has watched RUNNING for ORPHAN_S while it waited: a
    process killed between creating a trial and its first heartbeat leaves one, and Optuna's stale
    check skips trials without a heartbeat. A live trial beats within HEARTBEAT_S and lasts
    milliseconds. Timed on this process's own clock (`watched`: trial number -> when first seen):
    a trial's start time is its creator's clock, another machine's, maybe in another time zone."""

    from optuna.storages import RetryHeartbeatStaleTrialCallback  # optuna: heavy, imported on first use
    from optuna.trial import TrialState  # optuna: heavy, imported on first use

    now = time.monotonic()
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if now - watched.setdefault(t.number, now) > ORPHAN_S:
            study.tell(t.number, state=TrialState.FAIL)
            RetryHeartbeatStaleTrialCallback(max_retry=RETRIES)(study, study.trials[t.number])


def _storage_failed(url: str | None, error: BaseException) -> None:
    """One line when the study's database failed mid-search (a server down, unreachable, refusing
    the database): Optuna surfaces it as its StorageInternalError, or as an UnboundLocalError from
    its own trial loop, with SQLAlchemy's error in the chain. Nothing completed is lost there."""
    from sqlalchemy.exc import SQLAlchemyError  # sqlalchemy: heavy, imported on first use

    seen, cause = set(), error
    while cause is not None and id(cause) not in seen and not isinstance(cause, SQLAlchemyError):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if url is None or not isinstance(cause, SQLAlchemyError):
        return
    first_line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    raise AutoparError(f"the Optuna storage {shown(url)} failed mid-search: {first_line}; its completed trials "
                       f"are kept: rerun the same command to resume") from None


def trial_plan(trial, workload) -> Plan:
    """The plan a trial suggests: one position in [0, 1] per knob, the valid choice nearest to it,
    so a knob keeps one distribution across trials; every knob suggested (multivariate TPE models
    them jointly), the plan kept as the trial's user attribute. The measured search
    (autopar/traces/launchers/search.py) walks the space the same way."""
    constant = _constant_folded(workload)

    def choose(k, choices) -> int:
        if k.name in constant:
            return 0
        positions = np.array([k.position_of(c, choices) for c in choices])
        return nearest(positions, _suggest(trial, k))

    plan = sample(workload, choose)
    for k in decisions():
        if k.name not in trial.params and k.name not in constant:
            _suggest(trial, k)
    trial.set_user_attr("plan", plan.to_dict())
    return plan


def _within_budget(trial, budget: int) -> None:
    """Keep the study's budget exact across processes: a trial runs only if fewer than `budget`
    trials numbered before it completed, run or wait to run (a failed one does not count: its
    retry does). Trial numbers are assigned by the storage in order, so two processes never
    both take the last slot; the one that finds the budget spent stops its loop."""
    import optuna  # optuna: heavy, imported on first use

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)
    before = sum(t.number < trial.number for t in trial.study.get_trials(deepcopy=False, states=states))
    if before >= budget:
        trial.study.stop()
        raise optuna.TrialPruned(f"the study's budget of {budget} trials is spent")


def _constant_folded(workload) -> set[str]:
    """Folded axes with one degree whatever the others (ep for a dense model): left out of every
    trial of the study, so they add no dimension for TPE to search."""
    world = workload.world_size
    return {name for name, f in FOLDED.items()
            if len(knob(name).choices(workload, {a: world for a in f.within})) == 1}


def _suggest(trial, knob) -> float:
    """A position in [0, 1]: one of the fixed slots of a categorical knob (TPE models them as
    categories), any share of its range for a degree, micro-batch or recompute count."""
    if knob.slots is not None:
        n = len(knob.slots)
        return trial.suggest_categorical(knob.name, list(range(n))) / max(n - 1, 1)
    return trial.suggest_float(knob.name, 0.0, 1.0)


def _study_key(workload) -> str:
    """A short hash of everything the study's space and objective depend on."""
    key = [workload.profile.digest, workload.cluster.to_dict(), workload.global_batch, workload.optimizer,
           workload.memory_headroom]
    if workload.fixed:  # a study under `--fix` searched a narrower space (none: the key studies had before)
        key.append([[name, repr(value)] for name, value in workload.fixed])
    text = json.dumps(key, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _import_optuna():
    try:
        import optuna  # optuna: heavy, imported on first use
    except ImportError:
        raise AutoparError("the optuna method needs Optuna: pip install 'autopar[search]'") from None
    return optuna


@contextmanager
def _quiet(optuna):
    """Silence Optuna's line per trial (the progress bar replaces it) and its warnings that the
    heartbeat API is experimental, then restore both."""

    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(before)


@contextmanager
def _progress_bar(enabled: bool, done: int, total: int):
    """A rich bar on stderr, as a study callback; trials already in a resumed study count as done."""

    with Progress(TextColumn("optuna"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                  disable=not enabled) as bar:
        task = bar.add_task("", total=total, completed=done)
        best = float("inf")

        def advance(study, trial) -> None:
            nonlocal best
            if trial.state.name != "COMPLETE":  # pruned past the budget, or failed
                return
            if trial.constraints[CONSTRAINT] <= 0:
                best = min(best, trial.value)
            bar.update(task, advance=1, description=f"best {best:.4g} s" if best < float("inf") else "none fits yet")

        yield advance
