"""dflash_lab: DFlash speculative decoding on Laguna models, as a notebook lab.

The package follows the data path of one DFlash step, a module per step:

    config      the drafter's config.json, validated the way vLLM validates it
    target      the Laguna target (transformers) and its aux hidden states
    drafter     the DFlash drafter: combine_hidden_states, context K/V, block drafting
    checkpoint  save/load in vLLM's DFlashLagunaForCausalLM layout (safetensors)
    spec_decode draft -> verify -> accept, with vLLM's acceptance counters
    metrics     the same counters read from a vLLM /metrics page
    kv_specs    each layer's KV-cache spec (vLLM's classes) for Laguna+DFlash, MTP, Qwen3.5, DeepSeek-V4
    kv_presets  the KV-cache chapter's models (Poolside's Laguna pairs among them)
    kv_groups   how vLLM groups the KV cache of hybrid models, and the drafter's group
    kv_engine   what vLLM 0.33's engine itself does with the groups (its annotation, checks)
    kv_layout   the groups read back: rows for the figures, memory per group
    viz         plotly figures from plain data
    widgets     ipywidgets controls wired to those figures
"""

__version__ = "0.1.0"
