"""Every published training row the repository has, against the cost model: one line per row.

    python experiments/published_report.py               # every file; about a minute on one core
    python experiments/published_report.py --markdown    # the table of docs/hardware.md, "Every published row"
    python experiments/published_report.py --files torch_native_shared.csv flashattention_training_a100.csv

For each row of `data/published/*.csv` and of vTrain's two ground-truth files (`data/vtrain`): the
file and row, the plan it is priced as, the published figure, the prediction, the error
(predicted / published - 1 in the row's own metric: for a time, positive is slower; for a
throughput, faster) and whether the row was used to fit a coefficient (which one) or is an
independent check. A row autopar cannot express is listed as left out, with the reason. Per file:
the median and max |error| over the rows priced.

Each file is priced as the experiment that owns it prices it, with the shipped coefficients:
Megatron Table 1 and Korthikanti Table 5 (`cost_vs_published.py`, the bundled GPT), NeMo 24.07
(`nemo_fp8.py`), the FlashAttention table (`flash_training_a100.py`, eager; the compiled error in
the note), NeMo AutoModel's MoE rows (`autopar/search/published_moe.py`), Llama 3 Table 4
(`autopar/search/published.py`, `published_context_parallel.py`), the torch-native rows
(`autopar/search/published_torch.py`: runtime torch on the preset of each row's GPU), vTrain
(`autopar/traces/vtrain.py` on `vtrain-a100`, the shipped coefficients, not `autopar calibrate`'s:
`calibration_report.py` gives the calibrated, cross-validated figures). A CSV no reader knows is
listed row by row as left out. Nothing is fitted here.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from autopar.cluster import load_cluster
from autopar.cost import Coefficients, torch_runtime
from autopar.errors import AutoparError
from autopar.search import published, published_megatron, published_moe, published_torch
from autopar.search.published_context_parallel import LLAMA3_CP_TABLE4, context_parallel_rows
from autopar.traces.vtrain import import_vtrain, read_vtrain_csv

HERE = Path(__file__).resolve().parent
DATA = published.DATA
VTRAIN = HERE.parent / "data" / "vtrain"
VTRAIN_FILES = ("ground_truth_single.csv", "ground_truth_multi.csv")
A100_FIT = ("fitted: A100 gemm_efficiency, gemm_half_flops, elementwise_traffic; selene's link_efficiency.ib "
            "(cost_vs_published.py --fit)")
CHECK = "independent check"


def _experiment(name: str):
    """A sibling experiment script as a module (its readers and predictors; nothing copied)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@dataclass(frozen=True)
class Entry:
    """One published figure: priced (predicted set) or left out (reason set)."""

    file: str
    row: str  # the CSV line and what the row is
    plan: str
    metric: str
    published: float
    fitted: str  # which coefficient the row fitted, or CHECK
    predicted: float | None = None
    reason: str = ""  # why it is left out
    note: str = ""

    @property
    def error(self) -> float | None:
        return None if self.predicted is None else self.predicted / self.published - 1


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        return list(csv.DictReader(f))


# --- Megatron-LM Table 1 and Korthikanti Table 5 (A100, bundled GPT, the A100 fit) -------------------

@cache
def _megatron_errors() -> dict[str, tuple[str, float, float]]:
    """case -> (plan, predicted, published), as cost_vs_published.py reports them."""
    exp = _experiment("cost_vs_published")
    c = Coefficients.for_cluster(load_cluster("selene"), "megatron")
    return {case: (plan, pred, pub) for case, plan, pred, pub in exp.errors(c, exp.cases())}


def megatron_table1(name: str) -> list[Entry]:
    errors = _megatron_errors()
    out = []
    for line, row in enumerate(published.MEGATRON_TABLE1, start=2):
        plan, pred, pub = errors[f"Megatron {row.size}"]
        out.append(Entry(name, f"{line}: GPT {row.size}, {row.gpus} GPUs", plan, "hardware TFLOP/s per GPU", pub,
                         A100_FIT, pred))
    return out


def korthikanti_table5(name: str) -> list[Entry]:
    errors = _megatron_errors()
    out = []
    for line, row in enumerate(published.KORTHIKANTI_TABLE5, start=2):
        for mode in ("full", "sel+sp"):
            plan, pred, pub = errors[f"Korthikanti {row.size} {mode}"]
            out.append(Entry(name, f"{line}: GPT {row.size} {mode}", plan, "iteration s", pub, A100_FIT, pred))
    return out


# --- NeMo 24.07 FP8 (H100) ---------------------------------------------------------------------------

