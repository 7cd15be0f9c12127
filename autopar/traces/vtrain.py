"""Import vTrain's measured iteration times (``data/vtrain/ground_truth_*.csv``) as traces.

vTrain (Bang et al., MICRO 2024; MIT licence) measured GPT-style models trained with
Megatron-DeepSpeed on A100 GPUs: 1,440 runs on one node of 2, 4 or 8 GPUs and 109 runs on 64 to
512 GPUs. Each CSV row gives the GPU count, global and micro batch, hidden size, heads, layers,
sequence length, the tensor / data / pipeline degrees and the iteration time in milliseconds
(the multi-node file adds the parameter count in billions). vTrain's own simulator, which
profiles every operator on the real GPU, reports a mean absolute percentage error of 8.37% on
the single-node runs and 14.73% on the multi-node runs.

What the CSV does not say is taken from vTrain's published validation configurations
(``config/validation/*`` in github.com/VIA-Research/vTrain): every run used activation
checkpointing of every layer (``use_checkpoint: true``), the 1F1B pipeline schedule, no DDP
gradient bucketing (the data-parallel all-reduce runs after the backward pass), 8 GPUs per node,
800 Gb/s of inter-node bandwidth per node (``inter_node_bandwidth: 800``: the `vtrain-a100` preset,
4 x HDR per DGX A100 node where a DGX A100 has 8).
The rest is Megatron-DeepSpeed's defaults: fp16 mixed precision with gradients all-reduced in
fp16, no ZeRO, tensor-parallel ranks innermost in the rank order (then data, then pipeline), and
vocabulary 51,200 (GPT-2's 50,257 tokens padded, as Megatron pads it to a multiple of 128 x tp
at tp = 8; ``vocab`` changes it). A run whose micro-batches are fewer than its pipeline stages is
recorded with the GPipe schedule, which is what Megatron's 1F1B degenerates to there. No
gradient bucketing is a plan whose one bucket holds the whole gradient. The model is
``megatron_gpt.py`` beside this file: the zoo's GPT with Megatron's vocabulary-parallel loss.
(ZeRO-1 instead of none was tried: the single-node fit is the same to 0.1%.)
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from autopar.atomic import atomic_path
from autopar.cluster import load_cluster
from autopar.cost import PlanArrays, evaluate
from autopar.errors import AutoparError
from autopar.plan import Plan, balanced_split, device_blocks
from autopar.profile import profile_model
from autopar.traces.models import model_digest
from autopar.traces.record import TraceRecord, current_versions
from autopar.workload import Workload

VOCAB = 51200
# the zoo's GPT with Megatron's vocab-parallel loss (see megatron_gpt.py), named relative to the
# directory holding the autopar package so that records stay valid on other machines
MODEL_FILE = Path(__file__).with_name("megatron_gpt.py")
MODEL = "autopar/traces/megatron_gpt.py"
FRAMEWORK = "Megatron-DeepSpeed (measured by vTrain, MICRO 2024)"
# DGX A100 nodes with 4 x HDR (800 Gb/s) per node, as vTrain's configurations give its cluster
# (autopar/cluster/presets.py)
CLUSTER = "vtrain-a100"
# Megatron-DeepSpeed's attention (baddbmm, FusedScaleMaskSoftmax, dropout, bmm: vTrain's
# src/model/gpt_modeling.py mirrors it) and its fp32 vocab-parallel loss, whatever the model file
# writes (autopar/runtime.py)
SWITCHES = ("megatron_cross_entropy", "megatron_softmax")

# CSV header -> field; the multi-node file adds "Parameters (billion)"
COLUMNS = {
    "# GPUs": "gpus",
    "global batch": "global_batch",
    "micro batch": "micro_batch",
    "hidden size": "hidden",
    "attention heads": "heads",
    "# layers": "layers",
    "sequence length": "seq_len",
    "tensor parallelism": "tp",
    "data parallelism": "dp",
    "pipeline parallelism": "pp",
    "iteration time (ms)": "time_ms",
}
OPTIONAL_COLUMNS = {"Parameters (billion)": "params_billion"}


@dataclass(frozen=True)
class VTrainRow:
    line: int  # 1-based line number in the CSV (the header is line 1)
    gpus: int
    global_batch: int
    micro_batch: int
    hidden: int
    heads: int
    layers: int
    seq_len: int
    tp: int
    dp: int
    pp: int
    time_ms: float
    params_billion: float | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.hidden, self.heads, self.layers, self.seq_len)

    def model_args(self, vocab: int = VOCAB) -> dict:
        return {"hidden": self.hidden, "heads": self.heads, "layers": self.layers, "vocab": vocab,
                "seq_len": self.seq_len}

    def plan(self, precision: str = "fp16", zero: int = 0, vocab: int = VOCAB) -> Plan:
        """The Megatron-DeepSpeed configuration of this run as a Plan (see the module docstring)."""
        nmb = self.global_batch // (self.dp * self.micro_batch)
        h, layers = self.hidden, self.layers
        # no gradient bucketing: one all-reduce of the whole gradient after the backward pass
        grad_mb = 2 * (13 * layers * h * h + (2 * vocab + self.seq_len) * h) / 2**20  # >= the fp16 gradient
        per_rank = max(device_blocks(balanced_split(self.layers, self.pp), self.pp))
        schedule = "1f1b" if self.pp == 1 or nmb >= self.pp else "gpipe"
        return Plan(dp=self.dp, tp=self.tp, pp=self.pp, micro_batch_size=self.micro_batch, num_micro_batches=nmb,
                    mesh_order=("pp", "dp", "tp"), zero=zero if self.dp > 1 else 0,
                    bucket_mb=float(2 ** math.ceil(math.log2(grad_mb))) if self.dp > 1 else 25.0,
                    recompute="full", recompute_blocks=per_rank,
                    schedule=schedule, precision=precision,
                    grad_comm_dtype=precision if precision != "fp32" else "fp32")


def read_vtrain_csv(path) -> list[VTrainRow]:
    """The rows of a vTrain ground-truth CSV, checked; AutoparError names the file, line and column."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a FIFO would block the read
        raise AutoparError(f"{path} is not a regular file; give the path of a vTrain CSV file")
    try:
        # the files start with a UTF-8 byte-order mark
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise AutoparError(
                    f"{path}: not a vTrain ground-truth CSV: missing column(s) {', '.join(repr(c) for c in missing)} "
                    f"(found {', '.join(repr(h) for h in header) or 'no header'})")
            reader.fieldnames = header
            rows = [_row(path, number, raw) for number, raw in enumerate(reader, start=2)]
    except OSError as e:
        raise AutoparError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise AutoparError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not rows:
        raise AutoparError(f"{path}: the CSV has a header but no rows")
    return rows


