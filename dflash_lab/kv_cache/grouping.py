"""vLLM 0.33's own answers about the KV-cache groups, asked of vLLM's code: nothing decided here.

Three questions the chapter, the engine wrapper and the draft-group rules all ask, each
answered in one place by the vLLM function that decides it in 0.33:

    the grouping        ``get_kv_cache_groups`` on a default ``VllmConfig`` whose cache layout is
                        set: ``LBHNC`` (the general path) or ``BLHNC`` (block-outermost: the
                        packed path when page sizes differ); no group is flagged as the drafter's
    the block drop      ``SpeculativeConfig.needs_eagle_block_drop()`` / ``use_eagle_block_drop()``
                        per method, vLLM's own predicates on a stand-in config
    one group or not    V1's ``validate_same_kv_cache_group``: whether the drafter's layers sit in
                        one KV-cache group (``v1_refusal``; the V1 model runner refuses otherwise)

``groups`` applies the draft-group rules on top of the grouping; ``engine`` runs 0.33's
engine-level annotation with the same config. Both import from here, and this module imports
neither. vLLM is imported on first use only (``common.vllm_api``).
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from dflash_lab.kv_cache.common import check_spec_dict, vllm_api, vllm_version

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

# The two cache layouts the lab compares; vLLM accepts the other KVCacheLayout names too.
LAYOUTS = {"LBHNC": "general", "BLHNC": "packed"}


def check_method(method: str | None) -> str | None:
    """``method`` if it is None or a speculative method vLLM 0.33 knows; errors name the argument."""
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


def layout_name(layout: str) -> str:
    """vLLM's KVCacheLayout name for ``layout`` ('general' -> 'LBHNC', 'packed' -> 'BLHNC')."""
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a string such as 'LBHNC' or 'BLHNC', got {type(layout).__name__}")
    aliases = {v: k for k, v in LAYOUTS.items()}  # "general" -> "LBHNC", "packed" -> "BLHNC"
    name = aliases.get(layout, layout)
    members = vllm_api().KVCacheLayout.__members__
    if name not in members:
        raise ValueError(
            f"layout {layout!r} is not a vLLM KV-cache layout; expected 'LBHNC' (general), "
            f"'BLHNC' (packed) or one of {list(members)}"
        )
    return name


# ---------------------------------------------------------------------------
# The grouping
# ---------------------------------------------------------------------------


@lru_cache(maxsize=None)
def grouping_config(layout: str, hybrid_manager_disabled: bool):
    """A default VllmConfig with the layout resolved, as the engine core would before profiling."""
    # Cached: building one takes a few hundred ms, and the grouping only reads it.
    config = vllm_api().VllmConfig()
    config.cache_config.kv_cache_layout = layout
    config.scheduler_config.disable_hybrid_kv_cache_manager = hybrid_manager_disabled
    return config


def vllm_kv_cache_groups(kv_cache_spec: Any, *, layout: str = "LBHNC", hybrid_manager_disabled: bool = False) -> list:
    """vLLM 0.33's ``get_kv_cache_groups``, as it comes: no group is flagged as the drafter's."""
    specs = check_spec_dict(kv_cache_spec)
    layout = layout_name(layout)
    config = grouping_config(layout, bool(hybrid_manager_disabled))
    try:
        # vLLM may rewrite the dict in place (hybrid manager disabled): hand it a copy.
        return vllm_api().planning.get_kv_cache_groups(config, dict(specs))
    except (AssertionError, NotImplementedError, TypeError, ValueError) as exc:
        raise ValueError(
            f"vLLM {vllm_version()} cannot group these layers (layout={layout}, "
            f"hybrid_manager_disabled={bool(hybrid_manager_disabled)}): {type(exc).__name__}: {exc}"
        ) from exc


# ---------------------------------------------------------------------------
# The block drop: vLLM's SpeculativeConfig predicates
# ---------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _speculative_stub_class() -> type:
    # vLLM's own SpeculativeConfig predicates, bound to a plain object: building a real
    # SpeculativeConfig needs a target and a drafter model on disk, these need one field.
    cls = vllm_api().SpeculativeConfig
    borrowed = ("use_eagle", "use_dflash", "use_dspark", "needs_eagle_block_drop", "use_eagle_block_drop",
                "use_multi_module_mtp")
    return type("SpeculativeConfigStub", (), {name: getattr(cls, name) for name in borrowed})


def speculative_config_stub(method: str, *, disable_eagle_block_drop: bool = False,
                            disable_lookahead_block_hashes: bool = False, num_speculative_tokens: int = 1):
    """An object answering vLLM 0.33's ``SpeculativeConfig`` predicates (``use_eagle()``,
    ``needs_eagle_block_drop()``, ...) with vLLM's own code, for ``method``."""
    stub = _speculative_stub_class()()
    stub.method = check_method(method)
    stub.draft_model_config = None  # single-module MTP: no draft hf_config to read
    stub.num_speculative_tokens = num_speculative_tokens
    stub.disable_eagle_block_drop = bool(disable_eagle_block_drop)
    stub.disable_lookahead_block_hashes = bool(disable_lookahead_block_hashes)
    return stub


def needs_eagle_block_drop(method: str | None) -> bool:
    """vLLM 0.33's ``SpeculativeConfig.needs_eagle_block_drop()``: True for eagle, eagle3, mtp.

    Their draft K/V at a position is built from the next token, so a prefix-cache hit's
    last block must be recomputed. DFlash and dspark build it from the target's hidden
    state alone (``config/speculative.py:2122-2149``).
    """
    return method is not None and bool(speculative_config_stub(method).needs_eagle_block_drop())


def use_eagle_block_drop(method: str | None) -> bool:
    """vLLM 0.33's ``SpeculativeConfig.use_eagle_block_drop()`` with the drop not switched off."""
    return method is not None and bool(speculative_config_stub(method).use_eagle_block_drop())


# ---------------------------------------------------------------------------
# One group or not: the V1 runner's check
# ---------------------------------------------------------------------------


def draft_layer_names(kv_cache_spec: Any) -> list[str]:
    """The layers whose spec carries the draft marker (``is_draft``), as vLLM's proposer lists its own."""
    return [name for name, spec in check_spec_dict(kv_cache_spec).items() if spec.is_draft]


def v1_refusal(kv_cache_spec: Any, groups: list) -> str | None:
    """vLLM V1's ``validate_same_kv_cache_group`` on ``groups``: None where it accepts, else its own message.

    The lab's one answer to "are the drafter's layers in one KV-cache group": vLLM's check itself
    (``SpecDecodeBaseProposer``, ``v1/spec_decode/llm_base_proposer.py:1689-1709``), run on stand-ins
    for the proposer and the KV-cache config, with the draft layers of ``draft_layer_names``.
    """
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposer = SimpleNamespace(_draft_attn_layer_names=draft_layer_names(kv_cache_spec))
    try:
        SpecDecodeBaseProposer.validate_same_kv_cache_group(proposer, SimpleNamespace(kv_cache_groups=groups))
    except AssertionError as refused:
        return str(refused)
    return None


def drafter_layers_per_group(kv_cache_spec: Any, groups: list) -> list[int]:
    """How many draft layers each group holding any of them holds (``[3]``: one group; ``[2, 2]``: split)."""
    drafted = set(draft_layer_names(kv_cache_spec))
    return [n for n in (len(drafted.intersection(g.layer_names)) for g in groups) if n]
