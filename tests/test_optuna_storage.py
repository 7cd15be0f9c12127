"""Optuna studies on a PostgreSQL server (issue 43): search processes share one study to its budget
exactly, and one killed with SIGKILL loses no completed trial while its running trial is failed by
its stale heartbeat and retried; processes sharing a study with one seed draw different plans. The
server is real: initdb and pg_ctl from the system's packages (.ci/run installs them), run as an
unprivileged user (postgres refuses root) in a temporary folder on a free loopback port, stopped
after the module."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from conftest import workload

from autopar.errors import AutoparError
from autopar.search import get_planner, optuna_search

optuna = pytest.importorskip("optuna")
psycopg = pytest.importorskip("psycopg", reason="the PostgreSQL driver: pip install -e '.[dev]'")
TESTS = Path(__file__).resolve().parent


# The quick test comes first: the server fixture is torn down after the module's last test, and a test
# not marked slow may start no process (tests/conftest.py), pg_ctl stop included.
@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")  # the heartbeat's
def test_processes_that_open_a_study_together_with_one_seed_draw_different_plans(tmp_path):
    """Each trial of a stored study draws from the seed and its number: two searches that open an empty
    study at the same moment with the default seed do not spend the budget on the same plans."""
    w, url = workload(size="tiny"), f"sqlite:///{tmp_path}/study.db"
    planners = [optuna_search.OptunaPlanner(trials=4, storage=url, progress=False) for _ in range(2)]
    studies = [p._study(optuna, w) for p in planners]  # both open the study before either runs a trial
    for planner, study in zip(planners, studies):
        study.optimize(lambda trial: planner._objective(trial, w), n_trials=2)
    drawn = [tuple(sorted(t.params.items())) for t in studies[0].trials]
    assert len(drawn) == 4 and len(set(drawn)) == 4



@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")  # the orphan is made by ask(), on purpose
def test_a_trial_that_never_beat_is_failed_on_the_waiting_process_clock(tmp_path, monkeypatch):
    """A trial left RUNNING without a heartbeat by a worker on another machine whose clock is an hour
    ahead (its start time lies in this process's future) is still failed and retried: the waiting
    process times it on its own clock."""
    monkeypatch.setattr(optuna_search, "ORPHAN_S", 1)
    w, db = workload(size="tiny"), tmp_path / "study.db"
    planner = optuna_search.OptunaPlanner(trials=3, storage=f"sqlite:///{db}", progress=False)
    orphan = planner._study(optuna, w).ask()  # created, then its process died before the first heartbeat
    with sqlite3.connect(db) as con:
        con.execute("UPDATE trials SET datetime_start = datetime(datetime_start, '+1 hour') WHERE number = ?",
                    (orphan.number,))
    planner.propose(w, 1)
    trials = optuna.load_study(study_name=planner._study(optuna, w).study_name, storage=f"sqlite:///{db}").trials
    assert trials[orphan.number].state == optuna.trial.TrialState.FAIL
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in trials) == 3

def postgres_bin() -> Path | None:
    """initdb's folder: on PATH, or Debian's /usr/lib/postgresql/<version>/bin (not on PATH)."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server for the module; yields a function that creates a database and returns its URL."""
    bindir = postgres_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): apt-get install postgresql (.ci/run does)")
    folder = Path(tempfile.mkdtemp(prefix="autopar-pg-"))  # not under tmp_path: the server's user must reach it
    run_as = {}
    if os.geteuid() == 0:  # postgres refuses to run as root: as the package's user (else nobody), owning the folder
        users = {u.pw_name: u for u in pwd.getpwall()}
        user = users.get("postgres") or users["nobody"]
        os.chown(folder, user.pw_uid, user.pw_gid)
        run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
    env = {"PATH": os.environ.get("PATH", ""), "LC_ALL": "C"}

    def pg(*args):
        return subprocess.run([str(bindir / args[0]), *args[1:]], capture_output=True, text=True, cwd=folder,
                              env=env, timeout=120, **run_as)

    data = folder / "data"
    made = pg("initdb", "-D", data, "-U", "autopar", "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C")
    if made.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.fail(f"initdb failed: {made.stderr[-1000:]}")
    for _ in range(3):  # another process may take the free port before the server binds it
        port = free_port()
        options = (f"-h 127.0.0.1 -p {port} -k {folder} -c fsync=off -c synchronous_commit=off "
                   f"-c full_page_writes=off -c max_connections=50")
        started = pg("pg_ctl", "-D", data, "-l", folder / "server.log", "-w", "-t", "60", "-o", options, "start")
        if started.returncode == 0:
            break
    else:
        log = (folder / "server.log").read_text() if (folder / "server.log").exists() else started.stderr
        shutil.rmtree(folder, ignore_errors=True)
        pytest.fail(f"the PostgreSQL server did not start: {log[-1000:]}")

    def database(name: str) -> str:
        with psycopg.connect(host="127.0.0.1", port=port, user="autopar", dbname="postgres", autocommit=True) as con:
            con.execute(f"CREATE DATABASE {name}")
        return f"postgresql://autopar@127.0.0.1:{port}/{name}"

    try:
        yield database
    finally:
        pg("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)


# A search process: waits for the test's go (so the two processes search at the same time), tags each trial it
# runs with its name, and takes 0.05 s more a trial; the victim hangs in its third trial's evaluation (its parameters
# suggested) until it is killed.
CHILD = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import autopar.search.optuna_search as optuna_search
from conftest import workload

me, folder = {me!r}, Path({folder!r})
work = workload(size="tiny")
objective, evaluate, count, number = optuna_search.OptunaPlanner._objective, optuna_search.evaluate, 0, None

def tagged(self, trial, workload):
    global count, number
    trial.set_user_attr("worker", me)
    count, number = count + 1, trial.number
    return objective(self, trial, workload)

def slow(*args, **kwargs):
    if me == "victim" and count == 3:
        (folder / "hung").write_text(str(number))
        time.sleep(600)
    time.sleep(0.05)
    return evaluate(*args, **kwargs)

optuna_search.OptunaPlanner._objective, optuna_search.evaluate = tagged, slow
(folder / (me + ".ready")).touch()
while not (folder / "go").exists():
    time.sleep(0.02)
optuna_search.OptunaPlanner(trials={trials}, storage={url!r}, progress=False).propose(work, 1)
"""


@pytest.fixture
def spawned():
    """The test's search processes; any still running when it ends (a failed assertion) are killed."""
    children = []
    yield children
    for child in children:
        if child.poll() is None:
            child.kill()
            child.wait()


def start(tmp_path, names, url, trials, spawned):
    """The search processes, ready and then let go together."""
    children = {}
    for me in names:
        script = tmp_path / f"{me}.py"
        script.write_text(textwrap.dedent(CHILD.format(tests=str(TESTS), me=me, folder=str(tmp_path), url=url,
                                                       trials=trials)))
        children[me] = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE)
        spawned.append(children[me])
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"{me}.ready").exists() for me in names):
        assert time.monotonic() < deadline and all(c.poll() is None for c in children.values()), \
            [c.stderr.read().decode()[-2000:] for c in children.values() if c.poll() is not None]
        time.sleep(0.05)
    (tmp_path / "go").touch()
    return children


