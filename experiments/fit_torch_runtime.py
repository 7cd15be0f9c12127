"""Fit the torch runtime's coefficients to the torch-native rows and print each row held out.

    python experiments/fit_torch_runtime.py

Per row: the fold that predicts it (its table left out, or the row itself where a feature has one table
on its GPU type, autopar/calibrate/torch_runtime.py `fold`), the fold's fitted values, the held-out
prediction and error; then median and max |error|, and each GPU type's fit on all its rows, the values
autopar/cost/torch_runtime.py `TORCH_RUNTIME` ships (copied there by hand, each with the rows that set it).
A row autopar cannot express is listed with the reason. About two minutes on one core.
"""

from __future__ import annotations

import numpy as np

from autopar.calibrate import torch_runtime as fit
from autopar.cost import torch_runtime
from autopar.search import published_torch as pt


def main() -> None:
    errors, without = [], []
    for case, kind, values, tokens in fit.held_out():
        err = tokens / case.row.tokens_per_s_per_gpu - 1
        errors.append(abs(err))
        if not (case.row.source == "TTATP" and case.row.precision == "float8-rowwise"):
            without.append(abs(err))
        shipped = fit.predict(case, torch_runtime.fitted(case.gpu)) / case.row.tokens_per_s_per_gpu - 1
        print(f"{case.row.line:3d} {case.row.label:88s} published {case.row.tokens_per_s_per_gpu:8,.0f} "
              f"held out ({kind}) {tokens:8,.0f} {err:+6.1%}  shipped {shipped:+6.1%}  "
              + " ".join(f"{k}={v:.3g}" for k, v in values.items()))
    for row in pt.ROWS:
        if pt.expressible(row):
            print(f"{row.line:3d} {row.label:88s} left out: {pt.expressible(row)}")
    print(f"held out: {len(errors)} rows, median |error| {np.median(errors):.1%}, max {max(errors):.1%}")
    print(f"held out without the async-TP table's float8-rowwise rows (torchtitan issue 1207's low baseline; "
          f"torchao's rowwise row cannot predict them): {len(without)} rows, median |error| "
          f"{np.median(without):.1%}, max {max(without):.1%}")
    for gpu, values in fit.shipped_fit().items():
        rows = [c.row.line for c in fit.by_gpu()[gpu]]
        print(f"fit on all rows of {gpu} (lines {', '.join(map(str, rows))}): "
              + ", ".join(f"{k} = {v}" for k, v in values.items()))


if __name__ == "__main__":
    main()
