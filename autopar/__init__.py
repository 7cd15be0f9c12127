"""autopar: pick, explain and apply a parallel training plan for a PyTorch model."""

__version__ = "0.1.0"