def finished(child, timeout=180) -> None:
    assert child.wait(timeout=timeout) == 0, child.stderr.read().decode()[-2000:]


def the_study(url):
    (name,) = optuna.get_all_study_names(url)
    return optuna.load_study(study_name=name, storage=url)


@pytest.mark.slow  # the server and the search processes
def test_two_processes_share_one_study_to_its_budget_exactly(postgres, tmp_path, spawned):
    url, trials = postgres("budget"), 12
    children = start(tmp_path, ["one", "two"], url, trials, spawned)
    for child in children.values():
        finished(child)
    study = the_study(url)
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(complete) == trials
    assert {t.user_attrs["worker"] for t in complete} == {"one", "two"}  # both searched the one study
    # no trial beyond the budget was evaluated: the others were stopped before their plan
    assert sum("plan" in t.user_attrs for t in study.trials) == trials
    assert {t.state for t in study.trials} <= {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED}


@pytest.mark.slow
def test_a_killed_process_loses_no_trial_and_its_running_trial_fails(postgres, tmp_path, spawned):
    url, trials = postgres("killed"), 10
    children = start(tmp_path, ["survivor", "victim"], url, trials, spawned)
    deadline = time.monotonic() + 120
    while not (tmp_path / "hung").exists():
        assert time.monotonic() < deadline and children["victim"].poll() is None, \
            children["victim"].stderr.read().decode()[-2000:]
        time.sleep(0.02)
    hung = int((tmp_path / "hung").read_text())
    complete = optuna.trial.TrialState.COMPLETE
    done = the_study(url).get_trials(states=(complete,))
    before = {t.number: (t.params, t.value) for t in done}
    assert sum(t.user_attrs["worker"] == "victim" for t in done) == 2  # the victim's trials before the hung one
    os.kill(children["victim"].pid, signal.SIGKILL)
    assert children["victim"].wait() == -signal.SIGKILL
    finished(children["survivor"])

    study = the_study(url)
    after = {t.number: (t.params, t.value) for t in study.get_trials(states=(complete,))}
    assert len(after) == trials and all(after[n] == v for n, v in before.items())  # nothing completed was lost
    killed = study.trials[hung]
    assert killed.user_attrs["worker"] == "victim" and killed.state == optuna.trial.TrialState.FAIL
    retried = [t for t in study.trials if t.system_attrs.get("failed_trial") == hung]
    assert [(t.state, t.params, t.user_attrs["worker"]) for t in retried] == [(complete, killed.params, "survivor")]
    assert optuna.trial.TrialState.RUNNING not in {t.state for t in study.trials}


