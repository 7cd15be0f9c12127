"""Calibration: fit the cost model's coefficients to measured traces and all-reduce tables, and
profile the local machine into a cluster JSON.

    dataset.py          trace records -> rows grouped by (model, cluster size) for fast prediction
    fit.py              robust least squares on log time, within physical bounds
    folds.py            train/test splits that keep each model on one side
    metrics.py          MAPE, max error, Spearman, per-group best-pick ratio
    collectives.py      link efficiency and latency from all-reduce tables
    cluster_profile.py  gloo/NCCL all-reduce, matmul and memory timing -> cluster JSON
    calibration.py      the procedure behind `autopar calibrate`

scipy is imported only when a fit runs.
"""

from autopar.calibrate.calibration import CalibrationResult, calibrate
from autopar.calibrate.dataset import Dataset, build_dataset, job_mix, load_traces
from autopar.calibrate.fit import FitResult, default_parameters, fit

__all__ = ["CalibrationResult", "Dataset", "FitResult", "build_dataset", "calibrate", "default_parameters", "fit",
           "job_mix", "load_traces"]
