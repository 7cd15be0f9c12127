"""Profile with the kernels a CUDA training run uses, not the ones meta/CPU fall back to.

On CPU and meta, ``F.dropout`` multiplies by a noise tensor in the input's dtype and saves it
(CUDA's fused kernel saves a bool mask: 2-4x less); ``F.scaled_dot_product_attention`` takes the
math path, which saves the seq x seq probabilities in fp32 (CUDA's flash kernel saves only the
output and a per-row log-sum-exp); ``F.rms_norm`` decomposes into fp32 ops that save two fp32
copies of the input (CUDA's fused kernel saves the input and the per-row 1/rms). Inside
:class:`CudaKernels` these calls are rerouted to ops that save what the CUDA kernels save, so
saved bytes and FLOPs match a GPU run.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_DROPOUT = inspect.signature(F.dropout)
_SDPA = inspect.signature(lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                          scale=None, enable_gqa=False: None)


def _dropout(input, p, training, inplace):
    if training and 0 < p < 1:
        return torch.ops.aten.native_dropout(input, p, True)[0]
    return NotImplemented


def _sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if enable_gqa and query.dim() == 4 and query.shape[-3] % key.shape[-3] == 0:  # flash-eligible too
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    if attn_mask is None and query.shape[-3] == key.shape[-3] == value.shape[-3] and query.dim() == 4:
        return torch.ops.aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    return NotImplemented  # masks or grouped heads: keep torch's own choice


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
