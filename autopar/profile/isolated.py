"""Profiling a model.py in a child process, under a time bound.

A model.py is code: importing and building it may loop, sleep, call `sys.exit` or `os._exit`,
or kill its process. The CLI profiles it in `python -m autopar.profile.isolated`, which writes the
profile (or the one-line ModelFileError) to a result file and stores the profile in the cache;
the parent waits at most `timeout` seconds, then kills the child's whole process group. Whatever
the model did, the user gets one line naming the file and exit status 2. A wait longer than
PROGRESS_AFTER_S says on stderr what autopar waits for (stdout stays clean for --json), and the
child dies with its parent (`autopar.executor.lifeline`): a killed autopar leaves no profiler.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autopar.errors import AutoparError, ModelFileError
from autopar.executor.lifeline import die_with_parent
from autopar.profile.model_profile import ModelProfile

DEFAULT_PROFILE_TIMEOUT = 120.0  # seconds: the largest zoo models (175b GPT, 70b Llama) profile in ~10 s here
PROGRESS_AFTER_S = 5.0  # a profile still running after this long gets one line on stderr
PROGRESS = "autopar: profiling"  # how that line starts


def check_timeout(seconds: float, flag: str = "--profile-timeout") -> float:
    if not (isinstance(seconds, (int, float)) and 0 < seconds < 86_400):
        raise AutoparError(f"{flag} must be a number of seconds in (0, 86400), got {seconds}")
    return float(seconds)


def profile_isolated(path, model_args: dict, dtype: str, timeout: float):
    """The ModelProfile of the model.py at `path`, measured in a child process within `timeout` s."""

    check_timeout(timeout)
    with tempfile.TemporaryDirectory(prefix="autopar-profile-") as tmp:
        result = Path(tmp) / "result.json"
        request = json.dumps({"path": str(path), "args": model_args, "dtype": dtype, "result": str(result),
                              "parent": os.getpid()}, default=str)
        # -P: the current directory is not put on the child's sys.path (a cuda.py or numpy.py there would shadow
        # the real module, a checkout's autopar the installed one); the model file's own directory is
        # (`modelfile.load_model_file`)
        child = subprocess.Popen([sys.executable, "-P", "-m", "autopar.profile.isolated", request],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 start_new_session=True)  # its own process group: killed whole
        try:
            stderr = _wait(child, path, timeout)
        except subprocess.TimeoutExpired:
            _kill(child)
            raise ModelFileError(f"{path}: profiling did not finish within --profile-timeout {timeout:g} s "
                                 f"(does the model file loop or wait at import or in build_model?); raise "
                                 f"--profile-timeout for a model that is just slow") from None
        except BaseException:  # an interrupt of autopar itself: no profiler left behind
            _kill(child)
            raise
        if result.is_file():
            out = json.loads(result.read_text())
            if "error" in out:
                raise ModelFileError(out["error"])
            return ModelProfile.from_dict(out["profile"])
        last = (stderr.decode(errors="replace").strip().splitlines() or [""])[-1][:200]
        raise ModelFileError(f"{path}: the model file ended the profiling process ({_status(child.returncode)})"
                             + (f": {last}" if last else "") + "; a model.py must not exit or kill its process")


def _wait(child: subprocess.Popen, path, timeout: float) -> bytes:
    """The child's stderr once it ends; one line on stderr if that takes over PROGRESS_AFTER_S."""
    started = time.monotonic()
    try:
        return child.communicate(timeout=min(timeout, PROGRESS_AFTER_S))[1]
    except subprocess.TimeoutExpired:
        if timeout <= PROGRESS_AFTER_S:
            raise
    waited = time.monotonic() - started
    print(f"{PROGRESS} {path} ({waited:.0f} s so far; --profile-timeout {timeout:g}) ...", file=sys.stderr, flush=True)
    return child.communicate(timeout=max(timeout - waited, 0.0))[1]


def _kill(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _status(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def main(argv: list[str]) -> None:
    """The child: profile, write {"profile": ...} or {"error": one line}, exit 0."""
    request = json.loads(argv[0])
    die_with_parent(request["parent"])  # SIGKILL: nothing of a profile half-written is kept (atomic writes)
    try:
        from autopar.profile.profiler import profile_model  # pulls torch: imported on first use

        out = {"profile": profile_model(request["path"], request["args"], dtype=request["dtype"]).to_dict()}
    except AutoparError as e:
        out = {"error": str(e)}
    except BaseException as e:  # noqa: BLE001 - whatever the model did, the parent reports one line
        first = (str(e).strip().splitlines() or ["(no message)"])[0]
        out = {"error": f"{request['path']}: profiling raised {type(e).__name__}: {first}"}
    Path(request["result"]).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
