"""Issue 39 point 8: faults and bad input a new user hit. Each is one line on stderr and exit
status 2 before any work starts, or the work is kept: mesh orders, `run --trace` into a missing
folder, empty workload lists, broken measurement caches, profile-cluster timeouts, calibrate's
progress line, a model file that keeps the profiler waiting, and the ranks' tracebacks (a failed rank's one
line naming its log folder: tests/test_executor_run.py::test_a_failing_rank_fails_the_job_quickly_and_is_named)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from autopar.cli import main
from autopar.errors import PlanError
from autopar.plan import Plan

TINY = ["--model-arg", "size=tiny"]
PLAN = {"schema_version": 1, "dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 2, "num_micro_batches": 2,
        "precision": "fp32"}


def one_error(capsys) -> str:
    """The command's stderr, which must be exactly one error line."""
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("autopar: error: "), err
    return err[0]


# -- mesh orders -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", [["pp", "dp"], ["dp", "cp", "tp"], ["tp"]])
def test_a_mesh_order_leaving_out_an_axis_is_refused(order):
    with pytest.raises(PlanError, match="leaves out|must be a permutation"):
        Plan.from_dict({**PLAN, "mesh_order": order})


def test_a_plan_written_before_cp_existed_still_loads_with_cp_in_its_default_place():
    assert Plan.from_dict({**PLAN, "mesh_order": ["pp", "dp", "tp"]}).mesh_order == ("pp", "dp", "cp", "tp")


def test_a_null_mesh_order_in_a_plan_file_is_one_line(tmp_path, capsys):
    (tmp_path / "p.json").write_text(json.dumps({**PLAN, "mesh_order": None}))
    assert main(["estimate", "gpt", *TINY, "--cluster", "cpu", "--plan", str(tmp_path / "p.json")]) == 2
    assert "mesh_order must be a list" in one_error(capsys)


def test_the_mesh_order_flag_must_name_every_axis(capsys):
    code = main(["estimate", "gpt", *TINY, "--cluster", "cpu", "--dp", "1", "--micro-batch", "1", "--global-batch",
                 "8", "--mesh-order", "pp,dp"])
    assert code == 2 and "leaves out tp" in one_error(capsys)


# -- run --trace into a folder that does not exist yet ------------------------------------------------------
RECORD = {"schema_version": 1, "time": "2026-01-01T00:00:00+00:00",
          "cluster": {"name": "cpu", "nodes": 1, "gpus_per_node": 2, "gpu": "cpu", "backend": "gloo"},
          "model": {"name": "gpt", "path": "gpt", "digest": "0" * 64, "args": {"size": "tiny"}, "dims": {},
                    "params": 6},
          "workload": {"global_batch": 4, "seq_len": 1}, "plan": {**PLAN, "micro_batch_size": 1},
          "measured": {"step_times_s": [0.1], "median_step_s": 0.1, "tokens_per_s": 40.0,
                       "peak_memory_bytes": [1.0, 1.0], "losses": [1.0]},
          "predicted": None, "outcome": "ok", "error": None, "versions": {}}


def test_a_measured_run_is_appended_to_a_trace_in_a_folder_not_made_yet(tmp_path):
    """`autopar run --trace nodir/t.jsonl` ran the whole job, then lost the measurement: the trace's
    folder is made as every output's is (check_output allowed the path before the launch)."""
    from autopar.atomic import check_output
    from autopar.traces.record import TraceRecord, append_record, read_records

    trace = tmp_path / "nodir" / "deeper" / "t.jsonl"
    check_output(trace, "--trace")  # what the CLI checks before launching
    append_record(trace, TraceRecord.from_dict(RECORD))
    records, problems = read_records(trace)
    assert len(records) == 1 and not problems and records[0].measured["median_step_s"] == 0.1


# -- train: an empty workload list, a broken measurement cache ------------------------------------------------
def test_an_empty_workload_list_is_one_line_and_keeps_the_policy(tmp_path, capsys):
    (tmp_path / "w.json").write_text("[]")
    policy = tmp_path / "pol.zip"
    policy.write_bytes(b"the user's policy")
    assert main(["train", "cost", "--workloads", str(tmp_path / "w.json"), "--timesteps", "64", "-o",
                 str(policy)]) == 2
    assert "lists no workloads" in one_error(capsys)
    assert policy.read_bytes() == b"the user's policy" and not (tmp_path / "pol.json").exists()


