"""How vLLM groups the KV cache of hybrid models, and which group is the drafter's.

vLLM packs the layers of a spec dict (``kv_specs``) into *KV-cache groups*: the
layers of one group share one block table. A speculative drafter adds its own
attention layers, and vLLM flags the groups that hold them
(``KVCacheGroupSpec.is_eagle_group``). In 0.33 two kinds of code read the flag, and
neither asks which method flagged it. Prefix caching: with the EAGLE last-block drop on
(eagle, eagle3, mtp), flagged groups give back the last block of a cache hit, whose draft
K/V depends on the next token (``kv_cache_coordinator.py:129-137``; with no group flagged
it drops in *every* group, Mamba state included), and the flags gate Mamba shared-prefix
checkpoints (``kv_cache_manager.py:187-192``). KV connectors: the OffloadingConnector
keeps a flagged group's trailing chunk back while a request decodes
(``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:208-212, 467-468``), and
the Mooncake store marks the spec groups of flagged groups
(``.../mooncake/store/coordinator.py:196-216``).

This module follows the data path of that decision:

    vLLM's grouping   ``grouping.vllm_kv_cache_groups``: vLLM 0.33's ``get_kv_cache_groups``
                      on the general (``LBHNC``) or packed (``BLHNC``) layout
    the drop          ``grouping.needs_eagle_block_drop``: vLLM's own predicate per method
    the rules         upstream vLLM #55390: the draft marker, the trailing-layer rule
                      (MTP anywhere, every EAGLE-family method on DeepSeek V4/V4.1) behind
                      an exact-partition check, and a warning when a hybrid with Mamba
                      layers has no flagged group. ``rules`` picks which rules run, and when:
                      ``"seed"`` (default) as the seed patch's own tests state them, for
                      every EAGLE-family method, the warning after every annotation;
                      ``"seed-gated"`` the same rules behind vLLM 0.33's gate, only where
                      ``use_eagle_block_drop()`` (eagle, eagle3, mtp); ``"vllm-0.33"`` vLLM
                      0.33 itself: its ``get_global_kv_cache_groups`` (``engine``), the
                      marker rule alone behind that gate, no trailing-layer rule
                      (``kv_cache_planning.py:1650-1656``). ``kv_cache.compare`` tabulates
                      where "seed" and "vllm-0.33" differ.

``engine`` runs vLLM 0.33's own engine-level annotation (``rules="vllm-0.33"``);
``layout`` reads the groups back: rows for the figures and memory per group. vLLM's own
answers (the grouping, the predicates, V1's one-group check) live in ``grouping``; the names
chapter 4 and the tests reach through this module are re-exported from there.
vLLM is imported on first use only (``common.vllm_api``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from dflash_lab.kv_cache.engine import engine_kv_cache_groups
from dflash_lab.kv_cache.grouping import (  # noqa: F401  (re-exported: chapter 4 and the tests use them from here)
    EAGLE_METHODS,
    LAYOUTS,
    SPEC_METHODS,
    check_method,
    draft_layer_names,
    drafter_layers_per_group,
    grouping_config,
    layout_name,
    needs_eagle_block_drop,
    speculative_config_stub,
    use_eagle_block_drop,
    v1_refusal,
    vllm_kv_cache_groups,
)
from dflash_lab.kv_cache.common import check_spec_dict, vllm_api

logger = logging.getLogger("dflash_lab.kv_cache.groups")

# The text of rule 3's warning; tests and the notebook look for it.
DRAFT_GROUP_WARNING = "no KV cache group could be identified as the draft model's"

# On DeepSeek V4/V4.1 every EAGLE-family drafter's layer registers after every target
# layer, as an MTP block does, by reusing the target's decoder layer.
TRAILING_LAYER_MODEL_TYPES = ("deepseek_v4", "deepseek_v41")

# Which rules run, and when. "seed": the seed patch (port of #55390) as its test file states it:
# annotation for every EAGLE-family method (its DeepSeek-V4 test flags dspark's group) and
# the warning called after every annotation (its test_non_mtp_eagle_hybrid_still_warns expects
# eagle, eagle3 and dspark on the Qwen3.5 hybrid to warn). "seed-gated": the same rules behind
# 0.33's gate, which annotates and warns only under use_eagle_block_drop(). "vllm-0.33": vLLM
# 0.33's own path (get_global_kv_cache_groups): that gate, the marker rule alone, vLLM's warning.
RULES = {
    "seed": "#55390 as the seed's tests state it: every EAGLE-family method, warning after every annotation",
    "seed-gated": "#55390 behind vLLM 0.33's gate: only where use_eagle_block_drop() (eagle, eagle3, mtp)",
    "vllm-0.33": "vLLM 0.33's get_global_kv_cache_groups: the is_draft marker only, behind the same gate; no #55390",
}

# ---------------------------------------------------------------------------
# Checking the arguments
# ---------------------------------------------------------------------------


def _check_model_type(model_type: str | None) -> str | None:
    """Any non-empty string is a model type: the rules never ask whether transformers or vLLM
    knows it (remote-code models such as ``mimo`` bring their own types)."""
    if model_type is None:
        return None
    if not isinstance(model_type, str):
        raise TypeError(f"model_type must be a string or None, got {type(model_type).__name__}")
    if not model_type.strip():
        raise ValueError("model_type is empty: pass the `model_type` of the target's config.json "
                         "(e.g. 'laguna', 'qwen3_5', 'deepseek_v4') or None")
    return model_type


def _check_rules(rules: str) -> str:
    if rules not in RULES:
        raise ValueError(f"rules {rules!r} is not one of {list(RULES)}: 'seed' (the seed patch's rules, as its "
                         "tests state them), 'seed-gated' (the same rules behind vLLM 0.33's block-drop gate) or "
                         "'vllm-0.33' (vLLM 0.33's own annotation: the draft marker behind that gate)")
    return rules


# ---------------------------------------------------------------------------
# The rules of upstream vLLM #55390
# ---------------------------------------------------------------------------


def rules_run(method: str | None, rules: str = "seed") -> bool:
    """Whether the draft-group rules (annotation and warning) run for ``method`` under ``rules``.

    ``"seed"``: for every EAGLE-family method (``use_eagle()``). ``"seed-gated"`` and
    ``"vllm-0.33"``: only under ``use_eagle_block_drop()``, the branch of
    ``get_global_kv_cache_groups`` (``kv_cache_planning.py:1650-1656``) that holds both the
    annotation and the warning.
    """
    method, rules = check_method(method), _check_rules(rules)
    if method not in EAGLE_METHODS:
        return False
    return True if rules == "seed" else use_eagle_block_drop(method)


def uses_trailing_mtp_layers(method: str | None, model_type: str | None) -> bool:
    """Whether the drafter's KV layers can be found by position (they register last).

    The seed patch's ``_uses_trailing_mtp_layers``: False unless the method is EAGLE-family
    (vLLM's ``use_eagle()``); True for ``mtp`` on any model type (an MTP block reuses the
    target's decoder layer and registers after every target layer); otherwise True exactly
    when the target is DeepSeek V4/V4.1, for every EAGLE-family method there. Other
    drafters elsewhere (eagle, eagle3, dflash, dspark) are not covered.
    """
    method, model_type = check_method(method), _check_model_type(model_type)
    if method not in EAGLE_METHODS:
        return False
    return method == "mtp" or model_type in TRAILING_LAYER_MODEL_TYPES


def groups_partition_layers_exactly(kv_cache_spec: Any, groups: list) -> bool:
    """Whether the groups hold every layer of ``kv_cache_spec`` exactly once, and nothing else."""
    specs = check_spec_dict(kv_cache_spec)
    names = [name for group in groups for name in group.layer_names]
    return len(names) == len(specs) and set(names) == set(specs)


def annotate_draft_groups(
    method: str | None,
    model_type: str | None,
    kv_cache_spec: Any,
    groups: list,
    *,
    use_trailing_layer_fallback: bool = False,
    rules: str = "seed",
) -> None:
    """Set ``is_eagle_group`` on every group: True exactly for the drafter's groups.

    Nothing is flagged unless the rules run (``rules_run``: every EAGLE-family method under
    ``"seed"``, only eagle/eagle3/mtp under ``"seed-gated"`` and ``"vllm-0.33"``). Under
    ``"vllm-0.33"`` only rule 1 exists, as in 0.33 (``kv_cache_planning.py:1651-1655``).
    1. Marker rule: a group holding a layer whose spec carries ``is_draft`` is the
       drafter's. Markers are read from ``kv_cache_spec`` by layer name, because a merged
       group spec may not keep them.
    2. Trailing-layer rule (``use_trailing_layer_fallback``): the group holding the last
       registered layer is the drafter's, but only if the groups partition exactly the
       layers of ``kv_cache_spec``; otherwise "the last layer" may sit in no group or in two.
       When a drafter's trailing layers span several groups, only the very last one's is found.
    """
    method, model_type = check_method(method), _check_model_type(model_type)
    specs = check_spec_dict(kv_cache_spec)
    if use_trailing_layer_fallback and _check_rules(rules) == "vllm-0.33":
        raise ValueError("use_trailing_layer_fallback: vLLM 0.33 has no trailing-layer rule (it is #55390's); "
                         "use rules='seed' or 'seed-gated'")
    flagged = [False] * len(groups)
    if rules_run(method, rules):
        draft_layers = {name for name, spec in specs.items() if spec.is_draft}
        flagged = [not draft_layers.isdisjoint(group.layer_names) for group in groups]
        if use_trailing_layer_fallback and groups_partition_layers_exactly(specs, groups):
            last_layer = next(reversed(specs))
            flagged = [f or last_layer in group.layer_names for f, group in zip(flagged, groups)]
    for group, flag in zip(groups, flagged):
        group.is_eagle_group = flag


def group_layer_specs(group) -> dict[str, Any]:
    """Each layer's spec as the group keeps it (a packed group keeps one per layer)."""
    spec = group.kv_cache_spec
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    if inner is not None:
        return dict(inner)
    return {name: spec for name in group.layer_names}


def group_holds_mamba(group) -> bool:
    """Whether any layer of the group keeps Mamba/GDN state."""
    return any(isinstance(spec, vllm_api().iface.MambaSpec) for spec in group_layer_specs(group).values())


def warn_if_draft_group_unidentified(method: str | None, groups: list, *, rules: str = "seed") -> bool:
    """Rule 3: warn when the rules run, no group is flagged and some group holds Mamba layers.

    The warning's own test is vLLM's (``kv_cache_planning.py:1044-1071``): nothing without a
    Mamba group, so a sliding + full hybrid never warns. Where it is called differs: the seed
    calls it after every annotation (so dspark and dflash warn too), 0.33 only inside its
    block-drop branch (``:1650-1656``), where a group-less drop would reach every group, Mamba
    state included (``kv_cache_coordinator.py:134-135``). Returns whether it warned.
    """
    if not rules_run(method, rules) or any(g.is_eagle_group for g in groups):
        return False
    mamba_groups = [i for i, g in enumerate(groups) if group_holds_mamba(g)]
    if not mamba_groups:
        return False
    logger.warning(
        "Speculative decoding (method=%s) is on but %s (Mamba groups %s; rules=%s).", method, DRAFT_GROUP_WARNING,
        mamba_groups, rules,
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
    rules: str = "seed",
) -> list:
    """vLLM's grouping, then the draft-group rules on top of it.

    The trailing-layer rule is on where ``uses_trailing_mtp_layers`` says so, on the packed
    and the general path alike. ``layout`` is a vLLM KVCacheLayout name ('LBHNC' general,
    'BLHNC' block-outermost/packed) or 'general' / 'packed'. ``rules`` (see ``RULES``):
    ``"seed"`` (the seed patch's rules as its tests state them), ``"seed-gated"`` (the same
    rules behind 0.33's block-drop gate) or ``"vllm-0.33"``: vLLM 0.33's own
    ``get_global_kv_cache_groups`` (``engine.engine_kv_cache_groups``), its warning logged
    again here so ``captured_warnings`` sees it.
    """
    method, model_type, rules = check_method(method), _check_model_type(model_type), _check_rules(rules)
    specs = check_spec_dict(kv_cache_spec)
    if rules == "vllm-0.33":
        groups, warned = engine_kv_cache_groups(specs, method=method, layout=layout,
                                                hybrid_manager_disabled=hybrid_manager_disabled)
        for message in warned:
            logger.warning("vLLM 0.33: %s", message)
        return groups
    groups = vllm_kv_cache_groups(specs, layout=layout, hybrid_manager_disabled=hybrid_manager_disabled)
    annotate_draft_groups(method, model_type, specs, groups,
                          use_trailing_layer_fallback=uses_trailing_mtp_layers(method, model_type), rules=rules)
    warn_if_draft_group_unidentified(method, groups, rules=rules)
    return groups
