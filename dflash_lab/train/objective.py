"""The DFlash training objective: anchors, blocks, soft labels, position-weighted loss.

Every training sequence yields many DFlash blocks. At each sampled anchor
position p the block is [x_p, MASK x (bs-1)] at positions p..p+bs-1; the
drafter's context is the target's aux hidden states of positions < p; block
position j is trained towards the target's distribution at position p+j-1
(its prediction of token p+j), with a loss weight exp(-(j-1)/gamma) that
decays along the block, because a draft token only counts if every token
before it was accepted.

All blocks of a batch share one drafter forward: the drafter's own attention
mask (``dflash_attention_mask``) keeps each block to its own context and
slots, so how the drafter attends is decided in ``dflash_lab.drafter`` alone.
Short blocks (to serve smaller block sizes too) only hide slots from that mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..block_attention import dflash_attention_mask, draft_block_ids
from ..target import target_forward

# ---------------------------------------------------------------------------
# Where blocks sit, and what each block position learns
# ---------------------------------------------------------------------------


def sample_anchors(batch: int, lo: int, hi: int, num: int, gen: torch.Generator) -> torch.Tensor:
    """(B, num) sorted distinct anchor positions in [lo, hi], per sequence."""
    scores = torch.rand(batch, hi - lo + 1, generator=gen)
    return scores.topk(min(num, hi - lo + 1), dim=1).indices.sort(dim=1).values + lo


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """DFlash blocks: [x_p, MASK x (B-1)] at positions p..p+B-1 for every anchor p.

    ids (B, T), anchors (B, A) -> block ids (B, A*bs) and positions (B, A*bs).
    """
    positions = anchors[..., None] + torch.arange(block_size, device=ids.device)  # (B, A, bs)
    block = draft_block_ids(ids.gather(1, anchors), block_size, mask_token_id)  # (B, A, bs)
    return block.flatten(1), positions.flatten(1)


def label_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, A, bs-1): block position j >= 1 learns the target's prediction made AT position p+j-1."""
    return anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)


