"""How vLLM groups the KV cache of hybrid models, and which group is the drafter's.

vLLM describes every layer that keeps state per token with a *KV-cache spec*
(``FullAttentionSpec``, ``SlidingWindowSpec``, ``MambaSpec``, the MLA specs ...)
and packs the layers into *KV-cache groups*: the layers of one group share one
block table. A speculative drafter adds its own attention layers, and the
scheduler must know which group holds them (``KVCacheGroupSpec.is_eagle_group``):
those groups drop the volatile last block from prefix-cache hits. When no group
is flagged, vLLM's coordinator falls back to flagging *every* group, Mamba
state included.

This module follows the data path of that decision:

    spec builders     a layer name -> spec dict, in registration order, for a
                      Laguna target + DFlash drafter, an MTP drafter, a
                      Qwen3.5-shaped hybrid and a DeepSeek-V4-shaped model
    vLLM's grouping   ``get_kv_cache_groups`` from vLLM 0.33, on a default
                      ``VllmConfig`` whose cache layout is set: ``LBHNC`` (the
                      general path) or ``BLHNC`` (block-outermost: the packed path
                      when page sizes differ)
    the rules         upstream vLLM #55390: the draft marker, the trailing-layer
                      rule for MTP (and DeepSeek V4/V4.1 dspark) drafters, and a
                      warning when a hybrid's draft group cannot be found
    memory            page size, block size, bytes per token and capacity of
                      each group for a KV budget (vLLM's own block accounting)
    pictures          plain rows (``describe_groups``) for ``viz.py``

vLLM is imported on first use only; without it the rest of the lab still works
and the grouping functions raise an ImportError that says how to install it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

logger = logging.getLogger("dflash_lab.kv_groups")

INSTALL_HINT = (
    'the KV-cache grouping needs vLLM 0.33: install it with `pip install "vllm==0.33.*"` '
    "(or run `make setup`, which installs every dependency of the lab)"
)

# The text of rule 3's warning; tests and the notebook look for it.
DRAFT_GROUP_WARNING = "no KV cache group could be identified as the draft model's"

# ``SpeculativeConfig.method`` values vLLM 0.33 accepts (its deprecated per-model
# MTP aliases such as "deepseek_mtp" are spelled "mtp" here, as vLLM rewrites them).
SPEC_METHODS = (
    "ngram", "ngram_gpu", "suffix", "draft_model", "custom_class", "extract_hidden_states",
    "eagle", "eagle3", "mtp", "dflash", "dspark",
)
# The EAGLE family (vLLM's ``SpeculativeConfig.use_eagle()``): drafters that read
# the target's hidden states and keep their own KV cache. Only they have a draft
# group to find.
EAGLE_METHODS = ("eagle", "eagle3", "mtp", "dflash", "dspark")
# DeepSeek V4/V4.1 register the dspark draft layer after every target layer, as an
# MTP block does, by reusing the target's decoder layer.
TRAILING_DSPARK_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")

# The two cache layouts the lab compares; vLLM accepts the other KVCacheLayout names too.
LAYOUTS = {"LBHNC": "general", "BLHNC": "packed"}

LAGUNA_LAYER_TYPES = ("full_attention", "sliding_attention")

# A Laguna-shaped target used when no config is given: hybrid attention
# (sliding, sliding, full) x 2 with small GQA heads, like the lab's tiny target.
EXAMPLE_LAGUNA_CONFIG = {
    "model_type": "laguna",
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_size": 256,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
    "sliding_window": 64,
}


# ---------------------------------------------------------------------------
# vLLM, imported on first use
# ---------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _vllm() -> SimpleNamespace:
    """vLLM's KV-cache classes and grouping functions (imported once, lazily)."""
    # Grouping is host-side bookkeeping: run it on vLLM's CPU platform unless the
    # user picked another one.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
        from vllm.config import VllmConfig
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
        from vllm.v1 import kv_cache_interface
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
        from vllm.v1.core import kv_cache_planning
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} (importing vLLM failed: {exc})") from exc
    return SimpleNamespace(
        version=vllm.__version__,
        VllmConfig=VllmConfig,
        iface=kv_cache_interface,
        planning=kv_cache_planning,
        MambaStateShapeCalculator=MambaStateShapeCalculator,
        GDN=MambaAttentionBackendEnum.GDN_ATTN,
        KVCacheLayout=KVCacheLayout,
    )


