"""Compare the cost model with Megatron-LM's published A100 figures, and refit the defaults.

    python experiments/cost_vs_published.py          # errors with the default coefficients
    python experiments/cost_vs_published.py --fit    # fit one set of coefficients to all rows

The fit minimises squared log errors over all 10 rows of Narayanan et al. Table 1 (hardware
TFLOP/s) and the 8 cells of Korthikanti et al. Table 5 (iteration time) at once: one set of
coefficients for every row, no per-row tuning. Its result is what `Coefficients` defaults to.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from rich.console import Console
from rich.table import Table

from autopar.cost import Coefficients
from autopar.cost.published import (KORTHIKANTI_TABLE5, MEGATRON_TABLE1, best, korthikanti_candidates,
                                    megatron_candidates)

FITTED = ("gemm_efficiency", "gemm_half_flops", "elementwise_traffic", "dp_overlap", "nvlink", "ib")
BOUNDS = {"gemm_efficiency": (0.3, 1.0), "gemm_half_flops": (1e8, 1e12), "elementwise_traffic": (0.01, 1.0),
          "dp_overlap": (0.0, 1.0), "nvlink": (0.3, 1.0), "ib": (0.3, 1.0)}


def coefficients(x) -> Coefficients:
    values = dict(zip(FITTED, x))
    base = Coefficients()
    links = {**base.link_efficiency, "nvlink": values.pop("nvlink"), "ib": values.pop("ib")}
    return dataclasses.replace(base, link_efficiency=links, **values)


def cases() -> list[tuple[str, float, object, object]]:
    """(case, published figure, workload, candidate plans) for every published figure; the
    figure is hardware TFLOP/s per GPU for Megatron rows and seconds for Korthikanti cells."""
    out = []
    for row in MEGATRON_TABLE1:
        out.append((f"Megatron {row.size}", row.tflops_per_gpu, *megatron_candidates(row)))
    for row in KORTHIKANTI_TABLE5:
        for selective in (False, True):
            pub = row.selective_sp_s if selective else row.full_recompute_s
            name = f"Korthikanti {row.size} {'sel+sp' if selective else 'full'}"
            out.append((name, pub, *korthikanti_candidates(row, selective)))
    return out


def errors(c: Coefficients, all_cases) -> list[tuple[str, str, float, float]]:
    """(case, plan, predicted, published) for every published figure."""
    out = []
    for name, pub, workload, candidates in all_cases:
        plan, est = best(workload, candidates, c)
        pred = est.hw_tflops_per_gpu if name.startswith("Megatron") else est.iteration_time_s
        out.append((name, plan.describe(), pred, pub))
    return out


def fit(all_cases) -> Coefficients:
    from scipy.optimize import minimize

    base = Coefficients()
    x0 = [getattr(base, n) if hasattr(base, n) else base.link_efficiency[n] for n in FITTED]
    scale = np.array(x0, dtype=float)

    def loss(z):
        x = np.clip(z * scale, [BOUNDS[n][0] for n in FITTED], [BOUNDS[n][1] for n in FITTED])
        return sum(np.log(p / q) ** 2 for _, _, p, q in errors(coefficients(x), all_cases))

    res = minimize(loss, np.ones(len(FITTED)), method="Nelder-Mead", options={"maxiter": 300, "xatol": 1e-3})
    x = np.clip(res.x * scale, [BOUNDS[n][0] for n in FITTED], [BOUNDS[n][1] for n in FITTED])
    return coefficients(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="refit the default coefficients")
    args = parser.parse_args()
    console = Console()
    c = Coefficients()
    all_cases = cases()
    if args.fit:
        c = fit(all_cases)
        console.print({n: getattr(c, n) for n in FITTED[:4]} | {n: c.link_efficiency[n] for n in FITTED[4:]})
    table = Table(title="cost model vs published figures (dgx-a100-80g)")
    for col in ("case", "plan chosen", "predicted", "published", "error"):
        table.add_column(col)
    rel = []
    for case, plan, pred, pub in errors(c, all_cases):
        rel.append((case, pred / pub - 1))
        table.add_row(case, plan, f"{pred:.2f}", f"{pub:.2f}", f"{pred / pub - 1:+.1%}")
    console.print(table)
    mega = [abs(e) for case, e in rel if case.startswith("Megatron")]
    korth = [abs(e) for case, e in rel if case.startswith("Korthikanti")]
    console.print(f"Megatron Table 1 (hardware TFLOP/s): median |error| {np.median(mega):.1%}, max {max(mega):.1%}")
    console.print(f"Korthikanti Table 5 (iteration time): median |error| {np.median(korth):.1%}, max {max(korth):.1%}")


if __name__ == "__main__":
    main()
