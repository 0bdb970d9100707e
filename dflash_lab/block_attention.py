"""Who a DFlash block sees and where its keys live: the mask rule and the two K/V stores.

``visible_keys`` is the one rule (vLLM's block causality and window); ``dflash_attention_mask``
lays it out over [context ; blocks] for ``ConcatKV`` (eager decoding, training), ``SlotKV`` over
preallocated slots (the static, graphed path). ``draft_block_ids`` builds the block
[x_t, MASK x (B-1)] that every backend and the training objective feed the drafter.
The drafter (``drafter.py``) attends through these; they hold no parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layers import additive_mask

# ---------------------------------------------------------------------------
# Which keys a block query may see
# ---------------------------------------------------------------------------


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, q_start: torch.Tensor, k_is_context: torch.Tensor,
                 k_in_own_block: torch.Tensor, *, causal: bool, window: int | None) -> torch.Tensor:
    """THE rule: which keys a block query sees. Every argument broadcasts to (B, Q, K); returns bool (B, Q, K).

    q_pos / q_start: the query's position and its block's first position; k_pos: the key's position;
    k_is_context: the key holds a context position (the target's features); k_in_own_block: the key
    belongs to the query's own block. A query sees (a) context keys strictly before its block and
    (b) its own block: all of it, or with ``causal`` the keys at or before itself (vLLM's
    ``_dflash_layer_causal``, ``qwen3_dflash.py:62-73``: sliding layers are causal unless the config
    says otherwise). A ``window`` limits compute, not the K/V store: |q - k| < window, which for a causal layer is
    vLLM's one-sided (w, 0) and for a non-causal one ``_maybe_symmetrize_window``'s (w, w).
    """
    visible = (k_is_context & (k_pos < q_start)) | k_in_own_block
    if causal:
        visible = visible & (k_pos <= q_pos)
    if window is not None:
        visible = visible & ((q_pos - k_pos).abs() < window)
    return visible


def _block_starts(positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, Q) first position of each query's block; Q = num_blocks * block_size, each block contiguous."""
    B, Q = positions.shape
    if Q % block_size:
        raise ValueError(f"positions has {Q} block tokens, not a multiple of block_size {block_size}")
    nb = Q // block_size
    return positions.view(B, nb, block_size)[..., :1].expand(B, nb, block_size).reshape(B, Q)


def dflash_attention_mask(positions: torch.Tensor, context_positions: torch.Tensor, block_size: int,
                          window: int | None = None, *, causal: bool = False) -> torch.Tensor:
    """``visible_keys`` for keys laid out as [context ; blocks]: bool (B, Q, N+Q).

    ``positions`` (B, Q) holds Q = num_blocks * block_size block positions, each block
    contiguous; ``context_positions`` (N,) or (B, N). This is ``ConcatKV``'s key layout.
    """
    B, Q = positions.shape
    start = _block_starts(positions, block_size)[:, :, None]  # (B, Q, 1)
    if context_positions.dim() == 1:
        context_positions = context_positions.expand(B, -1)
    N = context_positions.shape[1]
    k_pos = torch.cat([context_positions, positions], dim=1)[:, None, :]  # (B, 1, N+Q)
    block_id = torch.arange(Q, device=positions.device) // block_size
    is_context = torch.arange(N + Q, device=positions.device) < N  # (N+Q,)
    own = torch.cat([torch.zeros(Q, N, dtype=torch.bool, device=positions.device),
                     block_id[:, None] == block_id[None, :]], dim=1)  # (Q, N+Q)
    return visible_keys(positions[:, :, None], k_pos, start, is_context, own, causal=causal, window=window)


# ---------------------------------------------------------------------------
# Where the keys live: two K/V stores behind the one attention
# ---------------------------------------------------------------------------


class ConcatKV:
    """Context K/V held beside the block: each layer attends to [context K/V ; block K/V].

    For eager decoding and training (any number of blocks per row). k, v: (L, B, N, nkv, hd)
    or (L, N, nkv, hd) (shared by every row); positions: (N,) or (B, N).
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        self.k, self.v, self.positions = k, v, positions

    def layer(self, i: int, positions: torch.Tensor):
        k_ctx, v_ctx = self.k[i], self.v[i]
        if k_ctx.dim() == 3:
            B = positions.shape[0]
            k_ctx, v_ctx = k_ctx.expand(B, -1, -1, -1), v_ctx.expand(B, -1, -1, -1)
        return lambda k, v: (torch.cat([k_ctx, k], dim=1), torch.cat([v_ctx, v], dim=1))  # (B, N+Q, nkv, hd)

    def mask(self, positions: torch.Tensor, block_size: int, *, causal: bool, window: int | None) -> torch.Tensor:
        return dflash_attention_mask(positions, self.positions.to(positions.device), block_size, window, causal=causal)


@dataclass
class SlotVisibility:
    """``visible_keys`` over ``SlotKV`` for a kernel that computes it instead of reading a mask: one block a row
    at slots start .. start+Q-1 sees the context slots below start and its own slots where ``pattern`` says
    (all, or the lower triangle when causal), within |q - k| < window."""

    positions: torch.Tensor  # (B, Q) int32, the block's positions
    start: torch.Tensor  # (B,) int32, its first position (the context is slots < start)
    pattern: torch.Tensor  # (B, Q, Q) bool, [i, j]: query i sees block slot j (one pattern, expanded)
    window: int | None


class SlotLayer:
    """One layer of ``SlotKV`` for one block: called with the block's K/V (B, Q, nkv, hd), it writes them into
    their slots and gives every slot back (B, S, nkv, hd). A kernel that writes K/V itself (the fast path's
    ``qk_rope_write``) reads ``k``, ``v`` and ``positions`` (slot == position) instead."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        self.k, self.v, self.positions = k, v, positions

    def __call__(self, k: torch.Tensor, v: torch.Tensor):
        index = self.positions[:, :, None, None].expand(*self.positions.shape, *self.k.shape[2:])  # (B, Q, nkv, hd)
        self.k.scatter_(1, index, k)
        self.v.scatter_(1, index, v)
        return self.k, self.v


class SlotKV:
    """Context K/V at slot == position of preallocated buffers k, v (L, B, S, nkv, hd), one block per row.

    For the static, graphed path: ``write`` scatters context K/V at their positions' slots; each
    layer writes the block's own K/V into slots t .. t+Q-1 in place and attends to the whole
    buffer, the mask (``visible_keys`` in slot terms) hiding every slot that is neither context
    before t nor this block. Slots past the accepted context may hold a rejected step's K/V:
    they are hidden, and overwritten before any query can see them.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, rope: tuple | None = None):
        self.k, self.v = k, v
        self.slots = torch.arange(k.shape[2], device=k.device)
        self.rope = rope  # (cos, sin) (S, rotary_dim) at every slot's position, made once, or None
        self._patterns: dict = {}  # (Q, causal) -> (Q, Q) bool, made once (a captured step only reads it)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (L, B, Q, nkv, hd) of positions (B, Q), written at those slots."""
        index = positions[None, :, :, None, None].expand_as(k)
        self.k.scatter_(2, index, k)
        self.v.scatter_(2, index, v)

    def layer(self, i: int, positions: torch.Tensor) -> "SlotLayer":
        return SlotLayer(self.k[i], self.v[i], positions)

    def visibility(self, positions: torch.Tensor, block_size: int, *, causal: bool,
                   window: int | None) -> SlotVisibility:
        """What ``mask`` shows, as a kernel reads it (``SlotVisibility``): no (B, Q, S) tensor built."""
        B, Q = self._one_block(positions, block_size)
        if (Q, causal) not in self._patterns:
            own = torch.arange(Q, device=self.k.device)
            # visible_keys within the block: every key is in the own block, so only causality decides
            self._patterns[Q, causal] = visible_keys(own[:, None], own[None, :], own[:1], own < 0, own >= 0,
                                                     causal=causal, window=None)
        positions = positions.int()
        return SlotVisibility(positions, positions[:, 0].contiguous(), self._patterns[Q, causal].expand(B, Q, Q),
                              window)

    @staticmethod
    def _one_block(positions: torch.Tensor, block_size: int) -> tuple[int, int]:
        B, Q = positions.shape
        if Q != block_size:
            raise ValueError(f"SlotKV holds one block per row: got {Q} block tokens for block_size {block_size}")
        return B, Q

    def mask(self, positions: torch.Tensor, block_size: int, *, causal: bool, window: int | None) -> torch.Tensor:
        B, Q = self._one_block(positions, block_size)
        start = positions[:, :1, None]  # (B, 1, 1): t, the context is slots < t
        k_pos = self.slots[None, None, :]  # (1, 1, S): slot == position
        own = (k_pos >= start) & (k_pos < start + Q)
        visible = visible_keys(positions[:, :, None], k_pos, start, k_pos < start, own, causal=causal, window=window)
        return additive_mask(visible, self.k.dtype)  # 0 / -inf: SDPA would convert a bool mask in every layer


def draft_block_ids(first: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """The drafter's input block [x_t, MASK x (B-1)] for every x_t in ``first`` (...,) -> (..., B).

    Every backend and the training objective build their blocks here.
    """
    block = torch.full((*first.shape, block_size), mask_token_id, dtype=torch.long, device=first.device)
    block[..., 0] = first
    return block
