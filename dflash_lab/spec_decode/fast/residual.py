"""A layer's residual adds with the RMSNorm that follows each, one kernel apiece (vLLM's fused_add_rms_norm).

A Laguna decoder layer adds twice to its residual stream h, and each add is followed by a norm:

    h = h + attention(x)            x = post_attention_layernorm(h)
    h = h + mlp(x)                  x = next layer's input_layernorm(h)   (the final norm after the last)

and a sparse layer's mlp(x) is itself a small sum: routed = sum over the k chosen experts of their
weighted outputs, then routed * routed_scaling_factor + shared. In torch that tail is a reduce, a scale,
two adds and a norm of about 7 kernels: at Laguna-XS.2's shape a decode token runs it 40 times, and
every kernel costs a few microseconds however little it reads. Here each tail is one kernel:

    add_norm(h, delta, norm)                        -> (h + delta, norm(h + delta))
    experts_add_norm(h, expert_out, scale, shared, norm)
        expert_out (N, k, H): the k weighted expert outputs of each token, not yet summed
                                                    -> (h', norm(h')), h' = h + (sum_k expert_out * scale + shared)
    producer_tail(h, norm, scale, k)                the same tail for one row, run inside the GEMV launch that
                                                    writes the delta (``IN_PRODUCER``): no launch of its own
    consumer_prologue(h, delta, norm)               add_norm's for one row, computed by every program of the GEMV
                                                    launch that reads x' (``IN_CONSUMER``): no launch of its own

Numerics follow torch's sequence: the sum over k in float32 rounded once to the dtype (as torch's reduce
does), each later product and add rounded to the dtype, the norm as ``triton_ops.rms_norm``. Where the
kernels do not run (``triton_ops.enabled``), the same ops run in torch.
"""

from __future__ import annotations

import torch

from . import pdl, triton_ops

try:  # Triton is a GPU-side extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None