def vllm_version() -> str:
    """The installed vLLM's version (imports vLLM; raises ImportError with the fix if missing)."""
    return _vllm().version


# ---------------------------------------------------------------------------
# Checking the arguments
# ---------------------------------------------------------------------------


def _check_method(method: str | None) -> str | None:
    if method is None:
        return None
    if not isinstance(method, str):
        raise TypeError(f"method must be a string or None, got {type(method).__name__}")
    if method not in SPEC_METHODS:
        raise ValueError(
            f"method {method!r} is not a speculative method vLLM 0.33 knows; "
            f"expected None or one of {list(SPEC_METHODS)}"
        )
    return method


@lru_cache(maxsize=1)
def _known_model_types() -> frozenset[str]:
    """Model types transformers knows, plus those vLLM registers itself (e.g. deepseek_v41)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    known = set(CONFIG_MAPPING_NAMES)
    try:
        from vllm.transformers_utils.config import _CONFIG_REGISTRY

        known |= set(_CONFIG_REGISTRY)
    except ImportError:
        known |= set(TRAILING_DSPARK_MODEL_TYPES)
    return frozenset(known)


def _check_model_type(model_type: str | None) -> str | None:
    if model_type is None:
        return None
    if not isinstance(model_type, str):
        raise TypeError(f"model_type must be a string or None, got {type(model_type).__name__}")
    if model_type not in _known_model_types():
        raise ValueError(
            f"model_type {model_type!r} is not a model type transformers or vLLM knows "
            "(the `model_type` of a config.json, e.g. 'laguna', 'qwen3_5', 'deepseek_v4')"
        )
    return model_type


def _check_spec_dict(kv_cache_spec: Any, *, argument: str = "kv_cache_spec") -> dict[str, Any]:
    """A name -> spec dict from a mapping or (name, spec) pairs; names unique and non-empty."""
    spec_cls = _vllm().iface.KVCacheSpec
    if isinstance(kv_cache_spec, Mapping):
        pairs = list(kv_cache_spec.items())
    elif isinstance(kv_cache_spec, Iterable) and not isinstance(kv_cache_spec, (str, bytes)):
        pairs = list(kv_cache_spec)
        if not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise TypeError(f"{argument} must be a mapping of layer name -> KVCacheSpec or (name, spec) pairs")
    else:
        raise TypeError(f"{argument} must be a mapping of layer name -> KVCacheSpec, got {type(kv_cache_spec).__name__}")
    if not pairs:
        raise ValueError(f"{argument} is empty: there are no layers to group")
    specs: dict[str, Any] = {}
    for name, spec in pairs:
        if not isinstance(name, str):
            raise TypeError(f"{argument}: layer name {name!r} is not a string")
        if not name.strip():
            raise ValueError(f"{argument}: a layer name is empty ({name!r})")
        if name in specs:
            raise ValueError(f"{argument}: layer name {name!r} appears twice; every layer registers once")
        if not isinstance(spec, spec_cls):
            raise TypeError(f"{argument}[{name!r}] must be a vLLM KVCacheSpec, got {type(spec).__name__}")
        specs[name] = spec
    return specs


def _layout_name(layout: str) -> str:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a string such as 'LBHNC' or 'BLHNC', got {type(layout).__name__}")
    aliases = {v: k for k, v in LAYOUTS.items()}  # "general" -> "LBHNC", "packed" -> "BLHNC"
    name = aliases.get(layout, layout)
    members = _vllm().KVCacheLayout.__members__
    if name not in members:
        raise ValueError(
            f"layout {layout!r} is not a vLLM KV-cache layout; expected 'LBHNC' (general), "
            f"'BLHNC' (packed) or one of {list(members)}"
        )
    return name


def _get(config: Any, key: str, default: Any = None, *, required: bool = False, where: str = "config") -> Any:
    """A key of a config dict, or an attribute of a config object (LagunaConfig, ...)."""
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    if required and value is None:
        raise ValueError(f"{where}: `{key}` is missing")
    return value


def _positive_int(value: Any, key: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: `{key}` must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{where}: `{key}` must be >= 1, got {value}")
    return value


def _layer_types(config: Any, num_layers: int, where: str) -> list[str]:
    """``layer_types`` of a Laguna-style config: one per layer, each full or sliding."""
    types = _get(config, "layer_types")
    if types is None:
        return ["full_attention"] * num_layers  # transformers' LagunaConfig default
    if not isinstance(types, (list, tuple)) or not all(isinstance(t, str) for t in types):
        raise TypeError(f"{where}: `layer_types` must be a list of strings, got {types!r}")
    if len(types) != num_layers:
        raise ValueError(
            f"{where}: `layer_types` has {len(types)} entries but num_hidden_layers is {num_layers}"
        )
    unknown = sorted(set(types) - set(LAGUNA_LAYER_TYPES))
    if unknown:
        raise ValueError(f"{where}: `layer_types` holds unknown types {unknown}; expected {list(LAGUNA_LAYER_TYPES)}")
    return list(types)


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype (e.g. 'bfloat16', 'float16', 'float32')")
    return value


# ---------------------------------------------------------------------------
# Spec builders: layer name -> KV-cache spec, in registration order
# ---------------------------------------------------------------------------


def _attention_heads(config: Any, where: str, num_kv_heads: int | None, head_dim: int | None) -> tuple[int, int]:
    kv = num_kv_heads if num_kv_heads is not None else _get(config, "num_key_value_heads")
    if kv is None:  # no GQA: one KV head per query head
        kv = _get(config, "num_attention_heads", required=True, where=where)
    hd = head_dim if head_dim is not None else _get(config, "head_dim")
    if hd is None:
        hidden = _get(config, "hidden_size", required=True, where=where)
        hd = hidden // _positive_int(_get(config, "num_attention_heads", required=True, where=where), "num_attention_heads", where)
    return _positive_int(kv, "num_key_value_heads", where), _positive_int(hd, "head_dim", where)


def laguna_target_specs(
    config: Any,
    *,
    dtype: str | torch.dtype = "bfloat16",
    block_size: int = 16,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, Any]:
    """The target's attention layers: ``model.layers.{i}.self_attn.attn``, sliding or full per ``layer_types``.

    ``config`` is a Laguna config dict (a config.json) or a LagunaConfig-like object.
    """
    v, where = _vllm(), "target config"
    n = _positive_int(_get(config, "num_hidden_layers", required=True, where=where), "num_hidden_layers", where)
    types = _layer_types(config, n, where)
    kv, hd = _attention_heads(config, where, num_kv_heads, head_dim)
    dtype, block_size = _torch_dtype(dtype), _positive_int(block_size, "block_size", "arguments")
    window = None
    if "sliding_attention" in types:
        window = _positive_int(_get(config, "sliding_window", required=True, where=where), "sliding_window", where)
    specs = {}
    for i, kind in enumerate(types):
        common = dict(block_size=block_size, num_kv_heads=kv, head_size=hd, dtype=dtype)
        if kind == "sliding_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = v.iface.SlidingWindowSpec(**common, sliding_window=window)
        else:
            specs[f"model.layers.{i}.self_attn.attn"] = v.iface.FullAttentionSpec(**common)
    return specs


def dflash_drafter_specs(
    drafter_config: Any,
    *,
    target_layer_count: int,
    dtype: str | torch.dtype = "bfloat16",
    block_size: int = 16,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, Any]:
    """A DFlash drafter's attention layers, as vLLM's ``DFlashLagunaModel`` registers them.

    Drafter layer j is named ``model.layers.{target_layer_count + j}.self_attn.attn`` so its
    cache never collides with the target's. Its KV cache is always full attention, even when
    ``layer_types`` are sliding: DFlash writes the verifier's context K/V at absolute cache
    slots, so the window only limits compute. Every layer carries the draft marker
    (``is_draft=True``), as vLLM's model runner sets it for drafter attention layers.
    """
    v, where = _vllm(), "drafter config"
    n = _positive_int(_get(drafter_config, "num_hidden_layers", required=True, where=where), "num_hidden_layers", where)
    _layer_types(drafter_config, n, where)  # checked, then ignored: the cache is full attention
    offset = _positive_int(target_layer_count, "target_layer_count", "arguments")
    kv, hd = _attention_heads(drafter_config, where, num_kv_heads, head_dim)
    spec = v.iface.FullAttentionSpec(
        block_size=_positive_int(block_size, "block_size", "arguments"),
        num_kv_heads=kv, head_size=hd, dtype=_torch_dtype(dtype), is_draft=True,
    )
    return {f"model.layers.{offset + j}.self_attn.attn": spec for j in range(n)}


def example_dflash_drafter_config(target_config: Any, *, num_layers: int = 3, sliding: bool = False) -> dict:
    """A drafter config shaped like the target's attention (its KV heads and head dim)."""
    where = "target config"
    kv, hd = _attention_heads(target_config, where, None, None)
    layer_type = "sliding_attention" if sliding else "full_attention"
    return {
        "num_hidden_layers": num_layers,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "layer_types": [layer_type] * num_layers,
        "sliding_window": _get(target_config, "sliding_window") if sliding else None,
    }


