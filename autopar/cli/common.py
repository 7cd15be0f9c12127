"""Flags shared by the planning subcommands, and turning them into a Workload."""

from __future__ import annotations

import argparse
import json
import sys

from autopar import capability
from autopar.cluster import load_cluster
from autopar.cluster.mixed import MixedCluster, load_any_cluster, single_spec
from autopar.cost.coefficients import Coefficients
from autopar.errors import AutoparError
from autopar.knobs import PRECISIONS, default_precision, fp8_problem, storage_dtype
from autopar.mixed.workload import MixedWorkload
from autopar.profile import profile_model
from autopar.profile.isolated import DEFAULT_PROFILE_TIMEOUT, check_timeout
from autopar.schema import check_global_batch
from autopar.traces.models import ModelSources
from autopar.workload import DEFAULT_MEMORY_HEADROOM, Workload

DEFAULT_CLUSTER = "dgx-a100-80g"
DEFAULT_GLOBAL_BATCH = 512


def add_workload_flags(parser: argparse.ArgumentParser, batch_default: int | None = DEFAULT_GLOBAL_BATCH) -> None:
    parser.add_argument("model", metavar="MODEL", help="path to a model.py (see the model.py contract)")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for build_model/example_batch, e.g. size=175b (repeatable)")
    parser.add_argument("--cluster", default=DEFAULT_CLUSTER, metavar="PRESET[:NODES,...]|FILE.json",
                        help=f"cluster preset or cluster JSON (default {DEFAULT_CLUSTER}); PRESET:NODES sizes a preset, "
                             "PRESET:NODES,PRESET:NODES is a mixed cluster of several GPU groups, as is a JSON with "
                             "groups (README, Clusters)")
    parser.add_argument("--nodes", type=int, default=None, help="number of nodes (default: the preset's)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the preset's)")
    parser.add_argument("--global-batch", type=int, default=batch_default, metavar="B",
                        help="samples per optimizer step" + (f" (default {batch_default})" if batch_default else ""))
    add_seq_len_flag(parser)
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="training precision (default: bf16 where the GPU runs it faster than fp32, else fp16 "
                             "where that is faster, else fp32, as on the cpu preset; fp8: fp8 GEMMs on bf16 "
                             "weights, H100 and newer)")
    parser.add_argument("--memory-headroom", type=float, default=DEFAULT_MEMORY_HEADROOM, metavar="F",
                        help="fraction of GPU memory plans leave free for the allocator's fragmentation "
                             f"(default {DEFAULT_MEMORY_HEADROOM:g})")
    parser.add_argument("--expert-imbalance", type=float, default=1.0, metavar="F",
                        help="MoE models: tokens on the busiest expert-parallel rank over the mean (default 1.0: "
                             "force-balanced, as published MoE benchmarks run)")
    parser.add_argument("--runtime", default="torch", metavar="torch|megatron-core|megatron-lm-2021|megatron",
                        help="what runs the plan: autopar's torch executor (default); megatron-core (Megatron-Core "
                             "with Transformer Engine as NeMo runs it: flash attention and the tp, grad-reduce and "
                             "param-gather overlaps); megatron-lm-2021 (the papers' bare Megatron-LM); megatron "
                             "(Megatron with only the --switch switches given); it decides which overlaps run")
    parser.add_argument("--switch", "--megatron", dest="megatron", action="append", default=[], metavar="SWITCH",
                        help="a runtime switch that is on (repeatable): Megatron-Core's flash_attn, tp_comm_overlap, "
                             "overlap_grad_reduce, overlap_param_gather, overlap_p2p_comm, moe_pad_to_capacity "
                             "(a megatron runtime); torch's async_tp and op_sac (torchtitan's async TP and per-op "
                             "selective checkpoint; runtime torch); deepep, moe_a2a_overlap, megatron_softmax "
                             "(Megatron-LM's unfused attention) and megatron_cross_entropy (its fp32 vocab-parallel "
                             "loss) under any runtime. --megatron is its older spelling")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_profile_timeout_flag(parser)


def add_model_flags(parser, optional: bool = False) -> None:
    """MODEL and --model-arg, for the commands that run a model (optional: checked by the command,
    so that a missing MODEL is one line)."""
    parser.add_argument("model", metavar="MODEL", nargs="?" if optional else None,
                        help="path to a model.py, or a zoo model name (gpt, llama, ...)")
    parser.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for build_model/example_batch, e.g. size=tiny (repeatable)")


def add_fix_flag(parser, also: str = "") -> None:
    """`--fix KNOB=VALUE` (repeatable): the plan space narrowed to plans holding it (autopar/search/fixed.py)."""
    parser.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                        help="consider only plans with this value of a knob or parallel degree, e.g. compile=false, "
                             f"pp=4, recompute=full (repeatable; dp is derived from the GPU count){also}")


def add_profile_timeout_flag(parser) -> None:
    parser.add_argument("--profile-timeout", type=float, default=DEFAULT_PROFILE_TIMEOUT, metavar="S",
                        help="profile the model.py in a child process and stop it after S seconds "
                             f"(default {DEFAULT_PROFILE_TIMEOUT:g})")


