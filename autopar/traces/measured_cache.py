"""The measured reward's cache file: each measured plan's reward and trace record, by workload
and plan (`autopar.traces.reward.MeasuredReward` writes it). A data file like the others: read
through its schema, and one a command cannot use is one line before any run. Light to import, so
`autopar train measured` checks its --cache before it loads torch."""

from __future__ import annotations

import math
import os

from autopar.errors import AutoparError
from autopar.profile.cache import cache_dir
from autopar.schema import Anything, Map, Num, Obj, Opt, check, loads, read_file

CACHE_SCHEMA = Map(Obj({"reward": Num(-math.inf), "record": Opt(Anything())}, required=("reward", "record")))


def default_cache() -> str:
    return str(cache_dir() / "measured-rewards.json")


def read_cache(path) -> dict:
    """The measurements cached at `path` ({} before the first); a cache autopar cannot use (not
    JSON, not a mapping of measurements, a folder, a FIFO) is one line, before any run."""
    if not os.path.lexists(path):
        return {}
    try:
        return check(loads(read_file(path, "measurement cache", AutoparError), str(path), AutoparError),
                     CACHE_SCHEMA, f"measurement cache {path}", AutoparError)
    except AutoparError as e:
        raise AutoparError(f"{e}; move it away (its plans are measured again) or name another cache file") from None
