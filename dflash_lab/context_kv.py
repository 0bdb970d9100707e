"""Context K/V: every drafter layer's K (after K-norm and RoPE) and V of the context, three ways.

For drafter layer l and context state x (one row per context position):

    K_l = RoPE(K-norm_l(W_K,l · RMSNorm_l(x))),   V_l = W_V,l · RMSNorm_l(x)      each (N, nkv, hd)

The three paths compute the same thing in different orders:

    reference : a per-layer loop, the readable definition.
    batched   : vLLM 0.33's structure (_build_context_kv_buffers / _project_context_kv /
                _normalize_context_k): stacked weights, one batched RMSNorm of the
                context with every layer's input-layernorm weight (L copies of the
                context), one bmm, one batched K-norm, RoPE on all layers at once.
    folded    : ours. RMSNorm(x) * w_l followed by W_l is x_hat @ (W_l * w_l)^T, so
                fold every layer's input-layernorm weight into its K/V rows once,
                normalise the context ONCE (no weight), run ONE GEMM for all layers'
                K and V, then K-norm + RoPE in one pass. On a GPU with Triton the norm
                becomes a row scale applied after the GEMM (row scales commute with it)
                and the last pass is a single fused kernel (dflash_lab.context_kv_kernel).

Because they round in different orders they agree to rounding only:
``context_kv_tolerance`` is the rule, and ``context_kv_agreement`` is the one
comparison every test, benchmark, notebook and widget uses.

Each function takes the drafter as its first argument and reads only its layers, its
config and its ``context_kv_buffers`` dict (``drafter.py`` calls in here through
``DFlashLagunaDrafter.precompute_context_kv``; this module never imports the drafter).
"""

from __future__ import annotations

import math

import torch

from .layers import apply_rope, rms_normalize, rope_tables
from . import context_kv_kernel as kernels

CONTEXT_KV_PATHS = ("reference", "batched", "folded")


# ---------------------------------------------------------------------------
# How close two paths must be, and the one way to measure it
# ---------------------------------------------------------------------------


BF16_ROUNDING_STEPS = 2  # how far apart two bf16 paths that round in different orders may land
BF16_MARGIN_STEPS = 1  # the margin above that, so agreement is never decided on the bound itself


def context_kv_tolerance(dtype: torch.dtype, scale: float = 1.0) -> tuple[float, float | None]:
    """(max, mean) abs error allowed between two context-K/V paths in ``dtype``.

    float32: 1e-5 relative to the largest |value| (at least 1e-5). bfloat16: 6e-2
    (K has unit RMS after K-norm), widened to three bf16 steps at the largest value
    when trained K-norm weights push |K| past 4 (a step there is 2**-5): the
    paths round in different orders, so they may land two steps apart, and the
    third step is the stated margin (a path two steps off sits one step inside). Mean 5e-3.
    """
    if dtype == torch.float32:
        return 1e-5 * max(1.0, scale), None
    step = 2.0 ** (math.floor(math.log2(max(scale, 1e-30))) - 7)  # bf16 spacing at `scale`
    return max(6e-2, (BF16_ROUNDING_STEPS + BF16_MARGIN_STEPS) * step), 5e-3


def context_kv_agreement(out, ref) -> dict:
    """Compare (K, V) of one path with the reference's (K, V) under ``context_kv_tolerance``.

    Returns ``ok`` (within tolerance), ``max_err`` / ``mean_err`` (the worse of K
    and V), ``max_tol`` / ``mean_tol`` (the rule at the reference's dtype and
    largest |value|; ``mean_tol`` is None in float32) and ``errors``: the
    element-wise |out - ref| of K and of V, in float32.
    """
    if len(out) != len(ref):
        raise ValueError(f"out holds {len(out)} tensors, ref {len(ref)}: pass (K, V) for both")
    for a, b in zip(out, ref):
        if a.shape != b.shape:
            raise ValueError(f"out has shape {tuple(a.shape)} where ref has {tuple(b.shape)}")
    errors = [(a.float() - b.float()).abs() for a, b in zip(out, ref)]
    scale = max(r.abs().max().item() for r in ref) if ref[0].numel() else 0.0
    max_tol, mean_tol = context_kv_tolerance(ref[0].dtype, scale)
    max_err = max((e.max().item() for e in errors if e.numel()), default=0.0)
    mean_err = max((e.mean().item() for e in errors if e.numel()), default=0.0)
    ok = max_err <= max_tol and (mean_tol is None or mean_err <= mean_tol)
    return {"ok": ok, "max_err": max_err, "mean_err": mean_err, "max_tol": max_tol, "mean_tol": mean_tol,
            "errors": errors}


# ---------------------------------------------------------------------------
# Stacked and folded weights, built once per set of weights
# ---------------------------------------------------------------------------

