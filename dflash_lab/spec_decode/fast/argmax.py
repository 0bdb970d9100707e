"""The greedy pick over a large vocabulary as one split launch: torch's argmax, row by row, in many programs.

torch's argmax over the last dimension reduces a row in one thread block. A row of Laguna-XS.2's logits is
100352 values, so at one token the whole pick runs on one SM: 27 us on an H200, about 1 % of the target's
token there. Here each row is cut into ``CHUNK``-wide pieces, one program a piece, and the piece's best is
packed into one int64 key, its value's order-preserving bits above its inverted index, so that the largest
key names the largest value and, among equal values, the lowest index. The programs of a row count
themselves in on an atomic counter (``pdl.counters``) and the last to arrive reduces the row's keys, writes
the index and resets the counter: the pick stays one launch.

    argmax(logits, out=None)   logits (..., V) -> int64 (...): what ``logits.argmax(-1)`` returns (the first
                               index of the maximum; a NaN counts as the maximum, the first NaN wins), from the
                               kernel where ``runs``, else from torch. out: a tensor of that shape to write into
                               (any strides, at most two dimensions)

The result is torch's bit for bit: a comparison of values, no arithmetic.
"""

from __future__ import annotations

import torch

from . import pdl, triton_ops

try:  # Triton is a GPU-side extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

ON = True  # the switch: a benchmark times the step with torch's argmax in the same process (off)
CHUNK = 2048  # vocabulary entries a program; a row of V entries is cdiv(V, CHUNK) programs
_INV = 0x7FFFFFFF  # the low 32 bits hold _INV - index: the larger key is the lower index


if triton is not None:

    @triton.jit
    def _argmax_kernel(x_ptr, out_ptr, keys_ptr, count_ptr, V, stride_x, W, stride_o0, stride_o1,
                       SPLITS: tl.constexpr, CHUNK: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        row = tl.program_id(0)
        split = tl.program_id(1)
        cols = split * CHUNK + tl.arange(0, CHUNK)
        ok = cols < V
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # a float's order as a signed integer's
        order = tl.where(x == 0.0, 0, order)  # -0.0 equals 0.0: the first of them wins, as in torch
        order = tl.where(x != x, 0x7FFFFFFF, order)  # every NaN above +inf, as torch ranks it
        key = (order.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)
        key = tl.where(ok, key, -9223372036854775807 - 1)
        best = tl.max(key, axis=0)
        o = out_ptr + (row // W) * stride_o0 + (row % W) * stride_o1
        if SPLITS == 1:
            tl.store(o, 0x7FFFFFFF - (best & 0xFFFFFFFF))
        else:
            tl.store(keys_ptr + row * SPLITS + split, best)
            if MERGE:  # the last program of the row reduces the row's keys, then resets its counter
                tl.debug_barrier()
                arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel", scope="gpu")
                if arrived == SPLITS - 1:
                    ks = tl.load(keys_ptr + row * SPLITS + tl.arange(0, SPLITS), cache_modifier=".cg")
                    tl.store(o, 0x7FFFFFFF - (tl.max(ks, axis=0) & 0xFFFFFFFF))
                    tl.atomic_xchg(count_ptr + row, 0, sem="relaxed", scope="gpu")


def runs(logits: torch.Tensor) -> bool:
    """Whether ``argmax`` takes the kernel for these logits: ``ON``, a floating dtype, a row under 2**31 entries, on
    CUDA or in Triton's interpreter, the fused switch on (``triton_ops.enabled``)."""
    return (ON and triton is not None and triton_ops.enabled(logits) and logits.dim() >= 1 and logits.numel() > 0
            and logits.dtype in (torch.float32, torch.float16, torch.bfloat16) and logits.shape[-1] < _INV)


def _splits(V: int) -> int:
    """Programs a row: a power of two (the merge loads the keys as one block), the last ones may be empty."""
    return triton.next_power_of_2(triton.cdiv(V, CHUNK))


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(-1)`` (into ``out`` when given); see the module docstring."""
    lead = logits.shape[:-1]
    if out is not None and (out.shape != lead or out.dtype != torch.long or out.dim() > 2
                            or out.device != logits.device):
        raise ValueError(f"argmax: out must be int64 of shape {tuple(lead)} (at most 2 dimensions) on "
                         f"{logits.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if not runs(logits):
        return logits.argmax(-1) if out is None else out.copy_(logits.argmax(-1))
    V = logits.shape[-1]
    x = logits.reshape(-1, V)
    if x.stride(-1) != 1:
        x = x.contiguous()
    R = x.shape[0]
    res = torch.empty(lead, device=logits.device, dtype=torch.long) if out is None else out
    o2 = res.view(1, 1) if res.dim() == 0 else res.unsqueeze(0) if res.dim() == 1 else res  # (rows // W, W)
    W = o2.shape[1]
    splits = _splits(V)
    keys = torch.empty(R * splits, device=x.device, dtype=torch.long) if splits > 1 else res
    counts = pdl.counters(x.device, R, "argmax") if splits > 1 else None
    _argmax_kernel[(R, splits)](x, o2, keys, counts if counts is not None else keys, V, x.stride(0), W,
                                o2.stride(0), o2.stride(1), SPLITS=splits, CHUNK=CHUNK, MERGE=counts is not None,
                                num_warps=4, **pdl.launch(x))
    if splits > 1 and counts is None:  # no counters while a graph is captured: torch reduces the keys
        o2.copy_((_INV - (keys.view(R, splits).amax(-1) & 0xFFFFFFFF)).view(o2.shape))
    return res
