"""Two fused kernels for the static decode path: RMSNorm, and per-head RMSNorm + RoPE.

In a CUDA graph the cost of a decode step of the shipped pair is the number of
kernels, not their arithmetic. Laguna's RMSNorm in torch is ~7 kernels (upcast,
square, mean, add, rsqrt, multiply, downcast, weight), and the q/k head norms
followed by partial RoPE ~26 per attention layer. Each becomes one kernel here:

    rms_norm(x, weight, eps)                   weight * round(x * rsqrt(mean(x^2) + eps))
    silu_mul(gate_up)                          round(silu(gate)) * up, the MLPs' activation (``act_mul``)
    write_kv(cache_k, cache_v, k, v, positions) a step's K and V into their cache slots, one launch
    head_norm_rope(q, k, wq, wk, cos, sin, eps) q/k head norms, then rotate_half RoPE on the
                                                first rotary_dim channels, both in one launch

Numerics follow the modules: statistics in float32, the normalised value rounded
to the input dtype before the weight, RoPE's products and sum each rounded to the
input dtype. The sum inside the mean runs in another order than torch's, so
results agree to rounding (float32: ~1e-7 relative), not bit for bit.

``linears`` (several projections of one input as one GEMM over weights concatenated once,
``layers.stacked_linears``) runs on every device; the kernels above only where ``enabled(x)``:
CUDA tensors with Triton installed, unless DFLASH_LAB_FUSED=0
(the switch ``dflash_lab.context_kv_kernel`` reads). Elsewhere ``norm`` / ``norm_rope`` fall back to
``layers.TorchOps``: this module can be passed as ``ops=`` wherever TorchOps can. It also hands the
drafter the attention kernel (``attention_usable``, ``slot_attention``): a drafter given these ops over
``SlotKV`` attends in one kernel a layer where it runs; TorchOps has neither, so the masks are used.
"""

from __future__ import annotations

import torch

from ...layers import TorchOps, stacked_linears
from ... import context_kv_kernel as kernels
from . import pdl
from .rope_tile import norm_rope_tile, store_tile
from .attention import slot_attention, usable as attention_usable  # noqa: F401 - the drafter reads them as ops.*

try:  # Triton is a GPU-side extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None


