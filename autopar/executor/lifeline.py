"""A child process that ends when the autopar process that started it ends.

A worker rank or a model profiler left behind by a killed `autopar` (kill -9, a closed
terminal) would keep a CPU or a GPU busy with nobody waiting for it. On Linux the kernel
signals the child when its parent dies (prctl PR_SET_PDEATHSIG); everywhere, a thread of the
child looks at its parent every POLL_S and signals the child itself once the parent changed
(re-parented to init or a subreaper), and a parent gone before either took hold ends it at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h
POLL_S = 1.0


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL, poll_s: float | None = POLL_S) -> None:
    """Deliver `signum` to this process when `parent_pid`, its parent, is gone (poll_s None: no
    polling thread, the kernel's signal alone)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum))
    if os.getppid() != parent_pid:  # the parent died before the kernel could be told
        os.kill(os.getpid(), signum)
        return
    if poll_s is None:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os.kill(os.getpid(), signum)

    threading.Thread(target=watch, name="autopar-lifeline", daemon=True).start()
