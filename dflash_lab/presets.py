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


def shrink_target_config(t: dict, *, hidden_size: int = 64, vocab_size: int = 512) -> dict:
    """A target config dict that pairs with ``shrink_drafter_config``'s output (same depth and ids)."""
    return {**copy.deepcopy(t), "hidden_size": hidden_size, "vocab_size": vocab_size}
