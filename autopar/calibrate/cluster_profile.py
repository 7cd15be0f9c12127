"""Profile the local machine into a cluster JSON: all-reduce bandwidth and latency across message
sizes and process counts, matmul throughput, and memory bandwidth.

On a CPU-only machine the workers are gloo processes with one thread each (the `cpu` preset's
"GPU" is one worker process); the measured figures replace the preset's nominal ones (peak
FLOP/s per dtype, memory bandwidth, the `shm` link's rate and latency). On a machine with CUDA
GPUs the workers are NCCL ranks, one per GPU, and CUDA GEMMs are timed; the datasheet figures
stay and the measurements become efficiency coefficients (GEMM efficiency = best measured /
peak, link efficiency and latency fitted as in `autopar.calibrate.collectives`), so a link never
exceeds its datasheet rate.

Workers are started with torch.multiprocessing and meet through a file store in a temporary
directory, so profiling needs no free TCP port.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from autopar.atomic import atomic_path
from autopar.calibrate.collectives import AllReduceTable, fit_allreduce
from autopar.calibrate.fit import onto
from autopar.cluster import detect, load_cluster
from autopar.cluster.hardware import Link
from autopar.cost.collectives import all_reduce_time
from autopar.errors import AutoparError

DEFAULT_SIZES = tuple(4096 * 4**i for i in range(8))  # 4 KiB ... 64 MiB
MIN_SECONDS = 0.02  # time each size for at least this long (or MAX_REPEATS operations)
MAX_REPEATS = 50
BLOCKS = 5  # timed blocks per size; the median is kept


@dataclass
class ProfileResult:
    backend: str
    device: str
    allreduce: list[tuple[int, int, float]] = field(default_factory=list)  # (bytes, ranks, seconds)
    # (collective, bytes of the whole buffer, ranks, seconds) for the ZeRO collectives, large buffers
    collectives: list[tuple[str, int, int, float]] = field(default_factory=list)
    matmul: dict = field(default_factory=dict)  # dtype -> {size: FLOP/s}
    memory_bytes_per_s: float = 0.0
    fit: dict = field(default_factory=dict)
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return {"backend": self.backend, "device": self.device,
                "allreduce": [{"bytes": b, "ranks": n, "seconds": s} for b, n, s in self.allreduce],
                "collectives": [{"op": op, "bytes": b, "ranks": n, "seconds": s} for op, b, n, s in self.collectives],
                "matmul_flops": {d: {str(k): v for k, v in r.items()} for d, r in self.matmul.items()},
                "memory_bytes_per_s": self.memory_bytes_per_s, "fit": self.fit, "wall_s": self.wall_s}


# -- collectives -----------------------------------------------------------------------------------
# What data parallelism runs besides DDP's all-reduce: FSDP's reduce-scatter and all-gather, and the
# broadcast with which ZeroRedundancyOptimizer shares each rank's updated shard. Timed on buffers
# of at least this many bytes (their bandwidth, relative to the all-reduce's, is what is kept).
ZERO_COLLECTIVES = ("reduce_scatter", "all_gather", "broadcast")
ZERO_MIN_BYTES = 2**20


def _collective(name: str, x, world: int):
    """A zero-argument call running collective `name` on buffer `x` (the whole, unsharded size)."""
    import torch  # torch: heavy, imported on first use
    import torch.distributed as dist  # torch: heavy, imported on first use

    if name == "all_reduce":
        return lambda: dist.all_reduce(x)
    shard = torch.empty(x.numel() // world, dtype=x.dtype, device=x.device)
    if name == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(shard, x)
    if name == "all_gather":
        return lambda: dist.all_gather_into_tensor(x, shard)

    def broadcast_shards():  # every rank's shard from that rank, as ZeroRedundancyOptimizer does
        for src in range(world):
            dist.broadcast(x[src * shard.numel():(src + 1) * shard.numel()], src=src)
    return broadcast_shards


def _collectives_worker(rank: int, world: int, backend: str, init_file: str, sizes: list[int], out: str) -> None:
    """One rank: time all_reduce of fp32 tensors of each size, and the ZeRO collectives on the
    large ones; rank 0 writes the slowest rank's time per operation (a collective ends when its
    last rank is done)."""
    import torch  # torch: heavy, imported on first use
    import torch.distributed as dist  # torch: heavy, imported on first use

    torch.set_num_threads(1)
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def timed(op) -> float:
        for _ in range(2):  # warm-up: connections, buffers
            op()
        sync()
        dist.barrier()
        start = time.perf_counter()
        op()
        sync()
        once = torch.tensor([time.perf_counter() - start], device=device)
        dist.all_reduce(once, op=dist.ReduceOp.MAX)  # every rank agrees on the repeat count
        repeats = int(min(MAX_REPEATS, max(3, MIN_SECONDS / max(once.item(), 1e-6))))
        blocks = []
        for _ in range(BLOCKS):  # the median block: robust to a busy machine's hiccups
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                op()
            sync()
            elapsed = torch.tensor([(time.perf_counter() - start) / repeats], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            blocks.append(float(elapsed.item()))
        return float(np.median(blocks))

    results = []
    try:
        for size in sizes:
            x = torch.ones(max(world, size // 4 // world * world), dtype=torch.float32, device=device)
            names = ("all_reduce",) + (ZERO_COLLECTIVES if size >= ZERO_MIN_BYTES else ())
            results += [(name, int(x.numel() * 4), world, timed(_collective(name, x, world))) for name in names]
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def measure_collectives(ranks: int, sizes=DEFAULT_SIZES, backend: str = "gloo", timeout_s: float = 300.0):
    """(collective, bytes, ranks, seconds) per collective and size, over `ranks` fresh processes."""
    import torch.multiprocessing as mp  # torch: heavy, imported on first use

    with tempfile.TemporaryDirectory(prefix="autopar-profile-") as tmp:
        out = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(_collectives_worker, args=(ranks, backend, os.path.join(tmp, "store"), list(sizes), out),
                                 nprocs=ranks, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise AutoparError(f"collective profiling over {ranks} {backend} processes took longer than "
                                       f"{timeout_s:.0f} s; use smaller --max-bytes or fewer --ranks")
        except mp.ProcessRaisedException as e:
            raise AutoparError(f"collective profiling over {ranks} {backend} processes failed: "
                               f"{str(e).strip().splitlines()[-1]}") from None
        except mp.ProcessExitedException as e:
            raise AutoparError(f"a collective profiling process exited with code {e.exit_code}") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        return [tuple(r) for r in json.loads(Path(out).read_text())]


# -- matmul and memory -------------------------------------------------------------------------------
def measure_matmul(sizes=(256, 512, 1024), dtypes=("fp32", "bf16"), device: str = "cpu") -> dict:
    """FLOP/s of square matmuls per dtype and size, in this process (one thread on CPU)."""
    import torch  # torch: heavy, imported on first use

    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # one worker process's share of the machine
    out = {}
    try:
        for name in dtypes:
            out[name] = {}
            for n in sizes:
                a = torch.randn(n, n, device=dev).to(torch_dtypes[name])
                b = torch.randn(n, n, device=dev).to(torch_dtypes[name])
                a @ b
                sync()
                start = time.perf_counter()
                a @ b
                sync()
                once = time.perf_counter() - start
                repeats = int(min(100, max(2, 0.02 / max(once, 1e-7))))
                best = 0.0
                for _ in range(3):  # the best block: what the unit can do
                    start = time.perf_counter()
                    for _ in range(repeats):
                        a @ b
                    sync()
                    best = max(best, 2 * n**3 * repeats / (time.perf_counter() - start))
                out[name][n] = best
    finally:
        torch.set_num_threads(threads)
    return out


def measure_memory(nbytes: int = 64 * 2**20, device: str = "cpu") -> float:
    """Bytes/s of a tensor copy (read + write counted), in this process."""
    import torch  # torch: heavy, imported on first use

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes // 4, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)
        sync()
        best = 0.0
        for _ in range(5):
            start = time.perf_counter()
            dst.copy_(src)
            sync()
            best = max(best, 2 * nbytes / (time.perf_counter() - start))
        return best
    finally:
        torch.set_num_threads(threads)


# -- fitting and the cluster -------------------------------------------------------------------------
def fit_gemm_half(matmul: dict, peak: float) -> float:
    """FLOPs at which a matmul reaches half of `peak`, from throughput by size: the cost model's
    efficiency curve F / (F + half) through the measured points (least squares on log rate)."""
    flops = np.array([2.0 * n**3 for by_size in matmul.values() for n in by_size])
    rate = np.array([r for by_size in matmul.values() for r in by_size.values()])
    peaks = np.array([max(by_size.values()) for by_size in matmul.values() for _ in by_size])
    if peak <= 0 or len(flops) == 0:
        return 1e3
    grid = np.logspace(3, 13, 201)
    err = [np.sum((np.log(peaks * flops / (flops + h)) - np.log(rate)) ** 2) for h in grid]
    return float(grid[int(np.argmin(err))])



def collective_efficiency(allreduce, collectives) -> dict[str, float]:
    """Each ZeRO collective's bandwidth relative to the all-reduce's on the same buffer and ranks:
    a ring all-gather or reduce-scatter moves half of what an all-reduce does, so its ideal time is
    half the measured all-reduce; the ratio is that over its measured time (median over sizes).
    NCCL comes out near 1; gloo's reduce-scatter well below."""
    reduce = {(b, n): t for b, n, t in allreduce}
    ratios: dict[str, list[float]] = {}
    for op, b, n, t in collectives:
        if (b, n) in reduce and t > 0:
            ratios.setdefault(op, []).append(reduce[(b, n)] / 2 / t)
    return {op: float(np.median(r)) for op, r in sorted(ratios.items())}


