"""GPU kernels for the folded context-K/V path.

The folded path (``context_kv.context_kv_folded``) is one GEMM of the context with
every layer's K/V rows, input-layernorm weights folded in. Its output,
viewed (N, L, 2, nkv, hd), still needs three things per layer before it is the
drafter's context K/V: the K RMSNorm, the (partial) RoPE, and the move from
token-major (N, L, ...) to layer-major (L, N, nkv, hd). In torch that is
several passes over the biggest tensor of the step; here it is ONE kernel
that reads the GEMM output once and writes K and V once:

    row_rstd          1/rms of every context row (one read of the [N, H] context)
    knorm_rope_split  GEMM output -> K (K-norm + RoPE) and V, layer-major

RMSNorm is a per-row scale, and a per-row scale commutes with a matrix product:
rms_norm(x) @ W^T == diag(1/rms(x)) (x @ W^T). So the GPU path runs the GEMM
on the raw context and applies 1/rms in the epilogue, where it costs nothing.

Numerics follow Laguna's modules exactly: the K-norm normalises in float32,
casts to the input dtype, then multiplies by the weight; RoPE runs in the input
dtype with cos/sin computed in float32 from the positions (as
``layers.rope_cos_sin`` does) and rounded to it. On an H200 the epilogue moves
about 4.0 TB/s (benchmarks/context_kv.md).

Whether the kernel runs is decided per call, by the ``fused`` argument of
``precompute_context_kv`` (and ``fused_available``): None runs it on CUDA
tensors with Triton installed unless ``DFLASH_LAB_FUSED=0`` is in the
environment; False never runs it; True insists on it. Under
``TRITON_INTERPRET=1`` an explicit ``fused=True`` also runs it on CPU tensors
(slowly): that is how CI checks the kernel without a GPU.
"""

from __future__ import annotations

import os

import torch

from .layers import rope_inv_freq

try:  # Triton is a GPU-side extra: the package works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

ENV_SWITCH = "DFLASH_LAB_FUSED"


# ---------------------------------------------------------------------------
# Whether the kernel runs: per call, no process-wide state
# ---------------------------------------------------------------------------


