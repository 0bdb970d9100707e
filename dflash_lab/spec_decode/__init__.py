"""DFlash speculative decoding: draft a block, verify it, keep the agreed prefix.

One file per step, in data-path order (like vLLM's ``v1/spec_decode/``):

    proposers  where drafts come from: DFlash (context K/V + one drafter forward
               per block) and prompt lookup (vLLM's ``ngram``, no model)
    sampling   the accept rules: logits -> probabilities, greedy accept,
               rejection sampling
    stats      ``SpecDecodeStats``: vLLM's acceptance counters and the lab's views
    loop       ``speculative_generate``: argument checks, the target's KV cache
               and verification forward, and the draft -> verify -> accept loop

The same greedy decoding the way a server runs it on a GPU (same tokens):

    static_target   the target's forward over a preallocated KV cache, no host syncs
    static_drafter  the drafter step over preallocated context K/V
    triton_ops      one-kernel norms for those forwards
    cuda_graphs     capture a step once, replay it with one launch
    batched         ``fast_generate`` / ``fast_generate_batch``: several prompts, ragged acceptance

The comparison CLI lives in ``dflash_lab.tools.compare_drafters``.
"""

from .batched import FastDecoder, fast_generate, fast_generate_batch
from .loop import (
    SpecDecodeResult,
    SpecDecodeStep,
    check_generation_args,
    crop_cache,
    generate_on_prompts,
    new_target_cache,
    prompt_lookup_generate,
    speculative_generate,
    verify_forward,
)
from .proposers import DFlashContext, PromptLookupDrafter, dflash_draft_logits, prompt_lookup
from .sampling import DRAFT_SAMPLE_METHODS, greedy_accept, logits_to_probs, rejection_sample, sample
from .stats import SpecDecodeStats

__all__ = [
    # the GPU fast path
    "FastDecoder", "fast_generate", "fast_generate_batch",
    # proposers
    "DFlashContext", "dflash_draft_logits", "prompt_lookup", "PromptLookupDrafter",
    # sampling
    "DRAFT_SAMPLE_METHODS", "logits_to_probs", "sample", "greedy_accept", "rejection_sample",
    # stats
    "SpecDecodeStats",
    # loop
    "SpecDecodeStep", "SpecDecodeResult", "new_target_cache", "crop_cache", "verify_forward",
    "check_generation_args", "speculative_generate", "prompt_lookup_generate", "generate_on_prompts",
]
