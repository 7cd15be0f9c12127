"""Atomic file writes: every file autopar writes (plans, profiles, traces, caches, cluster JSON,
policies) goes through a temporary file beside it and `os.replace`, so a crash, an interrupt or
an error never leaves a partial file, and a reader sees the old file or the new one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path) -> Iterator[Path]:
    """A temporary path to write; it replaces `path` only if the block ends without error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