if triton is not None:

    @triton.jit
    def _tail(h_ptr, d_ptr, s_ptr, w_ptr, h_out_ptr, x_out_ptr, n, D, stride_h, stride_d, stride_s, scale, eps,
              K: tl.constexpr, BLOCK_D: tl.constexpr):
        """Row n's tail. K == 0: delta = d[n]; K >= 1: delta = round(round(round(sum_k d[n, k]) * scale) + s[n]).
        d and s are read past L1 (``.cg``): in a producer's last program other programs wrote them."""
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        dt = h_out_ptr.dtype.element_ty
        if K == 0:
            delta = tl.load(d_ptr + n * stride_d + cols, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        else:
            acc = tl.zeros((BLOCK_D,), tl.float32)
            for k in tl.static_range(K):
                acc += tl.load(d_ptr + (n * K + k) * stride_d + cols, mask=m, other=0.0,
                               cache_modifier=".cg").to(tl.float32)
            routed = (acc.to(dt).to(tl.float32) * scale).to(dt).to(tl.float32)
            shared = tl.load(s_ptr + n * stride_s + cols, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
            delta = (routed + shared).to(dt).to(tl.float32)
        h = (tl.load(h_ptr + n * stride_h + cols, mask=m, other=0.0).to(tl.float32) + delta).to(dt)
        tl.store(h_out_ptr + n * D + cols, h, mask=m)
        hf = h.to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(hf * hf, axis=0) / D + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(x_out_ptr + n * D + cols, (w * (hf * rstd).to(dt).to(tl.float32)).to(dt), mask=m)

    @triton.jit
    def _residual_norm_kernel(h_ptr, d_ptr, s_ptr, w_ptr, h_out_ptr, x_out_ptr, D, stride_h, stride_d, stride_s,
                              scale, eps, K: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        _tail(h_ptr, d_ptr, s_ptr, w_ptr, h_out_ptr, x_out_ptr, tl.program_id(0).to(tl.int64), D, stride_h,
              stride_d, stride_s, scale, eps, K, BLOCK_D)


# Warps of the tail kernel (one program a row); None: 4 up to a 2048-wide row, else 8. ``scripts/moe_tiles.py
# --dense`` times the choices at Laguna-XS.2's shape.
WARPS: int | None = None


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    t = t.reshape(-1, D)
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(h, d, shared, scale: float, norm, k: int):
    shape, D = h.shape, h.shape[-1]
    h2, d2 = _rows(h, D), _rows(d, D)
    s2 = _rows(shared, D) if shared is not None else h2
    n = h2.shape[0]
    h_out = torch.empty((n, D), device=h.device, dtype=h.dtype)
    x_out = torch.empty_like(h_out)
    if n:
        _residual_norm_kernel[(n,)](h2, d2, s2, norm.weight, h_out, x_out, D, h2.stride(0), d2.stride(0),
                                    s2.stride(0), float(scale), triton_ops.norm_eps(norm), K=k,
                                    BLOCK_D=triton.next_power_of_2(D), num_warps=WARPS or (4 if D <= 2048 else 8),
                                    **pdl.launch(h))
    return h_out.view(shape), x_out.view(shape)


# Whether a one-row GEMV launch that produces a tail's delta runs the tail too (``producer_tail``): its last
# program to finish adds and norms, so the tail is no launch of its own. Benchmarks time both; off, as on an H100
# it made XS.2's token slower (3.270 against 3.180 ms, benchmarks/gemv_shape_tiles_h100.md).
IN_PRODUCER = False


def producer_tail(h: torch.Tensor, norm, scale: float = 1.0, k: int = 0):
    """For a one-row GEMV launch (``gemv.pair_gemv(tail=...)``) that writes the delta of h's tail: (the launch's
    keywords, h', x') where it can run it (``IN_PRODUCER``, the kernels run, one row, a counter at hand), else
    None. k == 0: the launch's row 0 is the delta (``add_norm``); k >= 1: its rows 0..k-1 are the k expert
    outputs and row k the shared expert's (``experts_add_norm``)."""
    if not (IN_PRODUCER and triton_ops.enabled(h)) or h.numel() != h.shape[-1] or h.stride(-1) != 1:
        return None
    counter = pdl.counters(h.device, 1, "residual tail")
    if counter is None:  # first asked for while a graph is captured: this capture keeps the tail kernel
        return None
    D = h.shape[-1]
    h_out, x_out = (torch.empty(h.shape, device=h.device, dtype=h.dtype) for _ in range(2))
    kw = dict(tail_h_ptr=h, tail_w_ptr=norm.weight, tail_h_out_ptr=h_out, tail_x_out_ptr=x_out, count_ptr=counter,
              tail_scale=float(scale), tail_eps=triton_ops.norm_eps(norm), TAIL=True, TAIL_K=k,
              TAIL_D=triton.next_power_of_2(D))
    return kw, h_out, x_out


# Whether an add's norm is computed by the one-row GEMV launch that reads it (``consumer_prologue``,
# ``gemv.add_norm_linear``): every program of the next product computes norm(h + delta) itself where it would
# load its input row, so the tail is no launch of its own and no program waits on another. Benchmarks time both;
# on an H100 a Laguna-XS.2 token took 3.105 ms with it against 3.146 without (benchmarks/xs2_switches_h100.md).
IN_CONSUMER = True


def consumer_prologue(h: torch.Tensor, delta: torch.Tensor, norm):
    """For a one-row GEMV launch whose input row is norm(h + delta) (``add_norm``'s x'): (the launch's keywords,
    h', x') where it can compute that itself (``IN_CONSUMER``, the kernels run, one contiguous row each), else
    None. Program (0, 0) of the launch writes h' and x' for the launches after it."""
    if not (IN_CONSUMER and triton_ops.enabled(h)) or delta.shape != h.shape or h.numel() != h.shape[-1]:
        return None
    if h.stride(-1) != 1 or delta.stride(-1) != 1:
        return None
    D = h.shape[-1]
    h_out, x_out = (torch.empty(h.shape, device=h.device, dtype=h.dtype) for _ in range(2))
    kw = dict(pro_h_ptr=h, pro_d_ptr=delta, pro_w_ptr=norm.weight, pro_h_out_ptr=h_out, pro_x_out_ptr=x_out,
              pro_eps=triton_ops.norm_eps(norm), PRO=True, PRO_D=triton.next_power_of_2(D))
    return kw, h_out, x_out


def add_norm(h: torch.Tensor, delta: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, norm(h + delta)) for h, delta (..., H) and an RMSNorm module: one kernel where it runs."""
    if delta.shape != h.shape:
        raise ValueError(f"add_norm: delta {tuple(delta.shape)} is not the residual's shape {tuple(h.shape)}")
    if not triton_ops.enabled(h):
        h = h + delta
        return h, triton_ops.norm(norm, h)
    return _launch(h, delta, None, 1.0, norm, 0)


def experts_add_norm(h: torch.Tensor, expert_out: torch.Tensor, scale: float, shared: torch.Tensor,
                     norm) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse layer's tail: h (..., H), expert_out (N, k, H) with N = h's rows (the k weighted outputs of each
    token's chosen experts), shared (..., H) -> (h', norm(h')), h' = h + (sum_k expert_out * scale + shared)."""
    D = h.shape[-1]
    N = h.numel() // D if D else 0
    if expert_out.dim() != 3 or expert_out.shape[0] != N or expert_out.shape[2] != D or shared.shape != h.shape:
        raise ValueError(f"experts_add_norm: expert_out {tuple(expert_out.shape)} must be (N={N}, k, {D}) and "
                         f"shared {tuple(shared.shape)} the residual's shape {tuple(h.shape)}")
    if not triton_ops.enabled(h) or not expert_out.is_contiguous():
        delta = expert_out.sum(dim=1).view(h.shape) * scale + shared
        return add_norm(h, delta, norm)
    return _launch(h, expert_out.reshape(-1, D), shared, scale, norm, expert_out.shape[1])