@pytest.mark.slow
def test_server_errors_are_one_line(postgres):
    """A server that refuses the connection, and a driver that is not installed: one line each, no password."""
    w = workload(size="tiny")
    url = postgres("errors").replace("autopar@", "autopar:secret@")
    port = url.split(":")[-1].split("/")[0]
    refused = url.replace(f":{port}/", f":{free_port()}/")
    for bad, why in ((refused, "Connection refused"), (url.replace("/errors", "/nosuchdb"), "nosuchdb"),
                     (url.replace("postgresql://", "postgresql+nosuchdriver://"), "nosuchdriver"),
                     (url.replace("postgresql://", "mysql://"), "MySQLdb")):
        with pytest.raises(AutoparError, match=f"cannot open Optuna storage .*{why}") as e:
            get_planner("optuna", trials=2, storage=bad, progress=False).propose(w)
        assert "\n" not in str(e.value) and "secret" not in str(e.value), str(e.value)



@pytest.mark.slow
def test_a_server_lost_mid_search_is_one_line_and_keeps_the_completed_trials(postgres, monkeypatch):
    """The database stops accepting connections after two trials (as when its server goes down or
    the network to it fails): the search stops with one line, and the trials it completed are there."""
    url, w = postgres("lost"), workload(size="tiny")
    admin = url.rsplit("/", 1)[0] + "/postgres"
    evaluate, count = optuna_search.evaluate, [0]

    def cut(*args, **kwargs):
        count[0] += 1
        if count[0] == 3:
            with psycopg.connect(admin, autocommit=True) as con:
                con.execute("ALTER DATABASE lost ALLOW_CONNECTIONS false")
                con.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'lost'")
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(optuna_search, "evaluate", cut)
    with pytest.raises(AutoparError, match="failed mid-search: .*not currently accepting connections.* rerun") as e:
        get_planner("optuna", trials=10, storage=url, progress=False).propose(w)
    assert "\n" not in str(e.value)
    with psycopg.connect(admin, autocommit=True) as con:
        con.execute("ALTER DATABASE lost ALLOW_CONNECTIONS true")
    assert len(the_study(url).get_trials(states=(optuna.trial.TrialState.COMPLETE,))) == 2
