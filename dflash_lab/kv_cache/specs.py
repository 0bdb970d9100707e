"""KV-cache specs: what each layer keeps per token, in vLLM 0.33's own spec classes.

A builder returns a model's layers as vLLM registers them: a dict layer name ->
spec (``FullAttentionSpec``, ``SlidingWindowSpec``, ``MambaSpec``, the MLA specs),
in registration order. Builders: a Laguna target and its DFlash drafter (marked
``is_draft``), an MTP drafter (a copy of the target's attention), a Qwen3.5-shaped
GDN/attention hybrid and a DeepSeek-V4-shaped model. ``kv_presets`` names the chapter's
models (Poolside's real Laguna pairs among them); ``kv_groups`` groups these dicts as
vLLM does.

The draft marker: vLLM 0.33's runner sets ``is_draft=True`` on *every* attention
layer a drafter adds, MTP included (``llm_base_proposer.py:1328-1335``,
``gpu_model_runner.py:7114-7115``). The MTP builders leave it off by default, as
#55390's tests do; ``mark_draft_layers`` (or ``mark_draft=True``) gives 0.33's
runtime specs. The marker has ``compare=False``, so it never changes a grouping.

``kv_block_size`` is the tokens one KV page holds (vLLM's ``CacheConfig.block_size``),
not the DFlash draft block that the rest of the lab calls ``block_size``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dflash_lab.kv_cache.common import (  # noqa: F401  (re-exported: the chapter and the tests reach them here)
    INSTALL_HINT,
    check_spec_dict,
    positive_int,
    torch_dtype,
    vllm_api,
    vllm_version,
)

LAGUNA_LAYER_TYPES = ("full_attention", "sliding_attention")

# Tokens per KV page unless a caller says otherwise: vLLM 0.33's ``CacheConfig.DEFAULT_BLOCK_SIZE``
# (``config/cache.py:185``), what an engine uses when no attention backend prefers another.
KV_BLOCK_SIZE = 16

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
# Checking the arguments
# ---------------------------------------------------------------------------


def _get(config: Any, key: str, default: Any = None, *, required: bool = False, where: str = "config") -> Any:
    """A key of a config dict, or an attribute of a config object (LagunaConfig, ...)."""
    value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
    if required and value is None:
        raise ValueError(f"{where}: `{key}` is missing")
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
        heads = _get(config, "num_attention_heads", required=True, where=where)
        hd = hidden // positive_int(heads, "num_attention_heads", where)
    return positive_int(kv, "num_key_value_heads", where), positive_int(hd, "head_dim", where)


def laguna_target_specs(
    config: Any,
    *,
    dtype: str | torch.dtype = "bfloat16",
    kv_block_size: int = KV_BLOCK_SIZE,  # tokens per KV page
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, Any]:
    """The target's attention layers: ``model.layers.{i}.self_attn.attn``, sliding or full per ``layer_types``.

    ``config`` is a Laguna config dict (a config.json) or a LagunaConfig-like object.
    """
    v, where = vllm_api(), "target config"
    n = positive_int(_get(config, "num_hidden_layers", required=True, where=where), "num_hidden_layers", where)
    types = _layer_types(config, n, where)
    kv, hd = _attention_heads(config, where, num_kv_heads, head_dim)
    dtype, kv_block_size = torch_dtype(dtype), positive_int(kv_block_size, "kv_block_size", "arguments")
    window = None
    if "sliding_attention" in types:
        window = positive_int(_get(config, "sliding_window", required=True, where=where), "sliding_window", where)
    specs = {}
    for i, kind in enumerate(types):
        common = dict(block_size=kv_block_size, num_kv_heads=kv, head_size=hd, dtype=dtype)
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
    kv_block_size: int = KV_BLOCK_SIZE,  # tokens per KV page
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
    v, where = vllm_api(), "drafter config"
    n = positive_int(_get(drafter_config, "num_hidden_layers", required=True, where=where), "num_hidden_layers", where)
    _layer_types(drafter_config, n, where)  # checked, then ignored: the cache is full attention
    offset = positive_int(target_layer_count, "target_layer_count", "arguments")
    kv, hd = _attention_heads(drafter_config, where, num_kv_heads, head_dim)
    spec = v.iface.FullAttentionSpec(
        block_size=positive_int(kv_block_size, "kv_block_size", "arguments"),
        num_kv_heads=kv, head_size=hd, dtype=torch_dtype(dtype), is_draft=True,
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
    kv_block_size: int = KV_BLOCK_SIZE,  # tokens per KV page
) -> dict[str, Any]:
    """A Laguna target followed by its DFlash drafter, in vLLM's registration order.

    Without ``target_config`` the built-in Laguna-shaped example is used; without
    ``drafter_config`` a 3-layer drafter with the target's heads (sliding when
    ``drafter_sliding``; the cache is full attention either way).
    """
    target_config = EXAMPLE_LAGUNA_CONFIG if target_config is None else target_config
    if drafter_config is None:
        drafter_config = example_dflash_drafter_config(target_config, sliding=drafter_sliding)
    specs = laguna_target_specs(target_config, dtype=dtype, kv_block_size=kv_block_size)
    specs.update(dflash_drafter_specs(drafter_config, target_layer_count=len(specs), dtype=dtype,
                                      kv_block_size=kv_block_size))
    return specs


def mark_draft_layers(kv_cache_spec: Any, layer_names: Iterable[str]) -> dict[str, Any]:
    """A copy of ``kv_cache_spec`` with ``is_draft=True`` on ``layer_names``, as vLLM 0.33's
    runner marks every attention layer a drafter adds (``replace(spec, is_draft=True)``)."""
    specs = check_spec_dict(kv_cache_spec)
    names = list(layer_names)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"layer_names: {unknown} are not layers of kv_cache_spec")
    return {n: dataclasses.replace(s, is_draft=True) if n in names else s for n, s in specs.items()}


def mtp_drafter_specs(target_specs: Any, num_layers: int = 1) -> dict[str, Any]:
    """An MTP drafter's attention layers: ``mtp.layers.{k}.self_attn.attn``.

    The MTP block reuses the target's decoder layer, so each layer gets exactly the spec
    of the target's full attention. Unmarked, as #55390's tests build it: only its position
    (it registers after every target layer) tells it apart. vLLM 0.33's runner would mark
    it (``mark_draft_layers``).
    """
    v = vllm_api()
    specs = check_spec_dict(target_specs, argument="target_specs")
    full = [s for s in specs.values() if type(s) is v.iface.FullAttentionSpec and not s.is_draft]
    if not full:
        raise ValueError("target_specs has no full-attention layer for the MTP block to copy")
    n = positive_int(num_layers, "num_layers", "arguments")
    return {f"mtp.layers.{k}.self_attn.attn": full[-1] for k in range(n)}


def _gdn_state(dtype: torch.dtype, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
               conv_kernel: int):
    """Shapes and dtypes of one Gated DeltaNet layer's state, from vLLM's own calculator."""
    conv, recurrent = vllm_api().MambaStateShapeCalculator.gated_delta_net_state_shape(
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
    kv_block_size: int = KV_BLOCK_SIZE,  # tokens per KV page
    align_pages: bool = True,
    mark_draft: bool = False,
) -> dict[str, Any]:
    """A Qwen3.5-shaped hybrid: ``num_blocks`` x [GDN, GDN, GDN, full attention] (+ an MTP layer).

    GDN layers are ``model.layers.{i}.linear_attn`` (``MambaSpec``, fixed-size state), full
    attention layers ``model.layers.{i}.self_attn.attn``, and the MTP drafter
    ``mtp.layers.0.self_attn.attn`` (spec-identical to the target's attention; marked
    ``is_draft`` only with ``mark_draft``, as vLLM 0.33's runner does).

    ``align_pages`` does what vLLM's platform does for hybrids before grouping: grow the
    attention block (in multiples of ``kv_block_size``) until one attention page is at least
    one Mamba state, then pad the Mamba page to exactly that size, so every layer has the
    same page size.
    """
    v = vllm_api()
    dtype, kv_block_size = torch_dtype(dtype), positive_int(kv_block_size, "kv_block_size", "arguments")
    shapes, dtypes = _gdn_state(dtype, *gdn_heads, *gdn_head_dims, conv_kernel=4)
    mamba = v.iface.MambaSpec(block_size=kv_block_size, shapes=shapes, dtypes=dtypes,
                              mamba_type=v.GDN, mamba_cache_mode="align")
    attn = v.iface.FullAttentionSpec(block_size=kv_block_size,
                                     num_kv_heads=positive_int(num_kv_heads, "num_kv_heads", "arguments"),
                                     head_size=positive_int(head_dim, "head_dim", "arguments"), dtype=dtype)
    if align_pages:
        per_block = attn.page_size_bytes  # bytes of one kv_block_size-token attention page
        attn_block = kv_block_size * -(-mamba.page_size_bytes // per_block)  # ceil: a page holds a whole state
        attn = attn.copy_with_new_block_size(attn_block)
        mamba = v.iface.MambaSpec(block_size=attn_block, shapes=shapes, dtypes=dtypes, mamba_type=v.GDN,
                                  mamba_cache_mode="align", page_size_padded=attn.page_size_bytes)
    specs, i = {}, 0
    for _ in range(positive_int(num_blocks, "num_blocks", "arguments")):
        for _ in range(3):
            specs[f"model.layers.{i}.linear_attn"] = mamba
            i += 1
        specs[f"model.layers.{i}.self_attn.attn"] = attn
        i += 1
    if with_mtp_layer:
        mtp = mtp_drafter_specs(specs)
        specs.update(mtp)
        if mark_draft:
            specs = mark_draft_layers(specs, mtp)
    return specs


def deepseek_v4_specs(
    num_target_layers: int = 3,
    *,
    with_draft_layer: bool = True,
    compress_ratio: int = 4,
    sliding_window: int = 128,
    head_dim: int = 576,  # one latent per token: 512 compressed KV + 64 RoPE dims
    dtype: str | torch.dtype = "bfloat16",
    kv_block_size: int = 64,  # tokens per KV page
    model_version: str | None = "deepseek_v4",
    mark_draft: bool = False,
) -> dict[str, Any]:
    """A DeepSeek-V4-shaped model: per decoder layer a sliding-window MLA cache and a compressed MLA cache.

    Layer i registers ``model.layers.{i}.self_attn.swa_attn`` (sliding-window MLA, one state
    per token) then ``model.layers.{i}.self_attn.attn`` (MLA keeping one state per
    ``compress_ratio`` tokens), so the two page sizes differ and the packed path applies on
    a block-outermost layout. The draft layer (index ``num_target_layers``) reuses the
    target's decoder layer: same specs, registered last; marked ``is_draft`` only with
    ``mark_draft`` (vLLM 0.33's runtime).
    """
    v = vllm_api()
    ratio = positive_int(compress_ratio, "compress_ratio", "arguments")
    if positive_int(kv_block_size, "kv_block_size", "arguments") % ratio:
        raise ValueError(f"compress_ratio {compress_ratio} must divide kv_block_size {kv_block_size}: "
                         "a block holds whole states")
    common = dict(block_size=kv_block_size, num_kv_heads=1,
                  head_size=positive_int(head_dim, "head_dim", "arguments"), dtype=torch_dtype(dtype),
                  max_tp_shards=1, model_version=model_version)
    swa = v.iface.SlidingWindowMLASpec(**common,
                                       sliding_window=positive_int(sliding_window, "sliding_window", "arguments"))
    compressed = v.iface.MLAAttentionSpec(**common, tokens_per_state=compress_ratio)
    specs = {}
    n = positive_int(num_target_layers, "num_target_layers", "arguments") + int(with_draft_layer)
    for i in range(n):
        specs[f"model.layers.{i}.self_attn.swa_attn"] = swa
        specs[f"model.layers.{i}.self_attn.attn"] = compressed
    if mark_draft and with_draft_layer:
        draft = n - 1
        specs = mark_draft_layers(specs, [f"model.layers.{draft}.self_attn.swa_attn",
                                          f"model.layers.{draft}.self_attn.attn"])
    return specs