def nemo(name: str) -> list[Entry]:
    exp = _experiment("nemo_fp8")
    rows = exp.runnable_rows()
    predicted = exp.predict(rows)
    fit = "fitted: H100 fp8_gemm_speedup (1.46 on all 12 rows; nemo_fp8.py --fit leaves each family out)"
    out = []
    for line, row in enumerate(published.NEMO_FP8, start=2):
        label = f"{line}: {row.model}, {row.gpus} GPUs"
        plan = f"tp{row.tp} pp{row.pp} cp{row.cp} vp{row.vp} mb {row.micro_batch}, {row.recompute} recompute, fp8"
        if row in predicted:
            out.append(Entry(name, label, plan, "tokens/s per GPU", row.tokens_per_s_per_gpu, fit, predicted[row]))
        else:
            out.append(Entry(name, label, plan, "tokens/s per GPU", row.tokens_per_s_per_gpu, fit,
                             reason="context parallelism: no cp axis in this checkout"))
    return out


# --- FlashAttention's training table (A100, torch) ---------------------------------------------------

def flash(name: str) -> list[Entry]:
    exp = _experiment("flash_training_a100")
    out = []
    for line, row in enumerate(exp.rows(), start=2):
        runs = exp.predicted(row)
        eager, _, plan, est = runs[False]
        compiled = runs[True][0]
        pub = float(row["tokens_per_s"])
        out.append(Entry(name, f"{line}: {row['model']}", plan.describe(), "tokens/s of the node", pub, CHECK, eager,
                         note=f"compiled {compiled / pub - 1:+.1%}" + ("" if est.fits else "; does not fit")))
    return out


# --- NeMo AutoModel MoE (H100) -----------------------------------------------------------------------

MOE_FIT = ("fitted: the grouped kernel's cost per expert problem (autopar/cost/moe.py MoeFit.problem_s, 0, on all "
           "six MoE rows of both frameworks; experiments/fit_moe.py holds each row out)")


def moe(name: str) -> list[Entry]:
    read = iter(published_moe.ALL_ROWS)
    out = []
    for line, raw in enumerate(published.read_table(name), start=2):
        label = f"{line}: {raw['model']}, {raw['gpus']} GPUs"
        pub = float(raw["tokens_per_s_per_gpu"])
        if not (raw["ep"] and raw["activation_checkpointing"]):  # what published_moe.ALL_ROWS reads
            out.append(Entry(name, label, "-", "tokens/s per GPU", pub, CHECK,
                             reason="expert parallelism or activation checkpointing not published for the row"
                                    + ("" if raw["model"] in published_moe.ZOO_SHAPES else
                                       f"; {raw['model']} is not a zoo shape")))
            continue
        row = _same(next(read), raw)
        why = published_moe.expressible(row)
        if why:
            out.append(Entry(name, label, "-", "tokens/s per GPU", pub, CHECK, reason=why))
            continue
        plan, _, tokens = published_moe.predicted_tokens_per_s(row)
        out.append(Entry(name, label, plan.describe(), "tokens/s per GPU", pub, MOE_FIT, tokens))
    return out


def _same(row, raw: dict[str, str]):
    """`row` (published_moe's reading of the file, in order) if it is the CSV row `raw`: the report's
    filter must stay published_moe's."""
    if (row.model, row.gpus) != (raw["model"], int(raw["gpus"])):
        raise AssertionError(f"published_moe read {row.model} on {row.gpus} GPUs where the CSV has {raw['model']} "
                             f"on {raw['gpus']}: update the report's row filter to published_moe's")
    return row


DENSE_CHECK = ("independent check of the shipped H100 fp8 speedup (experiments/fit_megatron_dense.py fits it "
               "without each family: acceptance 3)")


def bridge(name: str) -> list[Entry]:
    """Megatron-Bridge 25.11's DGX-H100 rows: the MoE ones as published_moe.py prices them."""
    read, dense = iter(published_moe.BRIDGE_ROWS), iter(published_megatron.BRIDGE_DENSE)
    out = []
    for line, raw in enumerate(published.read_table(name), start=2):
        label = f"{line}: {raw['model']}, {raw['gpus']} GPUs, {raw['precision']}"
        pub = float(raw["tokens_per_s_per_gpu"])
        if int(raw["ep"]) <= 1:  # a dense row: published_megatron.BRIDGE_DENSE, in order
            row = next(dense)
            if (row.model, row.gpus) != (raw["model"], int(raw["gpus"])):
                raise AssertionError(f"published_megatron read {row.model} where the CSV has {raw['model']}")
            plan, est = published.best(*published_megatron.candidates(row))
            out.append(Entry(name, label, plan.describe(), "tokens/s per GPU", pub, DENSE_CHECK,
                             est.tokens_per_s / row.gpus))
            continue
        plan, _, tokens = published_moe.predicted_tokens_per_s(_same(next(read), raw))
        out.append(Entry(name, label, plan.describe(), "tokens/s per GPU", pub, MOE_FIT, tokens))
    return out


