"""Real Laguna drafter and target configs, and a way to shrink them for a laptop.

``LAGUNA_S_21_DFLASH`` is Poolside's Laguna-S-2.1-DFlash ``config.json`` verbatim (a public
copy): six **sliding**, **causal** drafter layers, a flat ``rope_theta``, both layer-id keys.
``LAGUNA_XS_21_DFLASH`` is shaped like Laguna-XS-2.1-DFlash (its published geometry; the
feature layers and MLP width are the lab's guesses, marked so). The target configs carry the
shapes the KV-cache grouping needs (layers, layer types, heads, window).

``shrink_drafter_config`` keeps what decides behaviour in vLLM (layer types, causality,
window, RoPE, layer ids, gating, mask token) and scales the widths and the vocabulary down,
so that tests and chapters can build the real configs on a CPU.
"""

from __future__ import annotations

import copy

# Laguna-S-2.1-DFlash config.json, as published (key order kept).
LAGUNA_S_21_DFLASH: dict = {
    "architectures": ["DFlashLagunaForCausalLM"],
    "model_type": "laguna",
    "hidden_size": 3072,
    "intermediate_size": 12288,
    "num_hidden_layers": 6,
    "num_attention_heads": 72,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "layer_types": ["sliding_attention"] * 6,
    "rope_theta": 500000.0,
    "gating": "per-head",
    "vocab_size": 100352,
    "draft_vocab_size": 100352,
    "max_position_embeddings": 1048576,
    "torch_dtype": "bfloat16",
    "eagle_aux_hidden_state_layer_ids": [2, 11, 20, 30, 39, 48],
    "dflash_config": {
        "block_size": 16,
        "mask_token_id": 12,
        "num_target_layers": 48,
        "target_layer_ids": [1, 10, 19, 29, 38, 47],
        "causal": True,
    },
}

# Laguna-XS-2.1-DFlash geometry (hidden 2048, 5 sliding layers, 64 heads, 8 KV heads x 128,
# window 512, block 16, theta 500000). Guessed: intermediate_size, target_layer_ids.
LAGUNA_XS_21_DFLASH: dict = {
    "architectures": ["DFlashLagunaForCausalLM"],
    "model_type": "laguna",
    "hidden_size": 2048,
    "intermediate_size": 8192,  # guess: 4 x hidden, as in S-2.1
    "num_hidden_layers": 5,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "attention_bias": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "layer_types": ["sliding_attention"] * 5,
    "rope_theta": 500000.0,
    "gating": "per-head",
    "vocab_size": 100352,
    "draft_vocab_size": 100352,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "eagle_aux_hidden_state_layer_ids": [2, 10, 19, 28, 37],  # guess: spread over 40 layers
    "dflash_config": {
        "block_size": 16,
        "mask_token_id": 12,
        "num_target_layers": 40,
        "target_layer_ids": [1, 9, 18, 27, 36],
        "causal": True,
    },
}


def _periodic(n_layers: int, period: tuple[str, ...]) -> list[str]:
    return [period[i % len(period)] for i in range(n_layers)]


# Targets: the shapes that matter for pairing (vocab, depth, width) and for KV grouping.
LAGUNA_S_21_TARGET: dict = {
    "model_type": "laguna",
    "vocab_size": 100352,
    "hidden_size": 3072,
    "num_hidden_layers": 48,
    # period FULL, SWA, SWA, SWA: 12 full + 36 sliding layers
    "layer_types": _periodic(48, ("full_attention", "sliding_attention", "sliding_attention", "sliding_attention")),
    "num_attention_heads": 72,
    "num_attention_heads_per_layer": [48 if i % 4 == 0 else 72 for i in range(48)],
    "num_key_value_heads": 8,
    "head_dim": 128,
    "sliding_window": 512,
}

LAGUNA_XS_2_TARGET: dict = {
    "model_type": "laguna",
    "vocab_size": 100352,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    # 10 global + 30 sliding layers
    "layer_types": _periodic(40, ("full_attention", "sliding_attention", "sliding_attention", "sliding_attention")),
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "sliding_window": 512,
    "max_position_embeddings": 131072,
}

