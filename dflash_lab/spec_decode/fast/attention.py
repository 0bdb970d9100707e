"""One kernel for the static path's attention: visibility from positions, online softmax, Laguna's gate.

The torch path (``layers.gqa_attention``) attends every query to every slot of the cache through an
additive mask: the forward first builds a (B, g*Q, capacity) mask per window, then cuDNN's SDPA reads
the whole capacity, then two more kernels apply softplus(g) to the output. Here one launch per layer
does all of it, and reads only the slots a query can see:

    gated_attention(q, k, v, gate, qpos, scale, window=None, per_head=True)         the chain
    gated_attention(..., tree_start=start, ancestors=tree.ancestors)               a draft tree
    slot_attention(q, k, v, gate, visibility, scale, per_head)                     the drafter's block
    rope_attention(qkv, q_norm_w, k_norm_w, eps, cos, sin, rope_positions, ...)   a chain step from the raw
                   q|k|v projection: the head norms, RoPE and the new K/V's write (``triton_ops.qk_rope_write``)
                   done by the attention's own programs (``ROPE_IN``, off: one launch fewer a layer but slower)

q (B, Q, H, hd); k, v (B, nkv, S, hd) (the cache, or a prefill's own keys; any strides); gate (B, Q, H)
(``per_head``) or (B, Q, H*hd), pre-activation; qpos (B, Q) each query's position. The output is
(B, Q, H*hd): softplus(gate) * softmax(q k^T * scale + mask) v, with the torch path's roundings
(the attention output and the gate each rounded to the input dtype, then their product).

Which slots a query sees is the torch path's rule, computed in the kernel from qpos instead of read
from a mask (slot == position in the static cache):

    chain   slot s <= qpos, and qpos - s < window on a sliding layer
    tree    (``StaticTarget.forward(tree=...)``: the tree's Q = N + 1 indices sit at slots start .. start+N,
            tree index i at position qpos[b, i] = start + depth) slots below start as a chain query, tree
            slot start + j when ancestors[b, i, j], and within the window on positions
    block   the drafter's DFlash block over its context slots (``block_attention.SlotVisibility``): a
            tree whose ancestors are the block's pattern, all ones (non-causal) or the lower triangle
            (causal), and the window two-sided, |q - k| < window (``visible_keys``)

A program takes one (row, KV head, 16 of the g*Q query rows): the g query heads that share a KV head
are folded into the rows (as ``gqa_attention`` folds them), so K/V are read once per KV head. It walks
only the slot blocks between the lowest slot any of its queries sees (the window) and the highest. On a
long cache (``num_splits``: from 512 slots) several programs share that range and their partial maxima, sums
and accumulators are merged (flash-decoding), so that a decode step of a few rows does not walk a thousand
slots in a handful of programs. The merge runs in the split that finishes last (each split counts itself in
on an atomic counter, ``MERGE_IN_LAST``), so the whole attention stays one launch; a second kernel merges
instead where no counters are at hand (a first call while a CUDA graph is being captured) or the switch is off.
With RoPE taken in, each program first norms and rotates its own query rows into q and writes the K/V of
every new token whose slot lies in its own slot range (programs that share a range write the same values),
then reads them back after a barrier: no program reads a slot another program is still writing.
The exponentials run in float32; float32 inputs multiply in IEEE float32 (no TF32).

Off CUDA (and without Triton) ``usable`` is False and the static path keeps the torch route; Triton's
interpreter (TRITON_INTERPRET=1) runs this kernel on the CPU, which is how CI checks it.
"""

from __future__ import annotations

import torch

from ... import context_kv_kernel as kernels
from . import pdl
from .rope_tile import norm_rope_tile, store_tile

try:  # Triton is a GPU-side extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

