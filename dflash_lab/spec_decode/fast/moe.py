"""Routed experts that read only the experts the tokens chose, with static shapes (CUDA-graph capturable).

A decode step routes N tokens to k of E experts each. A real engine (vLLM's fused MoE)
reads the weights of the experts that were chosen and no others: at Laguna-XS.2's shape
(256 experts of 3 x 512 x 2048) one token touches 8 experts, 48 MB a layer, against
1.5 GB for all of them. This module does the same, without a host sync:

    align       the N*k (token, slot) pairs sorted by expert, each expert's run padded to
                a multiple of ``BLOCK_M`` rows, so that every block of BLOCK_M rows
                belongs to one expert (vLLM calls this step ``moe_align_block_size``).
                The number of blocks is data-dependent; its upper bound
                ceil(N*k / BLOCK_M) + min(E, N*k) is not, so the shapes are static and
                blocks past the used ones are skipped on the device
    gemm        one kernel per projection: program (block, column tile) reads its
                expert's weight tile once and multiplies it with the block's rows
                (gathered from the tokens for gate/up, from the padded rows for down).
                A block of B tokens therefore reads each DISTINCT expert it touches
                once (a few times more only when an expert holds more than BLOCK_M rows)
    one token   the decode step's k pairs need neither layout nor blocks: a GEMV kernel per projection
                (``gemv``), program (pair, column tile), streams each chosen expert's rows once; the
                gate/up program writes silu(gate) * up itself, and the shared expert's down projection
                runs in the routed down projection's launch (``one_token_experts(shared=...)``); with
                ``routed_one_token`` each gate/up program also routes (the top k of the router's logits),
                so router, routed and shared experts are two launches

On CUDA the GEMMs are a Triton kernel; elsewhere (and as the reference) the same
blocks run as one batched matmul over the block experts' weights, exact in float32. The router
before them (sigmoid, top-k with the correction bias, renormalisation) is one kernel too
(``fused_route``; ``static_target.route`` is its reference).
"""

from __future__ import annotations

import torch

from . import gemv, pdl, residual, triton_ops

try:  # Triton is a GPU-side extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

BLOCK_M = 16  # rows per block: the smallest tile tl.dot takes


