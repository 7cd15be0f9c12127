"""The layers of autopar, bottom first: data flows one way, in (model, cluster) to plan out to plan
applied. A module imports its own layer and the layers below it, never one above, and no import
cycle exists among modules or among packages. `tests/test_layering.py` checks every import
statement against this table; `docs/architecture.md` draws it and says what each layer holds.

A unit is a package (every module under it) or a top-level module. `envs/` and `policies/` are
installed as `autopar.envs` and `autopar.policies` (pyproject.toml).
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the contracts: plan, workload, knobs and axes, data-file schemas, errors; the cluster
    ("contract", ("autopar.errors", "autopar.atomic", "autopar.schema", "autopar.axes", "autopar.capability",
                  "autopar.knobs", "autopar.plan", "autopar.replan", "autopar.runtime", "autopar.workload",
                  "autopar.cluster", "autopar.mixed.plan", "autopar.mixed.workload")),
    # the model.py contract: loading a model file, the zoo, transformers configs (torch)
    ("model", ("autopar.modelfile", "autopar.hf", "autopar.hf_ref", "autopar.zoo", "autopar.layout")),
    # applies a plan with torch.distributed; knows no planner and no command line
    ("executor", ("autopar.executor",)),
    # measures a model once (asks the executor what it cannot run for that model)
    ("profile", ("autopar.profile",)),
    ("cost", ("autopar.cost",)),
    # the plan space and the planners that walk it (the rl planner is registered by name)
    ("search", ("autopar.search",)),
    # mixed GPU clusters: their cost, Why table and search, composing the homogeneous ones (its plan and
    # workload are contracts, above)
    ("mixed", ("autopar.mixed",)),
    # measured runs as trace records, and the cost model calibrated to them
    ("traces", ("autopar.traces", "autopar.calibrate")),
    # the Gymnasium environment and the trained policies (the rl planner, training from traces)
    ("rl", ("autopar.envs", "autopar.policies")),
    # the command line, reports (explain, plots, export) and the package's own lazy `autopar.apply`
    ("cli", ("autopar.cli", "autopar.explain", "autopar.stage_table", "autopar.report", "autopar.plots",
             "autopar.export", "autopar.layers", "autopar.__main__", "autopar")),
)

# Imported inside functions, where they are used, so `import autopar` and `autopar --help` stay light;
# every other import sits at module level.
LAZY_PACKAGES = ("torch", "stable_baselines3", "sb3_contrib", "optuna", "sqlalchemy", "transformers", "matplotlib",
                 "megatron", "scipy", "torchao", "submitit", "ray")


def layer_of(module: str) -> int:
    """The index in LAYERS of a module's unit; KeyError if unlisted (a new top-level module or
    package must be placed)."""
    unit = unit_of(module)
    for i, (_, units) in enumerate(LAYERS):
        if unit in units:
            return i
    raise KeyError(f"{module} is in no layer of autopar/layers.py")


def unit_of(module: str) -> str:
    """The package (or top-level module) a module belongs to: the listed unit it is or is under
    (`autopar` itself, the package root, only as itself)."""
    for _, units in LAYERS:
        for unit in units:
            if module == unit or (unit != "autopar" and module.startswith(unit + ".")):
                return unit
    return module
