"""Prompt lookup drafted on the host over a ``FastDecoder``: a step's drafts come from each row's tokens so far.

    seqs = host_rows(decoder, {row: prompt})   after a fill: each live row's prompt and first token
    seqs = live_tokens(decoder, rows)          each live row's tokens read back (after device-only steps)
    finished = host_step(decoder, seqs)        draft on the host, verify on the device, read the step back

As the V1 runner's ngram proposer does, the loop reads every step back: the next drafts need the tokens
this step emitted. ``"ngram_gpu"`` drafts inside the graphed step instead and reads nothing back.
"""

from __future__ import annotations

import torch


def host_rows(dec, rows) -> dict[int, list[int]]:
    """After a fill, for drafting on the host: each live row of ``rows`` {row: prompt} -> its tokens so far
    (the prompt and the first token)."""
    state = torch.stack([dec.last, dec.active.long()], 1).tolist()
    return {b: p.reshape(-1).tolist() + [state[b][0]] for b, p in rows.items() if state[b][1]}


def live_tokens(dec, rows) -> dict[int, list[int]]:
    """Each live row of ``rows`` -> its tokens so far, read back (host drafting resumes after device steps)."""
    rows = list(rows)
    S = dec.tokens.shape[1]
    back = torch.cat([dec.tokens, dec.pos[:, None], dec.active[:, None].long()], 1)[rows].tolist()
    return {b: r[:r[S] + 1] for b, r in zip(rows, back) if r[S + 1]}


def host_step(dec, seqs: dict[int, list[int]], width: int | None = None) -> list[int]:
    """One host-drafted step of ``width`` (default the decoder's block): drafts from each live row's tokens
    ``seqs`` {row: tokens}, verified on the device, read back into ``seqs``; returns the rows that finished
    (gone from ``seqs``)."""
    width = width or dec.B
    K, host_drafts, host_n = width - 1, dec._host_drafts, dec._host_n
    host_n.zero_()
    for b, s in seqs.items():
        d = dec.lookup.propose(s, min(K, dec.max_pos - len(s)))[:K]
        host_n[b] = len(d)
        if d:
            host_drafts[b, :len(d)] = torch.tensor(d)
    dec.drafts.copy_(host_drafts, non_blocking=True)
    dec.n_draft.copy_(host_n, non_blocking=True)
    (dec.step_at(width) if bool(host_n.any()) else dec.step_plain)()
    dec.host_steps += 1
    back = torch.cat([dec.argmax, dec.pos[:, None], dec.active[:, None].long()], 1).tolist()
    finished = []
    for b, s in list(seqs.items()):
        new_pos, still = back[b][-2], back[b][-1]
        s.extend(back[b][:new_pos - (len(s) - 1)])  # argmax 0 .. n
        if not still:
            finished.append(b)
            del seqs[b]
    return finished
