"""autopar: pick, explain and apply a parallel training plan for a PyTorch model.

`autopar.apply` and its elastic loop `autopar.train_elastic` (the executor) load on first use, so
`import autopar` stays light; importing it registers the Gymnasium env `autopar/ParallelPlan-v0`."""

import autopar.envs  # registers autopar/ParallelPlan-v0 with Gymnasium by a string entry point (no torch, no SB3)
import autopar.executor  # light: the executor's own __getattr__ loads torch on first use

__version__ = "0.1.0"


def __getattr__(name):
    if name in ("apply", "train_elastic"):
        return getattr(autopar.executor, name)
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
