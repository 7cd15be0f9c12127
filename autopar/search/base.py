"""The one interface every planner implements: propose(workload, k) -> the k best plans."""

from __future__ import annotations

from abc import ABC, abstractmethod

from autopar.plan import Plan


class Planner(ABC):
    name: str = ""

    def __init__(self):
        self.evaluations = 0  # cost-model evaluations spent by the last propose()

    @abstractmethod
    def propose(self, workload, k: int = 1) -> list[Plan]:
        """Up to k distinct valid plans that fit in memory, best first; raises NoValidPlanError
        when the workload admits none."""
