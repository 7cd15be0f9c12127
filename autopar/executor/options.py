"""How a plan is run: the one declaration of every run option, its default and its help text.

`autopar run`, `autopar traces collect`, `autopar train measured`, the measured reward, the
launcher and the worker all take a `RunOptions`. The command-line flags (`add_run_flags`) and the
worker's argv (`worker_argv`, read back by `add_run_flags(..., WORKER)` in the worker) are
generated from the fields below, so a default is written once. A new option is one field.
Light on purpose (no torch): the worker reads it before it imports torch, and `--help` stays instant.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace

from autopar.errors import AutoparError

OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}  # --optimizer: torch.optim class
BACKENDS = ("auto", "nccl", "gloo")


def _option(default, help: str, *, worker: bool = False, flag: str | None = None, metavar: str | None = None,
            choices=None):
    """A RunOptions field: its default, its help, whether the worker takes it, and its flag."""
    return field(default=default, metadata={"help": help, "worker": worker, "flag": flag, "metavar": metavar,
                                            "choices": choices})


@dataclass(frozen=True)
class ElasticSpec:
    """An elastic job (`autopar.executor.elastic`, flags in `autopar.cli.elastic`): `nnodes` is the
    most nodes, `min_nodes` the fewest; all nodes meet at `rdzv_endpoint` (its host's agent holds
    the rendezvous store). The worker receives it whole, as JSON (`--elastic-spec`)."""

    checkpoint_dir: str
    rdzv_endpoint: str
    min_nodes: int = 1
    checkpoint_every: int = 10
    max_restarts: int = 3  # failures (a node lost) the survivors restart from; growth spends none
    replanner: str | None = None  # module:function making the replan function (the executor imports no planner)
    cluster: str | None = None  # the cluster the planner re-plans for (scaled to the new world)
    replan_tolerance: float = 0.05
    node_group: str | None = None  # a mixed plan's job: the group of --cluster this node's GPUs belong to
    # torch's c10d rendezvous settings: seconds to wait for more nodes once MIN are there, and
    # how fast a dead node is dropped from the rendezvous (interval x attempts)
    rdzv_conf: str = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"

    def torchrun_flags(self, nnodes: int) -> list[str]:
        from autopar.executor import rendezvous  # torch: imported when a job starts, not with the CLI

        return ["--nnodes", f"{self.min_nodes}:{nnodes}", "--rdzv-backend", rendezvous.BACKEND,
                "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-conf", self.rdzv_conf,
                "--max-restarts", str(self.max_restarts)]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ElasticSpec:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class RunOptions:
    """Where and how a plan runs: torchrun's node flags, then the worker's options. Checked on
    construction (a bad value is an AutoparError naming its flag)."""

    nproc_per_node: int = _option(1, "ranks on this node", metavar="N")
    nnodes: int = _option(1, "number of nodes")
    node_rank: int = _option(0, "this node's rank (multi-node)")
    master_addr: str = _option("127.0.0.1", "address of node 0 (multi-node)")
    master_port: int = _option(29500, "rendezvous port on node 0 (multi-node)")
    backend: str = _option("auto", "auto: NCCL when this node has a GPU for every rank, else gloo", worker=True,
                           choices=BACKENDS)
    timeout_s: float = _option(900.0, "end a run after S seconds, outcome 'timeout'; also the collectives' timeout",
                               worker=True, flag="--timeout", metavar="S")
    steps: int = _option(10, "timed steps per run; their median is the measurement", worker=True)
    warmup: int = _option(3, "untimed steps first", worker=True)
    seed: int = _option(0, "initial weights and batch seed", worker=True)
    optimizer: str = _option("adamw", "optimizer of the training", worker=True, choices=tuple(OPTIMIZERS))
    lr: float = _option(1e-3, "learning rate", worker=True)
    check_parity: bool = _option(False, "also train the model in one process and report the largest relative loss "
                                        "difference, with what explains a mismatch (dropout, BatchNorm, low "
                                        "precision)", worker=True)
    no_dropout: bool = _option(False, "turn every dropout of the model off (for --check-parity: dropout masks "
                                      "differ by rank)", worker=True)
    # `autopar run --elastic` (its flags: autopar/cli/elastic.py): torchrun elastic membership
    elastic: ElasticSpec | None = field(default=None, metadata={"cli": False, "worker": False})

    def __post_init__(self):
        for name in ("steps", "nproc_per_node", "nnodes"):
            if getattr(self, name) < 1:
                raise AutoparError(f"{flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0 or not 0 <= self.node_rank < self.nnodes:
            raise AutoparError(f"need --warmup >= 0 and 0 <= --node-rank < --nnodes, got {self.warmup}, "
                               f"{self.node_rank}, {self.nnodes}")
        if not 0 < self.timeout_s < math.inf:
            raise AutoparError(f"--timeout must be a positive finite number of seconds, got {self.timeout_s}")
        if not 1 <= self.master_port <= 65535:
            raise AutoparError(f"--master-port must be a TCP port in [1, 65535], got {self.master_port}")
        if not 0 < self.lr < math.inf:
            raise AutoparError(f"--lr must be a positive finite number, got {self.lr}")
        for name in ("backend", "optimizer"):
            choices = _field(name).metadata["choices"]
            if getattr(self, name) not in choices:
                raise AutoparError(f"{flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def at_world(self, plan) -> RunOptions:
        """The options as the plan sees them: an elastic job's node count is the plan's world (it
        re-plans for any other); any other job's is its own."""
        if not self.elastic:
            return self
        return replace(self, nnodes=max(1, plan.world_size // self.nproc_per_node), node_rank=0)

    @classmethod
    def from_args(cls, args, **overrides) -> RunOptions:
        """The options an argparse namespace holds (flags from `add_run_flags`), defaults for the rest."""
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if f.metadata.get("cli", True) and hasattr(args, f.name)}
        return cls(**{**given, **overrides})


WORKER = tuple(f.name for f in fields(RunOptions) if f.metadata["worker"])  # what the worker's argv carries


def _field(name: str):
    return next(f for f in fields(RunOptions) if f.name == name)


def flag(name: str) -> str:
    """The command-line flag of a RunOptions field."""
    return _field(name).metadata["flag"] or "--" + name.replace("_", "-")


def add_run_flags(parser, names=None) -> None:
    """Add the flags of RunOptions' fields `names` (default: all) to an argparse parser or group,
    with the declared defaults, shown in the help."""
    for f in fields(RunOptions):
        if (names is not None and f.name not in names) or not f.metadata.get("cli", True):
            continue
        meta = f.metadata
        if isinstance(f.default, bool):
            parser.add_argument(flag(f.name), dest=f.name, action="store_true", help=meta["help"])
            continue
        shown = f"{f.default:g}" if isinstance(f.default, float) else f.default
        parser.add_argument(flag(f.name), dest=f.name, type=type(f.default), default=f.default,
                            choices=meta["choices"], metavar=meta["metavar"], help=f"{meta['help']} (default {shown})")


def worker_argv(options: RunOptions) -> list[str]:
    """The worker's option flags for these options (the fields marked worker)."""
    argv: list[str] = []
    for name in WORKER:
        value = getattr(options, name)
        if isinstance(value, bool):
            argv += [flag(name)] if value else []
        else:
            argv += [flag(name), repr(value) if isinstance(value, float) else str(value)]
    return argv + (["--elastic-spec", options.elastic.to_json()] if options.elastic else [])
