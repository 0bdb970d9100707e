"""One row times a weight matrix (a GEMV) as one Triton kernel: the decode step's products of a single token.

A decode step of one token multiplies one row by each weight matrix it reads: the routed experts' chosen
(token, expert) pairs, and at batch 1 every projection. The bytes of the weights are the whole cost, so
the kernel is laid out for reading them: program (pair, column tile) streams its BLOCK_N weight rows in
BLOCK_K chunks with plain vector loads and sums the products in float32, and there are enough programs to
keep every SM's loads in flight (a 16-row ``tl.dot`` block around one row, the routed experts' batched
path, reads the same bytes with fewer programs and wastes 15 of its 16 rows).

    pair_gemv(a, w, out, expert, scale, a_div)   out[p] = a[p // a_div] @ w[expert[p]]^T (* scale[p]);
                                                 with silu_mul, w's rows are [gate | up] and the program
                                                 writes silu(gate) * up (the routed experts' gate/up)
    linear(x, w, b)                              F.linear for one row, through the same kernel (one "expert")
                                                 where ``runs``; else F.linear (its tile by w's shape: a card's
                                                 sweep may give a shape its own, ``dense_tile``)
    linear_add_norm(x, w, h, norm, b)            a layer's residual tail after the product: (h + x w^T,
                                                 norm(h + x w^T)), in the same launch with ``residual.IN_PRODUCER``
    add_norm_linear(h, d, norm, w, b)            the tail before the product: (h + d, norm(h + d), norm(h + d) w^T),
                                                 in the same launch with ``residual.IN_CONSUMER``

Numerics: products and sums in float32, one rounding to the output dtype at the end (as a GEMM's epilogue);
the order of the sum differs from cuBLAS', so float32 results agree to rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import pdl, residual, triton_ops

try:  # Triton is a GPU-side extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

if triton is not None:

    @triton.jit
    def _pro_rstd(h_ptr, d_ptr, K, eps, PRO_D: tl.constexpr):
        """The prologue's norm scale: 1 / rms(round(h + d)) over the whole row, as ``residual._tail`` takes it."""
        cols = tl.arange(0, PRO_D)
        m = cols < K
        dt = h_ptr.dtype.element_ty
        hf = (tl.load(h_ptr + cols, mask=m, other=0.0).to(tl.float32)
              + tl.load(d_ptr + cols, mask=m, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        return 1.0 / tl.sqrt_rn(tl.sum(hf * hf, axis=0) / K + eps)

    @triton.jit
    def _pro_x(h_ptr, d_ptr, w_ptr, idx, kmask, rstd):
        """The prologue's row at idx: round(h + d) and norm(round(h + d)), each rounded to h's dtype, float32."""
        dt = h_ptr.dtype.element_ty
        hf = (tl.load(h_ptr + idx, mask=kmask, other=0.0).to(tl.float32)
              + tl.load(d_ptr + idx, mask=kmask, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        w = tl.load(w_ptr + idx, mask=kmask, other=0.0).to(tl.float32)
        return hf, (w * (hf * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)

    @triton.jit
    def _a_chunk(a_row, idx, kmask, pro_h, pro_d, pro_w, rstd, PRO: tl.constexpr):
        """The row's slice at idx, float32: loaded, or (PRO) the norm of the residual add computed here."""
        if PRO:
            _, a = _pro_x(pro_h, pro_d, pro_w, idx, kmask, rstd)
        else:
            a = tl.load(a_row + idx, mask=kmask, other=0.0).to(tl.float32)
        return a

    @triton.jit
    def _chunk(a_row, w_rows, k0, ks, cmask, K, N_OUT, stride_wn, pro_h, pro_d, pro_w, rstd,
               SILU_MUL: tl.constexpr, PRO: tl.constexpr):
        """One BLOCK_K chunk at k0: the row's slice (1, BLOCK_K) and its weights (and the up rows), float32."""
        kmask = (k0 + ks) < K
        m = cmask[:, None] & kmask[None, :]
        w = tl.load(w_rows + k0 + ks[None, :], mask=m, other=0.0).to(tl.float32)
        w_up = w
        if SILU_MUL:
            w_up = tl.load(w_rows + N_OUT * stride_wn + k0 + ks[None, :], mask=m, other=0.0).to(tl.float32)
        a = _a_chunk(a_row, k0 + ks, kmask, pro_h, pro_d, pro_w, rstd, PRO)[None, :]
        return a, w, w_up

    @triton.jit
    def _fma(acc, acc_up, a, w, w_up, SILU_MUL: tl.constexpr):
        """One chunk's products added to the sums (and the up rows' to theirs)."""
        acc += w * a
        if SILU_MUL:
            acc_up += w_up * a
        return acc, acc_up

    @triton.jit
    def _pair_row(a_row, w_rows, cols, cmask, N_OUT, K, stride_wn, SILU_MUL: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, dt: tl.constexpr, WAIT: tl.constexpr, PIPE: tl.constexpr,
                  pro_h=None, pro_d=None, pro_w=None, pro_eps=0.0, PRO: tl.constexpr = False,
                  PRO_D: tl.constexpr = 1):
        """One row a (K,) times BLOCK_N weight rows (and, SILU_MUL, the up rows N_OUT further): float32 sums.
        The first chunk is peeled: its weights are loaded before a, and WAIT waits for the previous kernel
        (``pdl.wait``) between the two, so under PDL the weights stream in while that kernel drains. PIPE: each
        iteration loads the next chunk before it multiplies the current one, so two chunks a program are in
        flight (the loads are not used before the products of the chunk before them). PRO: the row is not read
        but computed, norm(round(pro_h + pro_d)) with pro_w and pro_eps (``add_norm_linear``)."""
        ks = tl.arange(0, BLOCK_K)
        kmask = ks < K
        m = cmask[:, None] & kmask[None, :]
        w = tl.load(w_rows + ks[None, :], mask=m, other=0.0).to(tl.float32)
        w_up = w
        if SILU_MUL:
            w_up = tl.load(w_rows + N_OUT * stride_wn + ks[None, :], mask=m, other=0.0).to(tl.float32)
        pdl.wait(WAIT)
        rstd = 0.0
        if PRO:
            rstd = _pro_rstd(pro_h, pro_d, K, pro_eps, PRO_D)
        a = _a_chunk(a_row, ks, kmask, pro_h, pro_d, pro_w, rstd, PRO)[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        # the same sums in the same order either way. PIPE carries the next chunk's loads across an iteration;
        # the plain loop loads and multiplies a chunk within one, no loaded tile carried (carrying them made the
        # routed experts' one-token launches 15 % slower on an H100: 0.0299 against 0.0261 ms a layer)
        if PIPE:
            for k0 in range(BLOCK_K, K, BLOCK_K):
                a_n, w_n, w_up_n = _chunk(a_row, w_rows, k0, ks, cmask, K, N_OUT, stride_wn, pro_h, pro_d, pro_w,
                                          rstd, SILU_MUL, PRO)
                acc, acc_up = _fma(acc, acc_up, a, w, w_up, SILU_MUL)
                a, w, w_up = a_n, w_n, w_up_n
            acc, acc_up = _fma(acc, acc_up, a, w, w_up, SILU_MUL)
        else:
            acc, acc_up = _fma(acc, acc_up, a, w, w_up, SILU_MUL)
            for k0 in range(BLOCK_K, K, BLOCK_K):
                a, w, w_up = _chunk(a_row, w_rows, k0, ks, cmask, K, N_OUT, stride_wn, pro_h, pro_d, pro_w, rstd,
                                    SILU_MUL, PRO)
                acc, acc_up = _fma(acc, acc_up, a, w, w_up, SILU_MUL)
        y = tl.sum(acc, axis=1)
        if SILU_MUL:
            g = y.to(dt).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * tl.sum(acc_up, axis=1).to(dt).to(tl.float32)
        return y

    @triton.jit
    def _silu_input_row(gu_row, w_rows, cmask, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dt: tl.constexpr):
        """silu(gate) * up of a [gate | up] row (2K), rounded as ``triton_ops.silu_mul`` rounds it, times BLOCK_N
        weight rows: the shared expert's down projection reading its gate/up output directly."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + ks) < K
            g = tl.load(gu_row + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
            u = tl.load(gu_row + K + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
            a = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)[None, :]
            m = cmask[:, None] & kmask[None, :]
            acc += tl.load(w_rows + k0 + ks[None, :], mask=m, other=0.0).to(tl.float32) * a
        return tl.sum(acc, axis=1)

    @triton.jit
    def _route_pick(logits_ptr, bias_ptr, sel_ptr, wt_ptr, p, E, STORE, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr):
        """Laguna's router for one token inside a routed expert's program: sigmoid scores of the logits (E,),
        the top TOP_K of score + bias (best first, the lowest id among equals, as ``moe.fused_route``), and
        this pair's (p-th) expert id. STORE: also write it and its weight, its score over the chosen scores',
        to sel[p] / wt[p] (for the down projection). Each round is one max over keys that pack the score's
        order-preserving bits above the inverted expert id, so the max names its expert."""
        e = tl.arange(0, BLOCK_E)
        ok = e < E
        score = 1.0 / (1.0 + tl.exp(-tl.load(logits_ptr + e, mask=ok, other=0.0).to(tl.float32)))
        key = tl.where(ok, score + tl.load(bias_ptr + e, mask=ok, other=0.0).to(tl.float32), float("-inf"))
        bits = key.to(tl.int32, bitcast=True)
        order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # a float's order as a signed integer's
        packed = (order.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
        chosen = e < 0
        mine = tl.sum(tl.zeros((BLOCK_E,), tl.int64), axis=0)
        for i in tl.static_range(TOP_K):
            best = tl.max(packed, axis=0)
            idx = BLOCK_E - 1 - (best & (BLOCK_E - 1))  # the low bits: BLOCK_E is a power of two
            chosen = chosen | (e == idx)
            mine = tl.where(p == i, idx, mine)
            packed = tl.where(packed == best, -9223372036854775807 - 1, packed)
        weight = tl.sum(tl.where(e == mine, score, 0.0), axis=0) / tl.sum(tl.where(chosen, score, 0.0), axis=0)
        if STORE:
            tl.store(sel_ptr + p, mine)
            tl.store(wt_ptr + p, weight.to(wt_ptr.dtype.element_ty))
        return mine

    @triton.jit
    def _pair_gemv_kernel(a_ptr, w_ptr, out_ptr, expert_ptr, scale_ptr, gu2_ptr, w2_ptr, P, N_OUT, K, K2, A_DIV,
                          stride_a, stride_we, stride_wn, stride_w2n, stride_out, HAS_SCALE: tl.constexpr,
                          SILU_MUL: tl.constexpr, EXTRA: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, PIPE: tl.constexpr,
                          logits_ptr=None, bias_ptr=None, wt_ptr=None, E=0, ROUTE: tl.constexpr = False,
                          TOP_K: tl.constexpr = 1, BLOCK_E: tl.constexpr = 1, tail_h_ptr=None, tail_w_ptr=None,
                          tail_h_out_ptr=None, tail_x_out_ptr=None, count_ptr=None, tail_scale=1.0, tail_eps=0.0,
                          TAIL: tl.constexpr = False, TAIL_K: tl.constexpr = 0, TAIL_D: tl.constexpr = 1,
                          pro_h_ptr=None, pro_d_ptr=None, pro_w_ptr=None, pro_h_out_ptr=None, pro_x_out_ptr=None,
                          pro_eps=0.0, PRO: tl.constexpr = False, PRO_D: tl.constexpr = 1):
        """One (token, expert) pair p < P, one tile of output columns: out[p] = a[p // A_DIV] @ w[e]^T
        (* scale[p]). No 16-row block around a single row: every program streams its BLOCK_N weight rows with
        plain loads and sums products in float32. SILU_MUL: w holds [gate | up] (2 * N_OUT rows) and the
        program writes silu(gate) * up, each rounded to the output dtype as the block path's two steps round
        them. EXTRA: the programs of p = P compute one more row in the same launch, silu(gate) * up of the
        [gate | up] row gu2 (2 * K2) times w2 (N_OUT, K2), unscaled (the shared expert beside the routed).
        PDL: launched under programmatic dependent launch (``pdl``); PREFETCH (with PDL): w is one matrix that
        every pair reads (a dense projection; the ids go unread), so its first chunk loads before the wait.
        ROUTE: one token's pairs p < TOP_K route themselves (``_route_pick`` on the router's logits and bias):
        the tile-0 programs write the expert ids into expert_ptr and their weights into wt_ptr. TAIL: the last
        program to finish (counted on count_ptr, reset after) runs the residual tail of one row over the whole
        output (``residual.producer_tail``): TAIL_K == 0, out[0] is the delta; else out[:TAIL_K] the routed
        experts' and out[TAIL_K] the shared expert's. PRO: the row is the residual tail of the launch before, one
        row (``add_norm_linear``): each program computes norm(round(h + d)) itself where it would load a (no tail
        kernel between the two products), and program (0, 0) writes h + d and its norm for the launches after."""
        pdl.release(PDL)
        if not PREFETCH:
            pdl.wait(PDL)
        p = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N_OUT
        dt = out_ptr.dtype.element_ty
        if EXTRA and p == P:
            y = _silu_input_row(gu2_ptr, w2_ptr + cols[:, None].to(tl.int64) * stride_w2n, cmask, K2, BLOCK_N,
                                BLOCK_K, dt)
        else:
            if PREFETCH:  # one matrix, no expert id to read
                w_e = w_ptr
            elif ROUTE:
                w_e = w_ptr + _route_pick(logits_ptr, bias_ptr, expert_ptr, wt_ptr, p, E, tl.program_id(1) == 0,
                                          TOP_K, BLOCK_E) * stride_we
            else:
                w_e = w_ptr + tl.load(expert_ptr + p).to(tl.int64) * stride_we
            y = _pair_row(a_ptr + (p // A_DIV).to(tl.int64) * stride_a,
                          w_e + cols[:, None].to(tl.int64) * stride_wn, cols, cmask, N_OUT, K,
                          stride_wn, SILU_MUL, BLOCK_N, BLOCK_K, dt, PREFETCH, PIPE, pro_h_ptr, pro_d_ptr, pro_w_ptr,
                          pro_eps, PRO, PRO_D)
            if PRO:
                if (p == 0) & (tl.program_id(1) == 0):
                    idx = tl.arange(0, PRO_D)
                    rstd = _pro_rstd(pro_h_ptr, pro_d_ptr, K, pro_eps, PRO_D)
                    hf, xf = _pro_x(pro_h_ptr, pro_d_ptr, pro_w_ptr, idx, idx < K, rstd)
                    tl.store(pro_h_out_ptr + idx, hf.to(dt), mask=idx < K)
                    tl.store(pro_x_out_ptr + idx, xf.to(dt), mask=idx < K)
            if HAS_SCALE:
                y = y * tl.load(scale_ptr + p).to(tl.float32)
        tl.store(out_ptr + p.to(tl.int64) * stride_out + cols, y.to(dt), mask=cmask)
        if TAIL:  # as the attention's in-kernel merge: every thread's store made before the count releases it
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
                residual._tail(tail_h_ptr, out_ptr, out_ptr + TAIL_K * stride_out, tail_w_ptr, tail_h_out_ptr,
                               tail_x_out_ptr, 0, N_OUT, 0, stride_out, 0, tail_scale, tail_eps, TAIL_K, TAIL_D)
                tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")


# The tiles, one per use (the routed experts' gate/up reduces over the hidden size, their down over the expert
# width; "dense" serves every ``linear``): output columns per program, reduced elements per iteration, warps,
# and whether the next chunk is loaded before the current one is multiplied (pipe).
# ``scripts/moe_tiles.py --gemv`` times the choices at Laguna-XS.2's shape; these were the fastest on an H100
# (``benchmarks/gemv_tiles_h100.md``): the routed experts' one token 0.0207 ms a layer against 0.0320 for the
# 16-row block path, the dense projections of a layer 0.0332 ms against cuBLAS' 0.0430 (the H200's earlier
# choice, ``gemv_tiles_h200.md``, without the pipelined loop, ran them at 0.0482 ms there).
TILES = {"gate_up": {"block_n": 4, "block_k": 1024, "num_warps": 2, "pipe": False},
         "down": {"block_n": 8, "block_k": 256, "num_warps": 4, "pipe": False},
         "dense": {"block_n": 4, "block_k": 1024, "num_warps": 4, "pipe": True}}
# Whether ``linear`` takes one-row products from this kernel (True) or cuBLAS (False): the sweep above says
# which is faster on a card (this kernel, by 1.27x, on the H200).
DENSE = True
# Cards whose sweep chose other tiles (a substring of the CUDA device name -> its tiles): on the H200 the loop
# without the next-chunk load won every projection (``benchmarks/gemv_tiles_h200.md``, at Laguna-XS.2's shape).
CARD_TILES = {"H200": {"gate_up": {"block_n": 4, "block_k": 512, "num_warps": 4, "pipe": False},
                       "down": {"block_n": 8, "block_k": 256, "num_warps": 4, "pipe": False},
                       "dense": {"block_n": 4, "block_k": 1024, "num_warps": 2, "pipe": False}}}
_DEFAULT_TILES = {k: dict(v) for k, v in TILES.items()}
_CARD: list = []  # the card the tiles were chosen for, once a CUDA call asked


def dense_tile(n: int, k: int) -> str:
    """The tile ``linear`` uses for a weight of n rows and k columns: "dense NxK" where ``TILES`` has that shape
    (a sweep found it its own tile: ``scripts/moe_tiles.py --dense``), else the shared "dense"."""
    name = f"dense {n}x{k}"
    return name if name in TILES else "dense"


def use_card_tiles(device: torch.device) -> str | None:
    """Once per process, on CUDA: ``TILES`` takes this card's entry of ``CARD_TILES`` (per-shape "dense NxK"
    entries included), except where a caller has already set a tile (a sweep, a test). Returns the device name
    (None off CUDA). ``pair_gemv`` calls it."""
    if torch.device(device).type != "cuda":
        return None
    if not _CARD:
        _CARD.append(torch.cuda.get_device_name(device))
        for card, tiles in CARD_TILES.items():
            if card in _CARD[0]:
                TILES.update({k: dict(v) for k, v in tiles.items()
                              if TILES.get(k, _DEFAULT_TILES.get(k)) == _DEFAULT_TILES.get(k)})
    return _CARD[0]


def pair_gemv(a, w, out, expert, scale, a_div: int, silu_mul: bool = False, tile: str = "down",
              extra: tuple | None = None, single: bool = False, route: tuple | None = None,
              tail: dict | None = None, prologue: dict | None = None) -> None:
    """out (P, n) = each pair's row of a (row p // a_div) times its expert's w (E, N_w, K); n = N_w / 2 with
    silu_mul (w's rows [gate | up]), else N_w. extra = (gate_up (2 K2,), w2 (n, K2)): out has P + 1 rows and
    the last is silu(gate) * up times w2, computed in the same launch. single: w is one matrix (E = 1) and
    every pair reads it, so under PDL its first chunk loads before the wait for the previous kernel.
    route = (logits (E,), bias (E,), weights (P,)) for one token (a_div = P pairs, its top P experts): the
    kernel routes, writing the expert ids into ``expert`` and their weights into weights. tail: the keywords
    of ``residual.producer_tail`` (its rows of out are the tail's delta): the launch's last program runs it.
    prologue: the keywords of ``residual.consumer_prologue`` (a is not read: each program computes its row)."""
    P, n_out, K = expert.numel(), out.shape[1], w.shape[2]
    assert a.stride(-1) == 1 and w.stride(-1) == 1 and out.stride(-1) == 1 and a.shape[-1] == K
    assert w.shape[1] == (2 * n_out if silu_mul else n_out) and out.shape[0] == P + (extra is not None)
    gu2, w2 = extra if extra is not None else (a, w[0])  # (unread without extra)
    if extra is not None:
        assert gu2.stride(-1) == 1 and w2.stride(-1) == 1 and w2.shape[0] == n_out
        assert gu2.shape[-1] == 2 * w2.shape[1]
    assert not single or (w.shape[0] == 1 and extra is None)
    assert prologue is None or (a.shape[0] == 1 and P == 1 and extra is None and tail is None)
    routing = {}
    if route is not None:
        logits, bias, wt = route
        assert a.shape[0] == 1 and a_div == P and extra is None and scale is None and logits.stride(-1) == 1
        assert expert.dtype == torch.long and expert.is_contiguous() and wt.is_contiguous() and wt.numel() == P
        routing = dict(logits_ptr=logits, bias_ptr=bias, wt_ptr=wt, E=logits.shape[-1], ROUTE=True, TOP_K=P,
                       BLOCK_E=triton.next_power_of_2(logits.shape[-1]))
    if a.is_cuda and not _CARD:
        use_card_tiles(a.device)
    t = TILES[tile]
    launch = pdl.launch(a)
    grid = (out.shape[0], triton.cdiv(n_out, t["block_n"]))
    _pair_gemv_kernel[grid](a, w, out, expert, scale if scale is not None else a, gu2, w2, P, n_out, K, w2.shape[1],
                            a_div, a.stride(0), w.stride(0), w.stride(1), w2.stride(0), out.stride(0),
                            HAS_SCALE=scale is not None, SILU_MUL=silu_mul, EXTRA=extra is not None,
                            BLOCK_N=t["block_n"], BLOCK_K=t["block_k"], num_warps=t["num_warps"],
                            PIPE=t["pipe"],
                            PREFETCH=launch["PDL"] and single, **routing, **(tail or {}), **(prologue or {}),
                            **launch)


def runs(x: torch.Tensor) -> bool:
    """Whether the kernel serves x: bf16/fp16 on CUDA (float32 there stays cuBLAS'), any dtype in Triton's CPU
    interpreter."""
    if triton is None or not triton_ops.enabled(x):
        return False
    return x.dtype in (torch.bfloat16, torch.float16) if x.is_cuda else True


_EXPERT0: dict = {}


def _one_row(x: torch.Tensor, w: torch.Tensor, tail: dict | None = None, prologue: dict | None = None) -> torch.Tensor:
    """x (K elements) times w (N, K) through ``pair_gemv`` -> (1, N); tail: ``residual.producer_tail``'s keywords;
    prologue: ``residual.consumer_prologue``'s (x is then only a stand-in of its shape)."""
    K = w.shape[-1]
    key = str(x.device)
    if key not in _EXPERT0:  # made before a graph is captured (the first call is eager), read ever after
        _EXPERT0[key] = torch.zeros(1, dtype=torch.long, device=x.device)
    out = torch.empty(1, w.shape[0], device=x.device, dtype=x.dtype)
    if x.is_cuda and not _CARD:  # the card's per-shape tiles are known before one is looked up
        use_card_tiles(x.device)
    pair_gemv(x.reshape(1, K), w.unsqueeze(0), out, _EXPERT0[key], None, 1, tile=dense_tile(w.shape[0], K),
              single=True, tail=tail, prologue=prologue)
    return out


def _serves(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    return DENSE and b is None and x.numel() == w.shape[-1] and w.stride(-1) == 1 and runs(x)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b); a single row (x.numel() == K) through ``pair_gemv`` where ``runs`` and ``DENSE``."""
    if not _serves(x, w, b):
        return F.linear(x, w, b)
    return _one_row(x, w).view(*x.shape[:-1], w.shape[0])


def linear_add_norm(x: torch.Tensor, w: torch.Tensor, h: torch.Tensor, norm,
                    b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + F.linear(x, w, b), norm(that)), h's shape: for one row through ``pair_gemv`` with the tail in the
    same launch where ``residual.producer_tail`` allows, else ``linear`` then ``residual.add_norm``."""
    fused = residual.producer_tail(h, norm) if _serves(x, w, b) and h.numel() == w.shape[0] else None
    if fused is None:
        return residual.add_norm(h, linear(x, w, b).view(h.shape), norm)
    kw, h_out, x_out = fused
    _one_row(x, w, kw)
    return h_out, x_out


def add_norm_linear(h: torch.Tensor, delta: torch.Tensor, norm, w: torch.Tensor,
                    b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``residual.add_norm`` followed by ``linear``: (h', x', F.linear(x', w, b)) with h' = h + delta and
    x' = norm(h'). For one row in one launch where ``residual.consumer_prologue`` allows (each program of the
    product computes x' itself), else the tail kernel and the product."""
    fused = residual.consumer_prologue(h, delta, norm) if _serves(h, w, b) else None
    if fused is None:
        h, x = residual.add_norm(h, delta, norm)
        return h, x, linear(x, w, b)
    kw, h_out, x_out = fused
    return h_out, x_out, _one_row(h, w, prologue=kw).view(*h.shape[:-1], w.shape[0])
