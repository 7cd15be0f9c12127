"""User-facing errors: the CLI prints their message as one line and exits with code 2."""


class AutoparError(Exception):
    """Bad input that the user can fix; the message says what is wrong and how to fix it."""


class PlanError(AutoparError):
    """A plan is malformed or does not fit the workload."""


class ModelFileError(AutoparError):
    """model.py is missing, broken, or does not follow the model.py contract."""


class ClusterError(AutoparError):
    """An unknown cluster preset or a malformed cluster JSON file."""


class NoValidPlanError(AutoparError):
    """No plan satisfies the workload (batch divisibility, memory)."""
