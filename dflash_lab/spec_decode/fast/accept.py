"""A step's accept phase in one kernel: what ``FastDecoder._accept`` does in about 36 small torch ops.

After the target's verify forward, every row of the batch decides how many drafts it keeps and moves on:

    n     = the drafts before the first that differs from the target's argmax (only the first n_draft count)
    next  = argmax[n]: the correction, or the bonus token when every draft was kept
    tokens[pos + 1 .. pos + width] = argmax (what follows the kept prefix is overwritten by later steps)
    stopped = a stop token among argmax[0 .. n]
    the step's counters: drafts verified and accepted in this row's log, steps, drafting steps
    pos, last advance by n + 1 on a live row; a row ends at a stop token or at its final position
    a row being filled by chunks (``chunked_fill.advance``): its prompt kept, pos at the chunk's end, and at its
    prompt's last chunk the first token, live unless it is a stop token

Each of those ops reads a few dozen integers and costs a launch: at batch 1 the phase is launch-bound.
One program per row does it all with the same integer arithmetic, so the state after the step is the same
to the bit (``tests/test_accept_kernel.py`` compares every buffer with the torch phase in the interpreter).
Where the kernel does not run (``triton_ops.enabled``), the decoder keeps its torch phase.
"""

from __future__ import annotations

import torch

try:  # Triton is a GPU-side extra
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None


if triton is not None:

    @triton.jit
    def _accept_kernel(drafts_ptr, argmax_ptr, n_draft_ptr, tokens_ptr, stop_ptr, pos_ptr, last_ptr, limit_ptr,
                       active_ptr, n_steps_ptr, n_drafts_ptr, draft_log_ptr, accepted_log_ptr, fill_len_ptr,
                       fill_ids_ptr,
                       stride_drafts, stride_argmax, stride_tokens, stride_log, stride_fill, dump_col, fixed_verified,
                       WIDTH: tl.constexpr, N_STOP: tl.constexpr, BLOCK: tl.constexpr, CHUNKED: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        K = WIDTH - 1
        j = tl.arange(0, BLOCK)
        in_width = j < WIDTH
        is_draft = j < K
        argmax = tl.load(argmax_ptr + row * stride_argmax + j, mask=in_width, other=0)
        drafts = tl.load(drafts_ptr + row * stride_drafts + j, mask=is_draft, other=-1)
        n_draft = tl.load(n_draft_ptr + row)
        agree = (drafts == argmax) & is_draft & (j < n_draft)
        n = tl.min(tl.where(agree, K, j), axis=0)  # the first position that disagrees (K when none does)
        nxt = tl.sum(tl.where(j == n, argmax, 0), axis=0)
        pos = tl.load(pos_ptr + row)
        written = argmax
        if CHUNKED:  # a row being filled (``chunked_fill``): its prompt stays at the chunk's next positions
            T = tl.load(fill_len_ptr + row)
            filling = pos < T
            prompt = filling & (pos + 1 + j < T)
            kept = tl.load(fill_ids_ptr + row * stride_fill + pos + 1 + j, mask=in_width & prompt, other=0)
            written = tl.where(prompt, kept, argmax)
        tl.store(tokens_ptr + row * stride_tokens + pos + 1 + j, written, mask=in_width)
        hit = tl.zeros((BLOCK,), tl.int1)
        for s in tl.static_range(N_STOP):
            hit = hit | (argmax == tl.load(stop_ptr + s))
        stopped = tl.max((hit & in_width & (j <= n)).to(tl.int32), axis=0) > 0
        new_pos = pos + n + 1
        active = tl.load(active_ptr + row) != 0
        drafted = active & (n_draft > 0) & (K > 0)
        n_drafts = tl.load(n_drafts_ptr + row)
        col = tl.where(drafted, n_drafts, dump_col)
        verified = tl.where(fixed_verified < 0, tl.minimum(n_draft, K), fixed_verified)
        tl.store(draft_log_ptr + row * stride_log + col, verified)
        tl.store(accepted_log_ptr + row * stride_log + col, n)
        tl.store(n_steps_ptr + row, tl.load(n_steps_ptr + row) + active.to(tl.int64))
        tl.store(n_drafts_ptr + row, n_drafts + drafted.to(tl.int64))
        limit = tl.load(limit_ptr + row)
        ended = stopped | (new_pos >= limit)
        pos_out, live_out = tl.where(active, new_pos, pos), active & ~ended
        last_out = tl.where(active, nxt, tl.load(last_ptr + row))
        if CHUNKED:  # the chunk that held the prompt's last token gives the first token there
            done = filling & (pos + WIDTH >= T)
            first = tl.sum(tl.where(j == tl.minimum(tl.maximum(T - 1 - pos, 0), WIDTH - 1), argmax, 0), axis=0)
            first_stop = tl.zeros((), tl.int1)
            for s in tl.static_range(N_STOP):
                first_stop = first_stop | (first == tl.load(stop_ptr + s))
            pos_out = tl.where(filling, tl.minimum(pos + WIDTH, T), pos_out)
            last_out = tl.where(done, first, last_out)
            live_out = live_out | (done & (T < limit) & ~first_stop)
        tl.store(pos_ptr + row, pos_out)
        tl.store(last_ptr + row, last_out)
        tl.store(active_ptr + row, live_out.to(tl.int8))


def accept_step(dec, width: int) -> None:
    """``FastDecoder._accept`` of a step ``width`` tokens wide, in one launch on ``dec``'s buffers."""
    for name in ("drafts", "argmax", "tokens", "draft_log", "accepted_log"):
        if getattr(dec, name).stride(-1) != 1:
            raise ValueError(f"accept_step needs a contiguous last dimension in the decoder's {name}")
    if dec.draft_log.stride(0) != dec.accepted_log.stride(0):
        raise ValueError("accept_step needs the draft and accepted logs laid out alike")
    chunked = dec.fill_ids is not None
    fill_len, fill_ids = (dec.fill_len, dec.fill_ids) if chunked else (dec.pos, dec.tokens)  # unread unless chunked
    _accept_kernel[(dec.pos.shape[0],)](
        dec.drafts, dec.argmax, dec.n_draft, dec.tokens, dec.stop_ids, dec.pos, dec.last, dec.limit,
        dec.active.view(torch.int8), dec.n_steps, dec.n_drafts, dec.draft_log, dec.accepted_log, fill_len, fill_ids,
        dec.drafts.stride(0), dec.argmax.stride(0), dec.tokens.stride(0), dec.draft_log.stride(0), fill_ids.stride(0),
        dec.draft_log.shape[1] - 1, -1 if dec.tree_budget is None else dec.tree_budget,
        WIDTH=width, N_STOP=dec.stop_ids.shape[0], BLOCK=triton.next_power_of_2(max(width, 2)), CHUNKED=chunked)
