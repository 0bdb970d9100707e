"""The KV-cache chapter's models, by name, and a reader for a user's config.json.

Each preset is a spec dict (``kv_specs``) plus the drafter it is served with. Two are
Poolside's real Laguna pairs at full shape (``dflash_lab.presets``): the XS.2 target
(40 layers: 30 sliding, 10 full) with an XS-2.1-DFlash-shaped 5-layer drafter, and the
S-2.1 target (48 layers: 36 sliding, 12 full) with the 6-layer S-2.1-DFlash drafter.
The lab's shipped pair comes first, read from its config.json files (``runtime.target_path`` /
``drafter_path``, so the environment's checkpoints when they are set), and next to it the
shipped target with the shipped drafter made 4 layers deep (``shipped_drafter_config``): the
case where vLLM splits a drafter over two KV-cache groups of that target. The others are small
shapes that show one mechanism each: a toy Laguna + DFlash, a Qwen3.5-shaped GDN hybrid +
MTP and a DeepSeek-V4-shaped MLA model + MTP.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_lab.kv_cache import specs as kv_specs
from dflash_lab import presets
from dflash_lab.config import read_json  # the lab's one config.json reader
from dflash_lab.runtime import DEFAULT_DRAFTER, DEFAULT_TARGET, drafter_path, target_path

# ``shipped``: the lab's own pair, from its config.json files (``drafter_layers``: the shipped drafter
# made that many layers deep); ``pair`` names a real Poolside pair in ``presets.DRAFTER_PRESETS``;
# ``mtp`` says the drafter is an MTP block (a copy of a target layer, whose marker the lab can switch).
PRESETS = {
    "shipped_pair": dict(label="the pair in use (by default the shipped tiny Laguna code + its DFlash drafter)",
                         method="dflash", model_type="laguna", shipped=True),
    "shipped_target_4_layer_drafter": dict(label="the shipped target + a 4-layer drafter (the split case)",
                                           method="dflash", model_type="laguna", shipped=True, drafter_layers=4),
    "laguna_xs2_dflash": dict(label="Laguna-XS.2 + XS-2.1-DFlash (shape)", method="dflash", model_type="laguna",
                              pair="laguna-xs-2.1-dflash (shape)"),
    "laguna_s21_dflash": dict(label="Laguna-S-2.1 + S-2.1-DFlash", method="dflash", model_type="laguna",
                              pair="laguna-s-2.1-dflash"),
    "laguna_dflash": dict(label="toy Laguna + DFlash (6 + 3 layers)", method="dflash", model_type="laguna"),
    "qwen3_5_mtp": dict(label="Qwen3.5 hybrid + MTP", method="mtp", model_type="qwen3_5", mtp=True),
    "deepseek_v4": dict(label="DeepSeek-V4-shaped + MTP", method="mtp", model_type="deepseek_v4", mtp=True),
}


def poolside_pair_specs(name: str, *, dtype: str | torch.dtype = "bfloat16",
                        kv_block_size: int = kv_specs.KV_BLOCK_SIZE) -> dict[str, Any]:
    """A real Laguna target and its DFlash drafter (a ``presets.DRAFTER_PRESETS`` name), at full shape.

    Only the attention geometry reaches the grouping (layer types, KV heads, head dim,
    window), so the configs are used as published; nothing is shrunk.
    """
    drafter, target = presets.drafter_preset(name)
    return kv_specs.laguna_dflash_specs(target, drafter, dtype=dtype, kv_block_size=kv_block_size)


def preset_specs(name: str, *, drafter_sliding: bool = False, mark_draft: bool = False) -> dict[str, Any]:
    """The spec dict of a preset (see ``PRESETS``).

    ``drafter_sliding`` applies to the toy DFlash drafter (the real ones slide as their
    config says); ``mark_draft`` marks the MTP presets' draft layers as vLLM 0.33's runner
    does. DFlash drafter layers are always marked.
    """
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; expected one of {list(PRESETS)}")
    if "pair" in PRESETS[name]:
        return poolside_pair_specs(PRESETS[name]["pair"])
    if PRESETS[name].get("shipped"):
        depth = PRESETS[name].get("drafter_layers")
        if depth is None:  # the pair in use
            return kv_specs.laguna_dflash_specs(load_config(target_path()), shipped_drafter_config())
        # the worked split case is the shipped pair's, whatever pair is in use
        shipped = load_config(DEFAULT_TARGET), shipped_drafter_config(depth, path=DEFAULT_DRAFTER)
        return kv_specs.laguna_dflash_specs(*shipped)
    if name == "laguna_dflash":
        return kv_specs.laguna_dflash_specs(drafter_sliding=drafter_sliding)
    if name == "qwen3_5_mtp":
        return kv_specs.qwen3_5_hybrid_specs(mark_draft=mark_draft)
    return kv_specs.deepseek_v4_specs(mark_draft=mark_draft)


def shipped_drafter_config(num_layers: int | None = None, *, path: str | Path | None = None) -> dict:
    """The drafter in use's config.json (``path``: another drafter directory); with ``num_layers``, the same
    drafter made that many layers deep.

    Only the depth changes: ``num_hidden_layers`` and the per-layer lists (``layer_types``,
    ``mlp_layer_types``, ``num_attention_heads_per_layer``), cut short or extended with their
    last entry. Heads, head dim and dtype stay the shipped drafter's, so the pages stay the same
    size and only the layer counts reach vLLM's grouping.
    """
    config = load_config(drafter_path() if path is None else path)
    if num_layers is None:
        return config
    n = kv_specs.positive_int(num_layers, "num_layers", "arguments")
    deeper = dict(config, num_hidden_layers=n)
    for key, value in config.items():
        if isinstance(value, list) and value and len(value) == config["num_hidden_layers"] and key.endswith(
                ("layer_types", "_per_layer")):
            deeper[key] = (value + value[-1:] * n)[:n]
    return deeper


def load_config(path: str | Path) -> dict:
    """A config.json (or a folder holding one) as a dict; errors name the file."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"config file {path} must hold a JSON object, got {type(config).__name__}")
    return config
