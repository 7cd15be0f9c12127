"""`autopar run` end to end (acceptance 2), its fault handling (acceptance 3), the measured
reward backend, and the example script: real torchrun launches on gloo, small and few."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import error_lines, free_port
from test_traces_record import make_record

from autopar.executor.options import RunOptions
from autopar.plan import Plan
from autopar.traces import append_record, read_records
from autopar.traces.reward import MeasuredReward

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model-arg", "size=tiny", "--model-arg", "dropout=0.0"]
FAULTY_MODEL = '''
import os, time
from autopar.zoo.gpt import GPT, config, example_batch, tp_plan, blocks  # noqa: F401

class Faulty(GPT):
    def forward(self, tokens):
        if os.environ.get("RANK") == "1":
            {action}
        return super().forward(tokens)

def build_model(**kw):
    return Faulty(config(**kw))
'''


def ranks(n) -> list:
    """Launch flags for n ranks on this machine: gloo pinned, since with fewer GPUs than ranks NCCL cannot run them."""
    return ["--nproc-per-node", n, "--backend", "gloo"]


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def autopar(*args, cwd, timeout=240, wait=True):
    cmd = [sys.executable, "-m", "autopar", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout, check=False)


def save_plan(path, **kw) -> Path:
    base = {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 4, "num_micro_batches": 1, "precision": "fp32"}
    Plan(**{**base, **kw}).save(path)
    return path


def only_record(path):
    records, problems = read_records(path)
    assert problems == [] and len(records) == 1
    return records[0]


@pytest.mark.slow
def test_a_searched_plan_runs_on_4_ranks_and_writes_a_trace(tmp_path):
    found = autopar("search", "gpt", *TINY, "--cluster", "cpu", "--global-batch", 16, "-o", "plan.json",
                    cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    plan = Plan.load(tmp_path / "plan.json")
    ran = autopar("run", "plan.json", "gpt", *TINY, *ranks(plan.world_size), "--steps", 3,
                  "--warmup", 1, "--trace", "t.jsonl", "--cluster", "cpu", cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "median step" in ran.stdout and "loss per step" in ran.stdout
    record = only_record(tmp_path / "t.jsonl")
    assert record.outcome == "ok" and record.error is None and Plan.from_dict(record.plan) == plan
    m = record.measured
    assert len(m["step_times_s"]) == 3 and len(m["losses"]) == 4 and len(m["peak_memory_bytes"]) == plan.world_size
    assert m["median_step_s"] > 0 and m["tokens_per_s"] > 0 and min(m["peak_memory_bytes"]) > 0
    assert record.workload == {"global_batch": 16, "seq_len": 32}
    assert record.cluster["backend"] == "gloo" and record.cluster["gpus_per_node"] == plan.world_size
    assert record.model["dims"]["hidden"] == 64 and record.model["params"] > 0
    assert record.predicted["iteration_time_s"] > 0 and record.predicted["peak_memory_gb"] > 0


@pytest.mark.slow
def test_single_rank_run_checks_parity(tmp_path):
    save_plan(tmp_path / "p.json", micro_batch_size=2, num_micro_batches=2, recompute="full", recompute_blocks=2)
    ran = autopar("run", "p.json", "gpt", *TINY, "--steps", 2, "--warmup", 1, "--check-parity",
                  "--trace", "t.jsonl", cwd=tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    measured = only_record(tmp_path / "t.jsonl").measured
    assert measured["parity_max_rel_diff"] < 1e-5 and measured["parity_ok"] is True
    assert measured["parity_tolerance"] == 1e-5 and measured["parity_reference"] in ("cpu fp32", "cuda fp32")


@pytest.mark.slow
def test_a_plan_for_another_world_size_is_refused_before_launch(tmp_path):
    save_plan(tmp_path / "p.json", dp=2)
    ran = autopar("run", "p.json", "gpt", *TINY, *ranks(4), "--trace", "t.jsonl", cwd=tmp_path, timeout=60)
    assert ran.returncode == 2
    assert "needs dp x tp x pp x cp = 2 x 1 x 1 x 1 = 2 ranks but --nnodes 1 x --nproc-per-node 4 = 4" in ran.stderr
    assert len(error_lines(ran.stderr)) == 1 and not (tmp_path / "t.jsonl").exists()



@pytest.mark.slow
def test_two_nodes_on_one_machine_match_one_process(tmp_path):
    """Every single-node plan matches the single-process losses (test_executor_parity); two
    launchers on this machine, dp across the "nodes", must match them too."""
    save_plan(tmp_path / "p.json", dp=2, tp=2)  # tp inside a node, dp across the two nodes
    common = ["run", "p.json", "gpt", *TINY, "--steps", 2, "--warmup", 1, *ranks(2), "--nnodes", 2,
              "--master-addr", "127.0.0.1", "--master-port", free_port()]
    node1 = autopar(*common, "--node-rank", 1, cwd=tmp_path, wait=False)
    node0 = autopar(*common, "--node-rank", 0, "--trace", "t.jsonl", "--check-parity", cwd=tmp_path)
    assert node1.wait(timeout=120) == 0 and node0.returncode == 0, node0.stdout + node0.stderr
    record = only_record(tmp_path / "t.jsonl")
    assert record.cluster["nodes"] == 2 and len(record.measured["peak_memory_bytes"]) == 4
    assert record.measured["parity_max_rel_diff"] < 1e-5


def faulty_model(tmp_path, action: str) -> Path:
    path = tmp_path / "faulty.py"
    path.write_text(FAULTY_MODEL.format(action=action))
    return path


def test_a_rank_that_lost_its_peer_is_not_named_even_when_it_ended_first(tmp_path):
    """Under load the raising rank's teardown can outlast its peer, which raised on the closed
    connection and ended first: the peer's error (gloo's "Connection closed by peer") is a
    consequence, so the rank that raised its own error is named (in-process, faked failures)."""
    import json
    from types import SimpleNamespace

    from autopar.executor.launch import _failure
    from autopar.executor.worker import failure_note

    result = tmp_path / "result.json"
    echo = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:11398."
    for rank, t, message in ((1, 1.0, "RuntimeError: injected failure on rank 1"), (0, 2.0, echo)):
        Path(failure_note(result, rank)).write_text(json.dumps({"time": t, "message": message}))
    raised = SimpleNamespace(signal_name=lambda: "<N/A>", exitcode=1, timestamp=0)
    err = SimpleNamespace(failures={0: raised, 1: raised})
    assert _failure(err, result, SimpleNamespace(gone={0: 0, 1: 1})) == (
        "rank_failed", "rank 1 failed: RuntimeError: injected failure on rank 1")
    assert _failure(err, result, SimpleNamespace(gone={})) == (
        "rank_failed", "rank 1 failed: RuntimeError: injected failure on rank 1")


@pytest.mark.parametrize("action,shown", [
    ('raise RuntimeError("injected failure on rank 1")', "rank 1 failed: RuntimeError: injected failure on rank 1"),
    ("os.kill(os.getpid(), 9)", "rank 1 failed: killed by SIGKILL"),  # e.g. the OOM killer
    ("os._exit(9)", "rank 1 failed: exited with code 9 without raising (os._exit or sys.exit)"),
])
@pytest.mark.slow
def test_a_failing_rank_fails_the_job_quickly_and_is_named(tmp_path, action, shown):
    """Rank 0 fails too (its peer is gone); the message must name the cause, not the echo. It is stderr's one
    line (issue 39 point 8; a slow machine may add the profiler's wait notice) and names the launcher's log
    folder, which holds torchrun's agent log and the failed rank's own output."""
    model = faulty_model(tmp_path, action)
    save_plan(tmp_path / "p.json", dp=2)
    started = time.monotonic()
    ran = autopar("run", "p.json", model, *TINY, *ranks(2), "--trace", "t.jsonl", cwd=tmp_path)
    assert time.monotonic() - started < 120
    assert ran.returncode != 0
    err = error_lines(ran.stderr)
    assert len(err) == 1 and "Traceback" not in ran.stderr, err
    assert err[0].startswith(f"autopar: run failed (rank_failed): {shown}; every rank's ")
    assert shown in ran.stdout.replace("\n", " ")
    record = only_record(tmp_path / "t.jsonl")
    assert record.outcome == "rank_failed" and record.error == shown
    logs = Path(err[0].rsplit("launcher's log: ", 1)[1])
    try:
        assert (logs / "agent.log").is_file()
        if action.startswith("raise"):
            assert "injected failure on rank 1" in "".join(f.read_text() for f in logs.glob("*/attempt_*/1/*"))
    finally:
        shutil.rmtree(logs, ignore_errors=True)


@pytest.mark.slow
def test_a_rank_that_hangs_in_a_collective_times_out(tmp_path):
    model = faulty_model(tmp_path, "time.sleep(3600)")  # rank 0 waits for it in the all-reduce
    save_plan(tmp_path / "p.json", dp=2)
    started = time.monotonic()
    ran = autopar("run", "p.json", model, *TINY, *ranks(2), "--timeout", 30, "--trace", "t.jsonl",
                  cwd=tmp_path)
    assert ran.returncode != 0 and time.monotonic() - started < 135  # profiling, then at most 30 s
    record = only_record(tmp_path / "t.jsonl")
    assert record.outcome == "timeout" and "--timeout 30" in record.error
    assert "rank 1 was" in record.error and "faulty.py" in record.error, record.error  # the sleeper, not its peer
    assert ran.stderr.strip().splitlines()[-1].startswith(f"autopar: run failed (timeout): {record.error}; every ")


def _stat(pid) -> list[str]:
    """State, parent pid, ... of a process ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _stat(p.name)[1:2] == [str(pid)]]


