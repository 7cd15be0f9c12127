"""Profile with the kernels a CUDA training run uses, not the ones meta/CPU fall back to.

On CPU and meta, ``F.dropout`` multiplies by a noise tensor in the input's dtype and saves it
(CUDA's fused kernel saves a bool mask: 2-4x less); ``F.scaled_dot_product_attention`` takes the
math path, which saves the seq x seq probabilities in fp32 (CUDA's flash kernel saves only the
output and a per-row log-sum-exp); ``F.rms_norm`` decomposes into fp32 ops that save two fp32
copies of the input (CUDA's fused kernel saves the input and the per-row 1/rms). Inside
:class:`CudaKernels` these calls are rerouted to ops that save what the CUDA kernels save, so
saved bytes and FLOPs match a GPU run. :func:`fused_norms` does the same for RMS norm modules
written out op by op (HF's), so that how a norm is written does not change the profile.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

_DROPOUT = inspect.signature(F.dropout)
_SDPA = inspect.signature(lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                          scale=None, enable_gqa=False: None)


def _dropout(input, p, training, inplace):
    if training and 0 < p < 1:
        return torch.ops.aten.native_dropout(input, p, True)[0]
    return NotImplemented


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The flash kernel wherever CUDA takes it: no mask, 4-d inputs, and query heads equal to the
    key/value heads or (``enable_gqa``) a multiple of them. Grouped K/V are repeated first, as a
    model that repeats them itself does (torchtitan's repeat_kv, the bundled Llama), so both ways
    of writing grouped-query attention profile alike (the repeated copies are what flash saves)."""
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if attn_mask is not None or query.dim() != 4 or key.shape[-3] != value.shape[-3]:
        return NotImplemented  # masks: keep torch's own choice
    if heads != kv_heads:
        if not (enable_gqa and heads % kv_heads == 0):
            return NotImplemented  # torch raises its own error
        key, value = (t.repeat_interleave(heads // kv_heads, dim=-3) for t in (key, value))
    return torch.ops.aten._scaled_dot_product_flash_attention(
        query, key, value, dropout_p, is_causal, False, scale=scale)[0]


class _FusedRMSNorm(torch.autograd.Function):
    """RMS norm that saves what CUDA's fused kernel saves: the input and the 1/rms per row,
    computing in at least fp32."""

    @staticmethod
    def forward(ctx, x, weight, dims, eps):
        acc = torch.promote_types(x.dtype, torch.float32)
        rstd = torch.rsqrt(x.to(acc).pow(2).mean(dims, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.dims = dims
        y = x.to(acc) * rstd
        return (y if weight is None else y * weight.to(acc)).type_as(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        acc = rstd.dtype
        xhat = x.to(acc) * rstd
        g = grad.to(acc) if weight is None else grad.to(acc) * weight.to(acc)
        grad_x = rstd * (g - xhat * (g * xhat).mean(ctx.dims, keepdim=True))
        grad_w = None
        if weight is not None:
            grad_w = (grad.to(acc) * xhat).sum(tuple(range(x.dim() - weight.dim()))).type_as(weight)
        return grad_x.type_as(x), grad_w, None, None


def _rms_norm(input, normalized_shape, weight, eps):
    dims = tuple(range(-len(normalized_shape), 0))
    return _FusedRMSNorm.apply(input, weight, dims, torch.finfo(input.dtype).eps if eps is None else eps)


_REROUTE = {
    F.dropout: (_DROPOUT, _dropout),
    F.scaled_dot_product_attention: (_SDPA, _sdpa),
    F.rms_norm: (inspect.signature(F.rms_norm), _rms_norm),
}


def _norm_eps(module: nn.Module) -> float | None:
    """The epsilon of a hand-written RMS norm module (HF's ``LlamaRMSNorm`` and kin: a class named
    ...RMSNorm with a 1-d ``weight``), or None for any other module."""
    weight = getattr(module, "weight", None)
    if "rmsnorm" not in type(module).__name__.lower() or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    eps = next((v for a in ("eps", "variance_epsilon") if isinstance(v := getattr(module, a, None), float)), None)
    return eps


@contextlib.contextmanager
def fused_norms(model: nn.Module):
    """Run hand-written RMS norm modules as the fused kernel (``F.rms_norm``, rerouted below), as
    torch.compile, Transformer Engine or Liger run them on a GPU: written out in eager ops they would
    save fp32 copies of their input, and the profile would depend on how the norm is written."""
    patched = []
    for module in model.modules():
        if (eps := _norm_eps(module)) is not None and "forward" not in module.__dict__:
            module.forward = functools.partial(_module_rms_norm, module.weight, eps)
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _module_rms_norm(weight, eps, x):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class CudaKernels(TorchFunctionMode):
    """Reroute dropout, scaled-dot-product attention and RMS norm as CUDA runs them (module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _REROUTE:
            signature, reroute = _REROUTE[func]
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            out = reroute(*bound.arguments.values())
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)
