"""Faults in `autopar run`, injected into one of 4 gloo ranks of a tiny GPT, all runs appending to
one trace file: kill -9, SIGTERM, an exception, os._exit, an out-of-memory (a memory cap set on
the running rank with setrlimit), and SIGSTOP. For each run: the exit status, the wall time
against the bound, whether the last line of stderr names the failing rank, how many lines and
Python tracebacks stderr holds (the ranks' own output goes to the log folder that line names,
not the terminal; each run's stderr is kept as runN.stderr), and the outcome the trace records;
at the end, the records in the trace (none may be lost) and leftover workers.

    python experiments/fault_campaign.py [--runs 20] [--rank 2] [--timeout 300] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("kill9", "sigterm", "raise", "os_exit", "oom", "sigstop")
EXPECTED = {"kill9": "rank_failed", "sigterm": "rank_failed", "raise": "rank_failed", "os_exit": "rank_failed",
            "oom": "oom", "sigstop": "timeout"}
MODEL = '''
import os, pathlib
from autopar.zoo.gpt import GPT, config, example_batch, tp_plan, blocks  # noqa: F401

class Faulty(GPT):
    """Marks each forward of each rank in FAULT_DIR; on FAULT_RANK from step 3 on, faults as FAULT says."""
    steps = 0

    def forward(self, tokens):
        rank, out = os.environ.get("RANK"), os.environ.get("FAULT_DIR")
        if out and rank is not None:
            Faulty.steps += 1
            pathlib.Path(out, f"rank{rank}.step{Faulty.steps}").touch()
            if rank == os.environ.get("FAULT_RANK") and Faulty.steps >= 3:
                if os.environ.get("FAULT") == "raise":
                    raise RuntimeError(f"injected fault on rank {rank}")
                if os.environ.get("FAULT") == "os_exit":
                    os._exit(9)
        return super().forward(tokens)

def build_model(**kw):
    return Faulty(config(**kw))
'''


def workers(tag: str) -> dict[int, int]:
    """rank -> pid of this campaign's live worker processes (found by an environment tag)."""
    found = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (p / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):
            continue
        if env.get("FAULT_TAG") == tag and "RANK" in env and state != "Z":
            found[int(env["RANK"])] = int(p.name)
    return found


def inject(fault: str, pid: int) -> None:
    if fault == "kill9":
        os.kill(pid, signal.SIGKILL)
    elif fault == "sigterm":
        os.kill(pid, signal.SIGTERM)
    elif fault == "sigstop":
        os.kill(pid, signal.SIGSTOP)
    elif fault == "oom":  # cap the rank's address space at what it uses now: its next allocation fails
        vm = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if line.startswith("VmSize:"))
        resource.prlimit(pid, resource.RLIMIT_AS, (vm, vm))


def one_run(i: int, fault: str, args, d: Path, trace: Path) -> dict:
    tag = f"{os.getpid()}-{i}"
    marks = d / f"marks{i}"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FAULT": fault, "FAULT_TAG": tag,
           "FAULT_RANK": str(args.rank), "FAULT_DIR": str(marks)}
    cmd = [sys.executable, "-m", "autopar", "run", str(d / "p.json"), str(d / "faulty.py"), "--model-arg", "size=tiny",
           "--model-arg", "dropout=0.0", "--nproc-per-node", "4", "--steps", "200", "--warmup", "1",
           "--trace", str(trace), "--timeout", str(args.timeout)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    injected = fault in ("raise", "os_exit")
    while proc.poll() is None and not injected and time.monotonic() - started < args.timeout:
        if (marks / f"rank{args.rank}.step3").exists():
            pid = workers(tag).get(args.rank)
            if pid:
                inject(fault, pid)
                injected = True
        time.sleep(0.1)
    try:
        _, err = proc.communicate(timeout=args.timeout + 120)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    wall = time.monotonic() - started
    time.sleep(1)
    left = workers(tag)
    for pid in left.values():  # the campaign cleans up after a failure to, and counts it
        os.kill(pid, signal.SIGKILL)
    (d / f"run{i}.stderr").write_text(err)
    lines = [line for line in err.splitlines() if line.strip()]
    last = (lines or [""])[-1]
    return {"run": i, "fault": fault, "rc": proc.returncode, "wall_s": round(wall, 1), "last_line": last,
            "names_rank": f"rank {args.rank}" in last, "stderr_lines": len(lines),
            "tracebacks": err.count("Traceback (most recent call last)"), "leftover_workers": len(left),
            "injected": injected}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--rank", type=int, default=2, help="the rank that faults (of 4)")
    ap.add_argument("--timeout", type=float, default=300, help="autopar run --timeout (the bound)")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--out", default=None, help="folder for the trace and results (default: a temporary one)")
    args = ap.parse_args()
    d = Path(args.out or tempfile.mkdtemp(prefix="autopar-faults-"))
    d.mkdir(parents=True, exist_ok=True)
    (d / "faulty.py").write_text(MODEL)
    plan = {"schema_version": 1, "dp": 4, "tp": 1, "pp": 1, "micro_batch_size": 2, "num_micro_batches": 1,
            "precision": "fp32"}
    (d / "p.json").write_text(json.dumps(plan))
    trace = d / "trace.jsonl"
    faults = args.faults.split(",")
    results = []
    for i in range(args.runs):
        r = one_run(i, faults[i % len(faults)], args, d, trace)
        print(json.dumps(r), flush=True)
        results.append(r)
    from autopar.traces.record import read_records

    records, problems = read_records(trace)
    outcomes = [rec.outcome for rec in records]
    right = sum(o == EXPECTED[r["fault"]] for o, r in zip(outcomes, results))
    print(f"runs {len(results)} / records {len(records)} (lost {len(results) - len(records)}, malformed "
          f"{len(problems)}) / expected outcome {right} / last line names rank {sum(r['names_rank'] for r in results)}"
          f" / within bound {sum(r['wall_s'] < args.timeout + 60 for r in results)} / nonzero exit "
          f"{sum(r['rc'] not in (0, None) for r in results)} / leftover workers "
          f"{sum(r['leftover_workers'] for r in results)} / tracebacks on stderr "
          f"{sum(r['tracebacks'] > 0 for r in results)} (most stderr lines {max(r['stderr_lines'] for r in results)});"
          f" trace {trace}")
    print("outcomes:", {f: [o for o, r in zip(outcomes, results) if r["fault"] == f] for f in faults})
    return 0


if __name__ == "__main__":
    sys.exit(main())