def _running(pid: int) -> bool:
    return _stat(pid)[:1] not in ([], ["Z"])  # a zombie has exited; only its parent has not reaped it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_kill_9_of_the_launcher_leaves_whole_lines_and_no_workers(tmp_path):
    save_plan(tmp_path / "p.json", dp=2)
    trace = tmp_path / "t.jsonl"
    append_record(trace, make_record())  # an earlier run's line (written here: a run to write it starts 3 processes)
    launcher = autopar("run", "p.json", "gpt", *TINY, *ranks(2), "--steps", 100000, "--trace", trace,
                       cwd=tmp_path, wait=False)
    deadline = time.monotonic() + 60
    while len(_children(launcher.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    workers = _children(launcher.pid)
    assert len(workers) == 2, "workers did not start"
    time.sleep(3)  # mid-run
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    only_record(trace)  # the earlier run's line, whole; nothing half-written
    deadline = time.monotonic() + 20
    while any(map(_running, workers)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(map(_running, workers)), "orphaned workers kept running"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_a_stopped_rank_is_named_through_its_heartbeat_and_killed(tmp_path):
    """SIGSTOP: the rank's peers wait in a collective, torchrun sees nothing fail; the heartbeat
    goes stale, the launcher kills the stopped rank, and the record names it."""
    from autopar.executor.launch import STALE_S

    model = faulty_model(tmp_path, "os.kill(os.getpid(), 19)")  # SIGSTOP itself in its first forward
    save_plan(tmp_path / "p.json", dp=2)
    started = time.monotonic()
    ran = autopar("run", "p.json", model, *TINY, *ranks(2), "--trace", "t.jsonl", cwd=tmp_path)
    assert ran.returncode == 1 and time.monotonic() - started < STALE_S + 120
    record = only_record(tmp_path / "t.jsonl")
    assert record.outcome == "timeout" and record.error.startswith("rank 1 stopped responding"), record.error
    assert ran.stderr.strip().splitlines()[-1].startswith(f"autopar: run failed (timeout): {record.error}; every ")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_sigint_to_the_launcher_is_interrupted_130_and_ends_the_workers(tmp_path):
    save_plan(tmp_path / "p.json", dp=2)
    launcher = subprocess.Popen([sys.executable, "-m", "autopar", "run", "p.json", "gpt", *TINY, *map(str, ranks(2)),
                                 "--steps", "100000", "--trace", "t.jsonl"], cwd=tmp_path, env=env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while len(_children(launcher.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    workers = _children(launcher.pid)
    assert len(workers) == 2, "workers did not start"
    time.sleep(3)
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130 and err.strip().splitlines()[-1] == "autopar: interrupted", err[-2000:]
    assert not any(map(_running, workers)), "workers outlived the launcher"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA out-of-memory needs a GPU")
@pytest.mark.slow
def test_cuda_oom_is_an_outcome_not_a_crash(tmp_path):
    model = faulty_model(tmp_path, "pass").read_text().replace(
        "return super().forward(tokens)", "return super().forward(tokens) + torch.empty(1 << 50, device='cuda')")
    (tmp_path / "faulty.py").write_text("import torch\n" + model)
    save_plan(tmp_path / "p.json")
    ran = autopar("run", "p.json", tmp_path / "faulty.py", *TINY, "--trace", "t.jsonl", cwd=tmp_path)
    assert ran.returncode == 1
    assert only_record(tmp_path / "t.jsonl").outcome == "oom"


@pytest.mark.slow
def test_measured_reward_runs_in_process_and_is_cached_by_workload_and_plan(tmp_path, monkeypatch):
    """The reward calls the executor's launcher in this process (no `python -m autopar run` child:
    only torchrun's workers are started), and caches by workload and plan."""
    import autopar.traces.run_plan as run_plan_module

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    real_popen, launches = subprocess.Popen, []

    def popen(*a, **kw):
        argv = list(map(str, kw.get("args", a[0] if a else [])))
        assert "autopar" not in argv[:4], f"the reward shelled out: {argv}"
        return real_popen(*a, **kw)

    def launch(*a, **kw):
        launches.append(a)
        return real_launch(*a, **kw)

    real_launch = run_plan_module.launch
    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(run_plan_module, "launch", launch)
    cache = tmp_path / "cache.json"
    handler = signal.getsignal(signal.SIGINT)
    options = RunOptions(steps=2, warmup=1, timeout_s=120)
    reward = MeasuredReward("gpt", {"size": "tiny"}, options, cache_path=cache, trace_path=tmp_path / "t.jsonl")
    plan = Plan(dp=1, tp=1, pp=1, micro_batch_size=4, num_micro_batches=1, precision="fp32")
    first = reward(plan)
    assert len(launches) == 1 and launches[0][3].steps == 2  # the launcher, as a library, with these options
    assert signal.getsignal(signal.SIGINT) is handler  # torchrun's agent left no handler of its own behind
    assert "AUTOPAR_LAUNCHER_PID" not in os.environ  # nor the launcher its workers' variable
    assert not first["cached"] and first["record"]["outcome"] == "ok"
    assert first["reward"] == -first["record"]["measured"]["median_step_s"] < 0
    assert len(first["record"]["measured"]["step_times_s"]) == 2 and len(first["record"]["measured"]["losses"]) == 3
    again = MeasuredReward("gpt", {"size": "tiny"}, options, cache_path=cache)(plan)
    assert again["cached"] and again["reward"] == first["reward"] and len(launches) == 1
    assert reward.key(plan) != reward.key(plan.with_(zero=1))
    assert len(read_records(tmp_path / "t.jsonl")[0]) == 1
    repeated = reward.run(plan)  # a repeated run (traces collect --repeats) measures again
    assert not repeated["cached"] and len(read_records(tmp_path / "t.jsonl")[0]) == 2 and len(launches) == 2
    for call in (reward, reward.run):
        with pytest.raises(Exception, match="= 2 ranks but this reward backend runs 1"):
            call(plan.with_(dp=2))
    refused = reward(plan.with_(grad_comm_dtype="bf16"))  # gloo has no bf16 reduction: refused, nothing ran
    assert refused["reward"] == reward.failure_reward and refused["record"] is None and len(launches) == 2


@pytest.mark.slow
def test_the_example_trains_saves_and_resumes_under_another_plan(tmp_path):
    example = ROOT / "experiments" / "train_with_plan.py"
    save_plan(tmp_path / "dp2.json", dp=2, micro_batch_size=8)
    save_plan(tmp_path / "pp2.json", pp=2, micro_batch_size=4, num_micro_batches=4)

    def torchrun(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example),
               "--backend", "gloo", *map(str, args)]
        return subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240, check=False)

    first = torchrun("dp2.json", "--steps", 4, "--save", tmp_path / "ckpt")
    assert first.returncode == 0, first.stderr
    resumed = torchrun("pp2.json", "--steps", 6, "--resume", tmp_path / "ckpt")
    assert resumed.returncode == 0, resumed.stderr
    steps = [line.split() for line in (first.stdout + resumed.stdout).splitlines() if line.startswith("step")]
    assert [int(s[1]) for s in steps] == [1, 2, 3, 4, 5, 6]
    assert float(steps[-1][3]) < float(steps[0][3])
