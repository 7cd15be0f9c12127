"""A model's layout as its forward runs it: the blocks in order, what runs before the first block
(the first pipeline stage's part) and after the last (the last stage's), where the residual stream
enters and leaves. Read from the forward, never from module names, so a model with its own names
(`tok`, `pos`, `out`) pipelines and shards its sequence as torchtitan's layout does.

The forward is traced with torch.fx on whatever device the model is on (meta is fine; nothing
runs): the blocks, and every module holding no block, are leaves, so only the glue between them
is recorded and the modules themselves (their names, parameters, hooks) stay as they are. The
executor cuts pipeline stages from this graph (`autopar/executor/pipeline.py`).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

from torch import fx, nn


@dataclass(frozen=True)
class ForwardLayout:
    """Layout facts of one model (qualified names, the model's own)."""

    blocks: tuple[str, ...] = ()  # the blocks, in forward order
    first: tuple[str, ...] = ()  # modules and parameters the forward uses before the first block
    last: tuple[str, ...] = ()  # ... after the last block
    input: str | None = None  # the module whose output the first block receives (None: glue computes it)
    head: str | None = None  # the module whose output the forward returns (None: glue computes it)
    pp_problem: str | None = None  # why pipeline stages cannot be cut from this forward (one line)
    sp_problem: str | None = None  # why a tp_plan of style names cannot find the stream's ends (one line)
    skips_parts: bool = False  # the forward skips parts set to None and runs nn.Identity blocks (torchtitan's)
    graph: fx.Graph | None = field(default=None, repr=False, compare=False)  # the traced forward


class _Tracer(fx.Tracer):
    """Leaves: the blocks and every module that holds no block; the rest is traced through."""

    def __init__(self, blocks: set[int], holders: set[int]):
        super().__init__()
        self.block_ids, self.holders = blocks, holders

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self.block_ids or id(m) not in self.holders


def _holders(model: nn.Module, blocks: list[nn.Module]) -> set[int]:
    """ids of the modules that hold a block (the model itself included)."""
    ids = {id(b) for b in blocks}
    return {id(m) for m in model.modules() if id(m) not in ids and any(id(s) in ids for s in m.modules())}


def trace(model: nn.Module, blocks: list[nn.Module]) -> fx.Graph:
    """The forward's glue as an fx graph (blocks and block-free modules as call_module leaves).
    Arguments with defaults keep them (a forward's optional mask stays None)."""
    params = inspect.signature(model.forward).parameters
    concrete = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    return _Tracer({id(b) for b in blocks}, _holders(model, blocks)).trace(model, concrete_args=concrete or None)


def _reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, fx.proxy.TraceError) or "control flow" in text:
        return ("its forward branches on tensor values (data-dependent control flow), which torch.fx cannot "
                f"trace ({text})")
    return f"torch.fx cannot trace its forward ({type(exc).__name__}: {text})"


def _owner_has_params(model: nn.Module, target: str) -> bool:
    try:
        return isinstance(model.get_parameter(target), nn.Parameter)
    except AttributeError:
        return any(True for _ in model.get_submodule(target).parameters())


def recomputable(node: fx.Node) -> bool:
    """A value any stage can compute for itself: parameters/buffers read by name and functions of
    them and constants (no model input, no module call)."""
    if node.op == "get_attr":
        return True
    return node.op in ("call_function", "call_method") and all(recomputable(a) for a in node.all_input_nodes)


def live(nodes: list[fx.Node], pos: int) -> list[fx.Node]:
    """Values made before position `pos` and used from it on: what a stage cut there receives."""
    where = {n: i for i, n in enumerate(nodes)}
    return [n for n in nodes[:pos] if not recomputable(n) and any(where[u] >= pos for u in n.users)]


def _uses(graph: fx.Graph, block_pos: list[int]) -> dict[str, set[int]]:
    """{module or parameter holding parameters: segments using it}; segment -1 is before the first
    block, i after block i (the last: after every block)."""
    nodes = list(graph.nodes)

    def segment(i: int) -> int:
        return sum(1 for b in block_pos if b < i) - 1

    out: dict[str, set[int]] = {}
    for i, n in enumerate(nodes):
        if n.op == "call_module" and i not in block_pos:
            out.setdefault(n.target, set()).add(segment(i))
        elif n.op == "get_attr":
            out.setdefault(n.target, set()).update(segment(nodes.index(u)) for u in n.users)
    return out


def _stream(nodes: list[fx.Node], block_pos: list[int]) -> set[fx.Node]:
    """Values computed from a block's output."""
    out = {nodes[i] for i in block_pos}
    for n in nodes:
        if any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _first_input(node: fx.Node):
    if node.args:
        return node.args[0]
    return next(iter(node.kwargs.values()), None)


def _skips_parts(model: nn.Module, blocks: list[nn.Module], ends: list[nn.Module]) -> bool:
    """Whether the forward still traces with the first and last stages' parts set to None and
    every block an nn.Identity (torchtitan's layout): then stages are copies of the model."""
    memo = {id(b): nn.Identity() for b in blocks}
    memo.update({id(m): None for m in ends})
    try:
        trace(copy.deepcopy(model, memo), [])
    except Exception:  # any failure: the forward needs its parts; stages are cut from the graph instead
        return False
    return True


