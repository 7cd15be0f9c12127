"""Analytic, vectorised cost model: iteration time with breakdown and peak memory per GPU."""

from autopar.cost.arrays import PlanArrays
from autopar.cost.coefficients import Coefficients
from autopar.cost.collectives import collective_time
from autopar.cost.estimate import Estimate, estimate, estimates_from
from autopar.cost.model import MEMORY_PARTS, TIME_PARTS, evaluate

__all__ = ["Coefficients", "Estimate", "MEMORY_PARTS", "PlanArrays", "TIME_PARTS", "collective_time", "estimate",
           "estimates_from", "evaluate"]