def laguna_dflash_specs(
    target_config: Any = None,
    drafter_config: Any = None,
    *,
    drafter_sliding: bool = False,
    dtype: str | torch.dtype = "bfloat16",
    block_size: int = 16,
) -> dict[str, Any]:
    """A Laguna target followed by its DFlash drafter, in vLLM's registration order.

    Without ``target_config`` the built-in Laguna-shaped example is used; without
    ``drafter_config`` a 3-layer drafter with the target's heads (sliding when
    ``drafter_sliding``; the cache is full attention either way).
    """
    target_config = EXAMPLE_LAGUNA_CONFIG if target_config is None else target_config
    if drafter_config is None:
        drafter_config = example_dflash_drafter_config(target_config, sliding=drafter_sliding)
    specs = laguna_target_specs(target_config, dtype=dtype, block_size=block_size)
    specs.update(dflash_drafter_specs(drafter_config, target_layer_count=len(specs), dtype=dtype, block_size=block_size))
    return specs


def mtp_drafter_specs(target_specs: Any, num_layers: int = 1) -> dict[str, Any]:
    """An MTP drafter's attention layers: ``mtp.layers.{k}.self_attn.attn``.

    The MTP block reuses the target's decoder layer, so each layer gets exactly the spec
    of the target's full attention and no draft marker: only its position (it registers
    after every target layer) tells it apart.
    """
    v = _vllm()
    specs = _check_spec_dict(target_specs, argument="target_specs")
    full = [s for s in specs.values() if type(s) is v.iface.FullAttentionSpec and not s.is_draft]
    if not full:
        raise ValueError("target_specs has no full-attention layer for the MTP block to copy")
    n = _positive_int(num_layers, "num_layers", "arguments")
    return {f"mtp.layers.{k}.self_attn.attn": full[-1] for k in range(n)}


