"""One call over the fast path: ``fast_generate`` (one prompt) and ``fast_generate_batch`` (a static batch).

    fast_generate(target, drafter, input_ids, max_new_tokens=...)        one prompt -> SpecDecodeResult
    fast_generate_batch(target, drafter, prompts, max_new_tokens=...)    a batch -> list of SpecDecodeResult

Each builds its ``FastDecoder`` once per shape and keeps it (``cached_decoder``): building one
allocates every buffer and captures its CUDA graphs.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from ..loop import SpecDecodeResult
from ..proposers import resolve_drafter
from .decoder import FastDecoder
from .static_target import round_up

# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def _capacity(prompts, max_new_tokens: int) -> int:
    return max(int(p.shape[-1]) for p in prompts) + max_new_tokens


CAPACITY_STEP = 256  # cached decoders are sized in steps, so prompts of similar length share one
MAX_CACHED_DECODERS = 4  # per target, least recently used dropped first
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> OrderedDict(key -> FastDecoder)


def cached_decoder(target, drafter, *, batch: int, block_size: int, capacity: int, cuda_graphs: bool = True,
                   moe: str = "auto") -> FastDecoder:
    """The ``FastDecoder`` for (target, drafter, batch, block size, capacity, graphs, moe), built on first use.

    Building one allocates every buffer and captures its CUDA graphs; ``fast_generate`` called
    once per prompt would otherwise pay that on every call (measured on an H200: 1.08x
    target-only instead of the benchmark's 1.7-2.0x). The decoder reads the drafter's weights
    live, but the target's q/k/v and MLP weights are concatenated once: after changing the
    target's weights, call ``clear_decoder_cache()``.
    """
    per_target = _DECODERS.setdefault(target, OrderedDict())
    capacity = min(round_up(capacity, CAPACITY_STEP), target.config.max_position_embeddings)
    key = (drafter, batch, block_size, capacity, cuda_graphs, moe)
    if key in per_target:
        per_target.move_to_end(key)
    else:
        per_target[key] = FastDecoder(target, drafter, batch=batch, block_size=block_size, capacity=capacity,
                                      cuda_graphs=cuda_graphs, moe=moe)
        while len(per_target) > MAX_CACHED_DECODERS:
            per_target.popitem(last=False)
    return per_target[key]


def clear_decoder_cache() -> None:
    """Forget every cached decoder (their buffers and graphs go with them)."""
    _DECODERS.clear()


def fast_generate_batch(target, drafter, prompts, *, max_new_tokens: int, block_size: int | None = None,
                        cuda_graphs: bool = True, stop_token_ids=(), moe: str = "auto") -> list[SpecDecodeResult]:
    """Greedy decoding of all ``prompts`` in one batch (see the module docstring); one result per prompt.

    drafter: a DFlashLagunaDrafter, "ngram", None (no drafter) or a proposer; anything else is
    refused (``proposers.resolve_drafter``). block_size defaults to the drafter's config.block_size
    (a proposer's own block_size: 16 for "ngram"). The decoder is built
    once per shape and reused (``cached_decoder``).
    """
    prompts = [torch.as_tensor(p).reshape(-1) for p in prompts]
    if not prompts:
        return []
    if block_size is None:
        block_size = resolve_drafter(drafter).block_size
    max_pos = target.config.max_position_embeddings
    if (longest := max(int(p.shape[-1]) for p in prompts)) > max_pos:
        raise ValueError(f"a prompt has {longest} tokens, more than the target's max_position_embeddings ({max_pos})")
    # generation ends at max_position_embeddings, as on the eager loop (and in vLLM, at max_model_len)
    dec = cached_decoder(target, drafter, batch=len(prompts), block_size=block_size,
                         capacity=min(_capacity(prompts, max_new_tokens), max_pos), cuda_graphs=cuda_graphs, moe=moe)
    return dec.generate(prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)


def fast_generate(target, drafter, input_ids, *, max_new_tokens: int, block_size: int | None = None,
                  cuda_graphs: bool = True, stop_token_ids=(), moe: str = "auto") -> SpecDecodeResult:
    """``speculative_generate``'s greedy result for one prompt, from the static, graphed path."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] != 1:
        raise ValueError(f"input_ids must hold one sequence, got shape {tuple(ids.shape)}")
    return fast_generate_batch(target, drafter, [ids.reshape(-1)], max_new_tokens=max_new_tokens, block_size=block_size,
                               cuda_graphs=cuda_graphs, stop_token_ids=stop_token_ids, moe=moe)[0]
