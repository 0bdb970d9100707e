"""The drafter's side of the static path: context K/V in preallocated slots, no host copies or syncs.

The eager proposer (``proposers.py``) keeps the context K/V beside the block and the
drafter concatenates them in every layer (``block_attention.ConcatKV``). Here the buffers are
(L, batch, S, nkv, hd) with slot == position, as the target's cache (``static_target.py``),
and the drafter's own forward runs over them through ``block_attention.SlotKV``:

    append   the context K/V of a block's positions (the folded path, fused kernel
             on CUDA), scattered at their slots. The loop appends ALL B block
             positions every step; only the accepted ones (slots < the new context
             length) are ever visible, and the rejected ones are overwritten by the
             next step's append before that
    draft    [x_t, MASK x (B-1)] at positions t .. t+B-1 through ``DFlashLagunaDrafter.forward``
             with ``kv=SlotKV`` (each layer writes the block's K/V at slots t .. t+B-1) and
             one-kernel norms (``triton_ops``); the target's lm_head and an argmax give
             the B-1 drafts

Nothing about attention is written here: causality, the window and the mask are the
drafter's (``block_attention.visible_keys``). The context length of sequence b is t_b: its last
emitted token x_t is not yet context (its target features come from the next verification).
"""

from __future__ import annotations

import torch

from ...block_attention import SlotKV
from ...layers import rope_tables
from . import triton_ops
from .argmax import argmax
from .static_target import round_up


class StaticDrafter:
    """Context K/V slots and the block step of a ``DFlashLagunaDrafter`` for ``batch`` sequences."""

    def __init__(self, drafter, target, *, batch: int, capacity: int, block_size: int | None = None):
        cfg = drafter.config
        p = next(drafter.parameters())
        self.drafter, self.device, self.dtype = drafter, p.device, p.dtype
        self.target = target  # its embedding table and lm_head
        self.batch, self.capacity = batch, round_up(capacity, 16)
        shape = (len(drafter.layers), batch, self.capacity, cfg.num_key_value_heads, cfg.head_dim)
        slots = torch.arange(self.capacity, device=self.device)
        self.kv = SlotKV(torch.zeros(shape, device=self.device, dtype=self.dtype),
                         torch.zeros(shape, device=self.device, dtype=self.dtype),
                         rope=rope_tables(cfg, slots, self.dtype))  # a block's RoPE read at its slots
        self.offsets = torch.arange(block_size or cfg.block_size, device=self.device)  # the longest block drafted

    def append(self, aux: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Context K/V of target features aux (B, Q, n_aux * H_t) at positions (B, Q), written at those slots;
        with ``rows`` (B,): a prefill's, positions 0 .. Q-1, written into those rows only."""
        B, Q, _ = aux.shape
        k, v = self.drafter.context_kv(aux.reshape(B * Q, -1), positions.reshape(-1), ops=triton_ops)  # (L, B*Q, ..)
        k, v = k.unflatten(1, (B, Q)), v.unflatten(1, (B, Q))
        if rows is None:
            self.kv.write(positions, k, v)
        else:
            self.kv.k[:, :, :Q].index_copy_(1, rows, k)
            self.kv.v[:, :, :Q].index_copy_(1, rows, v)

    def draft_logits(self, last_token: torch.Tensor, start: torch.Tensor, block_size: int) -> torch.Tensor:
        """(B, block_size - 1, V) logits of blocks [last_token, MASK ...] at positions start .. start+block_size-1:
        position j predicts the token AT t+j (a draft tree is built from them)."""
        positions = start[:, None] + self.offsets[:block_size]  # (B, Q)
        return self.drafter.block_logits(self.target, last_token[:, None], positions, kv=self.kv, ops=triton_ops)[:, 0]

    def draft(self, last_token: torch.Tensor, start: torch.Tensor, block_size: int) -> torch.Tensor:
        """Greedy drafts (B, block_size - 1): the argmax of ``draft_logits``."""
        return argmax(self.draft_logits(last_token, start, block_size))