def build_context_kv_buffers(drafter, device, dtype) -> dict:
    """Stacked (batched path) and folded (folded path) weights on ``device`` in ``dtype``.

    Keys: ``kv_weights`` (L, 2*nkv*hd, H), ``input_layernorm_weights`` (L, H),
    ``k_norm_weights`` (L, hd), ``folded_weight`` (L*2*nkv*hd, H) with rows ordered
    (layer, k|v, head, channel), and ``kv_biases`` (L, 2*nkv*hd) when the
    projections have a bias. Built once per (device, dtype) into the drafter's
    ``context_kv_buffers`` (as vLLM builds its buffers once after loading), which the
    drafter empties whenever its weights may change (``refresh_context_kv_buffers``).
    They are inference constants (no gradient flows through them): training uses the
    reference path.
    """
    attns = [layer.self_attn for layer in drafter.layers]
    norms = [layer.input_layernorm for layer in drafter.layers]
    key = (torch.device(device), dtype)
    if key in drafter.context_kv_buffers:
        return drafter.context_kv_buffers[key]
    with torch.no_grad():
        q = attns[0].q_size
        kv_w = torch.stack([a.qkv_proj.weight[q:] for a in attns])  # (L, 2*nkv*hd, H)
        ln_w = torch.stack([n.weight for n in norms])  # (L, H)
        bufs = {
            "kv_weights": kv_w.to(device, dtype).contiguous(),
            "input_layernorm_weights": ln_w.to(device, dtype).contiguous(),
            "k_norm_weights": torch.stack([a.k_norm.weight for a in attns]).to(device, dtype).contiguous(),  # (L, hd)
            # fold in float32, round once
            "folded_weight": (kv_w.float() * ln_w.float()[:, None, :]).flatten(0, 1).to(device, dtype).contiguous(),
        }
        if attns[0].qkv_proj.bias is not None:
            bufs["kv_biases"] = torch.stack([a.qkv_proj.bias[q:] for a in attns]).to(device, dtype)  # (L, 2*nkv*hd)
    drafter.context_kv_buffers[key] = bufs
    return bufs


# ---------------------------------------------------------------------------
# The three paths: (drafter, context (N, H), positions (N,)) -> K, V each (L, N, nkv, hd)
# ---------------------------------------------------------------------------


def context_kv_reference(drafter, context: torch.Tensor, positions: torch.Tensor):
    cos, sin = rope_tables(drafter.config, positions, context.dtype)
    ks, vs = [], []
    for layer in drafter.layers:
        k, v = layer.self_attn.project_kv(layer.input_layernorm(context), cos, sin)  # (N, nkv, hd) each
        ks.append(k)
        vs.append(v)
    return torch.stack(ks), torch.stack(vs)  # (L, N, nkv, hd)


def context_kv_batched(drafter, context: torch.Tensor, positions: torch.Tensor):
    cfg, L, N = drafter.config, len(drafter.layers), context.shape[0]
    bufs = build_context_kv_buffers(drafter, context.device, context.dtype)
    normed = rms_normalize(context, cfg.rms_norm_eps).unsqueeze(0)  # (1, N, H)
    normed = bufs["input_layernorm_weights"][:, None, :] * normed  # (L, N, H)
    kv = torch.bmm(normed, bufs["kv_weights"].transpose(1, 2))  # (L, N, 2*nkv*hd)
    if "kv_biases" in bufs:
        kv = kv + bufs["kv_biases"][:, None, :]
    kv = kv.view(L, N, 2, cfg.num_key_value_heads, cfg.head_dim)
    k, v = kv.permute(2, 0, 1, 3, 4).contiguous()  # (L, N, nkv, hd)
    k = bufs["k_norm_weights"][:, None, None, :] * rms_normalize(k, cfg.rms_norm_eps)
    cos, sin = rope_tables(drafter.config, positions, context.dtype)
    return apply_rope(k, cos, sin), v


def context_kv_folded(drafter, context: torch.Tensor, positions: torch.Tensor, *,
                      fused: bool | None = None):
    """fused: None = the fused Triton epilogue where it can run (see kernels.fused_available),
    False = torch ops, True = insist on the kernel."""
    cfg, L, N = drafter.config, len(drafter.layers), context.shape[0]
    bufs = build_context_kv_buffers(drafter, context.device, context.dtype)
    if kernels.fused_available(context, fused):
        # 1/rms of each row, ONE GEMM on the raw context, ONE epilogue kernel (row scale,
        # K-norm, RoPE, K/V split): RMSNorm is a row scale, and row scales commute with GEMMs.
        return kernels.folded_context_kv(context, bufs["folded_weight"], bufs["k_norm_weights"], positions, cfg,
                                         bias=bufs.get("kv_biases"))
    kv = rms_normalize(context, cfg.rms_norm_eps) @ bufs["folded_weight"].T  # ONE GEMM: (N, L*2*nkv*hd)
    if "kv_biases" in bufs:
        kv = kv + bufs["kv_biases"].flatten()
    kv = kv.view(N, L, 2, cfg.num_key_value_heads, cfg.head_dim)
    cos, sin = rope_tables(drafter.config, positions, context.dtype)
    k = bufs["k_norm_weights"][:, None, None, :] * rms_normalize(kv[:, :, 0].transpose(0, 1), cfg.rms_norm_eps)
    return apply_rope(k, cos, sin).contiguous(), kv[:, :, 1].transpose(0, 1).contiguous()  # (L, N, nkv, hd)


def compute_context_kv(drafter, context: torch.Tensor, positions: torch.Tensor,
                       path: str = "folded", *, fused: bool | None = None):
    """K, V (L, N, nkv, hd) by ``path`` (one of CONTEXT_KV_PATHS); ``fused`` applies to the folded path only."""
    if path not in CONTEXT_KV_PATHS:
        raise ValueError(f"path must be one of {CONTEXT_KV_PATHS}, got {path!r}")
    if path == "folded":
        return context_kv_folded(drafter, context, positions, fused=fused)
    if fused:
        raise ValueError(f"fused=True applies to the folded path only, got path={path!r}")
    return {"reference": context_kv_reference, "batched": context_kv_batched}[path](drafter, context, positions)