DRAFTER_PRESETS = {
    "laguna-s-2.1-dflash": (LAGUNA_S_21_DFLASH, LAGUNA_S_21_TARGET),
    "laguna-xs-2.1-dflash (shape)": (LAGUNA_XS_21_DFLASH, LAGUNA_XS_2_TARGET),
}


def drafter_preset(name: str) -> tuple[dict, dict]:
    """(drafter config.json dict, matching target config dict), deep copies."""
    if name not in DRAFTER_PRESETS:
        raise KeyError(f"unknown drafter preset {name!r}; choose from {sorted(DRAFTER_PRESETS)}")
    drafter, target = DRAFTER_PRESETS[name]
    return copy.deepcopy(drafter), copy.deepcopy(target)


def shrink_drafter_config(d: dict, *, hidden_size: int = 64, num_attention_heads: int = 4,
                          num_key_value_heads: int = 2, head_dim: int = 16, intermediate_size: int = 128,
                          vocab_size: int = 512) -> dict:
    """``d`` with small widths and vocabulary; every behaviour-deciding key kept as is.

    The mask token id keeps its value (it must stay below ``vocab_size``).
    """
    out = copy.deepcopy(d)
    out.update(hidden_size=hidden_size, num_attention_heads=num_attention_heads,
               num_key_value_heads=num_key_value_heads, head_dim=head_dim, intermediate_size=intermediate_size,
               vocab_size=vocab_size, draft_vocab_size=vocab_size)
    if "target_hidden_size" in out:
        out["target_hidden_size"] = hidden_size
    return out


# Laguna-XS.2 as a full transformers ``LagunaConfig`` (33.5 B parameters), for building it with random
# weights at its true shape. From the published config.json: 48 attention heads, one full-attention layer
# in four (period FULL, SWA, SWA, SWA), the first layer's MLP dense and the rest sparse (256 experts,
# top-8, width 512, one shared expert of 512), YaRN RoPE with partial_rotary_factor 0.5 on full layers
# and default RoPE (theta 10000) on sliding ones. Per-layer heads (48 on full layers, 64 on sliding
# ones) and the routed scaling factor 2.5 are as read from the checkpoint by an independent loader
# (Luce-Org/lucebox PR #116: "per-layer head count [48,64,64,64]x10", "scale 2.5"). The YaRN factor and
# original context are the lab's guess (they change no step cost).
LAGUNA_XS_2_FULL: dict = {
    "model_type": "laguna",
    "vocab_size": 100352,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 40,
    "num_attention_heads": 48,
    "num_attention_heads_per_layer": [48 if i % 4 == 0 else 64 for i in range(40)],
    "num_key_value_heads": 8,
    "head_dim": 128,
    "layer_types": _periodic(40, ("full_attention", "sliding_attention", "sliding_attention", "sliding_attention")),
    "mlp_layer_types": ["dense"] + ["sparse"] * 39,
    "sliding_window": 512,
    "max_position_embeddings": 131072,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "moe_routed_scaling_factor": 2.5,
    "gating": "per-head",
    "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
                           "factor": 32.0, "original_max_position_embeddings": 4096},  # factor, original: guesses
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
    },
}


def laguna_xs_2_config(**overrides):
    """transformers' ``LagunaConfig`` for ``LAGUNA_XS_2_FULL`` (``overrides`` replace keys; per-layer lists are
    cut to ``num_hidden_layers`` when that is overridden)."""
    from transformers import LagunaConfig  # imported here: the presets are plain data elsewhere

    d = {**copy.deepcopy(LAGUNA_XS_2_FULL), **overrides}
    n = d["num_hidden_layers"]
    for key in ("num_attention_heads_per_layer", "layer_types", "mlp_layer_types"):
        if key not in overrides:
            d[key] = d[key][:n]
    return LagunaConfig(**d)