def fit_shm(rows) -> dict:
    """A ring's one-way rate, per-hop latency and per-call latency from (bytes, ranks, seconds):
    seconds = base + 2(n-1) hop + 2(n-1)/n bytes / rate (the cost model's all-reduce)."""
    from scipy.optimize import least_squares  # scipy: heavy, imported on first use

    b = np.array([r[0] for r in rows], dtype=float)
    n = np.array([r[1] for r in rows], dtype=float)
    s = np.array([r[2] for r in rows], dtype=float)
    if len(s) < 3:
        raise AutoparError(f"too few all-reduce measurements to fit a link: {len(s)}, need at least 3")

    def pred(z):
        rate, hop, base = np.exp(z)
        return all_reduce_time(b, n, rate, hop, base)

    x0 = np.log([1e9, 1e-5, 1e-5])
    lo, hi = np.log([1e6, 1e-9, 1e-9]), np.log([1e12, 1e-1, 1e-1])
    res = least_squares(lambda z: np.log(pred(z)) - np.log(s), x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1)
    rate, hop, base = np.exp(res.x)
    p = pred(res.x)
    return {"bandwidth": float(rate), "hop_latency": float(hop), "collective_latency_s": float(base),
            "mape": float(np.mean(np.abs(p / s - 1))), "rows": int(len(s))}


