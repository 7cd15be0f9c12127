"""Profile a model.py on the meta device: one forward + backward at micro-batch 1.

Only one representative of each run of identical consecutive blocks is executed (the blocks
ModuleList is temporarily narrowed to them), so a 175B-parameter GPT costs as much as one layer.
Hooks on those blocks move the recorder's segment: everything before the first block is the
``embed`` segment, everything after the last (final norm, output projection, loss) the ``head``.
In backward, tensor hooks on block boundaries do the same (autograd runs the chain in reverse).
Then the forward runs once more on a tensor-parallel rank's shards (`autopar.profile.tp_shards`):
a tp_plan the model's code cannot run sharded is refused here, at planning time.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.executor.limits import model_limits
from autopar.modelfile import ModelFile, load_model_file, priced_styles
from autopar.profile import cache as profile_cache
from autopar.profile.kernels import CudaKernels, fused_norms
from autopar.profile.model_profile import BlockProfile, ModelProfile
from autopar.profile.moe import moe_fields, routing_settings
from autopar.profile.recorder import Recorder, Tally, storage_key, tensor_bytes
from autopar.profile.tp_shards import check_tp_shards

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_ATTRS = ("n_heads", "num_heads", "n_kv_heads", "num_kv_heads", "num_key_value_heads")
# model.config names for the dims the cost model and the RL features use, with common aliases
DIM_ALIASES = {
    "hidden": ("hidden", "hidden_size", "dim", "d_model", "n_embd"),
    "heads": ("heads", "n_heads", "num_attention_heads", "n_head"),
    "kv_heads": ("kv_heads", "n_kv_heads", "num_key_value_heads"),
    "head_dim": ("head_dim",),  # where it is not hidden / heads (Gemma, Qwen3, GPT-OSS, DeepSeek-V3)
    "layers": ("layers", "n_layers", "num_hidden_layers", "n_layer"),
    "vocab": ("vocab", "vocab_size"),
    "ffn": ("ffn", "intermediate_size", "ffn_dim", "dense_ffn"),  # dense_ffn: the dense layers of an MoE (zoo)
    "seq_len": ("seq_len", "max_seq_len", "max_position_embeddings", "n_positions"),
}
_COLLECTIVE_STYLES = ("rowwise", "rowwise_in", "colwise_rep", "vocab")  # output leaves replicated
# a linear whose input it saves whole under torch's SP: the executor gathers the stream for these
# (executor/tensor_parallel.py `_REGION_ENTRIES`, and `_linear_style` for a vocab head); a `rowwise_in`
# linear is gathered too but saves only its feature slice, 1/tp as priced
_ENTRY_STYLES = ("colwise", "colwise_rep", "vocab")


def profile_model(path_or_modelfile, model_args: dict | None = None, dtype: str = "bf16",
                  cache: bool = True) -> ModelProfile:
    """The :class:`ModelProfile` of a model.py (path, zoo name or :class:`ModelFile`)."""
    if dtype not in DTYPES:
        raise AutoparError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    mf = path_or_modelfile if isinstance(path_or_modelfile, ModelFile) else load_model_file(path_or_modelfile)
    model_args = dict(model_args or {})
    digest = profile_cache.profile_digest(mf.path, mf.digest, model_args, dtype)
    if cache and (hit := profile_cache.load(digest)) is not None:
        return hit
    profile = _measure(mf, model_args, dtype, digest)
    if cache:
        profile_cache.store(profile)
    return profile


# -- grouping -------------------------------------------------------------------------------------
def block_signature(block: nn.Module) -> tuple:
    """Blocks with equal signatures compute the same thing: class, structure, parameter shapes."""
    return (type(block), repr(block),
            tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()))


def group_runs(blocks) -> list[tuple[nn.Module, int]]:
    """(representative, count) for each run of identical consecutive blocks."""
    runs: list[list] = []
    for block in blocks:
        sig = block_signature(block)
        if runs and runs[-1][2] == sig:
            runs[-1][1] += 1
        else:
            runs.append([block, 1, sig])
    return [(block, count) for block, count, _ in runs]


@contextlib.contextmanager
def _narrowed(blocks: nn.ModuleList, keep: list[nn.Module]):
    """Temporarily make ``blocks`` hold only ``keep``."""
    saved = blocks._modules
    blocks._modules = {str(i): m for i, m in enumerate(keep)}
    try:
        yield
    finally:
        blocks._modules = saved


# -- measuring ------------------------------------------------------------------------------------
def _sharded_params(module: nn.Module, style: str) -> list[nn.Parameter]:
    """The parameters a parallel style splits (row-wise linears keep their bias replicated)."""
    if style in ("rowwise", "rowwise_in"):
        return [module.weight]
    return [p for p in (module.weight, getattr(module, "bias", None)) if p is not None]


def _tp_unit(module: nn.Module, style: str) -> int:
    if isinstance(module, nn.Embedding):
        return module.num_embeddings
    return module.in_features if style in ("rowwise", "rowwise_in") else module.out_features


def _tp_units(modules, plan_styles: dict) -> tuple[int, ...]:
    units = set()
    for m in modules:
        units.update(v for a in HEAD_ATTRS if isinstance(v := getattr(m, a, None), int) and v > 0)
        if id(m) in plan_styles:
            units.add(_tp_unit(m, plan_styles[id(m)]))
    return tuple(sorted(units))


def model_dims(model: nn.Module) -> dict:
    """Dims found on ``model.config`` (a dataclass, object or dict) or on the model itself."""
    source = getattr(model, "config", model)
    get = source.get if isinstance(source, dict) else lambda k, d=None: getattr(source, k, d)
    dims = {}
    for dim, names in DIM_ALIASES.items():
        for name in names:
            if isinstance(value := get(name, None), int) and not isinstance(value, bool) and value > 0:
                dims[dim] = value
                break
    return dims


def _seq_len(dims: dict, model_args: dict, inputs) -> int:
    if "seq_len" in dims:
        return dims["seq_len"]
    if isinstance(model_args.get("seq_len"), int):
        return model_args["seq_len"]
    first = inputs[0]
    return first.shape[1] if first.dim() == 2 and not first.is_floating_point() else 1


def _prepare(mf: ModelFile, model_args: dict, dtype: str):
    """The model in ``dtype`` and training mode, and a batch of one sample, all on meta."""
    model = mf.build(**model_args).to(DTYPES[dtype]).train()
    inputs, targets = mf.example_batch(1, **model_args)
    inputs = tuple(t.to(DTYPES[dtype]) if t.is_floating_point() else t for t in inputs)
    return model, inputs, targets


def _measure(mf: ModelFile, model_args: dict, dtype: str, digest: str) -> ModelProfile:
    model, inputs, targets = _prepare(mf, model_args, dtype)
    tp_plan = mf.tp_plan(model)
    plan = priced_styles(model, tp_plan)
    styles = {id(model.get_submodule(name)): style for name, style in plan.items()}
    sharded = {id(p): p for name, style in plan.items() for p in _sharded_params(model.get_submodule(name), style)}
    blocks = mf.blocks(model)
    runs = group_runs(blocks) if blocks else [(model, 1)]  # no repeated layers: the model is one block
    dims = model_dims(model)
    seq_len = _seq_len(dims, model_args, inputs)
    rec = Recorder(seq_len, excluded={storage_key(t) for t in (*model.parameters(), *model.buffers())})
    for p in sharded.values():
        rec.tag(p)
    units = [rep for rep, _ in runs]
    narrowing = _narrowed(blocks, units) if blocks else contextlib.nullcontext()
    with narrowing:
        owner = _run(mf, model, units, inputs, targets, rec, styles)

    def entry(kind, segment, count, modules, params, extra_units=()):
        moe = moe_fields(modules, seq_len, DTYPES[dtype].itemsize)
        return _block_profile(kind, count, rec.tallies[segment], modules, params, sharded, styles, extra_units, moe)

    # whole heads per rank: the config's head counts bound tp however the attention module names them
    heads = tuple(sorted({dims[d] for d in ("heads", "kv_heads") if d in dims})) if plan else ()
    layers = [entry(type(rep).__name__, i, count, list(rep.modules()), list(rep.parameters()), heads)
              for i, (rep, count) in enumerate(runs)]
    ends = _outside_blocks(model, blocks if blocks else [model], owner)
    tied = _tied(ends)
    chain = (entry("embed", "embed", 1, *ends["embed"]), *layers, entry("head", "head", 1, *ends["head"]))
    name = mf.name + "".join(f" {k}={v}" for k, v in sorted(model_args.items()))
    if plan:
        tp_note = ""
    elif getattr(mf.module, "tp_note", ""):  # the model says why (an hf: model's refused styles)
        tp_note = mf.module.tp_note
    elif mf.has_tp_plan:
        tp_note = f"tp_plan(model) of {mf.path.name} shards nothing: planned with tp = 1"
    else:
        tp_note = f"{mf.path.name} defines no tp_plan(model): planned with tp = 1"
    profile = ModelProfile(name=name, digest=digest, seq_len=seq_len, dtype=dtype, blocks=chain,
                           has_tp_plan=bool(plan), tp_note=tp_note, dims=dims,
                           limits=model_limits(model, blocks, tp_plan), notes=getattr(mf.module, "notes", ()),
                           tied_params=sum(p.numel() for p in tied),
                           tied_tp_params=sum(p.numel() for p in tied if id(p) in sharded),
                           profiler=profile_cache.PROFILER_VERSION, **routing_settings(model.modules()))

    def forward():
        narrow = _narrowed(blocks, units) if blocks else contextlib.nullcontext()
        with narrow, fused_norms(model), CudaKernels():
            model(*inputs)

    heads = {v for m in model.modules() for a in HEAD_ATTRS if isinstance(v := getattr(m, a, None), int) and v > 0}
    check_tp_shards(mf, model, tp_plan, forward, heads)  # a tp_plan the forward cannot run on its shards is refused
    return profile


def _block_profile(kind: str, count: int, t: Tally, modules, params, sharded: dict, styles: dict,
                   extra_units: tuple[int, ...] = (), moe: dict | None = None) -> BlockProfile:
    return BlockProfile(
        kind=kind, count=count, params=sum(p.numel() for p in params),
        tp_params=sum(p.numel() for p in params if id(p) in sharded),
        fwd_flops=t.fwd_flops, bwd_flops=t.bwd_flops, tp_fwd_flops=t.tp_fwd_flops,
        saved_bytes=t.saved_bytes(), saved_tp_bytes=t.saved_bytes("sharded"),
        attn_core_bytes=t.saved_bytes("core"), loss_saved_bytes=t.saved_bytes("loss"),
        loss_saved_tp_bytes=t.saved_bytes("loss", "sharded"), entry_saved_bytes=t.saved_bytes("entry"),
        mask_saved_bytes=t.saved_bytes("mask"),
        attn_core_flops=t.attn_core_flops, io_bytes=t.io_bytes, out_bytes=t.out_bytes,
        tp_comm_bytes=t.tp_comm_bytes, tp_gather_bytes=t.tp_gather_bytes,
        tp_units=tuple(sorted({*_tp_units(modules, styles), *extra_units})),
        attn_flops=t.attn_flops, attn_core_io_bytes=t.attn_core_io_bytes, attn_scores=t.attn_scores,
        launches=t.launches, loss_launches=t.loss_launches, **(moe or {}))


def _run(mf: ModelFile, model, units, inputs, targets, rec: Recorder, styles: dict) -> dict:
    """Forward, loss and backward under the recorder; returns {module: segment of its first call}
    for the modules outside the blocks."""
    owner = {}

    def first_call(module, args):
        owner.setdefault(module, rec.segment)

    in_units = {id(m) for unit in units for m in unit.modules()}
    handles = [m.register_forward_pre_hook(first_call) for m in model.modules() if id(m) not in in_units]
    handles += [m.register_forward_hook(lambda m, args, out: _collective(rec, m, styles[id(m)], out))
                for m in model.modules() if styles.get(id(m)) in _COLLECTIVE_STYLES]
    handles += [m.register_forward_pre_hook(lambda m, args: _mark_entry_input(rec, args))
                for m in model.modules() if styles.get(id(m)) in _ENTRY_STYLES and not isinstance(m, nn.Embedding)]
    handles += _segment_hooks(rec, units)
    try:
        with fused_norms(model), CudaKernels(), rec, torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            output = model(*inputs)
            rec.in_loss = True
            loss = mf.loss_fn(output, targets)
            rec.in_loss = False
        rec.tallies["head"].out_bytes = tensor_bytes(loss)
        rec.backward = True
        with rec:
            loss.backward()
    except AutoparError:
        raise
    except Exception as exc:
        raise mf.error("the forward/backward pass on the meta device raised", exc,
                       "forward() and loss_fn() must use tensor shapes only, never tensor values") from exc
    finally:
        for h in handles:
            h.remove()
    return owner


def _outside_blocks(model: nn.Module, blocks, owner: dict) -> dict:
    """(modules, parameters) of the embed and head segments: modules outside the blocks, by the
    segment of their first call (never called: head); a shared parameter counts once, in the
    embedding if it uses it (`_tied`)."""
    in_units = {id(m) for block in blocks for m in block.modules()}
    seen = {id(p) for block in blocks for p in block.parameters()}
    ends = {"embed": ([], []), "head": ([], [])}
    outside = [m for m in model.modules() if id(m) not in in_units]
    for m in sorted(outside, key=lambda m: owner.get(m) != "embed"):  # the embedding's first: tied weights count there
        modules, params = ends["embed" if owner.get(m) == "embed" else "head"]
        modules.append(m)
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return ends


def _tied(ends: dict) -> list:
    """Parameters of the head's modules that the embedding holds: tied input and output embeddings
    (a language model's `output.weight = tok_embeddings.weight`), counted once, in the embedding."""
    embedding = {id(p) for p in ends["embed"][1]}
    return list({id(p): p for m in ends["head"][0] for p in m.parameters(recurse=False) if id(p) in embedding}.values())


def _collective(rec: Recorder, module: nn.Module, style: str, out):
    """A module whose style ends in a collective: its output is replicated and was communicated,
    all-reduced from partial sums (row-wise, a vocab-sharded embedding) or all-gathered from
    shards (colwise_rep, a vocab-sharded head's logits)."""
    if isinstance(out, torch.Tensor):
        rec.untag(out)
        gathered = style == "colwise_rep" or (style == "vocab" and not isinstance(module, nn.Embedding))
        if gathered:
            rec.tally.tp_gather_bytes += tensor_bytes(out)
        else:
            rec.tally.tp_comm_bytes += tensor_bytes(out)


def _mark_entry_input(rec: Recorder, args):
    """A column-wise linear's input: under sequence parallelism DTensor gathers it along the sequence
    and the linear saves the gathered tensor (tests/test_sp_memory.py)."""
    if args and isinstance(args[0], torch.Tensor):
        rec.mark_entry(args[0])


def _segment_hooks(rec: Recorder, units: list[nn.Module]) -> list:
    """Hooks that set ``rec.segment`` to the unit running, in forward and in backward."""

    def enter(i):
        def hook(module, args):
            if i == 0:  # the first unit's input: in backward, what follows is the embedding's
                _on_grad(args, rec, "embed")
            rec.segment = i
        return hook

    def leave(i):
        def hook(module, args, out):
            rec.tally.out_bytes = sum(tensor_bytes(t) for t in _tensors(out))
            if i == 0:
                rec.tallies["embed"].out_bytes = sum(tensor_bytes(t) for t in _tensors(args))
            _on_grad(out, rec, i)
            if i == len(units) - 1:
                rec.segment = "head"
        return hook

    handles = []
    for i, unit in enumerate(units):
        handles.append(unit.register_forward_pre_hook(enter(i)))
        handles.append(unit.register_forward_hook(leave(i)))
    return handles


def _tensors(x) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else [t for t in x if isinstance(t, torch.Tensor)]


def _on_grad(x, rec: Recorder, segment):
    """When backward reaches these tensors, the ops that follow belong to ``segment``."""
    for t in _tensors(x):
        if t.requires_grad:
            t.register_hook(lambda grad: setattr(rec, "segment", segment))
