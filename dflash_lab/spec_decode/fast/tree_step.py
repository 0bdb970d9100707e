"""The DDTree step of the fast path: one graph per (batch, block, node budget).

``FastDecoder(tree_budget=N)`` replays this in place of the chain's step. It drafts the block as the chain
does, builds the tree of its N best prefixes on the device (``tree.build_draft_tree``: fixed shapes, no
read-back; the per-depth beam search is one kernel, ``tree_build``), verifies [x_t, the N nodes] in one
``StaticTarget.forward`` with the tree's positions, slots and mask, and walks the target's argmax
(``tree_accept.walk``: one kernel; ``tree.accept_path`` is its reference). The accepted path is then laid
out as a chain's block would be: its K/V moved to the slots of positions t .. t+n, its tokens as the drafts,
the target's choices and features along it; the chain's append and accept finish the step, so the emitted
tokens, the stop and length rules and the counters are the chain's code (a tree logs N draft tokens per
step).
"""

from __future__ import annotations

import torch

from ..tree import build_draft_tree
from .argmax import argmax
from .tree_accept import walk
from .tree_build import beam_kernel


def tree_step(dec) -> None:
    """One DDTree step of every row (the module's docstring); ``dec`` is the ``FastDecoder``."""
    K, N = dec.B - 1, dec.tree_budget
    dec.block_pos.copy_(dec.pos[:, None] + dec.offsets)
    torch.clamp(dec.max_pos - 1 - dec.pos, min=0, max=K, out=dec.n_draft)
    tree = build_draft_tree(dec.dft.draft_logits(dec.last, dec.pos, dec.B), N, beams=beam_kernel)  # one launch
    ids = torch.cat([dec.last[:, None], tree.token_ids], dim=1)  # (b, N+1)
    logits, aux = dec.tgt.forward(ids, dec.pos[:, None] + tree.depths_with_root(), tree=tree, start=dec.pos)
    choice = argmax(logits)  # (b, N+1): the target's token after every tree index
    # the walk: path (b, K+1) the tree indices by depth; the accepted tokens and the target's choices along
    # the path written where the chain's append and accept read them (one kernel, ``tree_accept``)
    n, path = walk(tree, choice, dec.n_draft, dec.drafts, dec.argmax)
    dec.tgt.move_slots(dec.pos[:, None] + path, dec.block_pos)
    if dec.B not in dec.aux:
        dec.aux[dec.B] = aux.new_empty(aux.shape[0], dec.B, aux.shape[-1])
    dec.aux[dec.B].copy_(aux.gather(1, path[..., None].expand(-1, -1, aux.shape[-1])))
    dec._append()
    dec._accept()
