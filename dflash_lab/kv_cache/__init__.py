"""How vLLM 0.33 lays out the KV cache of hybrid models, and which group is the drafter's.

In the order the chapter (04) uses them:

    specs    each layer's KV-cache spec, with vLLM's own classes: Laguna + DFlash, MTP,
             a Qwen3.5-style GDN/attention hybrid, a DeepSeek-V4-shaped model
    presets  the chapter's models by name (Poolside's real Laguna pairs among them), a user's config.json
    groups   vLLM's grouping of those specs and who flags the draft group: upstream #55390's
             rules as the seed states them (rules="seed"), the same behind 0.33's gate
             (rules="seed-gated"), or vLLM 0.33's own annotation (rules="vllm-0.33", via engine)
    compare  the seed's rules beside vLLM 0.33's own: where they differ, and why (file:line)
    engine   what vLLM 0.33's engine itself does with the groups
    layout   the groups read back: rows for the figures, memory per group

vLLM is imported on first use only (``specs.vllm_api``).
"""

from .groups import (
    annotate_draft_groups,
    groups_partition_layers_exactly,
    kv_cache_groups,
    uses_trailing_mtp_layers,
)

__all__ = ["annotate_draft_groups", "groups_partition_layers_exactly", "kv_cache_groups", "uses_trailing_mtp_layers"]
