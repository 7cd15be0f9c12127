"""Which code a trace record's model may be profiled with: traces are data, never code.

Calibration needs each record's model profile. A trace file is passed between teams, so a
`model.path` in it must not make autopar import and run that file. A record's profile comes,
in this order, from
  1. the profile stored in the record (`model.profile`, written by `autopar run`), checked
     against the profile schema; one an older profiler measured is measured again when the
     code below allows (it lacks what the profiler now tells apart), else used as stored
     (`stale_note` says so);
  2. a model file bundled with autopar (the zoo, the vTrain importer's Megatron GPT), by name;
  3. a model file the user named on the command line (`--model-file FILE`) whose bytes and
     arguments match the record's `model.digest`;
  4. the record's own path, only with `--trust-model-paths` (the user vouches for the traces).
Anything else is refused in one line naming the record and the file, before any code runs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from autopar.errors import AutoparError
from autopar.profile import ModelProfile, profile_model
from autopar.profile.cache import PROFILER_VERSION
from autopar.profile.model_profile import profile_schema
from autopar.schema import check

PACKAGE = Path(__file__).resolve().parents[1]  # the autopar package directory


def bundled_files() -> set[Path]:
    """autopar's own model files: a trace may name these (they are autopar's code, not the trace's)."""
    from autopar import zoo  # pulls torch: imported on first use

    return {zoo.path(name).resolve() for name in zoo.MODELS} | {(PACKAGE / "traces" / "megatron_gpt.py").resolve()}


def _bundled(model: dict) -> Path | None:
    """The bundled file a record names, by zoo name or by its path inside the package."""
    from autopar import zoo  # pulls torch: imported on first use

    path = model.get("path")
    if path is None and model.get("name") in zoo.MODELS:
        return zoo.path(model["name"]).resolve()
    if not isinstance(path, str):
        return None
    if path in zoo.MODELS:
        return zoo.path(path).resolve()
    candidate = (PACKAGE.parent / path).resolve() if not Path(path).is_absolute() else Path(path).resolve()
    return candidate if candidate in bundled_files() else None


def _digests(file, args: dict) -> tuple[str, str]:
    """A model file's record digest, and the form `autopar run` wrote before it stored profiles."""

    source = hashlib.sha256(Path(file).read_bytes()).hexdigest()
    legacy = hashlib.sha256(f"{source}{json.dumps(args, sort_keys=True)}".encode()).hexdigest()
    return model_digest(file, args), legacy


@dataclass(frozen=True)
class ModelSources:
    """The model files the user vouches for (`--model`), and whether record paths are trusted."""

    files: tuple[str, ...] = ()
    trust_paths: bool = False

    def profile(self, model: dict, dtype: str, source: str):
        """The ModelProfile of a record's model (see the module docstring for where it comes from)."""

        stored, args, code = model.get("profile"), model.get("args"), None
        if stored is not None:
            d = check(stored, profile_schema(), f"{source}: model.profile", AutoparError)
            try:
                profile = ModelProfile.from_dict(d)
            except (TypeError, ValueError) as e:
                raise AutoparError(f"{source}: model.profile cannot be read ({e})") from None
            if profile.dtype == dtype:
                if profile.profiler == PROFILER_VERSION:
                    return profile
                code = self._code(model)  # an older profiler's: measured again where the code may run
                if args is None or code is None or not Path(code).is_file():
                    return profile
                try:
                    return profile_model(code, args, dtype=dtype)
                except AutoparError:  # the code no longer takes the record's arguments: priced as stored
                    return profile
        if args is None:
            raise _no_args(source)
        path = code or self._file(model, source)
        try:
            return profile_model(path, args, dtype=dtype)
        except AutoparError as e:
            raise AutoparError(f"{source}: cannot profile the record's model {path!r}: {e}") from None

    def check(self, model: dict, source: str) -> None:
        """Refuse now, before any profiling starts, a record whose profile can come from nowhere:
        it stores none, and it has no model arguments or no model file autopar may run."""
        if model.get("profile") is not None:
            return
        if model.get("args") is None:
            raise _no_args(source)
        self._file(model, source)

    def _code(self, model: dict) -> str | None:
        """The model file the user allows autopar to run for this record, if any."""
        bundled = _bundled(model)
        if bundled is not None:
            return str(bundled)
        for file in self.files:
            if Path(file).is_file() and model.get("digest") in _digests(file, model.get("args") or {}):
                return file
        if self.trust_paths:
            return resolve_model_path(str(model.get("path") or model.get("name")))
        return None

    def _file(self, model: dict, source: str) -> str:
        code = self._code(model)
        if code is not None:
            return code
        named = str(model.get("path") or model.get("name"))
        raise AutoparError(f"{source}: the record names the model file {named!r} and carries no profile; a trace is "
                           f"data and autopar does not run code it names: pass --model-file FILE (a file whose "
                           f"digest matches the record), or --trust-model-paths if you trust the traces' files")


def _no_args(source: str) -> AutoparError:
    return AutoparError(f"{source}: the record's model has no 'args' (the model arguments it was profiled with), so "
                        f"its profile cannot be rebuilt")


def stale_note(profile, source: str) -> str | None:
    """One line when a record's profile comes from an older profiler and could not be measured again."""
    if profile.profiler == PROFILER_VERSION:
        return None
    return (f"{source}: the record's stored profile is from {profile.profiler or 'a profiler before version 9'} "
            f"({PROFILER_VERSION} now) and could not be measured again (the record has no model arguments, its "
            f"model file is not available, or the file no longer takes those arguments): its loss's, column-wise "
            f"inputs' and dropout masks' memory is priced as that profile tells it; to re-profile, pass "
            f"--model-file FILE (the file the record names, taking the record's arguments)")


def resolve_model_path(path: str) -> str:
    """A record's model path: as given if it exists, a zoo name, or relative to the directory
    holding the autopar package (how imported traces name autopar's own model files)."""
    from autopar import zoo  # pulls torch: imported on first use

    if Path(path).is_file() or path in zoo.MODELS:
        return path
    inside = Path(__file__).resolve().parents[2] / path
    return str(inside) if inside.is_file() else path


def model_digest(path, args: dict) -> str:
    """sha256 of a model file's bytes and its arguments (zoo models by name)."""
    from autopar import zoo  # pulls torch: imported on first use

    path = str(path)
    file = Path(resolve_model_path(path))
    if not file.is_file() and path in zoo.MODELS:
        file = zoo.path(path)
    h = hashlib.sha256(file.read_bytes())
    h.update(json.dumps(args, sort_keys=True).encode())
    return h.hexdigest()
