"""How vLLM 0.33 lays out the KV cache of hybrid models, and which group is the drafter's.

In layer order (a module imports only those above it):

    common    vLLM, imported on first use, and the argument checks every module below shares
    specs     each layer's KV-cache spec, with vLLM's own classes: Laguna + DFlash, MTP,
              a Qwen3.5-style GDN/attention hybrid, a DeepSeek-V4-shaped model
    presets   the chapter's models by name (Poolside's real Laguna pairs among them), a user's config.json
    grouping  vLLM 0.33's own answers: its grouping of those specs, its block-drop predicates, and
              V1's check that the drafter's layers sit in one group (``v1_refusal``)
    engine    what vLLM 0.33's engine itself does with the groups (``get_global_kv_cache_groups``)
    groups    who flags the draft group: upstream #55390's rules as the seed states them
              (rules="seed"), the same behind 0.33's gate (rules="seed-gated"), or vLLM 0.33's
              own annotation (rules="vllm-0.33", via engine)
    compare   the seed's rules beside vLLM 0.33's own: where they differ, and why (file:line)
    layout    the groups read back: rows for the figures, memory per group

vLLM is imported on first use only (``common.vllm_api``).
"""

from .groups import (
    annotate_draft_groups,
    groups_partition_layers_exactly,
    kv_cache_groups,
    uses_trailing_mtp_layers,
)

__all__ = ["annotate_draft_groups", "groups_partition_layers_exactly", "kv_cache_groups", "uses_trailing_mtp_layers"]
