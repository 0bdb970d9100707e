"""Finished generations read back from a ``FastDecoder``: one gather and one copy, the host's bookkeeping after.

    snap = snapshot(decoder, rows)       every row's tokens, counts and draft logs gathered on the device
                                         and copied to pinned host memory without waiting (an event on CUDA),
                                         with the host's record of ``rows`` (prompt lengths, max_new_tokens)
    results(decoder, rows, snap)         one ``SpecDecodeResult`` per row, built from the snapshot: it waits
                                         for that copy only, and its sequences stay on the host

``serve`` snapshots the rows that finished, refills them and launches the next steps, and only then builds
their results, so the device does not idle while the host counts drafts and slices tokens (a refill
overwrites the rows on the device, hence the copy first). Without a snapshot ``results`` takes one at once
and waits for it, the one read-back (a sync) that ``FastDecoder.generate`` ends with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..loop import SpecDecodeResult
from ..stats import SpecDecodeStats


@dataclass
class Snapshot:
    back: torch.Tensor  # (batch, S + 3 + 2L) on the host: tokens | pos, steps, drafts | draft_log | accepted_log
    event: object  # a torch.cuda.Event recorded after the copy, or None (the copy is done)
    lengths: dict  # row -> its prompt's length, as the host knew it when the snapshot was taken
    max_new: dict  # row -> its max_new_tokens
    stop: frozenset  # the stop tokens then


def snapshot(decoder, rows) -> Snapshot:
    d = decoder
    counts = torch.stack([d.pos, d.n_steps, d.n_drafts], dim=1)
    block = torch.cat([d.tokens, counts, d.draft_log, d.accepted_log], dim=1)  # every row: no index to upload
    event = None
    if block.is_cuda:
        back = torch.empty(block.shape, dtype=block.dtype, pin_memory=True)
        back.copy_(block, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        back = block.cpu()
    rows = list(rows)
    return Snapshot(back, event, {r: d._lengths[r] for r in rows}, {r: d._max_new[r] for r in rows},
                    frozenset(d.stop))


def results(decoder, rows, snap: Snapshot | None = None) -> list[SpecDecodeResult]:
    """The generations of ``rows`` (filled since the last ``prefill``); see the module docstring."""
    d, rows = decoder, list(rows)
    device = d.device if snap is None else torch.device("cpu")
    snap = snapshot(d, rows) if snap is None else snap
    if snap.event is not None:
        snap.event.synchronize()
    S, L = d.tokens.shape[1], d.draft_log.shape[1]
    back = snap.back[rows].tolist()
    out = []
    for row, r in zip(rows, back):
        T, (pos, steps, drafts) = snap.lengths[row], r[S:S + 3]
        new = r[T:min(pos + 1, T + snap.max_new[row], d.max_pos)]
        for i, tok in enumerate(new):
            if tok in snap.stop:
                new = new[:i + 1]
                break
        stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * (d.B - 1), num_generated_tokens=len(new),
                                num_target_forwards=1 + steps)
        stats.observe_drafts(r[S + 3:S + 3 + drafts], r[S + 3 + L:S + 3 + L + drafts], depth=d.B - 1)
        out.append(SpecDecodeResult(torch.tensor([r[:T] + new], dtype=torch.long, device=device), stats, [], T))
    return out