def fused_enabled() -> bool:
    """What ``fused=None`` means: $DFLASH_LAB_FUSED (unset: on; 0/false/no/off: off)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def interpreting() -> bool:
    """True when this module's kernels run in Triton's CPU interpreter.

    That is decided when the module is imported: TRITON_INTERPRET=1 must be set before.
    """
    return triton is not None and type(_knorm_rope_split_kernel).__name__ == "InterpretedFunction"


def runs_here(x: torch.Tensor) -> bool:
    """Whether the lab's Triton kernels serve tensor ``x`` under the switch: Triton installed, $DFLASH_LAB_FUSED
    on, and ``x`` on CUDA (or on the CPU inside Triton's interpreter). The static path's kernels ask this."""
    return triton is not None and fused_enabled() and (x.is_cuda or interpreting())


def fused_available(t: torch.Tensor | None = None, fused: bool | None = None) -> bool:
    """Whether the fused Triton epilogue should run on tensor ``t``.

    ``fused``: None follows $DFLASH_LAB_FUSED (default on; CUDA only); False never;
    True insists, and raises if the kernel cannot run here.
    """
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused must be True, False or None, got {fused!r}")
    if fused is False or (fused is None and not fused_enabled()):
        return False
    device = t.device.type if t is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    runnable = triton is not None and (device == "cuda" or (fused is True and device == "cpu" and interpreting()))
    if fused is True and not runnable:
        why = "Triton is not installed" if triton is None else (
            f"tensors are on {device}; the kernel needs CUDA (or TRITON_INTERPRET=1 for CPU tensors)")
        raise RuntimeError(f"fused=True but the fused context-K/V kernel cannot run: {why}")
    return runnable


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _row_rstd_kernel(x_ptr, out_ptr, N, H, stride_n, eps,
                         BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        base = x_ptr + rows.to(tl.int64)[:, None] * stride_n
        acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            x = tl.load(base + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < H), other=0.0)
            x = x.to(tl.float32)
            acc += x * x
        ms = tl.sum(acc, axis=1) / H
        tl.store(out_ptr + rows, 1.0 / tl.sqrt_rn(ms + eps), mask=rows < N)

    @triton.jit
    def _rounded(x, dt: tl.constexpr, EMULATE_BF16: tl.constexpr):
        """float32 x rounded to dtype dt (to nearest even), kept in float32."""
        if EMULATE_BF16:  # the CPU interpreter truncates float32 -> bf16; round by hand
            bits = x.to(tl.uint32, bitcast=True)
            bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dt).to(tl.float32)

    @triton.jit
    def _knorm_rope_split_kernel(
        kv_ptr,  # (N, L, 2, nkv, hd): the GEMM output; rows N apart by stride_n
        k_ptr, v_ptr,  # (L, N, nkv, hd) each, contiguous
        w_ptr,  # (L, hd) K-norm weights
        pos_ptr,  # (N,) integer positions
        inv_freq_ptr,  # (ROT // 2,) float32 RoPE frequencies
        scale_ptr,  # (N,) float32 row scale (1/rms of the context), if HAS_SCALE
        bias_ptr,  # (L, 2, nkv, hd) K/V bias, if HAS_BIAS
        N, L, stride_n, eps,
        NKV: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
        BLOCK_D: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, EMULATE_BF16: tl.constexpr,
    ):
        # One program = BLOCK_N tokens x all heads x every layer: it reads one
        # contiguous slab of GEMM rows, and computes the tokens' cos/sin once for all
        # layers. Each head's channels are handled as three pieces so that
        # rotate_half is plain elementwise math: x1 = [0, ROT/2), x2 = [ROT/2, ROT),
        # x3 = [ROT, hd) passes through unrotated.
        HALF: tl.constexpr = ROT // 2
        PASS: tl.constexpr = HD - ROT
        dt = k_ptr.dtype.element_ty
        tok = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
        t3 = tok[:, None, None]  # (BN, 1, 1)
        h3 = tl.arange(0, BLOCK_H)[None, :, None]  # (1, BH, 1)
        c1 = tl.arange(0, BLOCK_HALF)[None, None, :]  # (1, 1, BHALF): channel in a rotary half
        c3 = tl.arange(0, BLOCK_PASS)[None, None, :]  # (1, 1, BPASS): channel past the rotary part
        cd = tl.arange(0, BLOCK_D)[None, None, :]  # (1, 1, BD): any channel (V)
        rows = (t3 < N) & (h3 < NKV)
        m1, m3, md = rows & (c1 < HALF), rows & (c3 < PASS), rows & (cd < HD)

        # cos/sin in float32 from the positions (as rope_cos_sin), rounded to the input dtype
        pos = tl.load(pos_ptr + t3, mask=t3 < N, other=0).to(tl.float32)  # (BN, 1, 1)
        angle = pos * tl.load(inv_freq_ptr + c1, mask=c1 < HALF, other=0.0)  # (BN, 1, BHALF)
        cos = _rounded(tl.cos(angle), dt, EMULATE_BF16)
        sin = _rounded(tl.sin(angle), dt, EMULATE_BF16)
        if HAS_SCALE:
            s = tl.load(scale_ptr + t3, mask=t3 < N, other=0.0)  # the input RMSNorm, moved behind the GEMM

        for layer in range(L):
            src = kv_ptr + t3.to(tl.int64) * stride_n + layer * (2 * NKV * HD) + h3 * HD  # K of (token, layer, head)
            dst = (layer * N + t3).to(tl.int64) * (NKV * HD) + h3 * HD  # (layer, token, head) of K and V
            bias = bias_ptr + layer * (2 * NKV * HD) + h3 * HD

            # --- the one read: V and K as projected (row scale, bias), all loads issued first
            v = tl.load(src + NKV * HD + cd, mask=md, other=0.0).to(tl.float32)
            x1 = tl.load(src + c1, mask=m1, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + c1, mask=m1, other=0.0).to(tl.float32)
            x3 = tl.load(src + ROT + c3, mask=m3, other=0.0).to(tl.float32)
            if HAS_SCALE:
                v, x1, x2, x3 = v * s, x1 * s, x2 * s, x3 * s
            if HAS_BIAS:
                v += tl.load(bias + NKV * HD + cd, mask=md, other=0.0).to(tl.float32)
                x1 += tl.load(bias + c1, mask=m1, other=0.0).to(tl.float32)
                x2 += tl.load(bias + HALF + c1, mask=m1, other=0.0).to(tl.float32)
                x3 += tl.load(bias + ROT + c3, mask=m3, other=0.0).to(tl.float32)
            tl.store(v_ptr + dst + cd, _rounded(v, dt, EMULATE_BF16).to(dt), mask=md)
            # (K stays in float32 here: rounding the scaled GEMM output again would add a
            # second rounding that the reference, which normalises before its GEMM, does not have.)

            # --- K RMSNorm (Laguna: normalise in float32, cast, then scale by the weight)
            ss = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2) + tl.sum(x3 * x3, axis=2)  # (BN, BH)
            rinv = (1.0 / tl.sqrt_rn(ss / HD + eps))[:, :, None]  # (BN, BH, 1)
            w = w_ptr + layer * HD
            w1 = tl.load(w + c1, mask=c1 < HALF, other=0.0).to(tl.float32)
            w2 = tl.load(w + HALF + c1, mask=c1 < HALF, other=0.0).to(tl.float32)
            w3 = tl.load(w + ROT + c3, mask=c3 < PASS, other=0.0).to(tl.float32)
            k1 = _rounded(w1 * _rounded(x1 * rinv, dt, EMULATE_BF16), dt, EMULATE_BF16)
            k2 = _rounded(w2 * _rounded(x2 * rinv, dt, EMULATE_BF16), dt, EMULATE_BF16)
            k3 = _rounded(w3 * _rounded(x3 * rinv, dt, EMULATE_BF16), dt, EMULATE_BF16)

            # --- RoPE (neox rotate_half) in the input dtype: [x1, x2] -> [x1 c - x2 s, x2 c + x1 s]
            o1 = _rounded(_rounded(k1 * cos, dt, EMULATE_BF16) + _rounded(-k2 * sin, dt, EMULATE_BF16),
                          dt, EMULATE_BF16)
            o2 = _rounded(_rounded(k2 * cos, dt, EMULATE_BF16) + _rounded(k1 * sin, dt, EMULATE_BF16),
                          dt, EMULATE_BF16)
            tl.store(k_ptr + dst + c1, o1.to(dt), mask=m1)
            tl.store(k_ptr + dst + HALF + c1, o2.to(dt), mask=m1)
            tl.store(k_ptr + dst + ROT + c3, k3.to(dt), mask=m3)


def _launch_config(n_heads: int, head_dim: int) -> tuple[int, int]:
    """(tokens per program, warps): ~2k elements of K (and of V) per layer step.

    Small programs keep registers low (64 a thread at Laguna-XS.2 shapes on sm_90),
    so ~8 programs share a multiprocessor and keep enough loads in flight.
    """
    per_token = triton.next_power_of_2(n_heads) * triton.next_power_of_2(head_dim)
    return max(1, min(64, 2048 // per_token)), 4


# ---------------------------------------------------------------------------
# Host wrappers
# ---------------------------------------------------------------------------


def row_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / rms(x) over the last dim, float32, (N,): the input RMSNorm as a row scale."""
    if x.dim() != 2:
        raise ValueError(f"row_rstd takes an (N, H) tensor, got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    n, h = x.shape
    out = torch.empty(n, device=x.device, dtype=torch.float32)
    if n:
        block_r = 4
        _row_rstd_kernel[(triton.cdiv(n, block_r),)](
            x, out, n, h, x.stride(0), eps, BLOCK_R=block_r, BLOCK_H=min(1024, triton.next_power_of_2(h)), num_warps=4)
    return out


def knorm_rope_split(kv: torch.Tensor, k_norm_weights: torch.Tensor, positions: torch.Tensor, cfg, *,
                     row_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None):
    """Finish the folded GEMM in one pass: K-norm + RoPE on K, split, layer-major.

    kv: (N, L, 2, nkv, hd) view of the GEMM output (rows may be strided; each
    row contiguous). k_norm_weights: (L, hd). positions: (N,).
    row_scale: optional (N,) float32 multiplier of every row (the context's 1/rms).
    bias: optional (L, 2*nkv*hd) K/V bias, added after the row scale.
    Returns K, V, each (L, N, nkv, hd) contiguous in kv's dtype.
    """
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError(f"kv must be (N, L, 2, nkv, hd), got shape {tuple(kv.shape)}")
    n, n_layers, _, nkv, hd = kv.shape
    if (kv.stride(4), kv.stride(3), kv.stride(2), kv.stride(1)) != (1, hd, nkv * hd, 2 * nkv * hd):
        raise ValueError(f"each row of kv must be contiguous (N, L*2*nkv*hd); got strides {kv.stride()}")
    if k_norm_weights.shape != (n_layers, hd):
        raise ValueError(f"k_norm_weights must be ({n_layers}, {hd}), got {tuple(k_norm_weights.shape)}")
    if positions.shape != (n,):
        raise ValueError(f"positions must be ({n},), got {tuple(positions.shape)}")
    rot = cfg.rotary_dim
    if rot % 2 or not 0 < rot <= hd:
        raise ValueError(f"rotary_dim {rot} must be even and in (0, head_dim={hd}]")
    k = torch.empty((n_layers, n, nkv, hd), device=kv.device, dtype=kv.dtype)
    v = torch.empty_like(k)
    if n == 0:
        return k, v
    device = kv.device
    inv_freq = rope_inv_freq(rot, float(cfg.rope.get("rope_theta", 10000.0)), device)  # cached, as rope_cos_sin's
    w = k_norm_weights.to(device=device).contiguous()
    pos = positions.to(device=device).contiguous()
    scale = row_scale.to(device=device, dtype=torch.float32).contiguous() if row_scale is not None else inv_freq
    b = bias.to(device=device).contiguous() if bias is not None else w
    block_n, warps = _launch_config(nkv, hd)
    grid = (triton.cdiv(n, block_n),)
    _knorm_rope_split_kernel[grid](
        kv, k, v, w, pos, inv_freq, scale, b,
        n, n_layers, kv.stride(0), float(cfg.rms_norm_eps),
        NKV=nkv, HD=hd, ROT=rot,
        BLOCK_N=block_n, BLOCK_H=triton.next_power_of_2(nkv), BLOCK_HALF=triton.next_power_of_2(rot // 2),
        BLOCK_PASS=triton.next_power_of_2(max(hd - rot, 1)), BLOCK_D=triton.next_power_of_2(hd),
        HAS_SCALE=row_scale is not None, HAS_BIAS=bias is not None,
        EMULATE_BF16=interpreting() and kv.dtype == torch.bfloat16, num_warps=warps,
    )
    return k, v


def folded_context_kv(context: torch.Tensor, folded_weight: torch.Tensor, k_norm_weights: torch.Tensor,
                      positions: torch.Tensor, cfg, bias: torch.Tensor | None = None):
    """The whole fused folded path: row 1/rms, ONE GEMM on the raw context, one epilogue.

    context (N, H); folded_weight (L*2*nkv*hd, H). Returns K, V (L, N, nkv, hd).
    """
    n = context.shape[0]
    n_layers, hd = k_norm_weights.shape
    rstd = row_rstd(context, cfg.rms_norm_eps)  # (N,) float32
    kv = context @ folded_weight.T  # (N, L*2*nkv*hd)
    return knorm_rope_split(kv.view(n, n_layers, 2, cfg.num_key_value_heads, hd), k_norm_weights, positions, cfg,
                            row_scale=rstd, bias=bias)


def epilogue_bytes(n: int, n_layers: int, nkv: int, hd: int, dtype: torch.dtype) -> int:
    """Fewest bytes the epilogue must move: read the GEMM output once, write K and V once."""
    return 2 * n * n_layers * 2 * nkv * hd * torch.finfo(dtype).bits // 8


__all__ = [
    "ENV_SWITCH", "fused_enabled", "fused_available", "interpreting", "runs_here",
    "row_rstd", "knorm_rope_split", "folded_context_kv", "epilogue_bytes",
]