def _row(path: Path, line: int, raw: dict) -> VTrainRow:
    if None in raw:  # more cells than header columns
        raise AutoparError(f"{path}:{line}: {len(raw[None])} more cell(s) than the header has columns")
    values = {}
    for column, name in {**COLUMNS, **OPTIONAL_COLUMNS}.items():
        if column not in raw:
            continue
        text = (raw[column] or "").strip()
        if not text:
            raise AutoparError(f"{path}:{line}: column {column!r} is empty")
        try:
            value = float(text)
        except ValueError:
            raise AutoparError(f"{path}:{line}: column {column!r} is {text!r}, not a number") from None
        if not math.isfinite(value) or value <= 0:
            raise AutoparError(f"{path}:{line}: column {column!r} must be positive, got {text}")
        if name not in ("time_ms", "params_billion"):
            if value != int(value):
                raise AutoparError(f"{path}:{line}: column {column!r} must be a whole number, got {text}")
            value = int(value)
        values[name] = value
    row = VTrainRow(line=line, **values)
    if row.tp * row.dp * row.pp != row.gpus:
        raise AutoparError(f"{path}:{line}: tp x dp x pp = {row.tp} x {row.dp} x {row.pp} = "
                           f"{row.tp * row.dp * row.pp}, but the row has {row.gpus} GPUs")
    if row.global_batch % (row.dp * row.micro_batch):
        raise AutoparError(f"{path}:{line}: global batch {row.global_batch} is not a multiple of "
                           f"dp x micro batch = {row.dp * row.micro_batch}")
    if row.hidden % row.heads:
        raise AutoparError(f"{path}:{line}: hidden size {row.hidden} is not divisible by {row.heads} heads")
    if row.layers < row.pp:
        raise AutoparError(f"{path}:{line}: {row.layers} layers cannot fill {row.pp} pipeline stages")
    return row


