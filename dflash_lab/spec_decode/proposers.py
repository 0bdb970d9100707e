"""Proposers: where the drafts come from.

    DFlash         ONE drafter forward over [x_t, MASK x (B-1)], conditioned on
                   the context K/V of every accepted position (``DFlashContext``);
                   the target's lm_head turns its hidden states into B-1 drafts
    prompt lookup  no model: copy what followed an earlier occurrence of the
                   sequence's last n-gram (vLLM's ``ngram`` method)
    no drafter     ``drafter=None`` everywhere: nothing is proposed, so the loop is plain
                   greedy decoding with the same overheads (``NoDrafter`` stands in the loop)

The loop (``loop.py``) verifies and accepts both the same way. (vLLM:
``v1/spec_decode/dflash.py`` and ``v1/spec_decode/ngram_proposer.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DEFAULT_BLOCK_SIZE
from ..drafter import DFlashLagunaDrafter, draft_block_ids
from ..runtime import is_int

# ---------------------------------------------------------------------------
# DFlash: the drafter's context K/V, then one forward per block
# ---------------------------------------------------------------------------


class DFlashContext:
    """The drafter's context K/V: every position the target has accepted so far.

    Like vLLM, K/V are written at absolute slots of a buffer sized for the whole
    generation; each step appends only the newly accepted positions, so the
    context is never recomputed.
    """

    def __init__(self, drafter: DFlashLagunaDrafter, capacity: int, device, dtype):
        cfg = drafter.config
        shape = (cfg.num_hidden_layers, capacity, cfg.num_key_value_heads, cfg.head_dim)  # (L, capacity, nkv, hd)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0

    def append(self, drafter: DFlashLagunaDrafter, aux_hidden: torch.Tensor) -> None:
        """Add the next positions from their target aux hidden states (n, n_aux * H_t)."""
        n = aux_hidden.shape[0]
        positions = torch.arange(self.length, self.length + n, device=aux_hidden.device)
        context = drafter.combine_hidden_states(aux_hidden)  # (n, H)
        k, v = drafter.precompute_context_kv(context, positions)  # (L, n, nkv, hd) each
        self.k[:, self.length:self.length + n] = k
        self.v[:, self.length:self.length + n] = v
        self.length += n

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.length, device=self.k.device)

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :self.length], self.v[:, :self.length]  # (L, N, nkv, hd) each


def dflash_draft_logits(drafter: DFlashLagunaDrafter, target, context: DFlashContext, last_token: int,
                        block_size: int) -> torch.Tensor:
    """ONE drafter forward over [x_t, MASK x (B-1)] at positions t .. t+B-1 (t = context.length).

    Returns (B-1, V) logits for positions t+1 .. t+B-1, from the target's lm_head.
    """
    device = context.k.device
    block_ids = draft_block_ids(torch.tensor([last_token], device=device), block_size, drafter.config.mask_token_id)
    noise_embeds = target.get_input_embeddings()(block_ids)  # (1, B, H): the target's embedding table
    positions = torch.arange(context.length, context.length + block_size, device=device)[None]  # (1, B)
    ctx_k, ctx_v = context.kv()
    hidden = drafter(noise_embeds, positions, ctx_k, ctx_v, context.positions)  # (1, B, H)
    return target.lm_head(hidden[0, 1:])  # (B-1, V): position j predicts the token AT t+j


# ---------------------------------------------------------------------------
# Prompt lookup: drafts copied from the sequence itself
# ---------------------------------------------------------------------------


def prompt_lookup(tokens: list[int], num_draft: int, prompt_lookup_min: int = 2, prompt_lookup_max: int = 5) -> list[int]:
    """vLLM's ``ngram`` proposer, in plain Python.

    Find the longest n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that
    ends the sequence and also occurs earlier in it; propose up to ``num_draft``
    tokens that followed its earliest earlier occurrence. No match, no draft.
    """
    T = len(tokens)
    for n in range(min(prompt_lookup_max, T - 1), prompt_lookup_min - 1, -1):
        suffix = tokens[T - n:]
        for start in range(T - n):  # earlier occurrences (they may overlap the suffix)
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + num_draft]
    return []


@dataclass(frozen=True)  # hashable: the fast path keeps one decoder per (drafter, shape)
class PromptLookupDrafter:
    """Prompt-lookup drafting (vLLM ``method="ngram"``): drafts copied from the sequence itself.

    Any object with ``block_size`` and ``propose(tokens, num_draft)`` can stand
    in the loop the same way. vLLM's own defaults are prompt_lookup_min =
    prompt_lookup_max = 5; a shorter minimum finds more matches in short prompts.
    """

    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    block_size: int = DEFAULT_BLOCK_SIZE  # 1 real token + up to 15 drafts, like the DFlash drafter
    max_block_size: int | None = None  # no model, no limit

    def __post_init__(self):
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= prompt_lookup_max={self.prompt_lookup_max}")

    def propose(self, tokens: list[int], num_draft: int) -> list[int]:
        return prompt_lookup(tokens, num_draft, self.prompt_lookup_min, self.prompt_lookup_max)


class NoDrafter:
    """What ``drafter=None`` becomes inside the eager loop: proposes nothing, so every step
    verifies x_t alone (plain decoding through the same loop, the fair baseline)."""

    block_size = 2  # 1 real token + room for a draft that never comes
    max_block_size = None

    def propose(self, tokens: list[int], num_draft: int) -> list[int]:
        return []


# ---------------------------------------------------------------------------
# The one gate every backend passes its ``drafter`` argument through
# ---------------------------------------------------------------------------

DRAFTER_KINDS = "a DFlashLagunaDrafter, 'ngram', None or a proposer"  # prompt lookup, no drafter, propose()


def resolve_drafter(drafter):
    """What a backend drafts with: the DFlash drafter itself, or a proposer (``propose(tokens, num_draft)``).

    None becomes ``NoDrafter``, "ngram" a ``PromptLookupDrafter``; anything else is refused,
    never turned into another method.
    """
    if drafter is None:
        return NoDrafter()
    if isinstance(drafter, str):
        if drafter != "ngram":
            raise ValueError(f"drafter must be {DRAFTER_KINDS}, got {drafter!r}")
        return PromptLookupDrafter()
    if isinstance(drafter, DFlashLagunaDrafter) or callable(getattr(drafter, "propose", None)):
        return drafter
    raise TypeError(f"drafter must be {DRAFTER_KINDS} with propose(tokens, num_draft), got {type(drafter).__name__}")


def require_dflash(drafter, backend: str) -> DFlashLagunaDrafter:
    """For a backend that only replays DFlash drafts (evaluation): the drafter, else a clear refusal."""
    drafter = resolve_drafter(drafter)
    if not isinstance(drafter, DFlashLagunaDrafter):
        raise TypeError(f"{backend} replays DFlash drafts: drafter must be a DFlashLagunaDrafter, "
                        f"got {type(drafter).__name__}")
    return drafter


def default_block_size(drafter) -> int | None:
    """The block a resolved drafter uses when none is given: DFlash's trained one, a proposer's own."""
    if isinstance(drafter, DFlashLagunaDrafter):
        return drafter.config.block_size
    return getattr(drafter, "block_size", None)


def check_block_size(block_size, drafter) -> int:
    """``block_size`` B = 1 real token + K = B - 1 drafts (vLLM's num_speculative_tokens + 1), checked once."""
    if block_size is None:
        block_size = default_block_size(drafter)
        if block_size is None:
            raise ValueError(f"block_size must be given: {type(drafter).__name__} has no default block_size")
    if not is_int(block_size):
        raise TypeError(f"block_size must be an integer, got {block_size!r}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (1 real token + at least 1 draft), got {block_size}")
    max_block = None if isinstance(drafter, DFlashLagunaDrafter) else getattr(drafter, "max_block_size", None)
    if max_block is not None and block_size > max_block:  # vLLM runs any num_speculative_tokens for DFlash
        raise ValueError(f"block_size {block_size} is larger than the drafter supports "
                         f"(its max_block_size is {max_block})")
    return block_size