BLOCK_N = 32  # key slots per iteration
BLOCK_M = 16  # folded query rows per program, whatever Q is: a row's sums never depend on the step's width
SPLIT_FROM, SPLIT_SLOTS, MAX_SPLITS = 512, 128, 8  # flash-decoding: a long cache's slots shared by programs
MERGE_IN_LAST = True  # the splits merged by the last of them (one launch), not by a second kernel
# A chain step's q/k norm, RoPE and K/V write inside the kernel (``rope_attention``), at most ROPE_MAX_Q tokens a
# row. Off: on an H100 a Laguna-XS.2 token took 3.110 ms with it against 3.044 ms with ``qk_rope_write`` apart
# (benchmarks/xs2_switches_h100.md); benchmarks time both.
ROPE_IN, ROPE_MAX_Q = False, 64


def usable(q: torch.Tensor) -> bool:
    """Whether ``gated_attention`` runs for these queries (CUDA, or Triton's interpreter; the fused switch on)."""
    return kernels.runs_here(q) and q.dtype in (torch.float32, torch.float16, torch.bfloat16)


if triton is not None:

    @triton.jit
    def _rows(G: tl.constexpr, BLOCK_M: tl.constexpr, NKV, Q):
        """This program's (row b, KV head, query qi, head, row_ok) of its BLOCK_M folded rows."""
        b = tl.program_id(0) // NKV
        kvh = tl.program_id(0) % NKV
        r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # folded rows: query qi, group member gi
        qi = r // G
        return b, kvh, qi, kvh * G + r % G, qi < Q

    @triton.jit
    def _finish(acc, l_i, b, qi, head, row_ok, g_ptr, out_ptr, sg_b, sg_q, so_b, so_q,
                HD: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr, PER_HEAD: tl.constexpr):
        """Normalise, round as SDPA's output is rounded, apply softplus(gate), store (B, Q, H*hd)."""
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HD
        dt = out_ptr.dtype.element_ty
        out = (acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]).to(dt).to(tl.float32)
        if HAS_GATE:
            if PER_HEAD:
                g = tl.load(g_ptr + b * sg_b + qi * sg_q + head, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            else:
                g = tl.load(g_ptr + b * sg_b + qi[:, None] * sg_q + head[:, None] * HD + d[None, :],
                            mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            e = tl.exp(tl.minimum(g, 20.0))
            gate = tl.where(g > 20.0, g, tl.where(e < 1e-4, e - 0.5 * e * e, tl.log(1.0 + e)))  # softplus (log1p)
            out = out * gate.to(dt).to(tl.float32)
        tl.store(out_ptr + b * so_b + qi[:, None] * so_q + head[:, None] * HD + d[None, :], out.to(dt),
                 mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _gated_attention_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, out_ptr, qpos_ptr, start_ptr, anc_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
        sq_b, sq_q, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sg_b, sg_q, so_b, so_q, sa_b, sa_i,
        NKV, Q, S, window, scale,
        G: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, TREE: tl.constexpr, HAS_GATE: tl.constexpr,
        PER_HEAD: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, count_ptr=None, MERGE: tl.constexpr = False,
        x_ptr=None, wq_ptr=None, wk_ptr=None, cos_ptr=None, sin_ptr=None, rpos_ptr=None, sx_b=0, sx_q=0, s_cs=0,
        eps=0.0, ROPE: tl.constexpr = False, TABLE: tl.constexpr = False, ROT: tl.constexpr = 2,
        BLOCK_HALF: tl.constexpr = 1, BLOCK_PASS: tl.constexpr = 1, BLOCK_T: tl.constexpr = 1,
    ):
        pdl.enter(PDL)
        b, kvh, qi, head, row_ok = _rows(G, BLOCK_M, NKV, Q)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HD
        qpos = tl.load(qpos_ptr + b * Q + qi, mask=row_ok, other=0)
        if TREE:
            start = tl.load(start_ptr + b)
            hi = start + Q
        else:
            start = 0
            hi = tl.max(tl.where(row_ok, qpos, 0), axis=0) + 1
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(tl.min(tl.where(row_ok, qpos, 2147483647), axis=0) - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        hi = tl.minimum(hi, S)
        end = hi
        if SPLITS > 1:  # this program's share of the slot blocks (flash-decoding): whole blocks each
            chunk = ((hi - lo + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
            lo = lo + tl.program_id(2) * chunk
            end = tl.minimum(lo + chunk, hi)
        k_base = k_ptr + b * sk_b + kvh * sk_h
        v_base = v_ptr + b * sv_b + kvh * sv_h
        if ROPE:  # this program's queries, and the step's new keys in its slot range, normed and rotated here
            _rope_in(x_ptr, q_ptr, k_base, v_base, wq_ptr, wk_ptr, cos_ptr, sin_ptr, rpos_ptr, qpos_ptr, b, kvh, qi,
                     head, row_ok, lo, end, Q, sx_b, sx_q, sq_b, sq_q, sq_h, sk_s, sv_s, s_cs, eps, NKV * G, NKV, HD,
                     ROT, TABLE, BLOCK_HALF, BLOCK_PASS, BLOCK_T, BLOCK_D)
            tl.debug_barrier()  # every thread's stores made before any thread reads them back
        q = tl.load(q_ptr + b * sq_b + qi[:, None] * sq_q + head[:, None] * sq_h + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for s0 in range(lo, end, BLOCK_N):
            s = s0 + tl.arange(0, BLOCK_N)
            s_ok = s < hi
            k = tl.load(k_base + s[:, None] * sk_s + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = scores * scale
            if TREE:
                rel = s - start
                in_tree = (rel >= 0) & s_ok
                anc = tl.load(anc_ptr + b * sa_b + qi[:, None] * sa_i + rel[None, :],
                              mask=row_ok[:, None] & in_tree[None, :], other=0)
                visible = ((rel < 0)[None, :] | (anc != 0)) & s_ok[None, :]
                kpos = tl.where(in_tree, tl.load(qpos_ptr + b * Q + rel, mask=in_tree, other=0), s)
            else:
                visible = (s[None, :] <= qpos[:, None]) & s_ok[None, :]
                kpos = s
            if HAS_WINDOW:  # |q - k|: a non-causal block sees keys after its query too (chain, tree: never)
                visible = visible & (tl.abs(qpos[:, None] - kpos[None, :]) < window)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + s[:, None] * sv_s + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLITS > 1:  # the partial (max, sum, accumulator) for ``_merge``
            tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
            part = (tile * SPLITS + tl.program_id(2)).to(tl.int64) * BLOCK_M
            rows = part + tl.arange(0, BLOCK_M)
            tl.store(part_m_ptr + rows, m_i)
            tl.store(part_l_ptr + rows, l_i)
            tl.store(part_acc_ptr + rows[:, None] * BLOCK_D + d[None, :], acc)
            if MERGE:  # the last split to count itself in merges all of them, then resets the counter
                tl.debug_barrier()  # every thread's partial stored before the count releases them
                arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
                if arrived == SPLITS - 1:
                    _merge((tile * SPLITS).to(tl.int64) * BLOCK_M, b, qi, head, row_ok, g_ptr, out_ptr, part_m_ptr,
                           part_l_ptr, part_acc_ptr, sg_b, sg_q, so_b, so_q, HD, BLOCK_D, BLOCK_M, SPLITS,
                           HAS_GATE, PER_HEAD)
                    tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
        else:
            _finish(acc, l_i, b, qi, head, row_ok, g_ptr, out_ptr, sg_b, sg_q, so_b, so_q,
                    HD, BLOCK_D, HAS_GATE, PER_HEAD)

    @triton.jit
    def _rope_in(x_ptr, q_ptr, k_base, v_base, wq_ptr, wk_ptr, cos_ptr, sin_ptr, rpos_ptr, qpos_ptr, b, kvh, qi, head,
                 row_ok, lo, end, Q, sx_b, sx_q, sq_b, sq_q, sq_h, sk_s, sv_s, s_cs, eps, H, NKV,
                 HD: tl.constexpr, ROT: tl.constexpr, TABLE: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_PASS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """What ``triton_ops.qk_rope_write`` does, for one program: its query rows' head norm and RoPE from the
        q|k|v projection x into q, and the K/V of every new token of row b whose slot (its position: a chain)
        lies in [lo, end), this program's range, into the cache. Programs that share a range write the same
        values; none reads a slot it did not write or an earlier step did not."""
        dt = q_ptr.dtype.element_ty
        tok = (b * Q + qi)[:, None]
        if TABLE:  # cos/sin tables over positions, read at each token's position; else one row a token
            cs = tl.load(rpos_ptr + tok, mask=row_ok[:, None], other=0).to(tl.int64) * s_cs
        else:
            cs = tok.to(tl.int64) * s_cs
        src = x_ptr + b * sx_b + qi[:, None] * sx_q + head[:, None] * HD
        o1, o2, y3, c1, c3, m1, m3 = norm_rope_tile(src, wq_ptr, cos_ptr, sin_ptr, row_ok[:, None], cs, eps, dt,
                                                    HD, ROT, BLOCK_HALF, BLOCK_PASS)
        store_tile(q_ptr + b * sq_b + qi[:, None] * sq_q + head[:, None] * sq_h, o1, o2, y3, c1, c3, m1, m3, ROT)
        t = tl.arange(0, BLOCK_T)[:, None]
        slot = tl.load(qpos_ptr + b * Q + t, mask=t < Q, other=-1)
        own = (t < Q) & (slot >= lo) & (slot < end)
        if TABLE:
            cs = tl.load(rpos_ptr + b * Q + t, mask=own, other=0).to(tl.int64) * s_cs
        else:
            cs = (b * Q + t).to(tl.int64) * s_cs
        row = x_ptr + b * sx_b + t * sx_q
        o1, o2, y3, c1, c3, m1, m3 = norm_rope_tile(row + (H + kvh) * HD, wk_ptr, cos_ptr, sin_ptr, own, cs, eps, dt,
                                                    HD, ROT, BLOCK_HALF, BLOCK_PASS)
        store_tile(k_base + slot.to(tl.int64) * sk_s, o1, o2, y3, c1, c3, m1, m3, ROT)
        dd = tl.arange(0, BLOCK_D)[None, :]
        md = own & (dd < HD)
        tl.store(v_base + slot.to(tl.int64) * sv_s + dd, tl.load(row + (H + NKV + kvh) * HD + dd, mask=md), mask=md)

    @triton.jit
    def _merge(first, b, qi, head, row_ok, g_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sg_b, sg_q, so_b,
               so_q, HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr,
               HAS_GATE: tl.constexpr, PER_HEAD: tl.constexpr):
        """The SPLITS partials of one program's rows (from row ``first``) merged: each rescaled to the largest
        max, then summed; finished as one split would be. Read past L1 (other programs wrote them)."""
        d = tl.arange(0, BLOCK_D)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        for sp in tl.static_range(SPLITS):
            m = tl.maximum(m, tl.load(part_m_ptr + first + sp * BLOCK_M + tl.arange(0, BLOCK_M), cache_modifier=".cg"))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for sp in tl.static_range(SPLITS):
            rows = first + sp * BLOCK_M + tl.arange(0, BLOCK_M)
            w = tl.exp(tl.load(part_m_ptr + rows, cache_modifier=".cg") - m_safe)  # 0 for a split that saw nothing
            l_i += w * tl.load(part_l_ptr + rows, cache_modifier=".cg")
            acc += w[:, None] * tl.load(part_acc_ptr + rows[:, None] * BLOCK_D + d[None, :], cache_modifier=".cg")
        _finish(acc, l_i, b, qi, head, row_ok, g_ptr, out_ptr, sg_b, sg_q, so_b, so_q,
                HD, BLOCK_D, HAS_GATE, PER_HEAD)

    @triton.jit
    def _combine_kernel(g_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sg_b, sg_q, so_b, so_q, NKV, Q,
                        G: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        SPLITS: tl.constexpr, HAS_GATE: tl.constexpr, PER_HEAD: tl.constexpr, PDL: tl.constexpr):
        """The splits of one program's rows merged, as a kernel of its own (``_merge``)."""
        pdl.enter(PDL)
        b, kvh, qi, head, row_ok = _rows(G, BLOCK_M, NKV, Q)
        first = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * SPLITS * BLOCK_M
        _merge(first, b, qi, head, row_ok, g_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, sg_b, sg_q, so_b,
               so_q, HD, BLOCK_D, BLOCK_M, SPLITS, HAS_GATE, PER_HEAD)


def gated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, qpos: torch.Tensor,
                    scale: float, *, window: int | None = None, per_head: bool = True,
                    tree_start: torch.Tensor | None = None, ancestors: torch.Tensor | None = None,
                    _rope: dict | None = None) -> torch.Tensor:
    """softplus(gate) * attention of q (B, Q, H, hd) over k/v (B, nkv, S, hd) -> (B, Q, H*hd); see the module
    docstring. ``gate`` None: no gate. A tree passes ``tree_start`` (B,) and ``ancestors`` (B, Q, Q) bool
    (any batch stride: a block's one pattern expanded). qpos in int32 saves a conversion per call."""
    B, Q, H, hd = q.shape
    nkv, S = k.shape[1], k.shape[2]
    tree = tree_start is not None
    if H % nkv or k.shape != v.shape[:3] + (hd,) or k.shape[0] != B or qpos.shape != (B, Q):
        raise ValueError(f"gated_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"qpos {tuple(qpos.shape)} do not fit (B, Q, H, hd) / (B, nkv, S, hd) / (B, Q)")
    if tree != (ancestors is not None) or (tree and ancestors.shape != (B, Q, Q)):
        raise ValueError("a tree needs tree_start (B,) and ancestors (B, Q, Q) together")
    if gate is not None and gate.shape != (B, Q, H if per_head else H * hd):
        raise ValueError(f"gate {tuple(gate.shape)} is not (B, Q, {'H' if per_head else 'H*hd'})")
    if any(t is not None and t.stride(-1) != 1 for t in (q, k, v, gate, ancestors)):
        raise ValueError("q, k, v, gate and ancestors need a contiguous last dimension")
    G = H // nkv
    out = torch.empty((B, Q, H * hd), device=q.device, dtype=q.dtype)
    qpos = qpos if qpos.dtype == torch.int32 and qpos.is_contiguous() else qpos.to(torch.int32).contiguous()
    start = tree_start.to(torch.int32).contiguous() if tree else qpos  # no copy when it is so already
    anc = ancestors.view(torch.uint8) if tree else qpos
    g = q if gate is None else gate
    splits = num_splits(S)
    grid = (B * nkv, triton.cdiv(G * Q, BLOCK_M), splits)
    block_d = triton.next_power_of_2(hd)
    if splits > 1:  # each program's partial (max, sum, accumulator) for the merge
        parts = grid[0] * grid[1] * splits * BLOCK_M
        part_m, part_l = (torch.empty(parts, device=q.device, dtype=torch.float32) for _ in range(2))
        part_acc = torch.empty((parts, block_d), device=q.device, dtype=torch.float32)
    else:  # never read: the kernel finishes in place
        part_m = part_l = part_acc = out
    counts = pdl.counters(q.device, grid[0] * grid[1], "attention") if splits > 1 and MERGE_IN_LAST else None
    _gated_attention_kernel[grid](
        q, k, v, g, out, qpos, start, anc, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), out.stride(0), out.stride(1),
        anc.stride(0) if tree else 0, anc.stride(1) if tree else 0,
        nkv, Q, S, window or 0, float(scale),
        G=G, HD=hd, BLOCK_D=block_d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLITS=splits,
        HAS_WINDOW=window is not None, TREE=tree, HAS_GATE=gate is not None, PER_HEAD=per_head,
        IEEE=q.dtype == torch.float32, **pdl.launch(q), count_ptr=counts, MERGE=counts is not None, **(_rope or {}),
    )
    if splits > 1 and counts is None:
        _combine_kernel[grid[:2]](g, out, part_m, part_l, part_acc, g.stride(0), g.stride(1), out.stride(0),
                                  out.stride(1), nkv, Q, G=G, HD=hd, BLOCK_D=block_d, BLOCK_M=BLOCK_M,
                                  SPLITS=splits, HAS_GATE=gate is not None, PER_HEAD=per_head, **pdl.launch(q))
    return out


def rope_in_usable(qkv: torch.Tensor) -> bool:
    """Whether ``rope_attention`` serves a step of these q|k|v rows (B, Q, ...): ``ROPE_IN``, the kernel runs
    here, at most ``ROPE_MAX_Q`` tokens a row (a decode or verify step; a prefill keeps its own kernel)."""
    return ROPE_IN and usable(qkv) and qkv.shape[1] <= ROPE_MAX_Q and qkv.stride(-1) == 1


def rope_attention(qkv: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor, rope_positions: torch.Tensor | None, cache_k: torch.Tensor, cache_v: torch.Tensor,
                   gate: torch.Tensor | None, qpos: torch.Tensor, scale: float, heads: int, *,
                   window: int | None = None, per_head: bool = True) -> torch.Tensor:
    """``triton_ops.qk_rope_write`` and ``gated_attention`` of a chain step in one launch: qkv (B, Q, >= (heads +
    2 nkv) * hd) the projection's q|k|v columns; q's and k's head norms (weights, eps) and RoPE (cos/sin tables
    read at ``rope_positions`` (B, Q), or rows (B, Q, rd) when None) applied in the attention kernel, which
    writes the new K/V at slots qpos (B, Q) of cache_k/v (B, nkv, S, hd) before it reads them. The same values,
    rounded the same way, as the two kernels; see ``rope_in_usable``."""
    B, Q, _ = qkv.shape
    nkv, hd = cache_k.shape[1], cache_k.shape[3]
    if qkv.shape[2] < (heads + 2 * nkv) * hd or qpos.shape != (B, Q) or not rope_in_usable(qkv):
        raise ValueError(f"rope_attention: qkv {tuple(qkv.shape)} and qpos {tuple(qpos.shape)} do not fit {heads} "
                         f"heads and {nkv} KV heads of {hd} at most {ROPE_MAX_Q} tokens, or the kernel does not run")
    table = rope_positions is not None
    cs, sn = (cos, sin) if table else (cos.reshape(B * Q, -1), sin.reshape(B * Q, -1))
    if cs.stride(-1) != 1 or sn.stride(-1) != 1 or cs.stride(0) != sn.stride(0):
        cs, sn = cs.contiguous(), sn.contiguous()
    qpos = qpos if qpos.dtype == torch.int32 and qpos.is_contiguous() else qpos.to(torch.int32).contiguous()
    rpos = rope_positions.to(torch.int32).reshape(-1).contiguous() if table else qpos
    rot = cs.shape[-1]
    kw = dict(x_ptr=qkv, wq_ptr=q_norm_w, wk_ptr=k_norm_w, cos_ptr=cs, sin_ptr=sn, rpos_ptr=rpos, sx_b=qkv.stride(0),
              sx_q=qkv.stride(1), s_cs=cs.stride(0), eps=float(eps), ROPE=True, TABLE=table, ROT=rot,
              BLOCK_HALF=triton.next_power_of_2(rot // 2), BLOCK_PASS=triton.next_power_of_2(max(hd - rot, 1)),
              BLOCK_T=triton.next_power_of_2(Q))
    q = torch.empty((B, Q, heads, hd), device=qkv.device, dtype=qkv.dtype)  # written by the kernel itself
    return gated_attention(q, cache_k, cache_v, gate, qpos, scale, window=window, per_head=per_head, _rope=kw)


def num_splits(slots: int) -> int:
    """How many programs share one row's slot range: 1 below ``SPLIT_FROM`` slots (a short cache is read in a
    few iterations), else one per ``SPLIT_SLOTS`` slots, at most ``MAX_SPLITS``. A function of the cache's
    capacity only, so a row's sums do not depend on the batch or the step's width."""
    return 1 if slots < SPLIT_FROM else min(MAX_SPLITS, slots // SPLIT_SLOTS)


def slot_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, visibility,
                   scale: float, per_head: bool = True) -> torch.Tensor:
    """The drafter's block over its slots: q (B, Q, H, hd), k/v (B, nkv, S, hd), visibility a
    ``block_attention.SlotVisibility`` -> (B, Q, H*hd)."""
    return gated_attention(q, k, v, gate, visibility.positions, scale, window=visibility.window, per_head=per_head,
                           tree_start=visibility.start, ancestors=visibility.pattern)
