"""Policy files: the sb3 zip with autopar's metadata and NumPy actor entries, and checkpoints."""

from __future__ import annotations

import io
import json
import platform
import re
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from autopar.atomic import atomic_path
from autopar.errors import AutoparError
from autopar.policies.load import ACTOR_ENTRY, META_ENTRY, NumpyActor


def actor_weights(model) -> dict[str, np.ndarray]:
    """The tensors NumpyActor needs, from a MaskablePPO model."""
    keep = ("features_extractor.", "mlp_extractor.policy_net.", "action_net.")
    return {k: v.detach().cpu().numpy() for k, v in model.policy.state_dict().items() if k.startswith(keep)}


def numpy_actor(model) -> NumpyActor:
    return NumpyActor(actor_weights(model), {})


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for package in ("autopar", "torch", "numpy", "gymnasium", "stable-baselines3", "sb3-contrib"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out


def write_policy(model, path: Path, meta: dict) -> None:
    """The sb3 zip plus autopar's entries, written atomically (an interrupt leaves the old file)."""
    buffer = io.BytesIO()
    model.save(buffer)
    actor = io.BytesIO()
    np.savez_compressed(actor, **actor_weights(model))
    with atomic_path(path) as tmp:
        tmp.write_bytes(buffer.getvalue())
        with zipfile.ZipFile(tmp, "a", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(META_ENTRY, json.dumps(meta, indent=1))
            archive.writestr(ACTOR_ENTRY, actor.getvalue())


def sidecar_path(output) -> Path:
    """The metadata sidecar of a policy file: policy.zip -> policy.json (never the policy itself)."""
    output = Path(output)
    if output.suffix == ".json":
        raise AutoparError(f"-o {output}: the policy file must not end in .json (its metadata sidecar is "
                           f"{output.stem}.json); use -o {output.with_suffix('.zip')}")
    return output.with_suffix(".json")


def latest_checkpoint(directory: Path) -> tuple[Path, int] | None:
    found = [(int(m.group(1)), p) for p in directory.glob("step_*.zip")
             if (m := re.fullmatch(r"step_(\d+)\.zip", p.name))]
    if not found:
        return None
    steps, path = max(found)
    return path, steps
