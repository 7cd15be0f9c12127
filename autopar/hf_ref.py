"""What an ``hf:PATH`` reference names, without torch or transformers: its config file and the digest
its profile is cached under, so a warm `autopar search hf:...` answers from the profile cache as a
model.py does (`autopar.profile.cache.lookup`) instead of importing transformers and profiling again.
`autopar.hf` builds the model."""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

from autopar.errors import ModelFileError

PREFIX = "hf:"
ADAPTER_VERSION = "3"  # part of the profile cache key: bump when the built model changes (3: MoE families)


def is_reference(ref) -> bool:
    return isinstance(ref, str) and ref.startswith(PREFIX)


def config_file(ref: str) -> Path:
    """The config.json an ``hf:`` reference names (the file, or ``config.json`` in a directory)."""
    path = Path(ref[len(PREFIX):]).expanduser().resolve()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ModelFileError(f"{path}: no such transformers config; give hf:PATH with PATH a config.json or a "
                             "local model directory holding one")
    return path


def source_digest(raw: bytes) -> str:
    """The digest of a config's bytes as built by this transformers and this adapter (the version read from
    the installed package's metadata: importing transformers takes seconds)."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        version = "absent"
    return hashlib.sha256(raw + f"|transformers {version}|adapter {ADAPTER_VERSION}".encode()).hexdigest()
