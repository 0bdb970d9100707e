"""DFlash speculative decoding: draft a block, verify it, keep the agreed prefix.

One file per step, in data-path order (like vLLM's ``v1/spec_decode/``):

    proposers  where drafts come from: DFlash (context K/V + one drafter forward
               per block) and prompt lookup (vLLM's ``ngram``, no model)
    sampling   the accept rules, the one home of each: logits -> probabilities,
               batched greedy accept, rejection sampling, and vLLM's other
               rejection_sample_methods (block verification, FLy, synthetic)
    tree       DDTree: a draft tree of one DFlash block's best prefixes, its tree-masked
               verification, the accepted path and the cache compaction
    stats      ``SpecDecodeStats``: vLLM's acceptance counters (the only place they are kept)
    metrics    the same counters read from (and written as) a vLLM /metrics page
    acceptance one run reported every community's way (vLLM's τ and rates, conditional
               rates, the length histogram, SGLang's accept length, a trainer's
               teacher-forced length, τ at its ceiling) and how to convert between them
    loop       ``speculative_generate``: argument checks, the target's KV cache
               and verification forward, and the draft -> verify -> accept loop
    schedule   K per running batch size: vLLM 0.33's ``num_speculative_tokens_per_batch_size``
               (its validation and batch -> K table) and the schedule a benchmark recommends

``fast/`` is a second backend of the same algorithm, the way a server runs it on a
GPU: static buffers, Triton kernels and CUDA graphs around the drafter's own
attention and the same accept rule (``fast/__init__`` lists its modules).

Names are exported lazily (PEP 562), so importing this package runs nothing until a name
is asked for: the counters (``stats``, ``metrics``) load without the drafter, transformers
or Triton, which is all ``dflash_lab.vllm_engine`` (``make serve``) needs of this package
(a plain import of every name here costs ~8 s on a 2-core CPU; tests/test_architecture.py).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    # the fast backend
    "FastDecoder": "fast.decoder", "fast_generate": "fast.generate", "fast_generate_batch": "fast.generate",
    "cached_decoder": "fast.generate", "clear_decoder_cache": "fast.generate", "serve": "fast.serving",
    # proposers
    "DFlashContext": "proposers", "dflash_draft_logits": "proposers", "prompt_lookup": "proposers",
    "PromptLookupDrafter": "proposers", "NoDrafter": "proposers",
    # sampling
    "DRAFT_SAMPLE_METHODS": "sampling", "logits_to_probs": "sampling", "sample": "sampling",
    "greedy_accept": "sampling", "greedy_accept_batch": "sampling", "rejection_sample": "sampling",
    "REJECTION_SAMPLE_METHODS": "sampling", "block_verify": "sampling", "fly_accept": "sampling",
    "fly_entropy": "sampling", "synthetic_accept": "sampling", "make_verifier": "sampling", "Verifier": "sampling",
    "unconditional_to_conditional_rates": "sampling", "acceptance_length_to_rates": "sampling",
    # draft trees
    "DraftTree": "tree", "build_draft_tree": "tree", "best_first_tree": "tree", "accept_path": "tree",
    # stats and /metrics
    "SpecDecodeStats": "stats", "stats_from_prometheus_text": "metrics", "prometheus_text": "metrics",
    # loop
    "SpecDecodeStep": "loop", "SpecDecodeResult": "loop", "new_target_cache": "loop", "crop_cache": "loop",
    "verify_forward": "loop", "check_generation_args": "loop", "speculative_generate": "loop",
    "prompt_lookup_generate": "loop", "generate_on_prompts": "loop",
    # the per-batch speculation schedule
    "SpeculationSchedule": "schedule", "validate_schedule": "schedule", "schedule_lookup": "schedule",
    "Measurement": "schedule", "recommend_schedule": "schedule", "speculative_config_json": "schedule",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
