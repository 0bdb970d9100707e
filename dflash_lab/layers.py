"""Small building blocks of Laguna's layers: RMSNorm, partial neox-style RoPE, GQA attention.

The drafter (``drafter.py``), the context-K/V paths (``context_kv.py``), their fused
kernel (``context_kv_kernel.py``) and the static target (``spec_decode/fast/static_target.py``)
all normalise, rotate and attend the same way; this is the one definition they share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, computed in float32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """Laguna's RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps)


_INV_FREQ: dict = {}


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """RoPE frequencies theta^(-2i / rotary_dim), float32, (rotary_dim / 2,).

    Computed once per (rotary_dim, theta, device) and shared (read only): every forward
    needs them, and a graphed decode step would otherwise recompute them in four kernels.
    """
    key = (rotary_dim, float(theta), str(torch.device(device) if device is not None else "cpu"))
    if key not in _INV_FREQ:
        with torch.inference_mode(False), torch.no_grad():
            steps = torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim
            _INV_FREQ[key] = 1.0 / (theta ** steps)
    return _INV_FREQ[key]


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables for neox-style RoPE on the first ``rotary_dim`` channels.

    Angles are computed in float32 from the positions, then rounded to ``dtype``.
    """
    freqs = positions.float()[..., None] * rope_inv_freq(rotary_dim, theta, positions.device)  # (..., rotary_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., rotary_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x (..., heads, hd); pass the rest.

    cos/sin are (..., rotary_dim) without the heads axis (broadcast over heads).
    This is Laguna's partial RoPE (rotate_half on the leading channels).
    """
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]
    x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1)


def rope_tables(config, positions: torch.Tensor, dtype: torch.dtype):
    """cos/sin of a drafter config's RoPE (its layer type's entry: rotary dim and theta) at ``positions``."""
    return rope_cos_sin(positions, config.rotary_dim, float(config.rope.get("rope_theta", 10000.0)), dtype)


class TorchOps:
    """How a forward runs its norms: the modules themselves. The fast path passes one-kernel
    versions with the same two functions (``spec_decode.fast.triton_ops``) in its place."""

    @staticmethod
    def norm(module, x: torch.Tensor) -> torch.Tensor:
        return module(x)

    @staticmethod
    def norms(modules, x: torch.Tensor, stacked: dict | None = None) -> torch.Tensor:
        """x (..., G * D): slice g normed by modules[g], the results side by side again (..., G * D). ``stacked``
        (where the fast path keeps the weights stacked) is not needed here."""
        slices = x.unflatten(-1, (len(modules), -1)).unbind(-2)
        return torch.stack([m(s) for m, s in zip(modules, slices)], dim=-2).flatten(-2)

    @staticmethod
    def norm_rope(module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int):
        """A per-head norm then RoPE: x (..., heads * head_dim) -> (..., heads, head_dim)."""
        return apply_rope(module(x.unflatten(-1, (heads, head_dim))), cos, sin)

    @staticmethod
    def linears(x: torch.Tensor, layers, stacked: dict | None = None) -> list[torch.Tensor]:
        """Several ``nn.Linear`` layers applied to the same x, one GEMM each (``stacked`` unused)."""
        return [layer(x) for layer in layers]

    @staticmethod
    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """An MLP's activation: silu(gate) * up."""
        return F.silu(gate) * up

    @staticmethod
    def add_norm(h: torch.Tensor, delta: torch.Tensor, module) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and the norm after it: (h + delta, module(h + delta))."""
        h = h + delta
        return h, module(h)


def stacked_linears(x: torch.Tensor, layers, stacked: dict | None) -> list[torch.Tensor]:
    """Several ``nn.Linear`` layers applied to the same x in ONE GEMM: their weights (and biases)
    concatenated once and kept in ``stacked`` under (the layers, device, dtype).

    ``stacked`` must be a dict that is emptied whenever the weights may change (the drafter's
    ``context_kv_buffers``, see ``DFlashLagunaDrafter.refresh_context_kv_buffers``); with None,
    or under autograd, the layers run one by one (a concatenated copy would cut the gradient).
    """
    if stacked is None or (torch.is_grad_enabled() and any(layer.weight.requires_grad for layer in layers)):
        return TorchOps.linears(x, layers)
    key = ("linears", *layers, x.device, x.dtype)
    if key not in stacked:
        w = torch.cat([layer.weight for layer in layers]).to(device=x.device, dtype=x.dtype)
        b = None
        if any(layer.bias is not None for layer in layers):
            b = torch.cat([layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features)
                           for layer in layers]).to(device=x.device, dtype=x.dtype)
        stacked[key] = (w, b, [layer.out_features for layer in layers])
    w, b, sizes = stacked[key]
    return list(F.linear(x, w, b).split(sizes, dim=-1))


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = visible) -> 0 / -inf in ``dtype`` (every row has a visible key)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def grouped_mask(mask: torch.Tensor, groups: int, batch: int, queries: int) -> torch.Tensor:
    """(B or 1, Q or 1, S) mask -> (batch, 1, groups * queries, S), the layout ``gqa_attention`` attends with.

    ``gqa_attention`` expands a 3-D mask itself, one copy per call; a forward that attends
    with one mask in every layer builds this once and passes it instead.
    """
    S = mask.shape[-1]
    return mask[:, None, None].expand(batch, 1, groups, queries, S).reshape(batch, 1, groups * queries, S)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q (B, Q, H, hd) over k/v (B, nkv, S, hd) -> (B, Q, H*hd).

    mask (B, Q, S) (B and Q may be 1: broadcast), or ``grouped_mask``'s (B, 1, g*Q, S): bool
    (True = visible) or additive (0 / -inf); every row sees a key.
    The g = H / nkv query heads that share a KV head are folded into the query axis,
    (B, nkv, g*Q, hd), so SDPA's fused kernels run on the KV heads as they are (no repeat
    of K/V, no enable_gqa fallback to the math kernel).
    """
    B, Q, H, hd = q.shape
    nkv = k.shape[1]
    g = H // nkv
    qg = q.view(B, Q, nkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, nkv, g * Q, hd)  # head h = kv h//g, member h%g
    m = mask if mask.dim() == 4 else grouped_mask(mask, g, B, Q)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=scale)  # (B, nkv, g*Q, hd)
    return out.view(B, nkv, g, Q, hd).permute(0, 3, 1, 2, 4).reshape(B, Q, H * hd)
