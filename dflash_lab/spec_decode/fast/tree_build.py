"""A DDTree's per-depth beam search in one kernel (``tree.build_draft_tree(beams=...)``).

``tree.beam_loop`` finds the best ``budget`` prefixes of each depth from those of the depth before with
three kernels a depth (a gather of the previous weights by beam, the add, a top-k): 42 launches for a
block of 16, most of a tree step's build. Here one program per tree walks every depth itself: it gathers
the previous depth's weights from its own output row, adds each extension's log q, and sorts the C
candidates (C is about budget * ln(budget), padded to a power of two) with ``tl.sort`` on one 64-bit key
per candidate: the float's bits, made order-preserving as an integer, above the candidate's index, so the
sort carries the index with it and equal weights keep the lower index first. The first ``budget`` of the
sorted keys are the depth's beam.

Values are the same float32 sums as ``beam_loop``'s (one add each), so both find the same beams; only
the order among exactly equal weights may differ (top-k leaves it unspecified).
"""

from __future__ import annotations

import torch

from . import triton_ops
from ..tree import beam_loop

try:  # Triton is a GPU-side extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

MAX_CANDIDATES = 4096  # one program sorts its candidates in registers; more go to ``beam_loop``

if triton is not None:

    @triton.jit
    def _ordered(x):
        """float32 -> int32 whose integer order is the float order (-inf lowest)."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

    @triton.jit
    def _beam_kernel(w_ptr, ext_ptr, beam_ptr, idx_ptr, scratch_ptr, C, K, BUDGET: tl.constexpr,
                     C_PAD: tl.constexpr):
        """w (b, K, BUDGET) with depth 1 filled in; writes depths 2 .. K and idx (b, K-1, BUDGET)."""
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, C_PAD)
        ok = c < C
        beam = tl.load(beam_ptr + c, mask=ok, other=0)
        j = tl.arange(0, BUDGET)
        w_row, ext_row = w_ptr + row * K * BUDGET, ext_ptr + row * (K - 1) * C
        scratch = scratch_ptr + row * C_PAD
        for d in range(0, K - 1):
            prev = tl.load(w_row + d * BUDGET + beam, mask=ok, other=float("-inf"))
            val = tl.where(ok, prev + tl.load(ext_row + d * C + c, mask=ok, other=0.0), float("-inf"))
            key = (_ordered(val).to(tl.int64) << 32) | (C_PAD - 1 - c).to(tl.int64)  # lower index first on ties
            tl.store(scratch + c, tl.sort(key, 0, descending=True))
            tl.debug_barrier()
            top = tl.load(scratch + j)
            idx = (C_PAD - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
            ordered = (top >> 32).to(tl.int32)
            w = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
            tl.store(w_row + (d + 1) * BUDGET + j, w)
            tl.store(idx_ptr + row * (K - 1) * BUDGET + d * BUDGET + j, idx.to(tl.int64))
            tl.debug_barrier()  # the next depth gathers these weights


def runs(first: torch.Tensor, ext_lp: torch.Tensor, budget: int) -> bool:
    """Whether ``beam_kernel`` serves this search: Triton where ``triton_ops.enabled``, float32, a power-of-two
    budget, and few enough candidates for one program's registers."""
    return (triton is not None and triton_ops.enabled(first) and first.dtype == torch.float32
            and budget & (budget - 1) == 0 and ext_lp.shape[-1] <= MAX_CANDIDATES)


def beam_kernel(first: torch.Tensor, ext_lp: torch.Tensor, beam: torch.Tensor, budget: int):
    """``tree.beam_loop`` in one launch where ``runs``, else ``beam_loop`` itself (same arguments and results)."""
    b, km1, C = ext_lp.shape
    if km1 == 0 or not runs(first, ext_lp, budget):
        return beam_loop(first, ext_lp, beam, budget)
    K, c_pad = km1 + 1, triton.next_power_of_2(C)
    weights = torch.empty(b, K, budget, device=first.device, dtype=torch.float32)
    weights[:, 0].copy_(first)
    idx = torch.empty(b, km1, budget, device=first.device, dtype=torch.long)
    scratch = torch.empty(b, c_pad, device=first.device, dtype=torch.int64)
    _beam_kernel[(b,)](weights, ext_lp.contiguous(), beam, idx, scratch, C, K, BUDGET=budget, C_PAD=c_pad,
                       num_warps=4 if c_pad <= 1024 else 8)
    return weights, idx
