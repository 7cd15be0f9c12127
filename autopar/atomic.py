"""Atomic file writes: every file autopar writes (plans, profiles, traces, caches, cluster JSON,
policies) goes through a temporary file beside it and `os.replace`, so a crash, an interrupt or
an error never leaves a partial file, and a reader sees the old file or the new one. Only a
regular file or a missing path is ever replaced (`check_output`, which the commands also call
before their work starts, so a bad -o fails in one line and costs nothing)."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from autopar.errors import AutoparError


def check_output(path, what: str = "output") -> Path:
    """Refuse, before any work, an output path autopar could not or must not write: anything but
    a regular file or a missing path (a directory, a symlink, a FIFO, a device: replacing it
    would destroy it), or a path whose folder cannot exist (a regular file on the way) or is
    not writable. Missing folders are created when the file is written."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as e:  # ENOTDIR: a regular file on the way
        raise AutoparError(f"cannot write {what} {path}: {e.strerror}") from None
    if info is not None and not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a symbolic link" if stat.S_ISLNK(info.st_mode) \
            else "not a regular file"
        raise AutoparError(f"{what} {path} is {kind}; autopar writes only regular files: give a file path")
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise AutoparError(f"cannot write {what} {path}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK) or str(folder).startswith(("/proc", "/sys")):
        raise AutoparError(f"cannot write {what} {path}: the folder {folder} is not writable")
    return path


@contextlib.contextmanager
def atomic_path(path) -> Iterator[Path]:
    """A temporary path to write; it replaces `path` only if the block ends without error."""
    path = check_output(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise AutoparError(f"cannot write {path}: {e.strerror}") from None
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users
    try:
        yield Path(tmp)
        check_output(path)  # the path may have become a symlink or a FIFO meanwhile
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