enabled = kernels.runs_here  # CUDA (or the interpreter), Triton installed, the fused switch on


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, D, stride_x, eps, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                         GROUPS: tl.constexpr = 1, PDL: tl.constexpr = False):
        # GROUPS > 1: row r is slice r % GROUPS of an input row, normed with weight row r % GROUPS (w: (GROUPS, D))
        pdl.enter(PDL)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]  # (R, 1)
        cols = tl.arange(0, BLOCK_D)[None, :]  # (1, D)
        mask = (rows < N) & (cols < D)
        x = tl.load(x_ptr + rows.to(tl.int64) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)  # (R,)
        dt = out_ptr.dtype.element_ty
        y = (x * rstd[:, None]).to(dt).to(tl.float32)  # normalised, rounded to the input dtype
        w = tl.load(w_ptr + (rows % GROUPS) * D + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows.to(tl.int64) * D + cols, (w * y).to(dt), mask=mask)

    @triton.jit
    def _head_norm_rope_kernel(
        x_ptr, out_ptr, w_ptr, cos_ptr, sin_ptr, N, stride_x, stride_cs, eps,
        HEADS: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl.enter(PDL)
        head = tl.program_id(1)  # one program = BLOCK_T tokens x one head
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # (T, 1)
        src = x_ptr + tok.to(tl.int64) * stride_x + head * HD
        o1, o2, y3, c1, c3, m1, m3 = norm_rope_tile(src, w_ptr, cos_ptr, sin_ptr, tok < N,
                                                     tok.to(tl.int64) * stride_cs, eps,
                                                     out_ptr.dtype.element_ty, HD, ROT, BLOCK_HALF, BLOCK_PASS)
        dst = out_ptr + (tok.to(tl.int64) * HEADS + head) * HD
        store_tile(dst, o1, o2, y3, c1, c3, m1, m3, ROT)

    @triton.jit
    def _qk_rope_write_kernel(
        x_ptr, q_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, rpos_ptr, slot_ptr, ck_ptr, cv_ptr, N, Q, stride_x,
        stride_cs, sc_b, sc_h, sc_s, eps, HQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, ROT: tl.constexpr,
        TABLE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
        BLOCK_D: tl.constexpr, PDL: tl.constexpr,
    ):
        pdl.enter(PDL)
        # x (N, HQ*HD | NKV*HD | NKV*HD | ...) rows of the q|k|v projection. Programs of head < HQ: q's norm and
        # RoPE into q (N, HQ, HD); the others: one KV head's k (norm, RoPE) and v, written to cache slots.
        # TABLE: cos/sin are tables over positions, read at each token's rope position; else one row a token.
        head = tl.program_id(1)
        tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # (T, 1)
        row = x_ptr + tok.to(tl.int64) * stride_x
        dt = q_ptr.dtype.element_ty
        if TABLE:
            cs = tl.load(rpos_ptr + tok, mask=tok < N, other=0).to(tl.int64) * stride_cs
        else:
            cs = tok.to(tl.int64) * stride_cs
        if head < HQ:
            o1, o2, y3, c1, c3, m1, m3 = norm_rope_tile(row + head * HD, wq_ptr, cos_ptr, sin_ptr, tok < N,
                                                         cs, eps, dt, HD, ROT, BLOCK_HALF, BLOCK_PASS)
            dst = q_ptr + (tok.to(tl.int64) * HQ + head) * HD
        else:
            h = head - HQ
            o1, o2, y3, c1, c3, m1, m3 = norm_rope_tile(row + (HQ + h) * HD, wk_ptr, cos_ptr, sin_ptr, tok < N,
                                                         cs, eps, dt, HD, ROT, BLOCK_HALF, BLOCK_PASS)
            slot = tl.load(slot_ptr + tok, mask=tok < N, other=0).to(tl.int64)
            at = (tok // Q).to(tl.int64) * sc_b + h * sc_h + slot * sc_s  # (T, 1) cache offsets
            d = tl.arange(0, BLOCK_D)[None, :]
            md = (tok < N) & (d < HD)
            tl.store(cv_ptr + at + d, tl.load(row + (HQ + NKV + h) * HD + d, mask=md), mask=md)
            dst = ck_ptr + at
        store_tile(dst, o1, o2, y3, c1, c3, m1, m3, ROT)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, I, stride_g, stride_u, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = col < I
        g = tl.load(g_ptr + row * stride_g + col, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + col, mask=m, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # silu, rounded to the dtype as torch's is
        tl.store(out_ptr + row * I + col, (a * u).to(dt), mask=m)


    @triton.jit
    def _write_kv_kernel(k_ptr, v_ptr, ck_ptr, cv_ptr, pos_ptr, rows_ptr, Q, NKV, sk_b, sk_q, sk_h, sv_b, sv_q,
                         sv_h, sc_b, sc_h, sc_s, ROWS: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr):
        pdl.enter(PDL)
        t = tl.program_id(0)  # token b * Q + j
        h = tl.program_id(1)
        b, j = t // Q, t % Q
        slot = tl.load(pos_ptr + t).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        m = d < HD
        row = tl.load(rows_ptr + b).to(tl.int64) if ROWS else b.to(tl.int64)
        dst = row * sc_b + h * sc_h + slot * sc_s + d
        tl.store(ck_ptr + dst, tl.load(k_ptr + b * sk_b + j * sk_q + h * sk_h + d, mask=m), mask=m)
        tl.store(cv_ptr + dst, tl.load(v_ptr + b * sv_b + j * sv_q + h * sv_h + d, mask=m), mask=m)


def write_kv(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             positions: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """cache_k/v (R, nkv, S, hd)[r_b, :, positions[b, j]] = k/v (B, Q, nkv, hd)[b, j], r_b = rows[b] (a prefill
    of some rows), else b: both in one kernel where ``enabled`` (k and v may be strided slices; the caches share
    their strides), else two scatters."""
    B, Q, nkv, hd = k.shape
    if not enabled(k) or k.stride(-1) != 1 or v.stride(-1) != 1 or cache_k.stride() != cache_v.stride():
        if rows is not None:  # the caches are state, never differentiated (as the kernel's writes are not)
            index = (rows[:, None, None], torch.arange(nkv, device=k.device)[None, :, None], positions[:, None, :])
            with torch.no_grad():
                cache_k.index_put_(index, k.transpose(1, 2))
                cache_v.index_put_(index, v.transpose(1, 2))
            return
        index = positions[:, None, :, None].expand(B, nkv, Q, hd)
        cache_k.scatter_(2, index, k.transpose(1, 2))
        cache_v.scatter_(2, index, v.transpose(1, 2))
        return
    pos = positions.contiguous()
    _write_kv_kernel[(B * Q, nkv)](k, v, cache_k, cache_v, pos, pos if rows is None else rows, Q, nkv, k.stride(0),
                                   k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), cache_k.stride(0),
                                   cache_k.stride(1), cache_k.stride(2), ROWS=rows is not None, HD=hd,
                                   BLOCK_D=triton.next_power_of_2(hd), **pdl.launch(k))


def silu_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up in one kernel where ``enabled`` (else torch): gate, up (..., I), rows may be strided; or
    gate (N, 2I) = [gate | up] alone -> (N, I) (the kernel only: ``act_mul`` asks ``enabled`` first)."""
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    if not enabled(gate):
        return torch.nn.functional.silu(gate) * up
    shape, I = gate.shape, gate.shape[-1]
    g2, u2 = gate.reshape(-1, I), up.reshape(-1, I)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    out = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    if g2.shape[0]:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(I, block))](g2, u2, out, I, g2.stride(0), u2.stride(0),
                                                               BLOCK=block, **pdl.launch(g2))
    return out.view(shape)


def add_norm(h: torch.Tensor, delta: torch.Tensor, module) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, module(h + delta)) in one kernel where ``enabled`` (``residual.add_norm``)."""
    from .residual import add_norm as one_kernel  # residual imports this module
    return one_kernel(h, delta, module)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Laguna's RMSNorm of x (..., D) in one kernel (rows may be strided; each row contiguous). weight (G, D):
    x (..., G * D) is G slices side by side, slice g normed with weight[g]."""
    shape, groups = x.shape, (weight.shape[0] if weight.dim() == 2 else 1)
    D = weight.shape[-1]
    if shape[-1] != groups * D:
        raise ValueError(f"rms_norm: x's last dimension {shape[-1]} is not {groups} x the weight's {D}")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    n = x2.shape[0]
    if n:
        block_r = 4 if D <= 1024 else 1
        _rms_norm_kernel[(triton.cdiv(n, block_r),)](x2, weight, out, n, D, x2.stride(0), float(eps),
                                                    BLOCK_R=block_r, BLOCK_D=triton.next_power_of_2(D), GROUPS=groups,
                                                    num_warps=4, **pdl.launch(x2))
    return out.view(shape)


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                   heads: int, head_dim: int) -> torch.Tensor:
    """x (..., heads * head_dim) (a slice of a projection: rows may be strided) -> (..., heads, head_dim):
    per-head RMSNorm with ``weight`` (head_dim,), then RoPE with cos/sin (..., rotary_dim) on the first
    rotary_dim channels (Laguna's q_norm/k_norm followed by apply_rope)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    cs, sn = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if cs.stride(-1) != 1 or sn.stride(-1) != 1 or cs.stride(0) != sn.stride(0):
        cs, sn = cs.contiguous(), sn.contiguous()
    n, rot = x2.shape[0], cs.shape[-1]
    out = torch.empty((n, heads, head_dim), device=x.device, dtype=x.dtype)
    if n:
        block_t = max(1, min(16, 2048 // triton.next_power_of_2(head_dim)))
        _head_norm_rope_kernel[(triton.cdiv(n, block_t), heads)](
            x2, out, weight, cs, sn, n, x2.stride(0), cs.stride(0), float(eps),
            HEADS=heads, HD=head_dim, ROT=rot, BLOCK_T=block_t, BLOCK_HALF=triton.next_power_of_2(rot // 2),
            BLOCK_PASS=triton.next_power_of_2(max(head_dim - rot, 1)), num_warps=4, **pdl.launch(x2))
    return out.view(*lead, heads, head_dim)


def qk_rope_write(qkv: torch.Tensor, q_norm, k_norm, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                  cache_k: torch.Tensor, cache_v: torch.Tensor, heads: int, kv_heads: int, head_dim: int,
                  rope_positions: torch.Tensor | None = None) -> torch.Tensor:
    """qkv (B, Q, >= (heads + 2 kv_heads) * head_dim), the q|k|v columns of one projection (rows may be strided)
    -> q (B, Q, heads, head_dim) after its head norm and RoPE; k (head norm, RoPE) and v go straight to their
    cache slots ``slots`` (B, Q) of cache_k/v (B, kv_heads, S, head_dim). cos/sin: (B, Q, rotary_dim), or
    tables (P, rotary_dim) over positions read at ``rope_positions`` (B, Q). One kernel where ``enabled``, else
    ``norm_rope`` twice and ``write_kv``: the same values either way."""
    B, Q, _ = qkv.shape
    qw, kw = heads * head_dim, kv_heads * head_dim
    table = rope_positions is not None
    if not enabled(qkv) or qkv.stride(-1) != 1 or cache_k.stride() != cache_v.stride() or cache_k.stride(-1) != 1:
        if table:
            cos, sin = cos[rope_positions], sin[rope_positions]
        q = norm_rope(q_norm, qkv[..., :qw], cos, sin, heads, head_dim)
        k = norm_rope(k_norm, qkv[..., qw:qw + kw], cos, sin, kv_heads, head_dim)
        write_kv(cache_k, cache_v, k, qkv[..., qw + kw:qw + 2 * kw].view(B, Q, kv_heads, head_dim), slots)
        return q
    x2 = qkv.reshape(B * Q, -1)
    cs, sn = (cos, sin) if table else (cos.reshape(B * Q, -1), sin.reshape(B * Q, -1))
    if cs.stride(-1) != 1 or sn.stride(-1) != 1 or cs.stride(0) != sn.stride(0):
        cs, sn = cs.contiguous(), sn.contiguous()
    n, rot = B * Q, cs.shape[-1]
    rpos = rope_positions.reshape(-1).contiguous() if table else slots
    eps = [norm_eps(m) for m in (q_norm, k_norm)]
    if eps[0] != eps[1]:
        raise ValueError(f"qk_rope_write: q and k head norms with different eps ({eps[0]}, {eps[1]})")
    q = torch.empty((B, Q, heads, head_dim), device=qkv.device, dtype=qkv.dtype)
    block_t = max(1, min(16, 2048 // triton.next_power_of_2(head_dim)))
    _qk_rope_write_kernel[(triton.cdiv(n, block_t), heads + kv_heads)](
        x2, q, q_norm.weight, k_norm.weight, cs, sn, rpos, slots.reshape(-1).contiguous(), cache_k, cache_v, n,
        Q, x2.stride(0), cs.stride(0), cache_k.stride(0), cache_k.stride(1), cache_k.stride(2), float(eps[0]),
        HQ=heads, NKV=kv_heads, HD=head_dim, ROT=rot, TABLE=table, BLOCK_T=block_t,
        BLOCK_HALF=triton.next_power_of_2(rot // 2), BLOCK_PASS=triton.next_power_of_2(max(head_dim - rot, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4, **pdl.launch(x2))
    return q


linears = stacked_linears  # several projections of one input in one GEMM (on every device)


def norm_eps(module) -> float:
    """An RMSNorm module's epsilon: transformers' Laguna names it variance_epsilon, the lab's eps."""
    return float(getattr(module, "variance_epsilon", None) or getattr(module, "eps"))


def norm(module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module (Laguna's or the lab's) applied to x: one kernel where ``enabled``, else the module."""
    if enabled(x):
        return rms_norm(x, module.weight, norm_eps(module))
    return TorchOps.norm(module, x)


def norms(modules, x: torch.Tensor, stacked: dict | None = None) -> torch.Tensor:
    """``TorchOps.norms`` (slice g of x (..., G * D) normed by modules[g]) in one kernel where ``enabled``, the
    weights stacked once into ``stacked`` under the contract of ``layers.stacked_linears`` (None: one by one)."""
    eps = {norm_eps(m) for m in modules}
    if stacked is None or not enabled(x) or len(eps) != 1:
        return TorchOps.norms(modules, x)
    key = ("norms", *modules, x.device, x.dtype)
    if key not in stacked:
        stacked[key] = torch.stack([m.weight.detach() for m in modules]).to(device=x.device, dtype=x.dtype)
    return rms_norm(x, stacked[key], eps.pop())


def norm_rope(module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """A head norm module then RoPE: one kernel where ``enabled``, else ``layers.TorchOps.norm_rope``."""
    if enabled(x):
        return head_norm_rope(x, module.weight, cos, sin, norm_eps(module), heads, head_dim)
    return TorchOps.norm_rope(module, x, cos, sin, heads, head_dim)


def is_silu(act) -> bool:
    """Whether ``act`` is plain SiLU: torch's module or function, or transformers' ``SiLUActivation`` (what
    ``ACT2FN["silu"]`` gives Laguna's MLPs: a module that calls F.silu, not an ``nn.SiLU``)."""
    return (act is torch.nn.functional.silu or isinstance(act, torch.nn.SiLU)
            or (type(act).__name__ == "SiLUActivation" and type(act).__module__.startswith("transformers.")))


def act_mul(act, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of gate_up (N, 2I) = [gate | up]: one kernel for SiLU where ``enabled``, else torch."""
    if enabled(gate_up) and is_silu(act):
        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up