@pytest.mark.parametrize("cache", ["corrupt", "directory", "wrong_entry", "list"])
def test_a_measurement_cache_autopar_cannot_use_is_one_line_before_any_work(cache, tmp_path, capsys):
    path = tmp_path / "c.json"
    if cache == "directory":
        path.mkdir()
    else:
        path.write_text({"corrupt": "{bad", "wrong_entry": '{"k": {"reward": "x", "record": null}}',
                         "list": "[1, 2]"}[cache])
    assert main(["train", "measured", "gpt", *TINY, "--cache", str(path), "-o", str(tmp_path / "p.zip")]) == 2
    line = one_error(capsys)
    assert "c.json" in line and "Traceback" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_a_valid_measurement_cache_is_read_back(tmp_path):
    from autopar.traces.reward import read_cache

    path = tmp_path / "c.json"
    assert read_cache(path) == {}
    path.write_text(json.dumps({"k": {"reward": -0.5, "record": None}}))
    assert read_cache(path) == {"k": {"reward": -0.5, "record": None}}


# -- profile-cluster: a timeout no process count can meet ----------------------------------------------------
@pytest.mark.parametrize("timeout", ["0", "-3", "0.01", "nan"])
def test_a_profile_cluster_timeout_too_small_is_refused_before_any_process_starts(timeout, tmp_path, capsys):
    """In the quick tier a started process fails the test (tests/conftest.py): this one starts none."""
    assert main(["profile-cluster", "--timeout", timeout, "-o", str(tmp_path / "c.json")]) == 2
    assert "--timeout must be between" in one_error(capsys)
    assert not list(tmp_path.iterdir())


# -- calibrate: refused before its progress line -----------------------------------------------------------
def write_records(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_calibrate_refuses_a_record_naming_untrusted_code_before_any_progress_line(tmp_path, capsys):
    evil = tmp_path / "evil.py"
    evil.write_text("import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n")
    other = {**RECORD["plan"], "num_micro_batches": 4}
    write_records(tmp_path / "t.jsonl", [{**RECORD, "model": {**RECORD["model"], "path": str(evil), "name": "evil"},
                                          "plan": plan} for plan in (RECORD["plan"], other)])
    assert main(["calibrate", str(tmp_path / "t.jsonl"), "--cluster", "cpu", "-o", str(tmp_path / "c.json")]) == 2
    assert "does not run code it names" in one_error(capsys)
    assert not (tmp_path / "RAN").exists() and not (tmp_path / "c.json").exists()


def test_calibrate_refuses_too_few_runs_before_any_progress_line(tmp_path, capsys):
    write_records(tmp_path / "t.jsonl", [RECORD] * 3)  # one plan measured three times: one row
    assert main(["calibrate", str(tmp_path / "t.jsonl"), "--cluster", "cpu"]) == 2
    assert "too few measured rows" in one_error(capsys)


# -- a model file that keeps the profiler waiting says so, on stderr ----------------------------------------
class _SlowChild:
    """A stand-in for the profiling process: still running at the first wait, done at the second."""

    def __init__(self):
        self.waits = []

    def communicate(self, timeout):
        self.waits.append(timeout)
        if len(self.waits) == 1:
            raise subprocess.TimeoutExpired("profiler", timeout)
        return b"", b"the child's stderr"


def test_a_long_profile_prints_one_progress_line_on_stderr_and_waits_out_its_timeout(capsys):
    from autopar.profile import isolated

    child = _SlowChild()
    assert isolated._wait(child, "model.py", 120.0) == b"the child's stderr"
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"{isolated.PROGRESS} model.py (") and "--profile-timeout 120" in err
    assert child.waits[0] == isolated.PROGRESS_AFTER_S and 0 < child.waits[1] <= 120  # the rest of the 120 s


def test_a_short_profile_prints_nothing(capsys):
    from autopar.profile import isolated

    class Quick(_SlowChild):
        def communicate(self, timeout):
            return b"", b""

    assert isolated._wait(Quick(), "model.py", 120.0) == b""
    assert capsys.readouterr() == ("", "")


@pytest.mark.slow
def test_a_looping_model_file_shows_what_autopar_waits_for_and_keeps_stdout_clean(tmp_path):
    (tmp_path / "loop.py").write_text("while True:\n    pass\n")
    env = {**os.environ, "AUTOPAR_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "autopar", "search", str(tmp_path / "loop.py"), "--cluster", "cpu",
                           "--global-batch", "8", "--profile-timeout", "9", "--json"], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == ""
    assert len(err) == 2 and err[0].startswith("autopar: profiling ") and "--profile-timeout 9" in err[0], err
    assert err[1].startswith("autopar: error: ") and "did not finish within --profile-timeout 9" in err[1]


