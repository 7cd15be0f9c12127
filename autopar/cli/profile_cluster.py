"""`autopar profile-cluster`: measure this machine (all-reduce, matmul, memory) into a cluster JSON."""

from __future__ import annotations

import argparse
import os

from rich.console import Console
from rich.table import Table

from autopar.calibrate.cluster_profile import profile_cluster, write_cluster
from autopar.cli.common import print_json
from autopar.cluster.measured import store_measurement
from autopar.errors import AutoparError
from autopar.executor.options import BACKENDS

NAME = "profile-cluster"
MIN_TIMEOUT_S = 10.0  # starting a process count's workers (torch import, gloo set-up) alone takes seconds


def _sizes(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except ValueError:

        raise argparse.ArgumentTypeError(f"expected a size like 64M or 4096, got {text!r}") from None


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="measure this machine's collectives and compute into a cluster JSON",
                       description="On this machine, time all-reduce over fresh processes (gloo on CPU, NCCL on "
                                   "CUDA GPUs) across message sizes and process counts, matmul throughput per "
                                   "dtype and memory bandwidth, fit the link's bandwidth and latency, and write "
                                   "a cluster JSON (the `cpu` preset with measured figures on CPU; the detected "
                                   "GPU preset with fitted efficiencies on GPUs).")
    p.add_argument("-o", "--output", metavar="cluster.json", help="write the cluster JSON here")
    p.add_argument("--ranks", metavar="N,...",
                   help="process counts to time (default 2,4 on CUDA GPUs and on CPUs with 4+ cores; 2 with fewer "
                        "cores: more gloo processes than cores time the scheduler, not the link)")
    p.add_argument("--min-bytes", type=_sizes, default=4096, metavar="SIZE", help="smallest message (default 4K)")
    p.add_argument("--max-bytes", type=_sizes, default=64 * 2**20, metavar="SIZE", help="largest message (default 64M)")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="auto: NCCL when CUDA GPUs are present, gloo otherwise")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help=f"per process count (default 300 s; at least {MIN_TIMEOUT_S:g} s)")
    p.add_argument("--json", action="store_true", help="print the measurements and the cluster as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    if not MIN_TIMEOUT_S <= args.timeout <= 86_400:  # before any process starts (nan fails here too)
        raise AutoparError(f"--timeout must be between {MIN_TIMEOUT_S:g} and 86400 seconds per process count, got "
                           f"{args.timeout:g}")
    try:
        if args.ranks is None:
            ranks = [n for n in (2, 4) if n <= max(2, os.cpu_count() or 1)]
        else:
            ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError:
        raise AutoparError(f"--ranks expects process counts like 2,4; got {args.ranks!r}") from None
    if args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        raise AutoparError(f"need 4 <= --min-bytes <= --max-bytes, got {args.min_bytes} and {args.max_bytes}")
    sizes, size = [], args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= 4
    if len(sizes) < 2 and len(ranks) < 2:
        raise AutoparError("need at least 2 message sizes or 2 process counts to fit bandwidth and latency; "
                           "widen --min-bytes .. --max-bytes")
    err = Console(stderr=True)
    cluster, result = profile_cluster(ranks, sizes, args.backend, timeout_s=args.timeout,
                                      progress=lambda m: err.print(f"[dim]{m}[/dim]"))
    if args.output:
        write_cluster(cluster, args.output)
    # CPU workers: this machine's figures, cached for `--cluster cpu` (GPUs keep their datasheets)
    cached = str(store_measurement(cluster)) if result.device == "cpu" else None
    if args.json:
        print_json({"cluster": cluster.to_dict(), "measurements": result.to_dict(), "output": args.output,
                    "cached": cached})
        return 0
    _print(cluster, result, args.output, Console())
    if cached:
        Console().print(f"cached this machine's measurement in {cached}: --cluster cpu now uses it")
    return 0


def _print(cluster, result, output, console) -> None:
    table = Table(title=f"all-reduce ({result.backend})")
    for col in ("bytes", "processes", "time (us)", "bus bandwidth (GB/s)"):
        table.add_column(col, justify="right")
    for nbytes, n, seconds in result.allreduce:
        busbw = nbytes / seconds * 2 * (n - 1) / n
        table.add_row(f"{nbytes:,}", str(n), f"{seconds * 1e6:.1f}", f"{busbw / 1e9:.2f}")
    console.print(table)
    fit = result.fit
    if "bandwidth" in fit:
        console.print(f"fitted ring: {fit['bandwidth'] / 1e9:.2f} GB/s, {fit['hop_latency'] * 1e6:.1f} us per hop, "
                      f"{fit['collective_latency_s'] * 1e6:.1f} us per call (MAPE {fit['mape']:.1%})")
    elif "note" in fit:
        console.print(fit["note"])
    else:
        console.print(f"fitted {fit['kind']}: efficiency {fit['efficiency']:.3f}, per-call latency "
                      f"{fit['collective_latency_s'] * 1e6:.1f} us (MAPE {fit['mape']:.1%})")
    efficiency = cluster.coefficients.get("collective_efficiency") or {}
    if efficiency:
        console.print("ZeRO collectives, bandwidth relative to the all-reduce's: "
                      + ", ".join(f"{op} {e:.2f}" for op, e in efficiency.items()))
    for dtype, by_size in result.matmul.items():
        best = max(by_size.values())
        console.print(f"matmul {dtype}: {best / 1e9:.1f} GFLOP/s per process "
                      f"({', '.join(f'{n}: {v / 1e9:.1f}' for n, v in by_size.items())})")
    console.print(f"memory copy: {result.memory_bytes_per_s / 1e9:.2f} GB/s per process")
    console.print(cluster.describe())
    if output:
        console.print(f"wrote {output} (use it with --cluster {output}); took {result.wall_s:.0f} s")