# --- torch-native rows (torchtitan, torchao) ---------------------------------------------------------

@cache
def _torch_native(row: published_torch.TorchNativeRow) -> tuple[str, float | None, str, str]:
    """(plan, predicted tokens/s per GPU, reason left out, note) for one row."""
    why = published_torch.expressible(row)
    if why:
        return "-", None, why, ""
    try:
        plan, est, tokens = published_torch.predicted_tokens_per_s(row)
    except AutoparError as e:  # what the torch runtime cannot run (autopar.capability)
        return "-", None, str(e), ""
    return plan.describe(), tokens, "", (f"{published_torch.PRESETS_BY_GPU[row.gpu]}; peak "
                                         f"{est.peak_memory_bytes / 2**30:.1f} GiB predicted"
                                         + ("" if est.fits else ", over the GPU's memory"))


def _torch_fit(row: published_torch.TorchNativeRow) -> str:
    """Which torch-runtime coefficients of its GPU type the row fitted (autopar/cost/torch_runtime.py)."""
    if published_torch.expressible(row):
        return CHECK
    shipped = torch_runtime.fitted(published_torch.gpu_name(row))
    names = [n for n in published_torch.features(row) if n in shipped]
    return (f"fitted: torch runtime's {', '.join(names)} ({published_torch.PRESETS_BY_GPU[row.gpu]}); held out "
            "in experiments/fit_torch_runtime.py")


def torch_native(name: str) -> list[Entry]:
    out = []
    for row in published_torch.ROWS:
        plan, tokens, why, note = _torch_native(row)
        if published_torch.compiled_beyond_executor(row) and not why:
            note += "; compiled under tp/pp as torchtitan ran it (autopar's executor does not: priced, not runnable)"
        out.append(Entry(name, f"{row.line}: {row.label}", plan, "tokens/s per GPU", row.tokens_per_s_per_gpu,
                         _torch_fit(row), tokens, why, note))
    return out


# --- other H100 rows: Llama 3 Table 4 and torchtitan's (the same runs as torch_native_shared.csv) -------

def other_h100(name: str) -> list[Entry]:
    cp_rows = iter(context_parallel_rows())
    out = []
    for line, raw in enumerate(published.read_table(name), start=2):
        pub = float(raw["value"])
        label = f"{line}: {raw['model']}, {raw['gpus']} GPUs, {raw['config']}"
        if raw["source"] == "Llama 3 paper Table 4":
            row = published._llama3_row(raw)
            if row in LLAMA3_CP_TABLE4:
                plan, pred, _, _ = next(cp_rows)
            else:
                plan, est = published.best(*published.llama3_candidates(row))
                plan, pred = plan.describe(), est.tflops_per_gpu
            out.append(Entry(name, label, str(plan), "model TFLOP/s per GPU", pub, CHECK, pred))
            continue
        twin = _torch_native_twin(raw)
        if twin is None:
            out.append(Entry(name, label, "-", "tokens/s per GPU", pub, CHECK,
                             reason="torchtitan Table 5 states Float8 + AsyncTP + compile for this run (the CSV says "
                                    "bf16): the torch_native_shared.csv row of that run"))
            continue
        plan, tokens, why, note = _torch_native(twin)
        out.append(Entry(name, label, plan, "tokens/s per GPU", pub, CHECK, tokens, why,
                         f"the run of torch_native_shared.csv line {twin.line}; {note}"))
    return out


def _torch_native_twin(raw: dict[str, str]):
    """The torch_native_shared.csv row of the same torchtitan run (bf16, no compile), or None."""
    for row in published_torch.ROWS:
        if (row.source.startswith("TT2412") and row.gpus == int(raw["gpus"]) and row.precision == raw["precision"]
                and not row.compile and row.tokens_per_s_per_gpu == float(raw["value"])):
            return row
    return None


# --- vTrain (A100, Megatron-DeepSpeed) ----------------------------------------------------------------

def vtrain(name: str) -> list[Entry]:
    fit = ("check of the shipped A100 coefficients" + ("; `autopar calibrate` fits its cluster coefficients to "
                                                         "these runs (calibration_report.py, 5-fold CV)"
                                                         if "single" in name else ""))
    path = VTRAIN / name
    out = []
    for row, record in zip(read_vtrain_csv(path), import_vtrain(path)):
        plan = f"dp{row.dp} tp{row.tp} pp{row.pp} mb {row.micro_batch}x{row.global_batch // (row.dp * row.micro_batch)}"
        label = f"{row.line}: h{row.hidden} L{row.layers} a{row.heads}, {row.gpus} GPUs"
        out.append(Entry(f"vtrain/{name}", label, plan, "iteration s", row.time_ms / 1e3, fit,
                         record.predicted["iteration_time_s"]))
    return out