def forward_layout(model: nn.Module, blocks: nn.ModuleList | None) -> ForwardLayout:
    """The layout facts of `model` whose repeated blocks are `blocks` (None: no blocks). Never
    raises for a forward it cannot read: the reasons are in `pp_problem` / `sp_problem`."""
    block_list = list(blocks) if blocks is not None else []
    names = {id(m): n for n, m in model.named_modules()}
    if any(id(b) not in names for b in block_list):
        why = "the blocks given are not modules of the model; pass its own repeated blocks"
        return ForwardLayout(pp_problem=why, sp_problem=why)
    try:
        graph = trace(model, block_list)
    except Exception as exc:  # the user's forward: any error it raises under tracing is the reason
        why = _reason(exc)
        return ForwardLayout(blocks=tuple(names.get(id(b), "?") for b in block_list),
                      pp_problem=f"pipeline parallelism cuts stages from the model's forward, but {why}; use pp=1",
                      sp_problem=f"sequence parallelism with style names finds the sequence's ends in the model's "
                                 f"forward, but {why}; use a tp_plan of torch ParallelStyles, or no sequence "
                                 f"parallelism")
    nodes = list(graph.nodes)
    block_names = tuple(names[id(b)] for b in block_list)
    block_pos = [i for i, n in enumerate(nodes) if n.op == "call_module" and n.target in block_names]
    called = [nodes[i].target for i in block_pos]
    segments = {i: [] for i in (-1, len(block_pos) - 1)}
    uses = _uses(graph, block_pos)
    for target, used in uses.items():
        for s in used & segments.keys():
            segments[s].append(target)
    first, last = tuple(segments[-1]), tuple(t for t in segments[len(block_pos) - 1] if t not in segments[-1])
    head, stream_input = _ends(model, nodes, block_pos)
    sp_problem = None if head else (
        "sequence parallelism with style names gathers the sequence into the module that computes the forward's "
        "output, and this forward has none after its blocks; use a tp_plan of torch ParallelStyles")
    ends = [model.get_submodule(t) for t in first + last
            if t in dict(model.named_modules()) and _owner_has_params(model, t)]
    pp_problem = _order_problem(model, block_names, called, uses)
    skips = pp_problem is None and _skips_parts(model, block_list, ends)
    if pp_problem is None and not skips:
        pp_problem = _crossing_problem(nodes, block_names, block_pos)
    return ForwardLayout(blocks=block_names, first=first, last=last, input=stream_input, head=head,
                  pp_problem=pp_problem, sp_problem=sp_problem, skips_parts=skips, graph=graph)


def _ends(model: nn.Module, nodes: list[fx.Node], block_pos: list[int]) -> tuple[str | None, str | None]:
    """(head, input): the last module with parameters after the blocks that the output comes from,
    and the only module with parameters before them that the first block's input comes from."""
    if not block_pos:
        return None, None

    def modules_behind(node, lo: int, hi: int) -> list[str]:
        seen, todo, found = set(), [node], []
        while todo:
            n = todo.pop()
            if not isinstance(n, fx.Node) or n in seen:
                continue
            seen.add(n)
            i = nodes.index(n)
            if lo <= i < hi and n.op == "call_module" and _owner_has_params(model, n.target):
                found.append((i, n.target))
            if lo <= i < hi:
                todo.extend(n.all_input_nodes)
        return [t for _, t in sorted(found)]

    behind_out = modules_behind(nodes[-1], block_pos[-1] + 1, len(nodes))
    behind_in = modules_behind(_first_input(nodes[block_pos[0]]), 0, block_pos[0])
    return (behind_out[-1] if behind_out else None), (behind_in[0] if len(behind_in) == 1 else None)


def _order_problem(model, block_names, called, uses) -> str | None:
    """Why no pipeline cut of this forward works (one line): blocks run out of order, a module
    with parameters used in two places of the stack; None otherwise."""
    if not block_names:
        return "pipeline parallelism needs the model's repeated blocks (an nn.ModuleList); use pp=1"
    if list(called) != list(block_names):
        return (f"pipeline parallelism runs each block once, in order, but the forward calls "
                f"{_short(called)} of the blocks {_short(block_names)}; use pp=1")
    by_param: dict[str, set[int]] = {}  # a parameter's own name (a tied copy has another: tied.py keeps it equal)
    for target, used in uses.items():
        for name in _param_names(model, target):
            by_param.setdefault(name, set()).update(used)
    for name, used in by_param.items():
        if len(used) > 1:
            where = ", ".join("before the blocks" if s < 0 else f"after {block_names[s]}" for s in sorted(used))
            return (f"the forward uses {name} at more than one place in the stack of blocks ({where}); a pipeline "
                    f"cut would need it on two stages: use pp=1")
    return None


def _param_names(model: nn.Module, target: str) -> list[str]:
    """The names of the parameters a module call or attribute read uses."""
    try:
        return [target] if isinstance(model.get_parameter(target), nn.Parameter) else []
    except AttributeError:
        pass
    try:
        module = model.get_submodule(target)
    except AttributeError:
        return []  # a buffer or constant
    return [f"{target}.{n}" for n, _ in module.named_parameters(remove_duplicate=False)]


def _crossing_problem(nodes, block_names, block_pos) -> str | None:
    """Why stages cut from the graph cannot pass only the blocks' outputs between them, or None."""
    stream = _stream(nodes, block_pos)
    for k, pos in enumerate(block_pos[1:], start=1):
        for n in live(nodes, pos):
            if n not in stream:
                return (f"the forward hands {block_names[k]} the value '{n.name}' computed before the blocks; "
                        f"pipeline stages pass only the blocks' outputs between them: compute it inside the "
                        f"blocks, or use pp=1")
    return None


def _short(names) -> str:
    names = list(names)
    return "[" + ", ".join(names[:3]) + (", ..." if len(names) > 3 else "") + "]"

