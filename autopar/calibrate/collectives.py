"""Fit link bandwidth efficiency and latency from measured all-reduce tables.

The cost model times a ring all-reduce of B bytes over n ranks as

    collective_latency_s + 2(n-1) * hop_latency * latency_scale + 2(n-1)/n * B / (efficiency * rate)

(docs/references.md §3, nccl-tests' bus-bandwidth convention), where `rate` and `hop_latency` are the
cluster's datasheet figures for the ring those ranks get and `efficiency` is the per-link-kind
coefficient. Given tables of (bytes, ranks, seconds), this fits the link kind's efficiency
(bounded by 1: no link beats its rate), latency_scale and collective_latency_s by least squares
on log time, with the same cost-model functions the planner uses. Each row weighs its share of the
table's span of log message size (`log_size_weights`): nccl-tests tables are often sampled at even
byte steps (vTrain's: every MiB from 1 MiB to 1 GiB, 99% of rows above 10 MB), which unweighted would
fit the bandwidth of large messages alone and leave the latency terms, what a tensor-parallel
all-reduce of a few MB pays, to wherever they fall.

Table formats read: nccl-tests output saved as CSV (columns "size(B)" and "time(ns)", optionally
twice for out-of-place and in-place; the rank count comes from the file name, e.g.
"a100_allreduce_8gpu.csv"), and autopar's own (columns "bytes", "ranks", "seconds", as
`autopar profile-cluster` measures).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autopar.calibrate.fit import with_values
from autopar.cost.coefficients import Coefficients
from autopar.cost.collectives import all_reduce_time
from autopar.errors import AutoparError


@dataclass(frozen=True)
class AllReduceTable:
    source: str
    ranks: np.ndarray  # int, per row
    nbytes: np.ndarray
    seconds: np.ndarray


def read_allreduce_table(path, ranks: int | None = None) -> AllReduceTable:
    """Rows of an all-reduce benchmark table (see the module docstring for the formats)."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO would block the read
        raise AutoparError(f"{path} is not a regular file; give the path of an all-reduce table (.csv)")
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        raise AutoparError(f"cannot read all-reduce table {path}: {e.strerror}") from None
    if not rows:
        raise AutoparError(f"{path}: empty all-reduce table")
    header = [h.strip() for h in rows[0]]
    body = [r for r in rows[1:] if any(c.strip() for c in r)]
    try:
        if "bytes" in header and "seconds" in header:
            b, s = header.index("bytes"), header.index("seconds")
            n = header.index("ranks") if "ranks" in header else None
            if n is None and ranks is None:
                raise AutoparError(f"{path}: no 'ranks' column; give the rank count")
            nb = np.array([float(r[b]) for r in body])
            sec = np.array([float(r[s]) for r in body])
            rk = np.array([int(r[n]) if n is not None else ranks for r in body])
        elif "size(B)" in header and "time(ns)" in header:
            if ranks is None:
                match = re.search(r"(\d+)\s*[-_]?(?:gpus?|ranks?|procs?)", path.name, re.IGNORECASE)
                if not match:
                    raise AutoparError(f"{path}: cannot tell the rank count; name the file like "
                                       f"'allreduce_8gpu.csv'")
                ranks = int(match.group(1))
            b = header.index("size(B)")
            times = [i for i, h in enumerate(header) if h == "time(ns)"]
            nb = np.array([float(r[b]) for r in body])
            # out-of-place and in-place runs: the faster is what the link allows
            sec = np.array([min(float(r[i]) for i in times) for r in body]) * 1e-9
            rk = np.full(len(body), ranks)
        else:
            raise AutoparError(f"{path}: not an all-reduce table: need columns 'size(B)' and 'time(ns)' "
                               f"(nccl-tests) or 'bytes', 'ranks' and 'seconds' (found {', '.join(header)})")
    except (ValueError, IndexError) as e:
        raise AutoparError(f"{path}: malformed row in all-reduce table ({e})") from None
    if len(body) == 0:
        raise AutoparError(f"{path}: the all-reduce table has no rows")
    if (nb <= 0).any() or (sec <= 0).any() or (rk < 2).any():
        raise AutoparError(f"{path}: sizes and times must be positive and ranks at least 2")
    return AllReduceTable(str(path), rk, nb, sec)


