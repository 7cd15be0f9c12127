"""What the cost model needs to know about a model, measured once on the meta device.

All per-sample figures are for one sample (micro-batch 1) at the profiled sequence length and
dtype; the cost model scales them linearly with the micro-batch size (exact for transformers,
whose attention term is quadratic in sequence length, not in batch).

Mixture-of-experts fields (`autopar.profile.moe` fills them; 0 in every dense block, so a dense
model has none). Per block instance:

- ``experts``: routed experts of the block (0: a dense block); ``top_k``: routed experts per token;
- ``expert_params``: parameters of all its routed experts (part of ``params``): what expert
  parallelism shards (each ep rank holds ``expert_params / ep``) and what ZeRO/FSDP shards over the
  expert-data-parallel group (dp x cp / ep); the rest of ``params`` shards over dp (x cp);
- ``expert_ffn``: the hidden size of one expert's SwiGLU (the grouped GEMM's n and k, with the
  model hidden size ``dims["hidden"]``); ``shared_params``: parameters of its shared (always-on)
  experts (part of ``params``, not of ``expert_params``);
- ``router_flops``: forward FLOPs of the router per sample (part of ``fwd_flops``);
- ``expert_flops``: forward FLOPs of the routed experts per sample for the routed tokens,
  seq x top_k tokens force-balanced over the experts (part of ``fwd_flops``; backward 2x);
- ``dispatch_bytes``: bytes one sample's tokens send in one dispatch all-to-all of the block,
  seq x top_k x hidden x dtype bytes; the combine sends as many back; backward repeats both.

Per model: ``capacity_factor`` (0.0: dropless routing, every token reaches its top-k experts; a
positive value caps each expert at factor x tokens x top_k / experts) and ``node_limit`` (at most
that many expert groups, nodes under expert parallelism, per token; 0: no limit), ``gate``
("learned", or "balanced": a benchmark's fixed gate sending token i to experts i·k ... i·k + k − 1,
which the cost model's DeepEP dispatch counts exactly: `autopar.cost.moe.destinations`), and the
properties ``is_moe``, ``num_experts``, ``top_k``, ``expert_params``, ``active_params``. The
expert-load imbalance factor is a workload setting (`Workload.expert_imbalance`), not a profile
figure: the profile is force-balanced.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

import networkx as nx

from autopar.schema import MAX_INT, MAX_ITEMS, Anything, Int, List, Map, Obj, Str, dataclass_schema

PROFILE_SCHEMA_VERSION = 3


@dataclass(frozen=True)
class BlockProfile:
    """One kind of block (embedding, a repeated layer, head), measured per sample."""

    kind: str  # "embed", "head", or the class name of a pipeline block
    count: int  # consecutive identical instances this entry stands for
    params: int  # parameters of one instance
    tp_params: int  # of which sharded by tensor parallelism
    fwd_flops: float  # forward FLOPs per sample (FlopCounterMode)
    bwd_flops: float  # backward FLOPs per sample
    tp_fwd_flops: float  # part of fwd_flops that tensor parallelism divides by t
    saved_bytes: float  # activation bytes saved for backward per sample (parameters excluded)
    saved_tp_bytes: float  # part of saved_bytes sharded by tensor parallelism (without sequence parallel)
    attn_core_bytes: float  # part of saved_bytes with a seq x seq extent: what selective recompute drops
    attn_core_flops: float  # forward FLOPs of those ops: what selective recompute redoes
    io_bytes: float  # bytes read + written by non-matmul ops in forward (memory-bound time)
    out_bytes: float  # bytes of the block's output per sample (pipeline p2p, checkpoint boundary)
    tp_comm_bytes: float  # bytes all-reduced per sample in forward under TP (row-wise outputs, vocab embeddings)
    tp_units: tuple[int, ...] = ()  # the tensor-parallel degree must divide each of these
    attn_flops: float = 0.0  # forward FLOPs of attention's score and value products, fused kernel or not
    attn_core_io_bytes: float = 0.0  # part of io_bytes moved by the core's elementwise ops (unfused softmax)
    attn_scores: float = 0.0  # attention score elements per sample (heads x seq x seq), fused kernel or not
    tp_gather_bytes: float = 0.0  # bytes all-gathered per sample in forward under TP (colwise_rep outputs, a
    # vocab-sharded head's logits); what each pass of a block communicates: cost/tensor_parallel.py
    loss_saved_bytes: float = 0.0  # part of saved_bytes the model file's loss_fn saved (head only): under
    # Megatron's vocab-parallel loss the head saves that loss's tensors instead (cost/cross_entropy.py)
    loss_saved_tp_bytes: float = 0.0  # of which sharded by tensor parallelism
    entry_saved_bytes: float = 0.0  # part of saved_bytes that is the input of a column-wise linear (a region's
    # entry): under sequence parallelism torch's DTensor linears save it gathered, whole on every rank
    mask_saved_bytes: float = 0.0  # part of saved_bytes that is dropout masks outside attention's core (bool):
    # Megatron-Core keeps one at each of the file's dropout sites (cost/fused.py)
    # mixture of experts (module docstring); all 0 in a dense block
    experts: int = 0  # routed experts
    top_k: int = 0  # routed experts per token
    expert_params: int = 0  # parameters of the routed experts (part of params): sharded by ep
    shared_params: int = 0  # parameters of the shared experts (part of params)
    expert_ffn: int = 0  # hidden size of one expert's SwiGLU
    router_flops: float = 0.0  # router forward FLOPs per sample (part of fwd_flops)
    expert_flops: float = 0.0  # routed experts' forward FLOPs per sample, force-balanced (part of fwd_flops)
    dispatch_bytes: float = 0.0  # bytes per sample of one dispatch all-to-all (combine: the same)
    # host launches: forward ops that run a kernel, per instance (a sample's; the count does not grow with
    # the batch), and of those the model file's loss_fn's (head only); 0 in profiles from before version 13
    launches: float = 0.0
    loss_launches: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "tp_units", tuple(int(u) for u in self.tp_units))


@dataclass(frozen=True)
class ModelProfile:
    """The block chain of a model (embedding, pipeline blocks, head) with its measured costs."""

    name: str
    digest: str  # hash of model.py, model args, seq_len and dtype: the cache key
    seq_len: int  # tokens per sample (1 for models without a sequence axis)
    dtype: str  # "bf16", "fp16" or "fp32": the dtype activations were measured in
    blocks: tuple[BlockProfile, ...]  # embed first, head last, repeated layers grouped by count
    has_tp_plan: bool
    tp_note: str = ""  # why tensor parallelism is unavailable, when it is
    dims: dict = field(default_factory=dict)  # hidden, heads, layers, vocab ... as found
    limits: dict = field(default_factory=dict)  # knob -> why the executor cannot do it (executor/limits.py)
    notes: tuple[str, ...] = ()  # what the model says about how it is priced (an hf: model's attention)
    capacity_factor: float = 0.0  # MoE routing: 0.0 dropless, else tokens an expert takes x its balanced share
    node_limit: int = 0  # MoE routing: at most this many expert groups (nodes) per token; 0: no limit
    gate: str = "learned"  # MoE routing: "learned" top-k, or "balanced" (token i -> experts i*k ... i*k + k - 1)
    # tied input and output embeddings: parameters the head uses that the embedding holds (counted in the
    # embedding's params only); a pipeline's last stage keeps a copy and all-reduces its gradient with the
    # first stage's every step (cost/model.py)
    tied_params: int = 0
    tied_tp_params: int = 0  # of which sharded by tensor parallelism
    profiler: str = ""  # the profiler version that measured it (profile/cache.py); "" before version 9: a
    # profile stored in a trace by an older autopar lacks what later versions tell apart

    def __post_init__(self):
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "notes", tuple(self.notes))

    # -- derived figures -------------------------------------------------------------------
    @property
    def embed(self) -> BlockProfile:
        return self.blocks[0]

    @property
    def head(self) -> BlockProfile:
        return self.blocks[-1]

    @property
    def layers(self) -> tuple[BlockProfile, ...]:
        """The pipeline blocks (everything between embedding and head), grouped."""
        return self.blocks[1:-1]

    @property
    def num_layers(self) -> int:
        return sum(b.count for b in self.layers)

    @property
    def layer_sequence(self) -> list[BlockProfile]:
        """One entry per pipeline block instance, in order."""
        return [b for b in self.layers for _ in range(b.count)]

    @property
    def params(self) -> int:
        return sum(b.params * b.count for b in self.blocks)

    @property
    def fwd_flops(self) -> float:
        return sum(b.fwd_flops * b.count for b in self.blocks)

    @property
    def is_moe(self) -> bool:
        return any(b.experts for b in self.blocks)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model): what ep must divide."""
        return max((b.experts for b in self.blocks), default=0)

    @property
    def top_k(self) -> int:
        return max((b.top_k for b in self.blocks), default=0)

    @property
    def moe_layers(self) -> int:
        return sum(b.count for b in self.blocks if b.experts)

    @property
    def expert_params(self) -> int:
        """Parameters of all routed experts: sharded over ep (and ZeRO over dp x cp / ep)."""
        return sum(b.expert_params * b.count for b in self.blocks)

    @property
    def active_params(self) -> int:
        """Parameters one token uses: all but the routed experts, plus top_k / experts of those."""
        return sum((b.params - b.expert_params + (b.expert_params * b.top_k // b.experts if b.experts else 0))
                   * b.count for b in self.blocks)

    @property
    def tp_units(self) -> tuple[int, ...]:
        return tuple(sorted({u for b in self.blocks for u in b.tp_units}))

    def graph(self) -> nx.DiGraph:
        """The block chain as a graph: one node per instance, edges carry boundary bytes."""
        g = nx.DiGraph(name=self.name)
        prev = None
        index = 0
        for entry in self.blocks:
            for _ in range(entry.count):
                node = f"{index}:{entry.kind}"
                g.add_node(node, kind=entry.kind, params=entry.params, fwd_flops=entry.fwd_flops,
                           saved_bytes=entry.saved_bytes)
                if prev is not None:
                    g.add_edge(prev, node, bytes=g.nodes[prev]["out_bytes"])
                g.nodes[node]["out_bytes"] = entry.out_bytes
                prev = node
                index += 1
        return g

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema_version"] = PROFILE_SCHEMA_VERSION
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> ModelProfile:
        d = dict(d)
        version = d.pop("schema_version", None)
        if version != PROFILE_SCHEMA_VERSION:
            raise ValueError(f"model profile schema version {version!r}, expected {PROFILE_SCHEMA_VERSION}")
        block_keys = {f.name for f in fields(BlockProfile)}
        d["blocks"] = tuple(BlockProfile(**{k: v for k, v in b.items() if k in block_keys}) for b in d["blocks"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        return cls.from_dict(json.loads(text))


def profile_schema() -> Obj:
    """A model profile stored in a trace record (what the profiler measured, as data)."""
    block = dataclass_schema(BlockProfile, {"tp_units": List(Int(1, MAX_INT))})
    return Obj({**dataclass_schema(ModelProfile).fields, "blocks": List(block, max_len=MAX_ITEMS),
                "dims": Map(Anything()), "dtype": Str(("bf16", "fp16", "fp32")),
                "seq_len": Int(1, MAX_INT), "schema_version": Int()},
               required=("name", "digest", "seq_len", "dtype", "blocks", "has_tp_plan"))
