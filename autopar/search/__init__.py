"""Planners behind one interface, found by name: each is imported only when asked for (optional
dependencies), and the rl planner lives above Search, in `autopar.policies.planner` (RL imports
Search, never the reverse: docs/architecture.md)."""

from __future__ import annotations

import importlib

from autopar.errors import AutoparError
from autopar.search.base import Planner

_PLANNERS = {
    "exhaustive": "autopar.search.exhaustive:ExhaustivePlanner",
    "rules": "autopar.search.rules:RulesPlanner",
    "rl": "autopar.policies.planner:RLPlanner",
    "optuna": "autopar.search.optuna_search:OptunaPlanner",
    "random": "autopar.search.random_search:RandomPlanner",
}


def planner_names() -> list[str]:
    return list(_PLANNERS)


def get_planner(name: str, **options) -> Planner:
    if name not in _PLANNERS:
        raise AutoparError(f"unknown planning method '{name}'; choose one of {planner_names()}")
    module, cls = _PLANNERS[name].split(":")
    return getattr(importlib.import_module(module), cls)(**options)


__all__ = ["Planner", "get_planner", "planner_names"]
