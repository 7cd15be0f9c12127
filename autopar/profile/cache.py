"""On-disk cache of model profiles: one JSON file per digest.

Files live under ``$AUTOPAR_CACHE_DIR`` if set, else ``~/.cache/autopar/profiles``. A file that
cannot be read back (corrupt, truncated, older schema) counts as a miss and is rewritten; writes
go through a temporary file and ``os.replace`` so that a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from autopar import hf_ref
from autopar.atomic import write_text_atomic
from autopar.errors import ModelFileError
from autopar.profile.model_profile import ModelProfile

PROFILER_VERSION = "autopar-profiler-14"  # 5: mixture-of-experts fields; 6: tied embeddings; 7: gathers;
# 8: the loss's saved bytes; 9: the column-wise linears' saved inputs; 10: dropout masks;
# 11: only native_dropout's masks are masks (not any bool tensor); 12: head_dim among the dims, and an
# MoE's dense_ffn as its ffn; 13: each block's kernel launches; 14: pp / sp limits from the forward's order
ZOO = Path(__file__).resolve().parent.parent / "zoo"


def _zoo_digest() -> str:
    """Bundled models (the zoo, and the trace importers' models built on it) share the zoo's
    code, so their profiles depend on all of it."""
    h = hashlib.sha256()
    for f in sorted(ZOO.glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


def profile_digest(path: Path, source_digest: str, model_args: dict, dtype: str) -> str:
    """Cache key: model file bytes (and the zoo's code for zoo models), model arguments, dtype
    and profiler version."""
    shared = _zoo_digest() if ZOO.parent in Path(path).resolve().parents else ""
    key = json.dumps([source_digest, shared, sorted(model_args.items()), dtype, PROFILER_VERSION], default=str)
    return hashlib.sha256(key.encode()).hexdigest()


def lookup(path, model_args: dict | None, dtype: str) -> ModelProfile | None:
    """The cached profile of a model file found from its bytes alone, without importing the
    model (nor torch): a warm `autopar search` starts in a fraction of a second. An ``hf:`` reference
    is found from its config's bytes and the installed transformers' version."""
    if hf_ref.is_reference(path):
        try:
            config = hf_ref.config_file(path)
            source = config.read_bytes()
        except (ModelFileError, OSError):
            return None  # the loader reports the problem
        return load(profile_digest(config, hf_ref.source_digest(source), dict(model_args or {}), dtype))
    path = Path(path)
    if not path.exists() and (ZOO / f"{path}.py").is_file():
        path = ZOO / f"{path}.py"
    try:
        if not path.is_file():  # a FIFO would block the read; a directory, a loop: the loader reports it
            return None
        source = path.read_bytes()
    except (OSError, RuntimeError):
        return None  # the loader reports the problem
    return load(profile_digest(path, hashlib.sha256(source).hexdigest(), dict(model_args or {}), dtype))


def cache_dir() -> Path:
    env = os.environ.get("AUTOPAR_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "autopar" / "profiles"


def cache_path(digest: str) -> Path:
    return cache_dir() / f"{digest}.json"


def load(digest: str) -> ModelProfile | None:
    """The cached profile for ``digest``, or None when absent or unreadable."""
    try:
        profile = ModelProfile.from_json(cache_path(digest).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return profile if profile.digest == digest else None


def store(profile: ModelProfile) -> Path:
    """Write ``profile`` atomically; returns its path."""
    path = cache_path(profile.digest)
    write_text_atomic(path, profile.to_json())
    return path
