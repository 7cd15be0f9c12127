"""`autopar run --elastic`: its flags, their checks, and what the run shows and records.

The job (`autopar.executor.elastic`) checkpoints every N steps into the job folder and re-plans
through `autopar.search.replan` whenever torchrun restarts it with another world size; the
trace record holds the final plan, the whole loss curve and one re-plan record per change.
"""

from __future__ import annotations

import math
import stat
from pathlib import Path

from autopar.errors import AutoparError
from autopar.executor.options import ElasticSpec
from autopar.replan import ReplanRecord

REPLANNER = "autopar.search.replan:from_worker_args"  # what the workers call to re-plan (ElasticSpec.replanner)


def add_elastic_flags(p) -> None:
    g = p.add_argument_group("elastic training (torchrun elastic membership; see docs/elastic.md)")
    g.add_argument("--elastic", action="store_true",
                   help="train to step warmup+steps across node losses and joins: checkpoint every "
                        "--checkpoint-every steps, re-plan when the world size changes, resume")
    g.add_argument("--checkpoint-dir", metavar="DIR",
                   help="the job folder (shared by all nodes): checkpoints, losses, re-plans; an existing one resumes")
    spec = ElasticSpec  # the defaults are ElasticSpec's, declared once
    g.add_argument("--checkpoint-every", type=int, default=spec.checkpoint_every, metavar="N",
                   help=f"steps between checkpoints (default {spec.checkpoint_every})")
    g.add_argument("--min-nodes", type=int, default=spec.min_nodes,
                   help=f"fewest nodes the job runs on (--nnodes: the most; default {spec.min_nodes})")
    g.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="where the nodes meet (default --master-addr:--master-port); its host must stay up")
    g.add_argument("--max-restarts", type=int, default=spec.max_restarts,
                   help=f"node losses to survive (default {spec.max_restarts}; joins cost none)")
    g.add_argument("--node-group", metavar="GROUP",
                   help="a mixed plan's job: the group of --cluster (a preset of PRESET:NODES,...) this node's GPUs "
                        "belong to; every node gives its own, and a re-plan counts the groups of the nodes running "
                        "(default on NCCL: the group of this node's GPU model)")
    g.add_argument("--replan-tolerance", type=float, default=spec.replan_tolerance, metavar="F",
                   help=f"keep the old plan (dp rescaled) when it is predicted at most F slower than the new best "
                        f"(default {spec.replan_tolerance})")


def elastic_spec(args):
    """The ElasticSpec of the flags, or None without --elastic; a wrong combination: one line."""
    if not args.elastic:
        if args.checkpoint_dir:
            raise AutoparError("--checkpoint-dir needs --elastic (only elastic runs checkpoint); add --elastic")
        if args.node_group:
            raise AutoparError("--node-group needs --elastic (it tells a re-plan which group this node is); "
                               "add --elastic or leave it out")
        return None
    if not args.checkpoint_dir:
        raise AutoparError("--elastic needs --checkpoint-dir DIR: the folder its checkpoints and re-plans go to "
                           "(shared by all nodes)")
    if args.check_parity:
        raise AutoparError("--check-parity cannot be combined with --elastic (the plan changes during the run); "
                           "drop one of them")
    for flag in ("checkpoint_every", "min_nodes"):
        if getattr(args, flag) < 1:
            raise AutoparError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.min_nodes > args.nnodes or args.max_restarts < 0:
        raise AutoparError(f"need 1 <= --min-nodes <= --nnodes and --max-restarts >= 0, got {args.min_nodes}, "
                           f"{args.nnodes}, {args.max_restarts}")
    if not 0 <= args.replan_tolerance < 1 or math.isnan(args.replan_tolerance):
        raise AutoparError(f"--replan-tolerance must be in [0, 1), got {args.replan_tolerance}")
    folder = Path(args.checkpoint_dir)
    if folder.exists() and not stat.S_ISDIR(folder.stat().st_mode):
        raise AutoparError(f"--checkpoint-dir {folder} exists and is not a folder; give a folder path")
    endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise AutoparError(f"--rdzv-endpoint must be HOST:PORT with a port in [1, 65535], got {endpoint!r}")
    return ElasticSpec(checkpoint_dir=str(folder.absolute()), rdzv_endpoint=endpoint, min_nodes=args.min_nodes,
                       checkpoint_every=args.checkpoint_every, max_restarts=args.max_restarts, replanner=REPLANNER,
                       cluster=args.cluster, replan_tolerance=args.replan_tolerance, node_group=args.node_group)


def show_replans(console, measured: dict) -> None:
    for d in measured.get("replans", []):
        console.print("re-plan: " + ReplanRecord.from_dict(d).describe(), markup=False, highlight=False)