@pytest.mark.slow
def test_the_profiler_imports_the_model_files_neighbours_not_the_current_directorys(tmp_path):
    """The profiling child has the model file's directory on its path (its own helper module imports) and not the
    current directory, whose numpy.py (or cuda.py, or a checkout's autopar) would shadow the real one."""
    model, cwd = tmp_path / "model", tmp_path / "elsewhere"
    model.mkdir()
    cwd.mkdir()
    (model / "helper.py").write_text("WIDTH = 16\n")
    (model / "mymodel.py").write_text(
        "import torch\nfrom helper import WIDTH\n\n\ndef build_model():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))\n"
        "\n\ndef example_batch(batch_size):\n"
        "    return torch.randn(batch_size, WIDTH), torch.randint(0, WIDTH, (batch_size,))\n")
    (cwd / "numpy.py").write_text("raise ImportError('the numpy.py of the current directory')\n")
    env = {**os.environ, "AUTOPAR_CACHE_DIR": str(tmp_path / "cache")}
    # -P: as the `autopar` script runs, without the current directory on the path (`python -m` would put it there)
    done = subprocess.run([sys.executable, "-P", "-m", "autopar", "search", str(model / "mymodel.py"), "--cluster",
                           "cpu", "--global-batch", "8", "--json"], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["plan"]["dp"] >= 1


# -- a failed rank is one line; the other ranks' tracebacks go to the log folder it names ---------------------
def test_the_launch_sends_every_ranks_output_to_files_under_the_log_folder(tmp_path):
    from autopar.executor.launch import torchrun_argv
    from autopar.executor.options import RunOptions

    argv = torchrun_argv("p.json", "gpt", {}, RunOptions(nproc_per_node=2), tmp_path / "r.json", tmp_path / "logs")
    assert argv[argv.index("--redirects") + 1] == "3" and argv[argv.index("--log-dir") + 1] == str(tmp_path / "logs")


def test_the_agents_log_goes_to_the_file_while_it_runs_and_back_to_stderr_after(tmp_path, capsys):
    import logging

    from autopar.executor.launch import _agent_log

    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    before = logging.getLogger("torch.distributed").handlers[:]
    with _agent_log(tmp_path / "agent.log"):
        logger.warning("Sending process 1 closing signal SIGTERM")
    assert "closing signal SIGTERM" in (tmp_path / "agent.log").read_text()
    assert "SIGTERM" not in capsys.readouterr().err
    assert logging.getLogger("torch.distributed").handlers == before


def test_a_clean_job_leaves_no_log_folder_and_a_failed_one_keeps_it(tmp_path):
    from autopar.executor.launch import LaunchResult, _keep_logs

    for outcome, wrote, kept in (("ok", "", False), ("ok", "a warning", True), ("rank_failed", "", True)):
        logs = tmp_path / f"{outcome}-{bool(wrote)}"
        (logs / "job_x" / "attempt_0" / "1").mkdir(parents=True)
        (logs / "job_x" / "attempt_0" / "1" / "stderr.log").write_text(wrote)
        result = _keep_logs(logs, LaunchResult(outcome), range(2))
        assert logs.exists() == kept and result.logs == (str(logs) if kept else None)


def test_a_rank_terminated_while_writing_its_error_file_leaves_none_half_written(tmp_path, monkeypatch):
    """torchrun's agent parses every failed rank's error file: a peer it terminated while that peer
    wrote its own left an empty file, and the agent raised JSONDecodeError (a traceback instead of
    autopar's line). The worker writes the file aside and renames it into place."""
    from autopar.executor.worker import _whole_error_file

    final = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(final))
    handler = _whole_error_file()

    def terminated(*args, **kwargs):
        raise SystemExit("SIGTERM while writing")

    with monkeypatch.context() as m:
        m.setattr(json, "dump", terminated)
        with pytest.raises(SystemExit):
            try:
                raise RuntimeError("lost the connection to a peer")
            except RuntimeError as e:
                handler.record_exception(e)
    assert not final.exists()  # the agent finds no file, not half of one
    try:
        raise RuntimeError("injected fault on rank 2")
    except RuntimeError as e:
        handler.record_exception(e)
    assert json.loads(final.read_text())["message"]["message"] == "RuntimeError: injected fault on rank 2"