@dataclass
class CollectiveFit:
    kind: str
    efficiency: float
    latency_scale: float
    collective_latency_s: float
    mape: float
    rows: int
    busbw_peak: float  # fitted bus bandwidth, bytes/s (efficiency x rate of the ring)

    def fitted(self) -> dict[str, float]:
        """The three coefficients, named as calibrate/fit.py's `param` names them."""
        return {f"link_efficiency.{self.kind}": self.efficiency, "latency_scale": self.latency_scale,
                "collective_latency_s": self.collective_latency_s}


def predict_allreduce(cluster, coeffs, ranks, nbytes) -> np.ndarray:
    """The cost model's all-reduce time for each (ranks, bytes): a ring over ranks 0..n-1."""

    ranks, nbytes = np.asarray(ranks), np.asarray(nbytes, dtype=float)
    out = np.empty(len(nbytes))
    for n in np.unique(ranks):
        rows = ranks == n
        link = cluster.ring(int(n), 1)
        out[rows] = all_reduce_time(nbytes[rows], int(n), link.bandwidth * coeffs.link(link.kind),
                                    link.latency * coeffs.latency_scale, coeffs.collective_latency_s)
    return out


def log_size_weights(ranks: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Per row, its share of the span of log message size its rank count's rows cover (half the gap
    to each neighbour), scaled so each rank count's weights sum to its row count: every decade of
    message size counts the same however densely the table samples it."""
    weights = np.ones(len(nbytes))
    for n in np.unique(ranks):
        rows = np.flatnonzero(ranks == n)
        rows = rows[np.argsort(nbytes[rows], kind="stable")]
        log_b = np.log(nbytes[rows])
        if len(rows) < 2 or log_b[-1] == log_b[0]:
            continue  # one size: nothing to spread
        edges = np.concatenate([[log_b[0]], (log_b[1:] + log_b[:-1]) / 2, [log_b[-1]]])
        share = np.diff(edges)
        weights[rows] = share * len(rows) / share.sum()
    return weights


def fit_allreduce(tables: list[AllReduceTable], cluster, start=None) -> CollectiveFit:
    """Fit the link efficiency of the kind the tables' rings run over, latency_scale and
    collective_latency_s. The cluster must hold as many ranks per node as the largest table."""
    from scipy.optimize import least_squares  # scipy: heavy, imported on first use

    ranks = np.concatenate([t.ranks for t in tables])
    nbytes = np.concatenate([t.nbytes for t in tables])
    seconds = np.concatenate([t.seconds for t in tables])
    if len(seconds) < 6:
        raise AutoparError(f"too few all-reduce measurements to fit: {len(seconds)} row(s), need at least 6 "
                           f"(3 coefficients, 2 rows each)")
    most = int(ranks.max())
    if most > cluster.gpus_per_node:
        cluster = cluster.with_nodes(1, most)
    kinds = {cluster.ring(int(n), 1).kind for n in set(ranks.tolist())}
    if len(kinds) != 1:
        raise AutoparError(f"the tables' rings run over different link kinds ({', '.join(sorted(kinds))}); "
                           f"fit one kind at a time")
    kind = kinds.pop()
    start = start or Coefficients.for_cluster(cluster)
    names = [f"link_efficiency.{kind}", "latency_scale", "collective_latency_s"]
    lo, hi = np.array([np.log(0.02), np.log(1e-3), np.log(1e-8)]), np.array([0.0, np.log(1e3), np.log(1e-2)])
    x0 = np.clip(np.log([max(start.link(kind), 0.02), max(start.latency_scale, 1e-3),
                         max(start.collective_latency_s, 1e-6)]), lo + 1e-9, hi - 1e-9)

    def coeffs(z):
        return with_values(start, names, np.exp(z))

    root_w = np.sqrt(log_size_weights(ranks, nbytes))  # least squares weighs squared residuals

    def residuals(z):
        return root_w * (np.log(predict_allreduce(cluster, coeffs(z), ranks, nbytes)) - np.log(seconds))

    res = least_squares(residuals, x0, bounds=(lo, hi), loss="soft_l1", f_scale=0.1, x_scale="jac")
    c = coeffs(res.x)
    pred = predict_allreduce(cluster, c, ranks, nbytes)
    link = cluster.ring(most, 1)
    return CollectiveFit(kind, float(c.link(kind)), float(c.latency_scale), float(c.collective_latency_s),
                         float(np.mean(np.abs(pred / seconds - 1))), len(seconds), link.bandwidth * c.link(kind))
