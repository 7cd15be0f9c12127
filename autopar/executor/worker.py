"""One rank of `autopar run`: torchrun starts `python -m autopar.executor.worker` per rank.

The worker applies the plan, trains warm-up + timed steps on the model's example batch, and
rank 0 writes the measurement (every rank's step times and peak memory, the global-batch
losses) as JSON for the launcher. Errors propagate: `record` writes them to torchrun's error
file, so the launcher can show the failing rank's message.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import time
from functools import partial

from autopar.atomic import write_text_atomic
from autopar.executor.lifeline import die_with_parent
from autopar.executor.mixed_layout import is_mixed_plan_file
from autopar.executor.options import OPTIMIZERS, WORKER, ElasticSpec, RunOptions, add_run_flags
from autopar.mixed.plan import MixedPlan
from autopar.plan import Plan


def parse_args(argv=None) -> argparse.Namespace:
    """The worker's files, and its run options as `autopar.executor.options` declares them."""
    p = argparse.ArgumentParser(prog="python -m autopar.executor.worker")
    p.add_argument("--plan", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--model-args", default="{}", help="JSON object of model arguments")
    p.add_argument("--result", required=True, help="where rank 0 writes the measurement JSON")
    add_run_flags(p, WORKER)
    p.add_argument("--elastic-spec", type=ElasticSpec.from_json, default=None,
                   help="an elastic run's ElasticSpec as JSON: train to step warmup + steps, resuming and re-planning")
    args = p.parse_args(argv)
    args.options = RunOptions.from_args(args, elastic=args.elastic_spec)
    return args


LAUNCHER_PID = "AUTOPAR_LAUNCHER_PID"  # set by `launch` for its workers


def _die_with_launcher() -> None:
    """An orphaned rank must not keep training (and holding a GPU) once its launcher is killed
    (`lifeline`: SIGTERM when the launcher is gone, or gone already). No polling thread: a thread
    started before torch loads aborts the rank when memory runs out ("cannot allocate memory for
    thread-local data", exit 127) before the rank can report its out-of-memory error."""
    die_with_parent(int(os.environ.get(LAUNCHER_PID, os.getppid())), signal.SIGTERM, poll_s=None)


def failure_note(result_path, rank) -> str:
    """Where a failing rank notes its error and when it happened, next to the result file."""
    return f"{result_path}.rank{rank}.failure"


def heartbeat_file(result_path, rank) -> str:
    """Where a rank beats: its pid, the step it is at, and (by the file's mtime) that it lives."""
    return f"{result_path}.rank{rank}.beat"


HEARTBEAT_S = 1.0  # a rank rewrites its heartbeat file this often, from a thread of its own
_progress = {"step": -1}  # the training step this rank is in (-1: starting up)
_stepped = threading.Event()  # set by the training loop at each step


def _where(frame) -> str:
    """`file:line function` of the main thread's innermost frame: where a hung rank waits."""
    if frame is None:
        return ""
    return f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"


def _beat(path: str) -> None:
    """Beat until the process ends. A thread keeps beating while the main thread waits in a
    collective, so a stale beat means the whole process is stopped (SIGSTOP) or gone."""

    main = threading.main_thread().ident
    while True:
        try:
            write_text_atomic(path, json.dumps({"pid": os.getpid(), "step": _progress["step"], "time": time.time(),
                                                "where": _where(sys._current_frames().get(main))}))
        except Exception:  # noqa: BLE001, S110 - a full disk must not kill the rank; the launcher sees the stale beat
            pass
        _stepped.wait(HEARTBEAT_S)  # a new step beats at once: the launcher knows the step a stopped rank was at
        _stepped.clear()


def main(argv=None) -> None:
    """Bind to the launcher first, then import torch (seconds) and train. `record` writes an
    uncaught error to torchrun's error file; the failure note adds a precise time, so the
    launcher can tell the rank that failed first from peers that failed because of it (error
    files carry whole seconds only)."""
    _die_with_launcher()
    args = parse_args(argv)
    rank = os.environ.get("RANK", "0")
    threading.Thread(target=_beat, args=(heartbeat_file(args.result, rank),), daemon=True).start()
    from torch.distributed.elastic.multiprocessing.errors import record  # torch: heavy, imported on first use

    try:
        record(_train, error_handler=_whole_error_file())(args)
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the launcher says "interrupted", once
        os._exit(130)
    except Exception as e:
        first = (str(e).strip().splitlines() or ["(no message)"])[0]
        write_text_atomic(failure_note(args.result, rank),
                          json.dumps({"time": time.time(), "message": f"{type(e).__name__}: {first}"}))
        raise


def _whole_error_file():
    """torch's error handler, writing the error file aside and renaming it into place: torchrun's
    agent reads a failed rank's file as soon as the rank has ended, and a rank the agent terminated
    while it wrote its own (a peer that failed on the lost connection) left half a file, on which
    the agent raised JSONDecodeError instead of reporting the job's failure."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler  # torch: heavy, imported on first use

    class WholeErrorFile(ErrorHandler):
        aside: str | None = None

        def _get_error_file_path(self):
            return self.aside or super()._get_error_file_path()

        def record_exception(self, e: BaseException) -> None:
            final = super()._get_error_file_path()
            if not final:
                return super().record_exception(e)
            self.aside = f"{final}.partial"
            try:
                super().record_exception(e)
            finally:
                self.aside = None
            os.replace(f"{final}.partial", final)

    return WholeErrorFile()


def _no_dropout(build):
    from autopar.executor.parity import without_dropout  # pulls torch: imported on first use

    return without_dropout(build())


def _train(args: argparse.Namespace) -> None:
    import torch  # torch: heavy, imported on first use
    import torch.distributed as dist  # torch: heavy, imported on first use

    from autopar.executor.measure import peak_memory_bytes, summarize, synchronize, tokens_per_sample  # torch
    from autopar.executor.parity import (  # torch
        deterministic,
        mismatch_causes,
        parity_report,
        parity_verdict,
        reference_losses,
    )
    from autopar.executor.train_step import apply  # pulls torch: imported on first use
    from autopar.modelfile import load_model_file  # pulls torch: imported on first use

    mixed = MixedPlan.load(args.plan) if is_mixed_plan_file(args.plan) else None  # lanes over GPU groups
    plan = Plan.load(args.plan) if mixed is None else None
    model_file = load_model_file(args.model)
    model_args = json.loads(args.model_args)
    options = args.options
    build = partial(model_file.build, **model_args)
    if options.no_dropout:
        build = partial(_no_dropout, build)
    optimizer = partial(getattr(torch.optim, OPTIMIZERS[options.optimizer]), lr=options.lr)
    if options.check_parity:  # the run and its reference alike
        deterministic()
    kwargs = {"tp_plan": model_file.tp_plan if model_file.has_tp_plan else None, "blocks": model_file.blocks,
              "seed": options.seed, "backend": options.backend, "timeout_s": options.timeout_s}
    elastic = _elastic(args, model_file, model_args, build, optimizer, mixed or plan, **kwargs) \
        if options.elastic else None  # trains all its steps itself
    if elastic:
        par = elastic.par
    elif mixed is not None:  # each rank labelled with its group, lane, segment, stage (autopar/executor/mixed.py)
        from autopar.executor.mixed import apply_mixed  # pulls torch: imported on first use

        par = apply_mixed(mixed, build, optimizer, model_file.loss_fn, **kwargs)
    else:
        par = apply(plan, build, optimizer, model_file.loss_fn, **kwargs)
    plan = par.plan
    torch.manual_seed(options.seed)
    inputs, targets = model_file.example_batch(plan.global_batch, device="cpu", **model_args)
    local_inputs, local_targets = par.local_batch(inputs, targets)
    times, losses = (elastic.step_times if elastic else []), []
    for step in range(0 if elastic else options.warmup + options.steps):
        _progress["step"] = step
        _stepped.set()
        synchronize(par.device)
        start = time.perf_counter()
        losses.append(par.train_step(local_inputs, local_targets))
        synchronize(par.device)
        times.append(time.perf_counter() - start)
    global_losses = par.global_losses(losses)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (times[options.warmup:] or times[-1:], peak_memory_bytes(par.device)))
    rank, backend, device = dist.get_rank(), dist.get_backend(), par.device
    labels = getattr(par, "labels", None)  # a mixed plan's ranks, by rank (none once re-planned onto one group)
    dist.barrier()  # no rank closes its connections while a peer still uses them
    # free the model (the reference needs the device's memory) and every reference to the process
    # groups (an elastic run holds `par` too), so that destroying them joins gloo's threads
    par.close()
    del local_inputs, local_targets, losses
    dist.destroy_process_group()
    if rank != 0:
        return
    measured = summarize([t for t, _ in gathered], [m for _, m in gathered], plan.global_batch,
                         tokens_per_sample(inputs))
    measured["losses"] = global_losses
    if options.elastic:  # the whole run's losses and re-plans, from the job folder
        measured.update(_elastic_measured(options.elastic.checkpoint_dir))
    if options.check_parity:  # on the plan's device and precision, now that no peer waits on this rank
        reference = reference_losses(build, optimizer, model_file.loss_fn, [(inputs, targets)] * len(global_losses),
                                     seed=options.seed, precision=plan.precision, device=device)
        measured.update(parity_report(global_losses, reference, plan.precision, device))
        measured["parity_verdict"] = parity_verdict(measured["parity_max_rel_diff"], mismatch_causes(build(), plan),
                                                    plan.precision)
    result = {"measured": measured, "seq_len": tokens_per_sample(inputs), "backend": backend,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if labels is not None:
        result["ranks"] = [label.to_dict() for label in labels]
    with open(args.result, "w", encoding="utf-8") as f:
        json.dump(result, f)


def step_batch(model_file, model_args: dict, seed: int, step: int, global_batch: int):
    """Step `step`'s batch of an elastic run: the model's example batch drawn with a seed of its own, so
    every plan and every resume sees the same data for the same step."""
    import torch  # torch: heavy, imported on first use

    with torch.random.fork_rng(devices=[]):  # leaves dropout's random stream alone
        torch.manual_seed(seed + 1_000_003 * (step + 1))
        return model_file.example_batch(global_batch, device="cpu", **model_args)


def _elastic(args: argparse.Namespace, model_file, model_args: dict, build, optimizer, plan, **kwargs):
    """An elastic run (`autopar.executor.elastic`) of `plan` (a Plan or a MixedPlan) to step warmup +
    steps, on the batches of `step_batch`."""
    from autopar.executor.elastic import train_elastic  # pulls torch: imported on first use
    from autopar.executor.rendezvous import WorkerSide  # pulls torch: imported on first use

    options, spec = args.options, args.options.elastic
    replan = None
    if spec.replanner:
        module, _, name = spec.replanner.partition(":")
        replan = getattr(importlib.import_module(module), name)(args)
    growth = WorkerSide.connect(spec.rdzv_endpoint) if spec.rdzv_endpoint else None
    return train_elastic(plan, build, optimizer, model_file.loss_fn, partial(step_batch, model_file, model_args,
                                                                             options.seed),
                         checkpoint_dir=spec.checkpoint_dir, steps=options.warmup + options.steps,
                         checkpoint_every=spec.checkpoint_every, replan=replan, growth=growth, on_step=_at_step,
                         node_group=spec.node_group, **kwargs)


def _at_step(step: int) -> None:
    _progress["step"] = step
    _stepped.set()


def _elastic_measured(checkpoint_dir) -> dict:
    from autopar.executor.elastic import JobDir  # pulls torch: imported on first use

    job = JobDir(checkpoint_dir)
    losses = job.losses()
    return {"losses": [loss for loss, _ in losses.values()], "loss_steps": list(losses),
            "loss_world_sizes": [world for _, world in losses.values()], "replans": [r.to_dict() for r in job.replans()],
            "plan": job.latest()["plan"]}


if __name__ == "__main__":
    main()