def block_bound(pairs: int, n_experts: int, block_m: int = BLOCK_M) -> int:
    """Most blocks ``pairs`` (token, expert) pairs can fill: every expert's last block may be partial."""
    return -(-pairs // block_m) + min(n_experts, pairs)


def align(selected: torch.Tensor, n_experts: int, block_m: int = BLOCK_M):
    """selected (N, k) expert ids -> (row_pair, block_expert, used_blocks).

    row_pair (n_blocks * block_m,): the pair index (token * k + slot) each padded row holds, or
    N*k on padding rows; block_expert (n_blocks,): the expert of each block (clamped to E-1 past
    the used ones); used_blocks (1,): how many blocks hold rows. Every op runs on the device. One token
    (N = 1) needs no sort: k blocks, one per chosen expert (fewer than the bound).
    """
    P = selected.numel()
    dev = selected.device
    flat = selected.reshape(-1)
    if selected.shape[0] == 1:  # one token: its k experts are distinct, one block each, no sort (the decode step)
        row_pair, used = _one_token(P, block_m, dev)[:2]
        return row_pair, flat, used
    n_blocks = block_bound(P, n_experts, block_m)
    counts = torch.zeros(n_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m  # blocks per expert
    block_end = torch.cumsum(blocks, 0)  # (E,)
    first_pair = torch.cumsum(counts, 0) - counts  # where each expert's pairs start in sorted order
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    expert_of = flat[order]
    rank = torch.arange(P, device=dev) - first_pair[expert_of]  # rank of the pair within its expert
    dest = (block_end - blocks)[expert_of] * block_m + rank  # its padded row
    row_pair = torch.full((n_blocks * block_m,), P, dtype=torch.long, device=dev).scatter_(0, dest, order)
    block_expert = torch.searchsorted(block_end, torch.arange(n_blocks, device=dev), right=True)
    return row_pair, block_expert.clamp_(max=n_experts - 1), block_end[-1:]


_ONE_TOKEN: dict = {}


def _one_token(P: int, block_m: int, device) -> tuple:
    """One token's layout, which depends on k alone: (row_pair, used, rows, valid, token_of_row) as ``align`` and
    ``gathered_experts`` use them, made once per device (a captured decode step reads them, never builds them)."""
    key = (P, block_m, str(device))
    if key not in _ONE_TOKEN:
        rows = torch.arange(P * block_m, device=device)
        row_pair = torch.where(rows % block_m == 0, rows // block_m, P)
        _ONE_TOKEN[key] = (row_pair, torch.full((1,), P, dtype=torch.long, device=device), rows, row_pair < P,
                           torch.zeros_like(rows))  # every row holds token 0 (or is padding, read as token 0)
    return _ONE_TOKEN[key]


if triton is not None:

    @triton.jit
    def _align_kernel(sel_ptr, row_pair_ptr, token_ptr, block_expert_ptr, used_ptr, P, E, K_TOP, R, NB,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
        """``align`` in one program: per-expert counts, each expert's first block (a cumsum), every pair's padded
        row (its expert's first row + its rank among the expert's earlier pairs: the stable order), each block's
        expert, and the token of every row (0 on padding). Pairs are taken CHUNK at a time, so any P fits."""
        e = tl.arange(0, BLOCK_E)
        c = tl.arange(0, CHUNK)
        counts = tl.zeros((BLOCK_E,), tl.int32)
        for p0 in range(0, P, CHUNK):
            ex = tl.load(sel_ptr + p0 + c, mask=p0 + c < P, other=-1).to(tl.int32)
            counts += tl.sum((ex[:, None] == e[None, :]).to(tl.int32), axis=0)
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_end = tl.cumsum(blocks, axis=0)
        first_row = (block_end - blocks) * BLOCK_M
        for r0 in range(0, R, CHUNK):  # every row padding first: row_pair P, token 0
            tl.store(row_pair_ptr + r0 + c, tl.zeros((CHUNK,), tl.int64) + P, mask=r0 + c < R)
            tl.store(token_ptr + r0 + c, tl.zeros((CHUNK,), tl.int64), mask=r0 + c < R)
        tl.debug_barrier()
        seen = tl.zeros((BLOCK_E,), tl.int32)  # pairs of each expert in the chunks before
        earlier = c[None, :] < c[:, None]  # (pair, other pair): the other comes first
        for p0 in range(0, P, CHUNK):
            ok = p0 + c < P
            ex = tl.load(sel_ptr + p0 + c, mask=ok, other=-1).to(tl.int32)
            hot = ex[:, None] == e[None, :]  # (CHUNK, E)
            same = (ex[:, None] == ex[None, :]) & earlier
            rank = tl.sum(tl.where(hot, seen[None, :], 0), axis=1) + tl.sum(same.to(tl.int32), axis=1)
            dest = tl.sum(tl.where(hot, first_row[None, :], 0), axis=1) + rank
            pair = p0 + c
            tl.store(row_pair_ptr + dest, pair.to(tl.int64), mask=ok)
            tl.store(token_ptr + dest, (pair // K_TOP).to(tl.int64), mask=ok)
            seen += tl.sum(hot.to(tl.int32), axis=0)
        for b0 in range(0, NB, CHUNK):  # block b's expert: how many experts end at or before it, clamped
            b = b0 + c
            owner = tl.sum(((block_end[None, :] <= b[:, None]) & (e[None, :] < E)).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.minimum(owner, E - 1).to(tl.int64), mask=b < NB)
        total = tl.sum(tl.where(e == E - 1, block_end, 0), axis=0)
        tl.store(used_ptr, total.to(tl.int64))


_ROWS: dict = {}


def align_rows(selected: torch.Tensor, n_experts: int, block_m: int = BLOCK_M):
    """``align`` and the rows' tokens in one kernel (where the block GEMM kernel runs): (row_pair,
    block_expert, used, rows, token_of_row), ``rows`` the padded rows' indices (a constant per size)."""
    N, k = selected.shape
    P, dev = N * k, selected.device
    n_blocks = block_bound(P, n_experts, block_m)
    R = n_blocks * block_m
    row_pair = torch.empty(R, dtype=torch.long, device=dev)
    token_of_row = torch.empty(R, dtype=torch.long, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.long, device=dev)
    used = torch.empty(1, dtype=torch.long, device=dev)
    block_e = triton.next_power_of_2(n_experts)
    chunk = max(16, min(64, 8192 // block_e))
    _align_kernel[(1,)](selected.reshape(-1).contiguous(), row_pair, token_of_row, block_expert, used, P,
                        n_experts, k, R, n_blocks, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, num_warps=8)
    key = (R, str(dev))
    if key not in _ROWS:
        _ROWS[key] = torch.arange(R, device=dev)
    return row_pair, block_expert, used, _ROWS[key], token_of_row


def _blocks_matmul(a: torch.Tensor, w: torch.Tensor, block_expert: torch.Tensor, block_m: int) -> torch.Tensor:
    """Reference: rows a (n_blocks * block_m, K) times their block expert's w (E, N_out, K)^T."""
    a = a.view(-1, block_m, a.shape[-1])
    return torch.bmm(a, w[block_expert].transpose(1, 2)).reshape(-1, w.shape[1])


if triton is not None:

    @triton.jit
    def _block_gemm_kernel(a_ptr, a_index_ptr, w_ptr, out_ptr, out_index_ptr, row_pair_ptr, block_expert_ptr,
                           used_ptr, scale_ptr, P, N_OUT, K, stride_a, stride_we, stride_wn, stride_out,
                           HAS_SCALE: tl.constexpr, SILU_MUL: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[out_index[r]] = a[a_index[r]] @ w[e]^T (* scale[pair]) for the rows r of one block of expert e.
        SILU_MUL: a's rows are [gate | up] (2K wide) and the operand is silu(gate) * up, rounded as
        ``triton_ops.silu_mul`` rounds it (the down projection reads the gate/up GEMM's output directly)."""
        pid_m = tl.program_id(0)
        if pid_m >= tl.load(used_ptr):
            return
        e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(row_pair_ptr + rows)
        valid = pair < P
        a_rows = tl.load(a_index_ptr + rows, mask=valid, other=0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_a + ks[None, :]
        w_ptrs = w_ptr + e * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            if SILU_MUL:
                u = tl.load(a_ptrs + K, mask=valid[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                g = a.to(tl.float32)
                a = ((g / (1.0 + tl.exp(-g))).to(a.dtype).to(tl.float32) * u).to(a.dtype)
            w = tl.load(w_ptrs, mask=kmask[:, None] & (cols[None, :] < N_OUT), other=0.0)
            acc = tl.dot(a, w, acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
        out_rows = tl.load(out_index_ptr + rows, mask=valid, other=0).to(tl.int64)
        out_ptrs = out_ptr + out_rows[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N_OUT))


# The block GEMM's tile over a block's output columns and the reduced dimension, and its launch shape.
# ``scripts/moe_tiles.py`` times the choices at Laguna-XS.2's shape (``benchmarks/moe_tiles_h100.md``): on an
# H100 this one was the fastest at 1 and 16 tokens together (0.0358 / 0.2560 ms a layer, 64/128/4/3 before:
# 0.0382 / 0.2802); every choice stays within 1.3x of it at 1 token, so the tile is not what is left.
TILES = {"block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}


def _block_gemm(a, a_index, w, out, out_index, row_pair, block_expert, used, scale, pairs: int,
                silu_mul: bool = False) -> None:
    n_out, K = w.shape[1], w.shape[2]
    assert a.stride(-1) == 1 and w.stride(-1) == 1 and out.stride(-1) == 1
    block_n, block_k = TILES["block_n"], TILES["block_k"]
    grid = (block_expert.shape[0], triton.cdiv(n_out, block_n))
    _block_gemm_kernel[grid](a, a_index, w, out, out_index, row_pair, block_expert, used,
                             scale if scale is not None else a, pairs, n_out, K, a.stride(0), w.stride(0), w.stride(1),
                             out.stride(0), HAS_SCALE=scale is not None, SILU_MUL=silu_mul, BLOCK_M=BLOCK_M,
                             BLOCK_N=block_n, BLOCK_K=block_k, num_warps=TILES["num_warps"],
                             num_stages=TILES["num_stages"])


def one_token_experts(experts, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor,
                      shared: tuple | None = None, tail: tuple | None = None):
    """The decode step's routed experts: one token, k distinct experts, each read once by a GEMV kernel (the
    16-row block of the batched path would carry one row). -> (k, H): each expert's weighted output.

    shared = (gate_up (2 I_s,), down (H, I_s)): the shared expert's down projection rides in the routed down
    projection's launch, reading silu(gate) * up from its gate/up output; -> (k + 1, H), the last row the
    shared expert's (unscaled). tail = (h, scale, norm), with shared: the layer's residual tail
    (``residual.experts_add_norm``) -> (h', norm(h')) instead, run inside the down launch where
    ``residual.producer_tail`` allows."""
    return _one_token_gemvs(experts, x, selected.reshape(-1).contiguous(), weights.reshape(-1).contiguous(),
                            shared, tail=tail)


def routed_one_token(experts, x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, top_k: int,
                     shared: tuple | None = None, tail: tuple | None = None) -> tuple:
    """``one_token_experts`` with the router inside the gate/up launch: logits (1, E) (a row of any stride
    whose last dimension is contiguous), bias (E,) -> (its output, expert ids (1, k)). Each gate/up program
    picks its own expert from the logits (``fused_route``'s choice and weights), so the router is no launch
    of its own; the down projection reads the ids and weights the gate/up programs wrote."""
    if logits.shape[0] != 1 or logits.stride(-1) != 1 or not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"routed_one_token: logits {tuple(logits.shape)} must be one row (1, E) with a contiguous "
                         f"last dimension and 1 <= top_k ({top_k}) <= E")
    sel = torch.empty(top_k, device=x.device, dtype=torch.long)
    wt = torch.empty(top_k, device=x.device, dtype=x.dtype)
    return (_one_token_gemvs(experts, x, sel, wt, shared, route=(logits[0], bias, wt), tail=tail),
            sel.view(1, top_k))


def _one_token_gemvs(experts, x, sel, wt, shared, route=None, tail=None):
    """The two GEMV launches of one token's routed experts (and the shared expert's down projection, and with
    ``tail`` the layer's residual tail)."""
    k = sel.numel()
    w_gu, w_down = experts.gate_up_proj, experts.down_proj
    silu = triton_ops.is_silu(experts.act_fn)
    h = torch.empty(k, w_gu.shape[1] // 2 if silu else w_gu.shape[1], device=x.device, dtype=x.dtype)
    gemv.pair_gemv(x, w_gu, h, sel, None, k, silu, tile="gate_up", route=route)
    act = h if silu else triton_ops.act_mul(experts.act_fn, h)
    out = torch.empty(k + (shared is not None), w_down.shape[1], device=x.device, dtype=x.dtype)
    fused = None
    if tail is not None:
        if shared is None:
            raise ValueError("one token's residual tail needs the shared expert's row (shared=...)")
        res, scale, norm = tail
        fused = residual.producer_tail(res, norm, scale, k)
    gemv.pair_gemv(act, w_down, out, sel, wt, 1, extra=shared, tail=fused[0] if fused else None)
    if tail is None:
        return out
    if fused is not None:  # the down launch ran the tail
        return fused[1], fused[2]
    return residual.experts_add_norm(res, out[None, :-1], scale, out[-1:].view(res.shape), norm)


if triton is not None:

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, w_ptr, sel_ptr, E, stride_l,
                      TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        n = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        x = tl.load(logits_ptr + n * stride_l + e, mask=ok, other=0.0).to(tl.float32)
        score = 1.0 / (1.0 + tl.exp(-x))  # sigmoid
        key = tl.where(ok, score + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32), float("-inf"))
        kk = tl.arange(0, BLOCK_K)
        sel = tl.zeros((BLOCK_K,), tl.int64)
        w = tl.zeros((BLOCK_K,), tl.float32)
        for i in tl.static_range(TOP_K):  # k rounds of max: the best first, the lowest id among equals
            best = tl.max(key, axis=0)
            idx = tl.min(tl.where(key == best, e, BLOCK_E), axis=0)
            sel = tl.where(kk == i, idx, sel)
            w = tl.where(kk == i, tl.sum(tl.where(e == idx, score, 0.0), axis=0), w)
            key = tl.where(e == idx, float("-inf"), key)
        w = w / tl.sum(w, axis=0)
        tl.store(w_ptr + n * TOP_K + kk, w.to(w_ptr.dtype.element_ty), mask=kk < TOP_K)
        tl.store(sel_ptr + n * TOP_K + kk, sel, mask=kk < TOP_K)


def route_runs(logits: torch.Tensor, router) -> bool:
    """Whether ``fused_route`` serves this router: CUDA or Triton's interpreter, no logit softcapping."""
    return triton_ops.enabled(logits) and not (getattr(router, "router_logit_softcapping", 0.0) or 0.0) > 0


def fused_route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, dtype: torch.dtype):
    """Laguna's router in one kernel: logits (N, E) (any dtype, rows of any stride) -> (weights (N, k) in
    dtype, expert ids (N, k)): sigmoid scores in float32, the top k of score + bias (best first), the chosen
    scores renormalised. ``static_target.route`` is the reference (no softcapping here)."""
    N, E = logits.shape
    if logits.stride(-1) != 1 or not 1 <= top_k <= E:
        raise ValueError(f"fused_route: logits {tuple(logits.shape)} need a contiguous last dimension and "
                         f"1 <= top_k ({top_k}) <= E")
    weights = torch.empty((N, top_k), device=logits.device, dtype=dtype)
    selected = torch.empty((N, top_k), device=logits.device, dtype=torch.long)
    _route_kernel[(N,)](logits, bias, weights, selected, E, logits.stride(0), TOP_K=top_k,
                        BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k),
                        num_warps=ROUTE_WARPS, **pdl.launch(logits))
    return weights, selected


# Warps of a router program: its k rounds of max over E scores are reductions across the program's warps
# (one warp: register shuffles only). ``scripts/moe_tiles.py --gemv`` times the choices: one warp was the fastest
# on an H100 (0.0025 ms a call against 0.0039 at four; ``benchmarks/gemv_tiles_h100.md``).
ROUTE_WARPS = 1


def kernel_runs(x: torch.Tensor) -> bool:
    """Whether the Triton kernels serve ``x``: bf16/fp16 on CUDA (float32 would round through TF32 there), any
    dtype in Triton's CPU interpreter (exact float32 products there); ``gemv.runs``' rule."""
    return gemv.runs(x)


def gathered_experts(experts, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor, *,
                     kernel: bool | None = None, reduce: bool = True) -> torch.Tensor:
    """The routed experts over the chosen (token, expert) pairs only, block by block. x (N, H) -> (N, H), or
    (N, k, H) with reduce=False: each chosen expert's weighted output, for a caller that sums them itself.

    ``experts`` has gate_up_proj (E, 2I, H), down_proj (E, H, I) and act_fn (transformers'
    ``LagunaExperts``); selected, weights (N, k). kernel=None: the Triton kernel where
    ``kernel_runs``, else the batched-matmul reference (the same blocks, exact in float32).
    """
    N, k = selected.shape
    x = x.contiguous()
    use_kernel = kernel_runs(x) if kernel is None else kernel
    if use_kernel and N == 1:  # the decode step: a GEMV per chosen expert, no layout
        out = one_token_experts(experts, x, selected, weights)
    elif use_kernel:
        out = _blocks_kernel(experts, x, selected, weights)
    else:
        out = _blocks_reference(experts, x, selected, weights)
    out = out.view(N, k, -1)
    return out.sum(dim=1) if reduce else out


def _blocks_kernel(experts, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Several tokens' pairs in 16-row blocks of one expert each, two Triton block GEMMs -> (N*k, H)."""
    P = selected.numel()
    w_gu, w_down = experts.gate_up_proj, experts.down_proj
    row_pair, block_expert, used, rows, token_of_row = align_rows(selected, w_gu.shape[0])  # one kernel
    h = torch.empty(row_pair.numel(), w_gu.shape[1], device=x.device, dtype=x.dtype)
    _block_gemm(x, token_of_row, w_gu, h, rows, row_pair, block_expert, used, None, P)
    silu = triton_ops.is_silu(experts.act_fn)  # then the activation runs inside the down projection's loads
    act = h if silu else triton_ops.act_mul(experts.act_fn, h)  # padding rows hold garbage, never read
    out = torch.empty(P, w_down.shape[1], device=x.device, dtype=x.dtype)  # every pair is one row: all written
    _block_gemm(act, rows, w_down, out, row_pair, row_pair, block_expert, used, weights.reshape(-1), P, silu)
    return out


def _blocks_reference(experts, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The same blocks as one batched matmul over the block experts' weights (exact in float32) -> (N*k, H)."""
    N, k = selected.shape
    P = N * k
    w_gu, w_down = experts.gate_up_proj, experts.down_proj
    row_pair, block_expert, _ = align(selected, w_gu.shape[0])
    if N == 1:  # one token: the layout is a constant
        valid, token_of_row = _one_token(P, BLOCK_M, x.device)[3:]
    else:
        valid = row_pair < P
        token_of_row = torch.where(valid, row_pair // k, 0)
    a = x[token_of_row] * valid[:, None].to(x.dtype)
    gate, up = _blocks_matmul(a, w_gu, block_expert, BLOCK_M).chunk(2, dim=-1)
    o = _blocks_matmul(experts.act_fn(gate) * up, w_down, block_expert, BLOCK_M)  # (rows, H)
    o = o * weights.reshape(-1)[row_pair.clamp(max=P - 1)][:, None]
    return torch.zeros(P + 1, o.shape[-1], device=x.device, dtype=o.dtype).index_add_(0, row_pair, o)[:P]


def distinct_experts(selected: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(..., N, k) expert ids -> (...,) how many distinct experts each group of N tokens touches."""
    hit = torch.zeros(*selected.shape[:-2], n_experts, dtype=torch.bool, device=selected.device)
    return hit.scatter_(-1, selected.flatten(-2), True).sum(-1)


def uniform_distinct(tokens: int, k: int, n_experts: int) -> float:
    """Expected distinct experts for ``tokens`` tokens each picking k distinct experts uniformly at random."""
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)
