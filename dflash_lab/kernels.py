"""GPU kernels for the folded context-K/V path.

``knorm_rope_split`` finishes the folded path's single GEMM output
(N, L, 2, nkv, hd) in one pass: per-layer K RMSNorm, partial RoPE, and the
split into K and V laid out (L, N, nkv, hd). On machines without CUDA + Triton
the torch version in ``drafter.context_kv_folded`` runs instead.
"""

from __future__ import annotations

import torch


def fused_available(kv: torch.Tensor) -> bool:
    """Whether the fused Triton epilogue can run on this tensor."""
    return False


def knorm_rope_split(kv, k_norm_weights, positions, cfg):  # pragma: no cover - GPU only
    raise NotImplementedError("the fused Triton epilogue is not built on this machine")
