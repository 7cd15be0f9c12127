"""Load a user's model.py and check it follows the model.py contract.

A model.py defines ``build_model(**model_args)`` and ``example_batch(batch_size, **model_args)``,
and optionally ``loss_fn(output, target)``, ``tp_plan(model)`` and ``blocks(model)``. Model
arguments reach a function only if its signature names them (or it takes ``**kwargs``), so a
minimal ``def build_model():`` works under any CLI flags. Every contract violation raises
:class:`~autopar.errors.ModelFileError` with a one-line message saying how to fix it.

Stdlib and torch only: the executor imports this module on every rank.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.util
import inspect
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from autopar import hf, zoo
from autopar.errors import ModelFileError

#: Tensor-parallel styles a ``tp_plan(model)`` may name (values of its dict), and what each means.
TP_STYLES = {
    "colwise": "shard the output features of an nn.Linear; the output stays sharded",
    "rowwise": "shard the input features of an nn.Linear whose input is sharded; output all-reduced",
    "colwise_rep": "like colwise, then all-gather the output so it is replicated",
    "rowwise_in": "rowwise on a replicated input (sliced locally); output all-reduced",
    "vocab": "shard the vocabulary: nn.Embedding rows (output all-reduced) or an output nn.Linear's "
             "out_features (logits all-gathered)",
    "head_norm": "a norm over each head's channels (input [batch, seq, heads, head_dim], heads sharded): "
                 "weight replicated, its gradient all-reduced (Qwen3's q_norm / k_norm)",
}

_module_ids = itertools.count()


def call_with_model_args(fn, *args, **model_args):
    """Call ``fn`` with the model arguments its signature accepts (all of them if it takes **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        model_args = {k: v for k, v in model_args.items() if k in names}
    return fn(*args, **model_args)


def _describe(exc: BaseException) -> str:
    """``Type: first line of the message``: error messages stay on one line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else '(no message)'}"


def _where(exc: BaseException, path: Path) -> str:
    """``file:line`` of the deepest traceback frame inside the model file, if any."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if Path(tb.tb_frame.f_code.co_filename) == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return f"{path}:{line}" if line else str(path)


def _non_meta(model: nn.Module) -> list[str]:
    tensors = itertools.chain(model.named_parameters(), model.named_buffers())
    return [f"{name} ({t.device})" for name, t in tensors if t.device.type != "meta"]


class ModelFile:
    """A loaded model.py: builds its model on the meta device and gives its example batches."""

    def __init__(self, path: Path, module, digest: str):
        self.path = path
        self.module = module
        self.digest = digest  # sha256 of the file bytes
        self.name = path.stem

    def error(self, what: str, exc: BaseException | None = None, fix: str = "") -> ModelFileError:
        """A one-line ModelFileError: ``file[:line]: what (cause); fix``."""
        where = _where(exc, self.path) if exc is not None else str(self.path)
        cause = f" ({_describe(exc)})" if exc is not None else ""
        return ModelFileError(f"{where}: {what}{cause}" + (f"; {fix}" if fix else ""))

    # -- model -----------------------------------------------------------------------------
    def build(self, **model_args) -> nn.Module:
        """Build the model on the meta device (no memory is allocated, no weights are loaded)."""
        try:
            with torch.device("meta"):
                model = call_with_model_args(self.module.build_model, **model_args)
        except BaseException as exc:  # sys.exit and interrupts from the model too
            if isinstance(exc, (NotImplementedError, RuntimeError)) and "meta" in str(exc).lower():
                raise self.error("build_model() cannot run on the meta device", exc,
                                 "build the model without loading weights, calling .to()/.cuda() or "
                                 "reading tensor values; load weights after building") from exc
            raise self.error("build_model() raised", exc) from exc
        if not isinstance(model, nn.Module):
            raise self.error(f"build_model() returned {type(model).__name__}, not a torch.nn.Module",
                             fix="return the model instance")
        off_meta = _non_meta(model)
        if off_meta:
            raise self.error(f"build_model() made tensors off the meta device: {', '.join(off_meta[:3])}",
                             fix="do not move the model (.to/.cuda) or load weights inside build_model(), "
                                 "and create tensors without an explicit device=")
        return model

    def example_batch(self, batch_size: int, *, device="meta", **model_args):
        """``(inputs, targets)`` with ``inputs`` a tuple of tensors, made on ``device``
        (so ``device`` is not passed on as a model argument)."""
        try:
            with torch.device(device):
                batch = call_with_model_args(self.module.example_batch, batch_size, **model_args)
        except BaseException as exc:  # as in build
            raise self.error(f"example_batch({batch_size}) raised", exc) from exc
        if isinstance(batch, dict) and {"inputs", "targets"} <= batch.keys():
            batch = (batch["inputs"], batch["targets"])
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise self.error(f"example_batch() returned {type(batch).__name__}",
                             fix="return (inputs, targets) or {'inputs': ..., 'targets': ...}")
        inputs, targets = batch
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        tensors = [*inputs, *(targets if isinstance(targets, (tuple, list)) else (targets,))]
        if not inputs or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise self.error("example_batch() inputs and targets must be tensors (or tuples of tensors)")
        bad = [tuple(t.shape) for t in tensors if t.dim() == 0 or t.shape[0] != batch_size]
        if bad:
            raise self.error(f"example_batch({batch_size}) gave tensors of shape {bad[0]}",
                             fix=f"make dimension 0 of every input and target the batch size {batch_size}")
        return inputs, targets

    # -- optional hooks ----------------------------------------------------------------------
    def loss_fn(self, output, target) -> torch.Tensor:
        """The model file's ``loss_fn``, else cross-entropy over the last dimension."""
        user = getattr(self.module, "loss_fn", None)
        if user is not None:
            return user(output, target)
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

    @property
    def has_tp_plan(self) -> bool:
        return callable(getattr(self.module, "tp_plan", None))

    def tp_plan(self, model: nn.Module) -> dict:
        """The tensor-parallel plan with wildcards expanded: ``{module FQN: style}`` ({} if none);
        a style is a name of :data:`TP_STYLES` or a torch ParallelStyle object."""
        if not self.has_tp_plan:
            return {}
        try:
            plan = self.module.tp_plan(model)
        except Exception as exc:
            raise self.error("tp_plan(model) raised", exc) from exc
        if not isinstance(plan, dict):
            raise self.error(f"tp_plan(model) returned {type(plan).__name__}",
                             fix="return a dict {module name: style}")
        optional = self.module.config_entries if isinstance(self.module, hf.HFSource) else frozenset()
        return resolve_tp_plan(model, plan, where=str(self.path), optional=optional)

    def blocks(self, model: nn.Module) -> nn.ModuleList | None:
        """The repeated layers to split into pipeline stages (default: the longest nn.ModuleList)."""
        user = getattr(self.module, "blocks", None)
        if user is None:
            lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
            return max(lists, key=len, default=None)
        try:
            found = user(model)
        except Exception as exc:
            raise self.error("blocks(model) raised", exc) from exc
        if found is None:  # the model says it has no blocks to pipeline
            return None
        if not isinstance(found, nn.ModuleList) or not any(found is m for m in model.modules()):
            raise self.error("blocks(model) must return an nn.ModuleList that is part of the model")
        return found


def _check_style(where: str, pattern: str, style) -> None:
    from torch.distributed.tensor.parallel import ParallelStyle  # torch: heavy, imported on first use

    if isinstance(style, ParallelStyle) or style in TP_STYLES:
        return
    raise ModelFileError(f"{where}: tp_plan entry {pattern!r} has style {style!r}; use one of "
                         f"{', '.join(TP_STYLES)}, or a torch ParallelStyle such as ColwiseParallel()")


def _check_module(where: str, pattern: str, name: str, module: nn.Module, style) -> None:
    if not isinstance(style, str):
        return  # a ParallelStyle checks its module itself when applied
    fits = {"vocab": (nn.Linear, nn.Embedding), "head_norm": (nn.Module,)}.get(style, (nn.Linear,))
    if not isinstance(module, fits):
        raise ModelFileError(f"{where}: tp_plan entry {pattern!r} names {name}, a {type(module).__name__}; "
                             "styles apply to nn.Linear, 'vocab' also to nn.Embedding, 'head_norm' to a norm")


def resolve_tp_plan(model: nn.Module, plan: dict, where: str = "tp_plan", optional=frozenset()) -> dict:
    """Expand ``*`` wildcards (one name component each, as torchtitan) and check every style: a
    name of :data:`TP_STYLES` or a torch ``ParallelStyle`` object (torchtitan's form), not both.
    An entry matching no module is an error, unless it is ``optional`` (a transformers config's
    generic plan, written for every config of its family): then it is dropped."""
    names = [name for name, _ in model.named_modules() if name]
    if len({isinstance(style, str) for style in plan.values()}) > 1:
        raise ModelFileError(f"{where}: tp_plan mixes style names and ParallelStyle objects; write every "
                             "entry in one form")
    resolved = {}
    for pattern, style in plan.items():
        _check_style(where, pattern, style)
        atoms = pattern.split(".")
        hits = [n for n in names if len(n.split(".")) == len(atoms)
                and all(fnmatch.fnmatchcase(a, p) for a, p in zip(n.split("."), atoms))]
        if not hits and pattern in optional:
            continue
        if not hits:
            raise ModelFileError(f"{where}: tp_plan entry {pattern!r} matches no module of the model; "
                                 "use dotted module names as in model.named_modules()")
        for name in hits:
            _check_module(where, pattern, name, model.get_submodule(name), style)
            resolved[name] = style
    return resolved


def priced_styles(model: nn.Module, plan: dict) -> dict[str, str]:
    """The style names the profiler prices a resolved tp_plan by: names as they are, torch's
    ParallelStyle objects by what they shard (SequenceParallel and PrepareModule* shard no weight)."""
    from torch.distributed.tensor import Replicate  # torch: heavy, imported on first use
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # torch: heavy

    out = {}
    for name, style in plan.items():
        if isinstance(style, str):
            if style != "head_norm":  # a replicated weight: priced as unsharded
                out[name] = style
            continue
        module = model.get_submodule(name)
        output = getattr(style, "output_layouts", (None,))[0]
        if isinstance(style, RowwiseParallel):
            inputs = style.input_layouts[0]
            out[name] = "vocab" if isinstance(module, nn.Embedding) else (
                "rowwise_in" if isinstance(inputs, Replicate) else "rowwise")
        elif isinstance(style, ColwiseParallel):
            out[name] = "colwise_rep" if isinstance(output, Replicate) else "colwise"
    return out


def sequence_parallel_styles(plan: dict) -> bool | None:
    """Whether a tp_plan of ParallelStyle objects shards the sequence (it has a SequenceParallel
    entry); None for a plan of style names, where the plan's sequence_parallel decides."""
    from torch.distributed.tensor.parallel import SequenceParallel  # torch: heavy, imported on first use

    if not plan or all(isinstance(style, str) for style in plan.values()):
        return None
    return any(isinstance(style, SequenceParallel) for style in plan.values())


def materialize(model: nn.Module, device) -> nn.Module:
    """Allocate a meta-built model on ``device`` and initialise it.

    Calls ``model.init_weights()`` when the model has one (the zoo models do: it also rebuilds
    buffers such as causal masks), else ``reset_parameters()`` of every module that has it.
    """
    model.to_empty(device=device)
    with torch.no_grad():
        if callable(getattr(model, "init_weights", None)):
            model.init_weights()
        else:
            for module in model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
    return model


def load_model_file(path) -> ModelFile:
    """Import a model.py (or a zoo model by name, e.g. ``"gpt"``) under a unique module name;
    ``hf:PATH`` names a transformers config instead (:mod:`autopar.hf`)."""
    if hf.is_reference(path):
        config_path, source, digest, name = hf.load(path)
        model_file = ModelFile(config_path, source, digest)
        model_file.name = name
        return model_file
    try:
        if not Path(path).exists() and str(path) in zoo.MODELS:
            path = zoo.path(str(path))
        path = Path(path).expanduser().resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise ModelFileError(f"{path}: cannot resolve the model path ({_describe(exc)})") from None
    if path.exists() and not path.is_file():
        raise ModelFileError(f"{path}: not a regular file (a FIFO, device or directory); give the path of a model.py")
    if not path.is_file():
        known = ", ".join(zoo.MODELS)
        raise ModelFileError(f"{path}: no such model file; give the path of a model.py or a zoo model ({known})")
    if path.suffix != ".py":
        raise ModelFileError(f"{path}: a model file must be a Python file ending in .py")
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read the model file ({_describe(exc)})") from exc
    digest = hashlib.sha256(source).hexdigest()
    try:
        code = compile(source, str(path), "exec")
    except SyntaxError as exc:
        raise ModelFileError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from exc
    name = f"autopar_model_{path.stem}_{digest[:12]}_{next(_module_ids)}"
    if path.parent != Path(zoo.__file__).parent and str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))  # its own modules beside it import, as under `python model.py`
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up here
    try:
        exec(code, module.__dict__)
    except BaseException as exc:  # noqa: BLE001 - sys.exit, KeyboardInterrupt ...: one line, not an exit
        del sys.modules[name]
        raise ModelFileError(f"{_where(exc, path)}: importing the model file raised {_describe(exc)}") from None
    for required, fix in (("build_model", "define build_model(**model_args) returning an nn.Module"),
                          ("example_batch", "define example_batch(batch_size, **model_args) returning "
                                            "(inputs, targets)")):
        if not callable(getattr(module, required, None)):
            raise ModelFileError(f"{path}: no function {required}(); {fix}")
    return ModelFile(path, module, digest)
