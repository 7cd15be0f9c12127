"""autopar: pick, explain and apply a parallel training plan for a PyTorch model.

`autopar.apply` (the executor) loads on first use, so `import autopar` stays light."""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "apply":
        from autopar.executor import apply

        return apply
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")