def _gdn_state(dtype: torch.dtype, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, conv_kernel: int):
    """Shapes and dtypes of one Gated DeltaNet layer's state, from vLLM's own calculator."""
    conv, recurrent = _vllm().MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel
    )
    return (conv, recurrent), (dtype, torch.float32)  # the recurrent state is kept in fp32


def qwen3_5_hybrid_specs(
    num_blocks: int = 2,
    *,
    with_mtp_layer: bool = True,
    num_kv_heads: int = 2,
    head_dim: int = 256,
    gdn_heads: tuple[int, int] = (16, 32),  # (key heads, value heads) of each Gated DeltaNet layer
    gdn_head_dims: tuple[int, int] = (128, 128),
    dtype: str | torch.dtype = "bfloat16",
    block_size: int = 16,
    align_pages: bool = True,
) -> dict[str, Any]:
    """A Qwen3.5-shaped hybrid: ``num_blocks`` x [GDN, GDN, GDN, full attention] (+ an MTP layer).

    GDN layers are ``model.layers.{i}.linear_attn`` (``MambaSpec``, fixed-size state), full
    attention layers ``model.layers.{i}.self_attn.attn``, and the MTP drafter
    ``mtp.layers.0.self_attn.attn`` (spec-identical to the target's attention, no marker).

    ``align_pages`` does what vLLM's platform does for hybrids before grouping: grow the
    attention block (in multiples of ``block_size``) until one attention page is at least
    one Mamba state, then pad the Mamba page to exactly that size, so every layer has the
    same page size.
    """
    v = _vllm()
    dtype, block_size = _torch_dtype(dtype), _positive_int(block_size, "block_size", "arguments")
    shapes, dtypes = _gdn_state(dtype, *gdn_heads, *gdn_head_dims, conv_kernel=4)
    mamba = v.iface.MambaSpec(block_size=block_size, shapes=shapes, dtypes=dtypes,
                              mamba_type=v.GDN, mamba_cache_mode="align")
    attn = v.iface.FullAttentionSpec(block_size=block_size, num_kv_heads=_positive_int(num_kv_heads, "num_kv_heads", "arguments"),
                                     head_size=_positive_int(head_dim, "head_dim", "arguments"), dtype=dtype)
    if align_pages:
        per_block = attn.page_size_bytes  # bytes of one block_size-token attention page
        attn_block = block_size * -(-mamba.page_size_bytes // per_block)  # ceil: a page holds a whole state
        attn = attn.copy_with_new_block_size(attn_block)
        mamba = v.iface.MambaSpec(block_size=attn_block, shapes=shapes, dtypes=dtypes, mamba_type=v.GDN,
                                  mamba_cache_mode="align", page_size_padded=attn.page_size_bytes)
    specs, i = {}, 0
    for _ in range(_positive_int(num_blocks, "num_blocks", "arguments")):
        for _ in range(3):
            specs[f"model.layers.{i}.linear_attn"] = mamba
            i += 1
        specs[f"model.layers.{i}.self_attn.attn"] = attn
        i += 1
    if with_mtp_layer:
        specs.update(mtp_drafter_specs(specs))
    return specs


def deepseek_v4_specs(
    num_target_layers: int = 3,
    *,
    with_draft_layer: bool = True,
    compress_ratio: int = 4,
    sliding_window: int = 128,
    head_dim: int = 576,  # one latent per token: 512 compressed KV + 64 RoPE dims
    dtype: str | torch.dtype = "bfloat16",
    block_size: int = 64,
    model_version: str | None = "deepseek_v4",
) -> dict[str, Any]:
    """A DeepSeek-V4-shaped model: per decoder layer a sliding-window MLA cache and a compressed MLA cache.

    Layer i registers ``model.layers.{i}.self_attn.swa_attn`` (sliding-window MLA, one state
    per token) then ``model.layers.{i}.self_attn.attn`` (MLA keeping one state per
    ``compress_ratio`` tokens), so the two page sizes differ and the packed path applies on
    a block-outermost layout. The draft layer (index ``num_target_layers``) reuses the
    target's decoder layer: same specs, no draft marker, registered last.
    """
    v = _vllm()
    if _positive_int(block_size, "block_size", "arguments") % _positive_int(compress_ratio, "compress_ratio", "arguments"):
        raise ValueError(f"compress_ratio {compress_ratio} must divide block_size {block_size}: a block holds whole states")
    common = dict(block_size=block_size, num_kv_heads=1,
                  head_size=_positive_int(head_dim, "head_dim", "arguments"), dtype=_torch_dtype(dtype),
                  max_tp_shards=1, model_version=model_version)
    swa = v.iface.SlidingWindowMLASpec(**common, sliding_window=_positive_int(sliding_window, "sliding_window", "arguments"))
    compressed = v.iface.MLAAttentionSpec(**common, tokens_per_state=compress_ratio)
    specs = {}
    n = _positive_int(num_target_layers, "num_target_layers", "arguments") + int(with_draft_layer)
    for i in range(n):
        specs[f"model.layers.{i}.self_attn.swa_attn"] = swa
        specs[f"model.layers.{i}.self_attn.attn"] = compressed
    return specs


# The three models of the chapter, with the drafter each one is served with.
PRESETS = {
    "laguna_dflash": dict(label="Laguna + DFlash", method="dflash", model_type="laguna"),
    "qwen3_5_mtp": dict(label="Qwen3.5 hybrid + MTP", method="mtp", model_type="qwen3_5"),
    "deepseek_v4": dict(label="DeepSeek-V4-shaped + MTP", method="mtp", model_type="deepseek_v4"),
}


def preset_specs(name: str, *, drafter_sliding: bool = False) -> dict[str, Any]:
    """The spec dict of a preset (see ``PRESETS``)."""
    if name == "laguna_dflash":
        return laguna_dflash_specs(drafter_sliding=drafter_sliding)
    if name == "qwen3_5_mtp":
        return qwen3_5_hybrid_specs()
    if name == "deepseek_v4":
        return deepseek_v4_specs()
    raise ValueError(f"preset {name!r} is unknown; expected one of {list(PRESETS)}")


def load_config(path: str | Path) -> dict:
    """A config.json as a dict; errors name the file."""
    from dflash_lab.config import read_json  # the lab's one config.json reader

    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"config file {path} must hold a JSON object, got {type(config).__name__}")
    return config


