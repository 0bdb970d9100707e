"""Small building blocks of Laguna's layers: RMSNorm and partial neox-style RoPE.

The drafter (``drafter.py``), the context-K/V paths (``context_kv.py``) and the
fused kernel (``spec_decode/fast/context_kv_kernel.py``) all normalise and rotate the same way; this is the
one definition they share.
"""

from __future__ import annotations

import torch
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


def rope_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """RoPE frequencies theta^(-2i / rotary_dim), float32, (rotary_dim / 2,)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim))


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
