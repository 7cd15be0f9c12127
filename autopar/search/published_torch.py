"""Published PyTorch-native training throughput the torch runtime is checked against
(`data/published/torch_native_shared.csv`, its SOURCE.md says where each row comes from).

torchtitan's Llama 3.1 tables on Meta's Grand Teton H100s and torchao's float8 / MXFP8 Llama 3 8B
rows: FSDP2 (ZeRO-3), DTensor tensor parallelism with sequence parallel norms, async TP, pipelining,
torch.compile of each block, torchao's float8 recipes. autopar prices a row as that setup runs:
runtime ``torch`` with the row's switches (`op_sac` for torchtitan's per-op selective checkpoint,
`async_tp`, `float8_tp` for its tensorwise float8 TP plan), the row's degrees, the local batch as one micro-batch (as many as stages under pp,
torchtitan's default), the row's recompute, compile and precision, on the preset of the row's GPU
(`PRESETS_BY_GPU`). The torch runtime's coefficients are fitted to these rows alone
(autopar/cost/torch_runtime.py, experiments/fit_torch_runtime.py); a row whose setup autopar cannot
express is left out with the reason (`expressible`). A row compiled under tp or pp is priced as
torchtitan ran it, though autopar's executor does not run it (`compiled_beyond_executor`).

Where the runs and autopar's knobs differ, knowingly: every tensorwise float8 row under FSDP2 gets
torchao's float8 all-gather (the cost model prices it for tensorwise under ZeRO-3), where torchtitan's
Table 1, 3 and 4 runs do not say whether they enabled it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import load_cluster
from autopar.cost import estimate
from autopar.cost.arrays import PlanArrays
from autopar.cost.estimate import estimates_from
from autopar.cost.model import evaluate
from autopar.plan import Plan, balanced_split
from autopar.profile import profile_model
from autopar.search.published import ZOO_LLAMA, read_table
from autopar.workload import Workload

TABLE = "torch_native_shared.csv"
# the zoo shape of each model (Llama 3.1 has Llama 3's architecture; only its context length differs)
ZOO_SIZES = {"Llama3-8B": "llama3-8b", "Llama3.1-8B": "llama3-8b", "Llama3-70B": "llama3-70b",
             "Llama3.1-70B": "llama3-70b", "Llama3.1-405B": "llama3-405b"}
# the preset of the row's GPU: Grand Teton for torchtitan's H100s; torchao's B200s were power-limited (the
# 750 W of docs/hardware.md). torchao's float8 README names no H100 part: taken as Meta's Grand Teton H100
# too (an assumption: torchao and torchtitan are Meta's, run on the same fleet with the same torchtitan
# recipe; the torch runtime fitted to torchtitan's tables alone predicts its bf16 and tensorwise rows
# within 6% on that part, where on the 700 W SXM5 part the same fit would move every torch estimate on
# dgx-h100 and NeMo AutoModel's H100 rows away from their published figures; docs/hardware.md)
PRESETS_BY_GPU = {"GT-H100": "grand-teton-h100", "H100": "grand-teton-h100", "B200(power-limited)": "dgx-b200-750w"}
# precision column -> (plan precision, fp8 recipe): torchao's recipes; FSDP2's float8 all-gather of
# tensorwise weights is what the cost model prices for tensorwise under ZeRO-3 (docs/hardware.md)
PRECISIONS = {"bf16": ("bf16", "none"), "float8-tensorwise": ("fp8", "tensorwise"),
              "float8-tensorwise+fp8-allgather": ("fp8", "tensorwise"), "float8-rowwise": ("fp8", "rowwise"),
              "mxfp8_cublas": ("fp8", "mxfp8")}
SCHEDULES = {"-": "1f1b", "1F1B": "1f1b"}


def _number(text: str) -> int | None:
    """A CSV cell as an int; `*` (a default or derived value) is dropped, `?` (not published) is None."""
    text = text.rstrip("*")
    return None if text in ("?", "") else int(text)


@dataclass(frozen=True)
class TorchNativeRow:
    line: int  # the CSV's line (the header is line 1)
    source: str
    model: str
    gpus: int
    gpu: str
    precision: str
    seq_len: int
    local_batch: int
    global_batch: int | None
    dp_shard: int
    dp_replicate: int
    tp: int
    pp: int
    pp_schedule: str
    cp: int
    ac: str
    compile: bool
    async_tp: bool
    tokens_per_s_per_gpu: float

    @property
    def dp(self) -> int:
        return self.dp_shard * self.dp_replicate

    @property
    def label(self) -> str:
        parts = [self.model, f"{self.gpus} {self.gpu}", self.precision, f"fsdp{self.dp_shard}"]
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
        parts += [f"pp{self.pp} {self.pp_schedule}"] if self.pp > 1 else []
        parts += ["compile"] if self.compile else []
        parts += ["async-tp"] if self.async_tp else []
        return f"{self.source} " + ", ".join(parts)


def _row(line: int, r: dict[str, str]) -> TorchNativeRow:
    return TorchNativeRow(line, r["source"], r["model"], int(r["gpus"]), r["gpu"], r["precision"],
                          _number(r["seq_len"]), _number(r["local_batch"]), _number(r["global_batch"]),
                          int(r["dp_shard"]), int(r["dp_replicate"]), int(r["tp"]), int(r["pp"]), r["pp_schedule"],
                          int(r["cp"]), r["ac"], r["compile"] == "on", r["async_tp"] == "on", float(r["value"]))


ROWS = tuple(_row(i, r) for i, r in enumerate(read_table(TABLE), start=2))


def expressible(row: TorchNativeRow) -> str | None:
    """None when autopar's plan space and the torch runtime hold the row's setup, else why not."""
    if row.model not in ZOO_SIZES:
        return f"{row.model} is not a zoo shape"
    if row.gpu not in PRESETS_BY_GPU:
        return f"no preset for the GPU {row.gpu!r}"
    if row.precision not in PRECISIONS:
        return f"precision {row.precision!r} is not one autopar prices"
    if row.dp_replicate > 1:
        return "HSDP (replicated FSDP groups) is not a plan autopar makes"
    if row.pp > 1 and row.pp_schedule not in SCHEDULES:
        return f"pipeline schedule {row.pp_schedule}: its virtual stages are not published"
    if row.dp * row.tp * row.pp * row.cp != row.gpus:
        return f"fsdp x tp x pp x cp = {row.dp * row.tp * row.pp * row.cp}, not the row's {row.gpus} GPUs"
    return None


def torch_workload(row: TorchNativeRow) -> Workload:
    """The row's model on its GPU's preset under runtime torch; the run fitted, so the budget is the
    GPU's whole memory (no search headroom)."""
    profile = profile_model(ZOO_LLAMA, {"size": ZOO_SIZES[row.model], "seq_len": row.seq_len}, dtype="bf16")
    preset = load_cluster(PRESETS_BY_GPU[row.gpu])
    cluster = preset.with_nodes(max(1, row.gpus // preset.gpus_per_node), min(row.gpus, preset.gpus_per_node))
    return Workload(profile, cluster, row.global_batch or row.local_batch * row.dp, runtime="torch",
                    fp8=PRECISIONS[row.precision][0] == "fp8", memory_headroom=0.0, switches=switches(row))


def switches(row: TorchNativeRow) -> tuple[str, ...]:
    """The torch runtime's switches the row ran: torchtitan's per-op selective checkpoint, async TP, and its
    float8 TP plan wherever a tensorwise float8 row has tp (torchtitan applies it whenever float8 is
    tensorwise: `enable_float8_tensorwise_tp`)."""
    float8_tp = row.tp > 1 and PRECISIONS.get(row.precision, ("", ""))[1] == "tensorwise"
    return ((("op_sac",) if row.ac.startswith("selective") else ()) + (("async_tp",) if row.async_tp else ())
            + (("float8_tp",) if float8_tp else ()))


def torch_plan(row: TorchNativeRow, workload: Workload) -> Plan:
    """FSDP2 over the shard degree (ZeRO-3), the local batch as one micro-batch, sequence-parallel
    norms under tp (torchtitan's TP plan), the row's recompute, compile and precision."""
    layers = workload.profile.num_layers
    precision, recipe = PRECISIONS[row.precision]
    full = row.ac.startswith("full")
    # torchtitan splits a pipelined rank's local batch into as many micro-batches as stages (its default
    # `pipeline_parallel_microbatches`); without pp it accumulates nothing
    split = row.pp if row.pp > 1 else 1
    return Plan(dp=row.dp, tp=row.tp, pp=row.pp, micro_batch_size=row.local_batch // split,
                num_micro_batches=workload.global_batch * split // (row.dp * row.local_batch),
                zero=3 if row.dp > 1 else 0,
                recompute="full" if full else "selective", recompute_blocks=-(-layers // row.pp) if full else 0,
                precision=precision, fp8_recipe=recipe, compile=row.compile, sequence_parallel=row.tp > 1,
                schedule=SCHEDULES.get(row.pp_schedule, "1f1b"), layer_split=balanced_split(layers, row.pp))


def compiled_beyond_executor(row: TorchNativeRow) -> bool:
    """Whether the row compiles blocks under tensor or pipeline parallelism: torchtitan does (its
    apply_compile after apply_tp), autopar's executor does not (autopar.capability)."""
    return row.compile and (row.tp > 1 or row.pp > 1)


def predicted_tokens_per_s(row: TorchNativeRow, coeffs=None):
    """(plan, estimate, tokens/s per GPU) the cost model gives an expressible row. A row compiled under
    tp or pp is priced as torchtitan ran it: its plan is checked by autopar.capability without compile
    (every other rule still holds), then priced compiled; the report says so."""
    w = torch_workload(row)
    plan = torch_plan(row, w)
    if compiled_beyond_executor(row):
        plan.with_(compile=False).validate(w)
        pa = PlanArrays.from_plans([plan], w.profile)
        est = estimates_from(w, pa, evaluate(w, pa, coeffs), 0)[0]
    else:
        est = estimate(w, plan, coeffs)
    return plan, est, w.global_batch * w.profile.seq_len / est.iteration_time_s / row.gpus


def features(row: TorchNativeRow) -> tuple[str, ...]:
    """The torch runtime's coefficients (autopar/cost/torch_runtime.py) this row's time depends on."""
    recipe = PRECISIONS[row.precision][1] if row.precision in PRECISIONS else "none"
    return (("gemm_efficiency",) + (("fp8_gemm_speedup",) if recipe in ("tensorwise", "mxfp8") else ())
            + (("fp8_rowwise_speedup",) if recipe == "rowwise" else ()) + (("async_tp_overlap",) if row.async_tp else ()))


def gpu_name(row: TorchNativeRow) -> str:
    """The spec name of the row's GPU type (the key of its torch-runtime coefficients)."""
    return load_cluster(PRESETS_BY_GPU[row.gpu]).gpu.name