# ---------------------------------------------------------------------------
# vLLM's grouping
# ---------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _vllm_config(layout: str, hybrid_manager_disabled: bool):
    # A default VllmConfig with the layout resolved, as the engine core would before
    # profiling. Cached: building one takes a few hundred ms, and the grouping only reads it.
    config = _vllm().VllmConfig()
    config.cache_config.kv_cache_layout = layout
    config.scheduler_config.disable_hybrid_kv_cache_manager = hybrid_manager_disabled
    return config


def vllm_kv_cache_groups(kv_cache_spec: Any, *, layout: str = "LBHNC", hybrid_manager_disabled: bool = False) -> list:
    """vLLM 0.33's ``get_kv_cache_groups``, as it comes: no group is flagged as the drafter's."""
    specs = _check_spec_dict(kv_cache_spec)
    layout = _layout_name(layout)
    config = _vllm_config(layout, bool(hybrid_manager_disabled))
    try:
        # vLLM may rewrite the dict in place (hybrid manager disabled): hand it a copy.
        return _vllm().planning.get_kv_cache_groups(config, dict(specs))
    except (AssertionError, NotImplementedError, TypeError, ValueError) as exc:
        raise ValueError(
            f"vLLM {vllm_version()} cannot group these layers (layout={layout}, "
            f"hybrid_manager_disabled={bool(hybrid_manager_disabled)}): {type(exc).__name__}: {exc}"
        ) from exc


