"""dflash_lab: DFlash speculative decoding on Laguna models, as a notebook lab.

The package follows the data path of one DFlash step, a module per step, in this order, which is
also the layer order: a module imports only modules listed above it (tests/test_architecture.py).

    runtime      plumbing at the bottom: paths, device/dtype, seeding, tokenizer, atomic writes
    config_keys  the keys vLLM reads more than one way: RoPE per layer type, swa_rope_parameters, sinks, layer ids
    config       the drafter's config.json, resolved the way vLLM 0.33 resolves it (causality, ids, RoPE)
    presets      real Poolside drafter/target configs (Laguna-S-2.1-DFlash, XS-2.1 shape), shrinkable
    target       the Laguna target (transformers) and its aux hidden states
    layers       RMSNorm and RoPE, the building blocks the drafter shares
    context_kv_kernel  the folded context-K/V path's fused Triton epilogue (GPU; CPU under Triton's interpreter)
    context_kv   the drafter's context K/V, three paths (reference, batched, folded) and one agreement rule
    block_attention  who a block query sees (vLLM's causality and window), the two K/V stores, the block's ids
    drafter      the DFlash drafter: combine_hidden_states, context K/V, one block through its layers
    checkpoint   save/load in vLLM's DFlashLagunaForCausalLM layout (safetensors)
    pair_files   a pair's files checked before anything loads: shards, the index, both configs, the fit
    spec_decode  draft -> verify -> accept: proposers, accept rules, draft trees, stats, /metrics, the loop; fast/
    kv_cache     vLLM's KV-cache specs, grouping of hybrid models, draft-group rules (#55390), memory
    vllm_engine  vLLM's own engine (CPU build, second virtualenv) on the same checkpoints
    viz          plotly figures from plain data
    export       data out: statistics as CSV/JSON, figures as SVG/HTML
    user_prompts your own prompts, from a file named by $DFLASH_LAB_PROMPTS
    corpus       the training corpus and its held-out split by file path
    assets       the shipped pair (or the one the variables name) and the held-out prompts
    train        the recipe: tokenizer, target, self-distillation data, the objective, evaluation
    user_pair    a pair in the format a researcher brings (sharded target, XS.2 layer pattern), random weights
    repro        offline, reproducible runs (network guard, rounding for nbval)
    poolside_cards  Poolside's published DFlash speed-ups (card rows, conditions, addresses)
    measure      timing the paths: what chapters time live and the benchmark CLIs write
    widgets      ipywidgets controls wired to the figures, and to the runs they redraw (training, timing)
    tools        benchmarks, the notebook report writer, comparison CLIs
"""

__version__ = "0.1.0"
