"""Laguna's q/k head norm followed by RoPE on a tile of heads, as Triton functions the kernels share.

    norm_rope_tile(src, w, cos, sin, ok, cs, eps, dt, ...)   per-head RMSNorm, then rotate_half RoPE, of the
                                                            (T, 1) heads at ``src`` -> three channel pieces
    store_tile(dst, pieces)                                 the pieces written at (T, 1) pointers ``dst``

``triton_ops``' norm + RoPE kernels run them over a projection's heads; the attention kernel runs them on its
own query rows and on the step's new keys when it takes RoPE in (``attention.rope_attention``), so both routes
round every value the same way.
"""

from __future__ import annotations

try:  # Triton is a GPU-side extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def norm_rope_tile(src, w_ptr, cos_ptr, sin_ptr, ok, cs, eps, dt,
                       HD: tl.constexpr, ROT: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr):
        """T heads (src: (T, 1) pointers to each head; ok (T, 1) the ones to compute): per-head RMSNorm, then
        rotate_half RoPE with cos/sin at row offsets cs (T, 1), in three channel pieces so that rotate_half is
        elementwise: [0, ROT/2), [ROT/2, ROT), [ROT, HD) (not rotated). Returns the pieces in dt and masks."""
        HALF: tl.constexpr = ROT // 2
        PASS: tl.constexpr = HD - ROT
        c1 = tl.arange(0, BLOCK_HALF)[None, :]
        c3 = tl.arange(0, BLOCK_PASS)[None, :]
        m1 = ok & (c1 < HALF)
        m3 = ok & (c3 < PASS)
        x1 = tl.load(src + c1, mask=m1, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + c1, mask=m1, other=0.0).to(tl.float32)
        x3 = tl.load(src + ROT + c3, mask=m3, other=0.0).to(tl.float32)
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x3 * x3, axis=1)
        rstd = (1.0 / tl.sqrt_rn(ss / HD + eps))[:, None]
        w1 = tl.load(w_ptr + c1, mask=c1 < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + c1, mask=c1 < HALF, other=0.0).to(tl.float32)
        w3 = tl.load(w_ptr + ROT + c3, mask=c3 < PASS, other=0.0).to(tl.float32)
        y1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        y3 = (w3 * (x3 * rstd).to(dt).to(tl.float32)).to(dt)
        cos1 = tl.load(cos_ptr + cs + c1, mask=m1, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + cs + HALF + c1, mask=m1, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + cs + c1, mask=m1, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + cs + HALF + c1, mask=m1, other=0.0).to(tl.float32)
        # x_rot * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype
        o1 = ((y1 * cos1).to(dt).to(tl.float32) + (-y2 * sin1).to(dt).to(tl.float32)).to(dt)
        o2 = ((y2 * cos2).to(dt).to(tl.float32) + (y1 * sin2).to(dt).to(tl.float32)).to(dt)
        return o1, o2, y3, c1, c3, m1, m3

    @triton.jit
    def store_tile(dst, o1, o2, y3, c1, c3, m1, m3, ROT: tl.constexpr):
        """``norm_rope_tile``'s pieces written at their channels from dst (T, 1) pointers."""
        tl.store(dst + c1, o1, mask=m1)
        tl.store(dst + ROT // 2 + c1, o2, mask=m1)
        tl.store(dst + ROT + c3, y3, mask=m3)