# ---------------------------------------------------------------------------
# The rules of upstream vLLM #55390
# ---------------------------------------------------------------------------


def uses_trailing_mtp_layers(method: str | None, model_type: str | None) -> bool:
    """Whether the drafter's KV layers can be found by position (they register last).

    True for every MTP drafter, whatever the model: an MTP block reuses the target's
    decoder layer (no marker) and registers after every target layer. DeepSeek V4/V4.1
    do the same with ``dspark``. Other drafters (eagle, eagle3, dflash, dspark elsewhere)
    are not covered.
    """
    method, model_type = _check_method(method), _check_model_type(model_type)
    if method not in EAGLE_METHODS:
        return False
    return method == "mtp" or (method == "dspark" and model_type in TRAILING_DSPARK_MODEL_TYPES)


def groups_partition_layers_exactly(kv_cache_spec: Any, groups: list) -> bool:
    """Whether the groups hold every layer of ``kv_cache_spec`` exactly once, and nothing else."""
    specs = _check_spec_dict(kv_cache_spec)
    names = [name for group in groups for name in group.layer_names]
    return len(names) == len(specs) and set(names) == set(specs)


def annotate_draft_groups(
    method: str | None,
    model_type: str | None,
    kv_cache_spec: Any,
    groups: list,
    *,
    use_trailing_layer_fallback: bool = False,
) -> None:
    """Set ``is_eagle_group`` on every group: True exactly for the drafter's groups.

    Only EAGLE-family methods have a draft group; for the others every flag is False.
    1. Marker rule: a group holding a layer whose spec carries ``is_draft`` is the
       drafter's. Markers are read from ``kv_cache_spec`` by layer name, because a merged
       group spec may not keep them.
    2. Trailing-layer rule (``use_trailing_layer_fallback``): the group holding the last
       registered layer is the drafter's, but only if the groups partition exactly the
       layers of ``kv_cache_spec``; otherwise "the last layer" may sit in no group or in two.
       When a drafter's trailing layers span several groups, only the very last one's is found.
    """
    method, model_type = _check_method(method), _check_model_type(model_type)
    specs = _check_spec_dict(kv_cache_spec)
    flagged = [False] * len(groups)
    if method in EAGLE_METHODS:
        draft_layers = {name for name, spec in specs.items() if spec.is_draft}
        flagged = [not draft_layers.isdisjoint(group.layer_names) for group in groups]
        if use_trailing_layer_fallback and groups_partition_layers_exactly(specs, groups):
            last_layer = next(reversed(specs))
            flagged = [f or last_layer in group.layer_names for f, group in zip(flagged, groups)]
    for group, flag in zip(groups, flagged):
        group.is_eagle_group = flag