def _cluster_size(preset_gpus_per_node: int, gpus: int) -> tuple[int, int]:
    """(nodes, GPUs per node) for a run on `gpus` GPUs: one partly used node, or full nodes."""
    if gpus <= preset_gpus_per_node:
        return 1, gpus
    if gpus % preset_gpus_per_node:
        raise AutoparError(f"{gpus} GPUs do not fill whole nodes of {preset_gpus_per_node} GPUs")
    return gpus // preset_gpus_per_node, preset_gpus_per_node


def import_vtrain(path, cluster: str = CLUSTER, vocab: int = VOCAB, precision: str = "fp16",
                  predict: bool = True, zero: int = 0):
    """TraceRecords for every row of a vTrain CSV, on `cluster` (a preset or cluster JSON) sized
    to each row's GPU count. With `predict`, each record carries the cost model's prediction
    with the cluster's coefficients (one profile per model shape, one cost-model call per
    shape and cluster size)."""

    rows = read_vtrain_csv(path)
    base = load_cluster(cluster)
    versions = {**current_versions("nccl"), "torch": "unknown", "python": "unknown", "framework": FRAMEWORK}
    profiles, plans = {}, []
    for row in rows:
        if row.shape not in profiles:
            profiles[row.shape] = profile_model(MODEL_FILE, row.model_args(vocab), dtype=precision)
        plan = row.plan(precision, zero, vocab)
        nodes, gpn = _cluster_size(base.gpus_per_node, row.gpus)
        workload = Workload(profiles[row.shape], base.with_nodes(nodes, gpn), row.global_batch, switches=SWITCHES)
        try:
            plan.validate(workload)
        except AutoparError as e:
            raise AutoparError(f"{path}:{row.line}: {e}") from None
        plans.append((plan, workload))

    predicted: list[dict | None] = [None] * len(rows)
    if predict:
        groups: dict[tuple, list[int]] = {}
        for i, (row, (_, w)) in enumerate(zip(rows, plans)):
            groups.setdefault((row.shape, w.cluster.nodes, w.cluster.gpus_per_node), []).append(i)
        for index in groups.values():
            workload = plans[index[0]][1]
            pa = PlanArrays.from_plans([plans[i][0] for i in index], workload.profile)
            res = evaluate(workload, pa)
            for j, i in enumerate(index):
                predicted[i] = {"iteration_time_s": float(res["iteration_time"][j]),
                                "peak_memory_gb": float(res["peak_memory"][j] / 1e9)}

    name = Path(path).name
    records = []
    for row, (plan, workload), pred in zip(rows, plans, predicted):
        profile, c = workload.profile, workload.cluster
        args = row.model_args(vocab)
        seconds = row.time_ms / 1e3
        records.append(TraceRecord(
            cluster={"name": c.name, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "gpu": c.gpu.name,
                     "backend": "nccl"},
            model={"name": "megatron_gpt", "path": MODEL, "args": args, "digest": model_digest(MODEL_FILE, args),
                   "dims": dict(profile.dims), "params": profile.params},
            workload={"global_batch": row.global_batch, "seq_len": row.seq_len, "runtime": workload.runtime,
                      "switches": list(workload.switches)},
            plan=plan.to_dict(),
            outcome="ok",
            measured={"step_times_s": [], "median_step_s": seconds,
                      "tokens_per_s": row.global_batch * row.seq_len / seconds,
                      "peak_memory_bytes": [], "losses": [], "source": f"vtrain:{name}:{row.line}"},
            predicted=pred,
            versions=versions,
        ))
    return records


def write_records(path, records) -> None:
    """Write a whole trace file atomically (a temporary file, then os.replace): an error or an
    interrupt never leaves a partial file behind."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(record.to_json() + "\n")
