"""Model profiling on the meta device: per-block parameters, FLOPs, activation memory, TP split.

`profile_model` answers from the cache without importing torch or the model; the profiler
(and torch) load only to measure."""

from __future__ import annotations

import os

from autopar.profile import cache as profile_cache
from autopar.profile.isolated import profile_isolated
from autopar.profile.model_profile import BlockProfile, ModelProfile


def profile_model(path_or_modelfile, model_args: dict | None = None, dtype: str = "bf16",
                  cache: bool = True, timeout: float | None = None) -> ModelProfile:
    """The ModelProfile of a model.py (a path, a zoo name such as "gpt", or a loaded ModelFile).
    With `timeout`, a path is profiled in a child process that gets that many seconds
    (`autopar.profile.isolated`: the CLI's --profile-timeout)."""
    if cache and isinstance(path_or_modelfile, (str, os.PathLike)):
        hit = profile_cache.lookup(path_or_modelfile, model_args, dtype)
        if hit is not None:
            return hit
        if timeout is not None:

            return profile_isolated(path_or_modelfile, dict(model_args or {}), dtype, timeout)
    from autopar.profile.profiler import profile_model as measure  # pulls torch: imported on first use

    return measure(path_or_modelfile, model_args, dtype=dtype, cache=cache)


__all__ = ["BlockProfile", "ModelProfile", "profile_model"]