def gather_positions(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x (B, T, D), pos (B, ...) -> (B, ..., D)."""
    B, D = x.shape[0], x.shape[-1]
    flat = x.gather(1, pos.reshape(B, -1, 1).expand(-1, -1, D))  # (B, prod(...), D)
    return flat.view(*pos.shape, D)


@torch.no_grad()
def target_soft_labels(target, ids: torch.Tensor, anchors: torch.Tensor, layer_ids, block_size: int):
    """One target pass over ids (B, T): (aux hidden states (B, T, n_aux * H), logits (B, A, bs-1, V)).

    The logits are those of the label positions only: the LM head runs on
    B*A*(bs-1) hidden states instead of all B*T.
    """
    out = target_forward(target, ids, layer_ids, use_cache=False, with_logits=False)
    return out.aux_hidden, labels_at(target, out.final_hidden, anchors, block_size)


@torch.no_grad()
def labels_at(target, final_hidden: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The target's logits (B, A, bs-1, V) at the label positions, from its final hidden states (B, T, H)."""
    return target.lm_head(gather_positions(final_hidden, label_positions(anchors, block_size)))


class TargetFeatureCache:
    """The frozen target's features of a fixed set of sequences, computed once.

    The target never changes during drafter training, so for a small data set (a
    notebook's) its forward can run once per sequence instead of once per step:
    the objective is the same, the step several times cheaper. (The CLI's data is
    too large to hold this way: it runs the target every step.)
    """

    @torch.no_grad()
    def __init__(self, target, pool: torch.Tensor, layer_ids, batch_size: int = 64):
        aux, final = [], []
        for i in range(0, pool.shape[0], batch_size):
            out = target_forward(target, pool[i:i + batch_size].long(), layer_ids, use_cache=False, with_logits=False)
            aux.append(out.aux_hidden)
            final.append(out.final_hidden)
        self.aux, self.final = torch.cat(aux), torch.cat(final)  # (N, T, n_aux * H), (N, T, H)

    def soft_labels(self, target, rows: torch.Tensor, anchors: torch.Tensor, block_size: int):
        """What target_soft_labels returns for pool[rows], without running the target."""
        return self.aux[rows], labels_at(target, self.final[rows], anchors, block_size)


# ---------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-(j-1)/gamma) for block positions j = 1..bs-1."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def dflash_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, weights: torch.Tensor):
    """Soft cross-entropy to the target's distribution, weighted by block position.

    draft_logits, target_logits: (..., bs-1, V); weights: (bs-1,) or (..., bs-1), zero
    where a block is shorter. Returns (loss, per-position top-1 agreement (bs-1,)).
    """
    logq = F.log_softmax(draft_logits.float(), dim=-1)
    p = F.softmax(target_logits.float(), dim=-1)
    ce = -(p * logq).sum(-1)  # (..., bs-1)
    weights = weights.expand_as(ce)
    loss = (ce * weights).sum() / weights.sum()
    agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()
    counted = (weights > 0).float().reshape(-1, ce.shape[-1])  # (blocks, bs-1)
    return loss, (agree.reshape(-1, ce.shape[-1]) * counted).sum(0) / counted.sum(0).clamp(min=1)


# ---------------------------------------------------------------------------
# Short blocks: one layout trains every block size up to block_size
# ---------------------------------------------------------------------------


def sample_block_lengths(shape, block_size: int, share: float, gen: torch.Generator) -> torch.Tensor:
    """Per-block lengths (shape): a ``share`` of blocks cut to a random length 2..bs-1, the rest full."""
    short = torch.rand(shape, generator=gen) < share
    return torch.where(short, torch.randint(2, block_size, shape, generator=gen), block_size)


def short_block_weights(weights: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Position weights (bs-1,) zeroed past each block's length: (B, A, bs-1)."""
    bs = weights.shape[0] + 1
    return weights * (torch.arange(1, bs, device=weights.device) < lengths[..., None])


def short_block_mask(mask: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """Shrink each block of a (B, Q, N+Q) DFlash mask to its first ``lengths`` (B, A) slots.

    Slots past a block's length are hidden as keys, so the slots before them
    compute exactly what a real block of that length computes: one layout
    trains every block size up to block_size at once.
    """
    B, A = lengths.shape
    slot = torch.arange(block_size, device=lengths.device)
    in_block = (slot < lengths[..., None]).flatten(1)  # (B, A*bs)
    n_ctx = mask.shape[-1] - A * block_size
    keys = torch.cat([in_block.new_ones(B, n_ctx), in_block], dim=1)  # (B, N+Q)
    return mask & keys[:, None, :]


# ---------------------------------------------------------------------------
# The drafter's side: every block of a batch in one forward
# ---------------------------------------------------------------------------


def draft_logits_for(target, drafter, ids: torch.Tensor, anchors: torch.Tensor, aux: torch.Tensor, block_size: int,
                     lengths: torch.Tensor | None = None):
    """The drafter's logits for every block: (B, A, bs, V). Context: all of ids, masked per block.

    lengths (B, A), optional: each block's own length (<= block_size), see short_block_mask.
    """
    B, T = ids.shape
    positions = torch.arange(T, device=ids.device)
    k, v = drafter.context_kv(aux.reshape(B * T, -1), positions.repeat(B), path="reference")  # (L, B*T, nkv, hd)
    k, v = k.unflatten(1, (B, T)), v.unflatten(1, (B, T))  # (L, B, T, nkv, hd)
    _, block_pos = block_inputs(ids, anchors, block_size, drafter.config.mask_token_id)  # positions (B, A*bs)
    mask = None
    if lengths is not None:
        # The attention the drafter will be served with (vLLM's window and causality rule), then short blocks.
        mask = short_block_mask(dflash_attention_mask(block_pos, positions, block_size, drafter.window,
                                                      causal=drafter.config.is_causal), lengths, block_size)
    return drafter.block_logits(target, ids.gather(1, anchors), block_pos, from_slot=0, context_k=k, context_v=v,
                                context_positions=positions, mask=mask)  # (B, A, bs, V)
