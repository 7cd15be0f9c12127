"""The executor on one GPU: a few minutes, one JSON line per check.

    python experiments/gpu_smoke.py              # every check
    python experiments/gpu_smoke.py --only dcp   # the checks whose name contains "dcp"
    python experiments/gpu_smoke.py --list

World size 1 on NCCL (NCCL refuses two ranks on one GPU; tests/test_executor_plans.py runs the
multi-rank plans on gloo). What CPU CI cannot see: the backend and device chosen, peak memory
after `apply` and during steps, CUDA-event against wall-clock step time, fp32 parity against CPU
and GPU references with TF32 on and off (cuDNN convolutions default to TF32), bf16/fp16 with
selective and full recompute against references in their precision, selective recompute's
memory with CUDA's dropout, ZeRO-3 with optimizer offload, a DCP checkpoint saved under ZeRO-3
and loaded under ZeRO-0, `autopar run --check-parity` through torchrun on NCCL, and the
CUDA-OOM outcome. Without a GPU the same script runs on gloo and marks the GPU-only checks
skipped (tests/test_gpu_smoke.py runs some of it so it cannot rot). Each line has "ok" where a
check has a verdict; parity lines carry the tolerance of their precision.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from autopar.executor.mesh import resolve_backend
from autopar.executor.parity import deterministic, parity_report, reference_losses
from autopar.executor.state import load_checkpoint, save_checkpoint
from autopar.executor.train_step import apply
from autopar.modelfile import load_model_file
from autopar.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if CUDA else torch.device("cpu")
MODELS = {"gpt": {"size": "tiny", "dropout": 0.0}, "llama": {"size": "tiny"}, "vit": {"size": "tiny", "dropout": 0.0}}
BATCH, STEPS = 8, 3


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def plan(**kw) -> Plan:
    return Plan(**{"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 4, "num_micro_batches": 2, "precision": "fp32", **kw})


def batch(name: str, args: dict):
    torch.manual_seed(1)
    return load_model_file(name).example_batch(BATCH, device="cpu", **args)


def reference(name: str, args: dict, precision: str, device) -> list[float]:
    zoo = load_model_file(name)
    return reference_losses(lambda: zoo.build(**args), adamw, zoo.loss_fn, [batch(name, args)] * STEPS,
                            precision=precision, device=device)


def train(name: str, p: Plan, args: dict | None = None, steps: int = STEPS, seed: int = 0):
    """Apply `p` (world size 1) and train; the ParallelModel and what was measured."""
    zoo, args = load_model_file(name), args or MODELS[name]
    par = apply(p, lambda: zoo.build(**args), adamw, zoo.loss_fn, tp_plan=zoo.tp_plan, blocks=zoo.blocks, seed=seed,
                backend="nccl" if CUDA else "gloo")
    info = {"backend": dist.get_backend(), "device": str(par.device),
            "params_on": sorted({f"{q.device}{' pinned' if q.is_pinned() else ''}" for q in par.model.parameters()})}
    if CUDA:  # apply resets the peak: what is allocated now is the sharded model and optimizer
        info["after_apply_MB"] = torch.cuda.memory_allocated() / 2**20
        info["peak_during_apply_reset"] = torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        events[0].record()
    local = par.local_batch(*batch(name, args))
    started = time.perf_counter()
    losses = [par.train_step(*local) for _ in range(steps)]
    if CUDA:
        events[1].record()
        torch.cuda.synchronize()
        info.update(event_ms=events[0].elapsed_time(events[1]), step_peak_MB=torch.cuda.max_memory_allocated() / 2**20)
    info["wall_ms"] = (time.perf_counter() - started) * 1e3
    if steps:
        info["losses"] = par.global_losses(losses)
    return par, info


def parity(name: str, precision: str = "fp32", **kw) -> dict:
    """Train a plan; its losses against references on the CPU (fp32) and on this device (the plan's precision)."""
    _, info = train(name, plan(precision=precision, **kw))
    info["cpu_fp32"] = parity_report(info["losses"], reference(name, MODELS[name], "fp32", "cpu"), "fp32",
                                     torch.device("cpu"))
    info.update(parity_report(info["losses"], reference(name, MODELS[name], precision, DEVICE), precision, DEVICE))
    info["ok"] = info["parity_ok"]
    return info


def with_tf32(name: str) -> dict:
    """Parity with TF32 in fp32 matmuls and convolutions (cuDNN's default): the difference is the
    point, not a failure; `main` turns TF32 off again for every other check."""
    if not CUDA:
        return {"skipped": "no GPU: TF32 is a CUDA setting"}
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "tf32"
    try:
        out = parity(name)
    finally:
        deterministic()
    out["ok"] = True
    return out


def cuda_graphs() -> dict:
    """The cuda_graphs knob: torch.compile(mode="reduce-overhead") of each block, replayed as CUDA graphs,
    with selective recompute (never run before a GPU was lent: docs/plan-space.md)."""
    if not CUDA:
        return {"skipped": "no GPU: CUDA graphs are refused elsewhere (autopar.capability)"}
    return parity("gpt", "bf16", compile=True, cuda_graphs=True, recompute="selective")


def recompute_memory() -> dict:
    """Peak step memory of a GPT with dropout under no / selective / full recompute (CUDA's dropout
    is one native_dropout op; selective recompute redoes it whole, as on the CPU)."""
    if not CUDA:
        return {"skipped": "no GPU: CUDA's dropout kernel and allocator statistics"}
    args = {"size": "tiny", "dropout": 0.1, "seq_len": 256}
    peaks = {}
    for mode, extra in (("none", {}), ("selective", {}), ("full", {"recompute_blocks": 4})):
        _, info = train("gpt", plan(precision="bf16", recompute=mode, **extra), args=args)
        peaks[f"{mode}_step_peak_MB"] = info["step_peak_MB"]
    none, selective, full = peaks.values()
    return {**peaks, "ok": full <= selective <= none}


def dcp_roundtrip() -> dict:
    with tempfile.TemporaryDirectory() as d:
        saved, a = train("gpt", plan(zero=3), steps=2)
        save_checkpoint(saved, d, step=2)
        resumed, _ = train("gpt", plan(), steps=0, seed=123)  # other weights: the checkpoint must win
        step = load_checkpoint(resumed, d)
        b = resumed.global_losses([resumed.train_step(*resumed.local_batch(*batch("gpt", MODELS["gpt"])))])
    report = parity_report(a["losses"] + b, reference("gpt", MODELS["gpt"], "fp32", DEVICE), "fp32", DEVICE)
    return {"step": step, "curve": a["losses"] + b, **report, "ok": step == 2 and report["parity_ok"]}


def autopar_run() -> dict:
    """`autopar run --check-parity` through torchrun, NCCL on a GPU (after this process's group is gone)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as d:
        plan(num_micro_batches=1, micro_batch_size=8).save(f"{d}/p.json")
        ran = subprocess.run([sys.executable, "-m", "autopar", "run", f"{d}/p.json", "gpt", "--model-arg", "size=tiny",
                              "--model-arg", "dropout=0.0", "--steps", "3", "--warmup", "1", "--check-parity",
                              "--trace", f"{d}/t.jsonl"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        trace = Path(d) / "t.jsonl"
        record = json.loads(trace.read_text().splitlines()[-1]) if trace.exists() else {}
    measured = record.get("measured", {})
    return {"rc": ran.returncode, "outcome": record.get("outcome"), "backend": record.get("cluster", {}).get("backend"),
            "parity": {k: v for k, v in measured.items() if k.startswith("parity")},
            "ok": ran.returncode == 0 and measured.get("parity_ok") is True, "tail": (ran.stdout + ran.stderr)[-400:]}


def gpu_tests() -> dict:
    if not CUDA:
        return {"skipped": "no GPU: the CUDA-OOM test needs one"}
    if dist.is_initialized():
        dist.destroy_process_group()
    tests = ["tests/test_executor_run.py::test_cuda_oom_is_an_outcome_not_a_crash",
             "tests/test_executor_run.py::test_single_rank_run_checks_parity",
             "tests/test_executor_units.py::test_single_rank_apply_matches_the_plain_loop"]
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    return {"rc": ran.returncode, "ok": ran.returncode == 0, "tail": ran.stdout[-800:]}


def environment() -> dict:
    info = {"torch": torch.__version__, "cuda": CUDA, "gpus": torch.cuda.device_count() if CUDA else 0,
            "auto_backend_1_rank": resolve_backend("auto", 1), "auto_backend_2_ranks": resolve_backend("auto", 2)}
    if CUDA:
        info.update(gpu=torch.cuda.get_device_name(), matmul_fp32=torch.backends.cuda.matmul.fp32_precision,
                    conv_fp32=torch.backends.cudnn.conv.fp32_precision)
    info["ok"] = info["auto_backend_1_rank"] == ("nccl" if CUDA else "gloo")
    return info


CHECKS = {
    "backend and devices": environment,
    "gpt fp32 zero0 2 micro-batches: parity, peak memory, event vs wall time": lambda: parity("gpt"),
    "gpt fp32 zero3 (FSDP2): parity, memory after apply": lambda: parity("gpt", zero=3),
    "llama fp32 (SDPA kernels): parity": lambda: parity("llama"),
    "vit fp32, TF32 on (cuDNN default): parity": lambda: with_tf32("vit"),
    "vit fp32, TF32 off, deterministic: parity": lambda: parity("vit"),
    "gpt bf16 selective recompute: parity in bf16": lambda: parity("gpt", "bf16", recompute="selective"),
    "gpt bf16 full recompute: parity in bf16": lambda: parity("gpt", "bf16", recompute="full", recompute_blocks=2),
    "gpt fp16 selective recompute (loss scaling): parity in fp16": lambda: parity("gpt", "fp16", recompute="selective"),
    "gpt fp16 full recompute zero3: parity in fp16": lambda: parity("gpt", "fp16", recompute="full", recompute_blocks=2,
                                                                    zero=3),
    "gpt bf16 selective recompute memory with dropout": recompute_memory,
    "gpt bf16 compiled blocks as CUDA graphs, selective recompute: parity in bf16": cuda_graphs,
    "gpt bf16 zero3 offload (pinned CPU shards): parity": lambda: parity("gpt", "bf16", zero=3, offload_optimizer=True),
    "gpt fp16 zero3 offload (CPU found-inf on the GPU group): parity":
        lambda: parity("gpt", "fp16", zero=3, offload_optimizer=True),
    "dcp save zero3, load zero0": dcp_roundtrip,
    "autopar run --check-parity (torchrun)": autopar_run,
    "cuda oom and single-rank tests (pytest)": gpu_tests,
}


def check(name: str) -> dict:
    try:
        out = CHECKS[name]()
    except Exception as e:  # noqa: BLE001 - one failed check must not hide the others
        traceback.print_exc()
        out = {"ok": False, "FAILED": f"{type(e).__name__}: {str(e)[:300]}"}
    line = {"check": name, **out}
    print(json.dumps(line), flush=True)
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="run only the checks whose name contains this")
    p.add_argument("--list", action="store_true", help="list the checks")
    args = p.parse_args(argv)
    names = [n for n in CHECKS if not args.only or args.only in n]
    if args.list:
        print("\n".join(names))
        return 0
    deterministic()  # before the first CUDA call: cuBLAS reads its workspace setting once
    lines = [check(n) for n in names]
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if all(line.get("ok", True) for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