def group_holds_mamba(group) -> bool:
    """Whether any layer of the group keeps Mamba/GDN state."""
    return any(isinstance(spec, _vllm().iface.MambaSpec) for spec in _layer_specs(group).values())


def warn_if_draft_group_unidentified(method: str | None, groups: list) -> bool:
    """Rule 3: warn when a drafter is on, no group is flagged and some group holds Mamba layers.

    vLLM's coordinator then flags every group as the drafter's, Mamba state included.
    Returns whether it warned.
    """
    method = _check_method(method)
    if method not in EAGLE_METHODS or any(g.is_eagle_group for g in groups):
        return False
    mamba_groups = [i for i, g in enumerate(groups) if group_holds_mamba(g)]
    if not mamba_groups:
        return False
    logger.warning(
        "Speculative decoding (method=%s) is on but %s; groups %s hold Mamba state that "
        "vLLM would then treat as draft cache.", method, DRAFT_GROUP_WARNING, mamba_groups,
    )
    return True


@contextlib.contextmanager
def captured_warnings():
    """Collect this module's warnings as strings (for a figure title) instead of printing them."""
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler, propagate = _Collect(level=logging.WARNING), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def kv_cache_groups(
    kv_cache_spec: Any,
    *,
    method: str | None = None,
    model_type: str | None = None,
    layout: str = "LBHNC",
    hybrid_manager_disabled: bool = False,
) -> list:
    """vLLM's grouping, then the draft-group rules on top of it.

    The trailing-layer rule is on where ``uses_trailing_mtp_layers`` says so, on the packed
    and the general path alike. ``layout`` is a vLLM KVCacheLayout name ('LBHNC' general,
    'BLHNC' block-outermost/packed) or 'general' / 'packed'.
    """
    method, model_type = _check_method(method), _check_model_type(model_type)
    specs = _check_spec_dict(kv_cache_spec)
    groups = vllm_kv_cache_groups(specs, layout=layout, hybrid_manager_disabled=hybrid_manager_disabled)
    annotate_draft_groups(method, model_type, specs, groups,
                          use_trailing_layer_fallback=uses_trailing_mtp_layers(method, model_type))
    warn_if_draft_group_unidentified(method, groups)
    return groups


# ---------------------------------------------------------------------------
# Reading the groups: rows for the figures, memory per group
# ---------------------------------------------------------------------------


def _layer_specs(group) -> dict[str, Any]:
    """Each layer's spec as the group keeps it (a packed group keeps one per layer)."""
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if inner is not None:
        return dict(inner)
    return {name: spec for name in group.layer_names}


def spec_kind(spec) -> str:
    """vLLM's name for a spec's kind: 'full_attention', 'sliding_window', 'mamba', 'mla_attention', ..."""
    return _vllm().iface.get_kv_cache_spec_kind(spec).value


@dataclass(frozen=True)
class LayerCell:
    name: str
    kind: str  # vLLM's KVCacheSpecKind value of the layer as grouped
    is_draft: bool  # the layer's spec carries the draft marker
    page_size_bytes: int

    @property
    def short_name(self) -> str:
        return short_layer_name(self.name)


@dataclass(frozen=True)
class GroupRow:
    index: int
    kind: str  # the kinds of its layers, joined with '+' when they differ
    block_size: int  # tokens per block (for Mamba: tokens per state block)
    page_size_bytes: int  # one layer's page (the largest, if they differ)
    is_draft_group: bool
    layers: tuple[LayerCell, ...]


def describe_groups(groups: list, kv_cache_spec: Any | None = None) -> list[GroupRow]:
    """Plain rows for ``viz.kv_group_layout_figure``: one per group, one cell per layer."""
    markers = {}
    if kv_cache_spec is not None:
        markers = {name: spec.is_draft for name, spec in _check_spec_dict(kv_cache_spec).items()}
    rows = []
    for i, group in enumerate(groups):
        per_layer = _layer_specs(group)
        cells = tuple(
            LayerCell(name, spec_kind(per_layer[name]), markers.get(name, per_layer[name].is_draft),
                      per_layer[name].page_size_bytes)
            for name in group.layer_names
        )
        kinds = list(dict.fromkeys(c.kind for c in cells))
        rows.append(GroupRow(i, "+".join(kinds), group.kv_cache_spec.block_size,
                             max((c.page_size_bytes for c in cells), default=0), group.is_eagle_group, cells))
    return rows


