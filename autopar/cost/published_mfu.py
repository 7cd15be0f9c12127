"""The best model-FLOPs utilisation published per GPU, runtime, precision and attention kernel, each
with its source (docs/references.md): what a prediction is held to before anyone believes it.

MFU here is model TFLOP/s per GPU over the datasheet peak of the run's precision (autopar/cluster/gpus.py),
the convention of `Estimate.mfu`. "flash" attention skips a causal mask's upper half, which the FLOPs
convention counts (docs/hardware.md), so a flash run's MFU can exceed any unfused one: the kernel is
part of the key and never relaxed.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.runtime import is_megatron

_A100 = ("A100-SXM4-80GB", "A100-SXM4-40GB")
_H100 = ("H100-SXM5-80GB",)


@dataclass(frozen=True)
class PublishedMfu:
    gpus: tuple[str, ...]  # GPU spec names (autopar/cluster/gpus.py)
    runtime: str  # "megatron" (Megatron-LM / Megatron-Core) or "torch" (a PyTorch stack of its own)
    precisions: tuple[str, ...]
    attention: str  # "unfused" or "flash"
    mfu: float
    source: str


PUBLISHED_MFU = (
    PublishedMfu(_A100, "megatron", ("bf16", "fp16"), "unfused", 0.563,
                 "Korthikanti et al. 2022 Table 5: 1T, selective recompute + sequence parallelism "
                 "(docs/references.md §2)"),
    PublishedMfu(_A100, "torch", ("bf16", "fp16"), "flash", 0.72,
                 "Dao 2023, FlashAttention-2: GPT-style on 8 A100, 225 TFLOP/s (docs/references.md §9)"),
    PublishedMfu(_H100, "torch", ("bf16",), "flash", 430e12 / 989e12,
                 "Llama 3 Table 4: 405B on 8,192 H100, 430 TFLOP/s of 989 (docs/references.md §6)"),
    PublishedMfu(_H100, "megatron", ("fp8",), "flash", 842e12 / 1979e12,
                 "NeMo 24.07 DGX-H100 FP8: GPT3-175B, 842 TFLOP/s of 1,979 (docs/references.md §7)"),
)


def best_published(gpu: str, runtime: str, precision: str, attention: str) -> PublishedMfu | None:
    """The best published row for this GPU, runtime and precision with this attention kernel; where
    none was published for that runtime, the GPU's best at that precision, then at any precision
    (never another GPU or kernel); None when the GPU has none."""
    family = "megatron" if is_megatron(runtime) else runtime
    rows = [r for r in PUBLISHED_MFU if gpu in r.gpus and r.attention == attention]
    for keep in (lambda r: r.runtime == family and precision in r.precisions,
                 lambda r: precision in r.precisions, lambda r: True):
        matching = [r for r in rows if keep(r)]
        if matching:
            return max(matching, key=lambda r: r.mfu)
    return None