READERS: dict[str, Callable[[str], list[Entry]]] = {
    "megatron_sc21_table1.csv": megatron_table1,
    "korthikanti_2022_table5.csv": korthikanti_table5,
    "nemo_24.07_dgx_h100_fp8.csv": nemo,
    "flashattention_training_a100.csv": flash,
    published_moe.TABLE: moe,
    published_moe.BRIDGE_TABLE: bridge,
    "other_h100.csv": other_h100,
    published_torch.TABLE: torch_native,
}


METRIC_COLUMNS = ("tokens_per_s_per_gpu", "tokens_per_s", "value", "tflops_per_gpu", "model_tflops_per_gpu")


def unknown(name: str) -> list[Entry]:
    """A CSV no reader knows: every row left out, said so (with its throughput column, if it has one)."""
    rows = _csv_rows(DATA / name)
    metric = next((c for c in METRIC_COLUMNS if rows and c in rows[0]), None)
    return [Entry(name, f"{line}: {', '.join(v for v in list(raw.values())[:3] if v)}", "-", metric or "-",
                  float(raw[metric]) if metric else float("nan"), "-", reason="no reader prices this file yet")
            for line, raw in enumerate(rows, start=2)]


def all_files() -> list[str]:
    """Every published CSV (data/published/*.csv), then vTrain's two files."""
    return sorted(p.name for p in DATA.glob("*.csv")) + [f"vtrain/{n}" for n in VTRAIN_FILES]


def report(files: list[str]) -> list[Entry]:
    out = []
    for name in files:
        if name.startswith("vtrain/"):
            out += vtrain(name.split("/", 1)[1])
        else:
            out += READERS.get(name, unknown)(name)
    return out


def summary(entries: list[Entry], file: str) -> tuple[int, int, float | None, float | None]:
    """(rows priced, rows left out, median |error|, max |error|) of one file."""
    mine = [e for e in entries if e.file == file]
    errs = [abs(e.error) for e in mine if e.error is not None]
    return (len(errs), len(mine) - len(errs), statistics.median(errs) if errs else None, max(errs) if errs else None)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _fig(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def text(entries: list[Entry], files: list[str]) -> str:
    lines = []
    for file in files:
        lines.append(f"== {file}")
        for e in (e for e in entries if e.file == file):
            err = "left out" if e.predicted is None else f"{e.error:+.1%}"
            tail = f"  [{e.reason}]" if e.reason else (f"  ({e.note})" if e.note else "")
            lines.append(f"  {e.row} | {e.plan} | {e.metric}: published {_fig(e.published)}, predicted "
                         f"{_fig(e.predicted)}, {err} | {e.fitted}{tail}")
    lines.append("")
    lines += [summary_line(entries, f) for f in files]
    return "\n".join(lines)


def summary_line(entries: list[Entry], file: str) -> str:
    priced, left, med, worst = summary(entries, file)
    return f"{file}: {priced} priced, {left} left out; median |error| {_pct(med)}, max {_pct(worst)}"


def markdown(entries: list[Entry], files: list[str]) -> str:
    """The docs/hardware.md table: every row of data/published, and vTrain's files summarised (their
    1,549 runs one by one are the text output's)."""
    out = ["| file | row | plan | metric | published | predicted | error | fitted or check |",
           "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        if e.file.startswith("vtrain/"):
            continue
        err = f"left out: {e.reason}" if e.predicted is None else f"{e.error:+.1%}"
        fitted = e.fitted + (f" ({e.note})" if e.note else "")
        cells = (f"`{e.file}`", e.row, e.plan, e.metric, _fig(e.published), _fig(e.predicted), err, fitted)
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    out += ["", "| file | figures priced | left out | median abs. error | max abs. error |", "|---|---|---|---|---|"]
    for file in files:
        priced, left, med, worst = summary(entries, file)
        out.append(f"| `{file}` | {priced} | {left} | {_pct(med)} | {_pct(worst)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print the docs/hardware.md table instead")
    parser.add_argument("--files", nargs="+", metavar="NAME",
                        help="only these files (names as listed: a data/published CSV or vtrain/<file>)")
    args = parser.parse_args(argv)
    files = all_files()
    if args.files:
        unknown_names = [f for f in args.files if f not in files]
        if unknown_names:
            print(f"published_report: no such file {', '.join(unknown_names)}; choose from {', '.join(files)}",
                  file=sys.stderr)
            raise SystemExit(2)
        files = [f for f in files if f in args.files]
    entries = report(files)
    print(markdown(entries, files) if args.markdown else text(entries, files))


if __name__ == "__main__":
    main()
