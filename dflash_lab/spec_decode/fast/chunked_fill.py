"""A refill's prompt carried through the step itself: chunked prefill, as vLLM's scheduler mixes prefill and decode.

    FastDecoder(..., chunked_fill=True)        every captured step also carries the rows being filled
    decoder.fill(rows, n, chunked=True)        a row takes its prompt with a few copies, no forward of its own

A ``FastDecoder.fill`` is its own forward over the filled rows: on a small model about as dear as a whole step,
for one row. vLLM 0.33 schedules no such pass: each step's batch holds every running request's tokens, a
new request's prompt tokens among them, chunked to the step's token budget (``v1/core/sched/scheduler.py``:
``num_new_tokens`` of a request still prefilling is its prompt's next chunk). Here the step's shape stays
(batch, W): a row being filled verifies its prompt's next W tokens in place of [x_t, drafts], at their
positions, so the target's K/V and the drafter's context K/V of the prompt are written by the step's own
verify and append; the row emits nothing until the chunk that holds its prompt's last token, whose argmax
there is its first token. A filled row costs the batch ceil(T / W) of its row's steps and no launch.

In the graphed step a row is being filled while ``pos < fill_len`` (its prompt's length T; 0 once filled by
``FastDecoder.fill``); it is inactive then, so the accept phase moves none of its state, and ``advance``
runs after it (where the accept kernel runs, the kernel does the same in its one launch: ``accept.py``):

    tokens  the prompt put back at the chunk's next positions (the accept phase wrote argmax there; at T
            it wrote the first token, which stays)
    pos     the chunk's end, T at the last chunk
    last    the first token, at the last chunk
    active  at the last chunk: live unless the first token is a stop token or T is its final position

The drafts of a row being filled are drafted and dropped (the row's step is computed, as a finished row's
is): every row of a graphed step runs the same kernels.
"""

from __future__ import annotations

import torch

from ...runtime import upload


def check(dec, phase_graphs: bool) -> None:
    """Refuse a decoder whose steps cannot carry a prompt: a host proposer, a tree step, phase graphs."""
    if dec.lookup is not None or dec.tree_budget is not None or phase_graphs:
        raise ValueError("chunked_fill needs a step drafted on the device (DFlash, ngram_gpu) or none, "
                         "and no tree_budget or phase_graphs")


def block_ids(dec, ids: torch.Tensor, width: int) -> torch.Tensor:
    """The verified block (b, width): a filling row's next prompt chunk, every other row's ``ids``."""
    chunk = dec.fill_ids.gather(1, dec.block_pos[:, :width])
    return torch.where((dec.pos < dec.fill_len)[:, None], chunk, ids)


def advance(dec, width: int) -> None:
    """After the accept phase: the filling rows move one chunk on (see the module docstring)."""
    pos, T = dec.pos, dec.fill_len
    filling = pos < T
    after = dec.block_pos[:, :width] + 1  # where the accept phase wrote this step's argmax
    restore = filling[:, None] & (after < T[:, None])
    dec.tokens.scatter_(1, after, torch.where(restore, dec.fill_ids.gather(1, after), dec.tokens.gather(1, after)))
    end = pos + width
    done = filling & (end >= T)  # this chunk held the prompt's last token
    first = dec.argmax[:, :width].gather(1, (T - 1 - pos).clamp(0, width - 1)[:, None])[:, 0]
    live = done & (T < dec.limit) & ~(first[:, None] == dec.stop_ids).any(-1)
    dec.last.copy_(torch.where(done, first, dec.last))
    dec.pos.copy_(torch.where(filling, torch.minimum(end, T), pos))
    dec.active.copy_(dec.active | live)


def stage(dec, rows: dict[int, torch.Tensor], lengths: dict[int, int], max_new: dict[int, int]) -> None:
    """Host side of a chunked fill: each row's prompt in its ``fill_ids`` and ``tokens``, and its state reset to
    position 0 with its prompt's length and final position; the next steps do the rest."""
    for b, p in rows.items():
        p = p.reshape(-1).to(dec.device)
        dec.fill_ids[b, :lengths[b]].copy_(p)
        dec.tokens[b, :lengths[b]].copy_(p)
    order = list(rows)
    host = torch.tensor([order, [lengths[b] for b in order], [max_new[b] for b in order]])
    index, T, n = upload(torch.empty(host.shape, dtype=torch.long, device=dec.device), host)  # no wait for the steps
    limit = (T + n - 1).clamp(max=dec.max_pos - 1)
    for buf, value in ((dec.fill_len, T), (dec.limit, limit), (dec.pos, torch.zeros_like(T))):
        buf.index_copy_(0, index, value)
    for buf in (dec.active, dec.n_steps, dec.n_drafts):
        buf.index_fill_(0, index, 0)


def row_state(dec) -> torch.Tensor:
    """(3, batch): each row's live flag (decoding, or being filled), the tokens it may still emit (a row being
    filled counts from its prompt's end) and whether it is being filled."""
    filling = dec.pos < dec.fill_len
    return torch.stack([(dec.active | filling).long(), dec.limit - torch.maximum(dec.pos, dec.fill_len),
                        filling.long()])