def add_trace_model_flags(group) -> None:
    """How trace records' models may be profiled: traces are data and name no code to run."""
    group.add_argument("--model-file", action="append", default=[], metavar="MODEL.py",
                       help="a model file you trust for records whose model digest matches it (repeatable); "
                            "records with a stored profile or a bundled model need none")
    group.add_argument("--trust-model-paths", action="store_true",
                       help="import the model files the trace records name (runs their code: only for your own "
                            "traces)")


def model_sources(args):
    return ModelSources(tuple(args.model_file), args.trust_model_paths)


def add_seq_len_flag(parser: argparse.ArgumentParser) -> None:
    """--seq-len, as every command that builds the model takes it (checked by `parse_model_args`)."""
    parser.add_argument("--seq-len", type=int, default=None, metavar="S",
                        help="sequence length (passed to the model as seq_len)")


def parse_model_args(pairs: list[str], seq_len: int | None) -> dict:
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise AutoparError(f"--model-arg expects KEY=VALUE, got '{pair}'")
        out[key] = _parse_value(value)
    if seq_len is not None:
        if seq_len < 1:
            raise AutoparError(f"--seq-len must be positive, got {seq_len}")
        out["seq_len"] = seq_len
    return out


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def check_size_flags(args) -> None:
    """--nodes and --gpus-per-node, named as the user typed them, before any cluster is sized by them."""
    for flag in ("nodes", "gpus_per_node"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise AutoparError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")


def load_workload(args, nodes: int | None = None, global_batch: int | None = None, mixed: bool = False):
    """Profile the model (cached) and load the cluster; flags win over the given defaults. A mixed
    --cluster gives a MixedWorkload where the command plans for one (`mixed`), else is refused."""

    batch = args.global_batch if args.global_batch is not None else global_batch
    check_global_batch(batch)
    check_size_flags(args)
    if not 0 <= args.memory_headroom < 1:
        raise AutoparError(f"--memory-headroom must be a fraction in [0, 1), got {args.memory_headroom}")
    cluster = load_any_cluster(args.cluster, nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    if isinstance(cluster, MixedCluster) and not mixed:
        raise AutoparError(f"--cluster {args.cluster} is a mixed cluster of groups {', '.join(cluster.group_names)}; "
                           "this command plans for one GPU type: give one preset or cluster JSON")
    if not isinstance(cluster, MixedCluster) and args.nodes is None and nodes is not None \
            and single_spec(args.cluster) is None:  # the command's own size, where --cluster gives none
        cluster = load_cluster(args.cluster, nodes=nodes, gpus_per_node=args.gpus_per_node)
    groups = cluster.groups if isinstance(cluster, MixedCluster) else (cluster,)
    for group in groups:  # a bad coefficient fails before the model is profiled
        Coefficients.from_dict(group.coefficients)
    if args.precision is None:  # mixed precision only where the device (every group's) runs it faster
        args.precision = (cluster.default_precision() if isinstance(cluster, MixedCluster)
                          else default_precision(cluster.gpu))
    problem = (cluster.precision_problem(args.precision) if isinstance(cluster, MixedCluster)
               else fp8_problem(args.precision, cluster.gpu))
    if problem:  # before the model is profiled
        raise AutoparError(problem)
    profile = profile_model(args.model, parse_model_args(args.model_arg, args.seq_len),
                            dtype=storage_dtype(args.precision), timeout=check_timeout(args.profile_timeout))
    imbalance = getattr(args, "expert_imbalance", 1.0)
    if imbalance != 1.0 and not profile.is_moe:
        raise AutoparError(f"--expert-imbalance {imbalance:g} applies to mixture-of-experts models, but {profile.name} "
                           f"is dense; leave it out")
    kind = MixedWorkload if isinstance(cluster, MixedCluster) else Workload
    return kind(profile=profile, cluster=cluster, global_batch=batch, memory_headroom=args.memory_headroom,
                runtime=getattr(args, "runtime", "torch"), switches=tuple(getattr(args, "megatron", ())),
                expert_imbalance=imbalance, fp8=args.precision == "fp8")


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=1)
    sys.stdout.write("\n")


def excluded(workload) -> dict[str, str]:
    """{limit: what the plan space leaves out and why} for this model on this runtime (autopar.capability)."""
    return {key: text for key, _, text in capability.excluded(capability.Target.of(workload))}


def workload_dict(workload) -> dict:
    p, c = workload.profile, workload.cluster
    return {"model": p.name, "params": p.params, "layers": p.num_layers, "seq_len": p.seq_len,
            "dims": p.dims, "cluster": c.name, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
            "gpu": c.gpu.name, "global_batch": workload.global_batch, "precision": workload.precision,
            "memory_headroom": workload.memory_headroom, "notes": list(p.notes), "excluded": excluded(workload),
            "runtime": workload.runtime, "megatron_switches": list(workload.switches),
            **({"experts": p.num_experts, "top_k": p.top_k, "active_params": p.active_params,
                "expert_imbalance": workload.expert_imbalance} if p.is_moe else {})}
