"""Analytic, vectorised cost model: iteration time with breakdown and peak memory per GPU."""

from autopar.cost.arrays import PlanArrays
from autopar.cost.coefficients import Coefficients
from autopar.cost.estimate import Estimate, estimate, estimates_from
from autopar.cost.model import MEMORY_PARTS, TIME_PARTS, evaluate

__all__ = ["Coefficients", "Estimate", "MEMORY_PARTS", "PlanArrays", "TIME_PARTS", "estimate", "estimates_from",
           "evaluate"]