def format_groups(groups: list, kv_cache_spec: Any | None = None) -> str:
    """One line per group: kind, block size, page size, draft flag and short layer names."""
    lines = []
    for row in describe_groups(groups, kv_cache_spec):
        flag = "  <- draft group" if row.is_draft_group else ""
        names = ", ".join(c.short_name + ("*" if c.is_draft else "") for c in row.layers)
        lines.append(f"g{row.index} {row.kind:<16} {row.block_size:>5} tok/block {row.page_size_bytes:>9,} B/page  "
                     f"[{names}]{flag}")
    return "\n".join(lines)


def short_layer_name(name: str) -> str:
    """'model.layers.7.self_attn.attn' -> 'L7', 'mtp.layers.0.self_attn.attn' -> 'mtp0', swa caches get ':swa'."""
    parts = name.split(".")
    if len(parts) >= 3 and parts[1] == "layers" and parts[2].isdigit():
        prefix = "L" if parts[0] == "model" else parts[0]
        suffix = {"linear_attn": ":gdn", "swa_attn": ":swa"}.get(parts[-1], "")
        return f"{prefix}{parts[2]}{suffix}"
    return name


@dataclass(frozen=True)
class GroupMemory:
    group: int
    kind: str
    num_layers: int
    is_draft_group: bool
    block_size: int  # tokens per block (Mamba: tokens per state block)
    page_size_bytes: int  # one layer's page
    bytes_per_block: int  # one block across all the group's layers
    bytes_per_token: float | None  # None for Mamba: its state does not grow with tokens
    pool_bytes_per_block: int  # stride of the shared block pool (set by the widest group)
    unused_bytes_per_block: int  # pool stride this group leaves empty (vLLM's padding)
    num_blocks: int  # blocks the budget buys in the shared pool
    tokens: int | None  # tokens the group holds if it owns every block (None for Mamba)


def group_memory(groups: list, *, layout: str = "LBHNC", kv_budget_bytes: int = 1 << 30) -> list[GroupMemory]:
    """Per-group memory for a KV budget, with vLLM's own block accounting.

    All groups draw blocks from one pool; vLLM sizes a block by the widest group
    (``get_kv_cache_config_from_groups``), so a narrower group leaves part of every
    block it owns empty.
    """
    budget = _positive_int(kv_budget_bytes, "kv_budget_bytes", "arguments")
    if not groups:
        raise ValueError("groups is empty: nothing to size")
    v = _vllm()
    config = v.planning.get_kv_cache_config_from_groups(
        _vllm_config(_layout_name(layout), False), groups, budget
    )
    rows = [(g, _layer_specs(g)) for g in groups]
    group_bytes = [sum(s.page_size_bytes for s in per_layer.values()) for _, per_layer in rows]
    if config.num_blocks == 0:
        raise ValueError(f"kv_budget_bytes={budget} is smaller than one block of the pool (>= {max(group_bytes):,} bytes)")
    pool = config.kv_cache_tensors[0].size // config.num_blocks
    memory = []
    for i, ((group, per_layer), nbytes) in enumerate(zip(rows, group_bytes)):
        is_mamba = group_holds_mamba(group)
        block_size = group.kv_cache_spec.block_size
        memory.append(GroupMemory(
            group=i,
            kind="+".join(dict.fromkeys(spec_kind(s) for s in per_layer.values())),
            num_layers=len(group.layer_names),
            is_draft_group=group.is_eagle_group,
            block_size=block_size,
            page_size_bytes=max(s.page_size_bytes for s in per_layer.values()),
            bytes_per_block=nbytes,
            bytes_per_token=None if is_mamba else nbytes / block_size,
            pool_bytes_per_block=pool,
            unused_bytes_per_block=pool - nbytes,
            num_blocks=config.num_blocks,
            tokens=None if is_mamba else config.num_blocks * block_size,
        ))
    return memory
