"""What a trained policy depends on, as digests recorded in the policy file.

`space`: the registry's decisions, slots and observation layout (`autopar.envs.knobs.space_signature`):
a policy trained under another space reads its actions differently and is refused. `cost`: the
cost model's source and coefficients (every preset's): the oracle the policy learnt from; when it
changes the policy still runs but may no longer match the oracle, so planners say so in one line
and the test suite fails until the shipped policy is retrained (`RETRAIN_COMMAND`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

RETRAIN_COMMAND = "autopar train --workloads 1024 --timesteps 100000 -o policies/default_policy.zip"


def cost_fingerprint() -> str:
    import autopar.cost
    from autopar.cluster.presets import PRESETS
    from autopar.cost.coefficients import Coefficients

    digest = hashlib.sha256()
    for path in sorted(Path(autopar.cost.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    coefficients = {"default": Coefficients().to_dict(), "presets": PRESETS}  # presets carry their own
    digest.update(json.dumps(coefficients, sort_keys=True, default=repr).encode())
    return digest.hexdigest()[:16]


def fingerprint() -> dict[str, str]:
    from autopar.envs.knobs import space_signature

    return {"space": space_signature(), "cost": cost_fingerprint()}


def stale(meta: dict) -> list[str]:
    """The parts of the fingerprint that changed since the policy was trained."""
    recorded = meta.get("fingerprint") or {}
    return [part for part, value in fingerprint().items() if recorded.get(part) != value]


def stale_note(meta: dict, path) -> str | None:
    """One line when the cost model changed since training (a changed space is refused at load)."""
    if "cost" not in stale(meta):
        return None
    return (f"note: {Path(path).name} was trained against an older cost model (source or coefficients changed "
            f"since); its plans may trail the oracle until it is retrained: {RETRAIN_COMMAND}")