def profile_cluster(ranks=(2, 4), sizes=DEFAULT_SIZES, backend: str = "auto", matmul_sizes=None,
                    timeout_s: float = 300.0, progress=None):
    """Measure this machine and return (Cluster, ProfileResult)."""

    import torch  # torch: heavy, imported on first use

    say = progress or (lambda msg: None)
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend not in ("gloo", "nccl"):
        raise AutoparError(f"--backend must be auto, gloo or nccl, got {backend!r}")
    if backend == "nccl" and not cuda:
        raise AutoparError("--backend nccl needs CUDA GPUs; this machine has none (use gloo)")
    ranks = sorted(set(int(r) for r in ranks))
    if not ranks or ranks[0] < 2:
        raise AutoparError(f"--ranks must list process counts of at least 2, got {ranks}")
    if backend == "nccl":  # no more ranks than GPUs; with one GPU there is no collective to time
        ranks = [n for n in ranks if n <= torch.cuda.device_count()]
    start = time.perf_counter()
    result = ProfileResult(backend, "cuda" if backend == "nccl" else "cpu")
    for n in ranks:
        say(f"all-reduce over {n} {backend} processes, {len(sizes)} sizes")
        rows = measure_collectives(n, sizes, backend, timeout_s)
        result.allreduce += [(b, k, t) for op, b, k, t in rows if op == "all_reduce"]
        result.collectives += [row for row in rows if row[0] != "all_reduce"]
    device = "cuda" if backend == "nccl" else "cpu"
    dtypes = ("fp32", "bf16", "fp16") if device == "cuda" else ("fp32", "bf16")
    matmul_sizes = matmul_sizes or ((1024, 4096, 8192) if device == "cuda" else (256, 512, 1024))
    say(f"matmul throughput ({', '.join(dtypes)}) and memory bandwidth")
    result.matmul = measure_matmul(matmul_sizes, dtypes, device)
    result.memory_bytes_per_s = measure_memory(device=device)
    best = {d: max(v.values()) for d, v in result.matmul.items()}

    if device == "cpu":
        base = detect() if not cuda else load_cluster("cpu", gpus_per_node=max(ranks))
        link = fit_shm(result.allreduce)
        result.fit = link
        flops = {"fp32": best["fp32"], "bf16": best["bf16"], "fp16": best["bf16"]}
        gpu = dataclasses.replace(base.gpu, name="cpu-process (profiled)", peak_flops=flops,
                                  hbm_bytes_per_s=result.memory_bytes_per_s)
        links = dict(base.links)
        # a ring hop crosses two shm edges (process -> host memory -> process)
        links["shm"] = Link(link["bandwidth"], link["hop_latency"] / 2, "shm")
        # the measured peak is what a large matmul reaches; the half point comes from the sizes;
        # Python and kernels share the cores, so host time adds to compute (host_overlap 1)
        coeffs = {"gemm_efficiency": 1.0, "gemm_half_flops": fit_gemm_half(result.matmul, best["fp32"]),
                  "host_overlap": 1.0, "collective_efficiency": collective_efficiency(result.allreduce,
                                                                                      result.collectives),
                  "hbm_efficiency": 1.0, "link_efficiency": {"shm": 1.0},
                  "latency_scale": 1.0, "collective_latency_s": link["collective_latency_s"]}
        cluster = dataclasses.replace(base, name="local-cpu-profiled", gpu=gpu, links=links, coefficients=coeffs)
    else:
        base = detect()
        if result.allreduce:
            table = AllReduceTable("profile", np.array([r[1] for r in result.allreduce]),
                                   np.array([r[0] for r in result.allreduce], dtype=float),
                                   np.array([r[2] for r in result.allreduce]))
            fitted = fit_allreduce([table], base)
            result.fit = {"kind": fitted.kind, "efficiency": fitted.efficiency, "latency_scale": fitted.latency_scale,
                          "collective_latency_s": fitted.collective_latency_s, "mape": fitted.mape}
            link_coeffs = fitted.fitted()
        else:
            result.fit = {"kind": "none", "note": "one GPU: no collective to time; link coefficients unchanged"}
            link_coeffs = {}
        peak = base.gpu.peak_flops
        gemm = min(1.0, max(best[d] / peak[d] for d in best))
        measured = {**link_coeffs, "gemm_efficiency": gemm,
                    "gemm_half_flops": fit_gemm_half(result.matmul, max(best.values())),
                    "hbm_efficiency": min(1.0, result.memory_bytes_per_s / base.gpu.hbm_bytes_per_s)}
        if result.collectives:
            measured["collective_efficiency"] = collective_efficiency(result.allreduce, result.collectives)
        # what was measured, over the detected cluster's own coefficients; the rest (the elementwise
        # traffic of the runtime's kernels above all) still comes from the GPU type's fit
        cluster = dataclasses.replace(base, name=f"{base.name}-profiled", coefficients=onto(base.coefficients, measured))
    result.wall_s = time.perf_counter() - start
    return cluster, result


def write_cluster(cluster, path) -> None:
    """Cluster.to_json to a temporary file, then os.replace: never a partial file."""
    with atomic_path(path) as tmp:
        cluster.to_json(tmp)
