"""The drafter-group rules of upstream vLLM #55390, pinned on vLLM 0.33's real grouping.

Every grouping here comes from vLLM's own ``get_kv_cache_groups`` on the CPU, on the
general layout (LBHNC) and the block-outermost one (BLHNC, which takes the packed
path when page sizes differ). Our rules are then applied on top. What chapter 4 says
about vLLM 0.33 itself (the runtime marker, the block drop per method, the engine's
own annotation, the exact-partition assertion, group counts at real Laguna shapes) is
pinned against vLLM's own functions at the end (FIDELITY §6, §9 items 1-6).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import typing
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
pytest.importorskip("vllm", reason='vLLM 0.33 is needed: pip install "vllm==0.33.*"')

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)

from dflash_lab.kv_cache import engine as kv_engine, layout as kv_layout, presets as kv_presets, specs as kv_specs  # noqa: E402
from dflash_lab.kv_cache import groups as kv  # noqa: E402
from dflash_lab.kv_cache.groups import v1_refusal  # noqa: E402
from dflash_lab import viz  # noqa: E402

LAYOUTS = ["LBHNC", "BLHNC"]
DSV4_DRAFT_LAYER = "model.layers.3.self_attn.attn"
MTP_LAYER = "mtp.layers.0.self_attn.attn"


def flagged(groups):
    return [g for g in groups if g.is_eagle_group]


def holds_mamba(group):
    return any(isinstance(s, MambaSpec) for s in iter_layer_specs(group.kv_cache_spec))


def warned(caplog) -> bool:
    return any(
        r.name == "dflash_lab.kv_cache.groups" and kv.DRAFT_GROUP_WARNING in r.getMessage() for r in caplog.records
    )


# ---------------------------------------------------------------------------
# Rule 2: the trailing-layer rule (MTP anywhere, every EAGLE-family method on DeepSeek V4/V4.1)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("method", "model_type"),
    [(m, t) for t in ("deepseek_v4", "deepseek_v41") for m in ("mtp", "dspark", "eagle", "eagle3", "dflash")],
)
def test_deepseek_v4_flags_exactly_the_group_holding_its_last_layer(method, model_type, layout):
    # The draft layer reuses the target's decoder layer: no marker, only its position.
    specs = kv_specs.deepseek_v4_specs()
    assert not any(s.is_draft for s in specs.values())
    assert next(reversed(specs)) == DSV4_DRAFT_LAYER

    groups = kv.kv_cache_groups(specs, method=method, model_type=model_type, layout=layout)

    (draft,) = flagged(groups)
    assert DSV4_DRAFT_LAYER in draft.layer_names


def test_deepseek_v4_block_outermost_layout_takes_the_packed_path():
    # The two MLA caches have different page sizes, so BLHNC packs them (one
    # UniformTypeKVCacheSpecs per group) while LBHNC unifies the pages instead.
    specs = kv_specs.deepseek_v4_specs()
    packed = kv.vllm_kv_cache_groups(specs, layout="BLHNC")
    general = kv.vllm_kv_cache_groups(specs, layout="LBHNC")
    assert all(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in packed)
    assert not any(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in general)
    assert len({g.kv_cache_spec.page_size_bytes for g in general}) == 1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model_type", ["glm4_moe", "laguna", "qwen3_next", "mimo", None])
def test_trailing_layer_rule_applies_to_mtp_on_any_model_type(model_type, layout):
    # "mimo" is a remote-code model type transformers does not know: the rule never asks.
    assert kv.uses_trailing_mtp_layers("mtp", model_type)
    groups = kv.kv_cache_groups(kv_specs.deepseek_v4_specs(), method="mtp", model_type=model_type, layout=layout)
    (draft,) = flagged(groups)
    assert DSV4_DRAFT_LAYER in draft.layer_names


def test_trailing_layer_rule_table_is_the_seeds():
    """FIDELITY §6: False unless EAGLE-family; mtp anywhere; every EAGLE-family method on DeepSeek V4/V4.1."""
    for model_type in ("deepseek_v4", "deepseek_v41", "laguna", "mimo", "qwen3_5", None):
        for method in (*kv.SPEC_METHODS, None):
            expected = method in kv.EAGLE_METHODS and (method == "mtp" or model_type in ("deepseek_v4", "deepseek_v41"))
            assert kv.uses_trailing_mtp_layers(method, model_type) is expected, (method, model_type)


@pytest.mark.parametrize("method", ["dspark", "eagle", "eagle3", "dflash"])
def test_trailing_layer_rule_is_off_for_other_drafters(method):
    assert not kv.uses_trailing_mtp_layers(method, "qwen3_5")
    groups = kv.kv_cache_groups(kv_specs.deepseek_v4_specs(), method=method, model_type="glm4_moe", layout="BLHNC")
    assert flagged(groups) == []


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("align_pages", [True, False])
def test_qwen3_5_mtp_flags_only_the_group_holding_the_mtp_layer(layout, align_pages, caplog):
    specs = kv_specs.qwen3_5_hybrid_specs(with_mtp_layer=True, align_pages=align_pages)
    with caplog.at_level(logging.WARNING):
        groups = kv.kv_cache_groups(specs, method="mtp", model_type="qwen3_5", layout=layout)

    (draft,) = flagged(groups)
    assert MTP_LAYER in draft.layer_names
    assert any(holds_mamba(g) for g in groups)
    assert not any(holds_mamba(g) for g in flagged(groups))
    assert not warned(caplog)


def test_qwen3_5_with_unaligned_pages_is_packed_on_the_block_outermost_layout():
    # Without vLLM's page alignment the GDN state and attention pages differ, so the
    # packed path runs: the rule above is then checked on both paths.
    specs = kv_specs.qwen3_5_hybrid_specs(align_pages=False)
    packed = kv.vllm_kv_cache_groups(specs, layout="BLHNC")
    general = kv.vllm_kv_cache_groups(specs, layout="LBHNC")
    assert all(isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs) for g in packed)
    assert [g.layer_names for g in packed] != [g.layer_names for g in general]


# ---------------------------------------------------------------------------
# Rule 3: the warning
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", ["eagle", "eagle3", "dspark"])
def test_qwen3_5_with_a_non_mtp_drafter_flags_nothing_and_warns(method, layout, caplog):
    # The seed's test_non_mtp_eagle_hybrid_still_warns, in the seed's rules (the default).
    specs = kv_specs.qwen3_5_hybrid_specs(with_mtp_layer=True)
    with caplog.at_level(logging.WARNING, logger="dflash_lab.kv_cache.groups"):
        groups = kv.kv_cache_groups(specs, method=method, model_type="qwen3_5", layout=layout)
    assert flagged(groups) == []
    assert warned(caplog)


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_no_warning_behind_033s_gate_where_nothing_drops(method, caplog):
    # FIDELITY §10.3: 0.33 warns only inside its block-drop branch (kv_cache_planning.py:1650-1656);
    # dspark and dflash have no drop there, so the same unflagged hybrid is not warned about.
    specs = kv_specs.qwen3_5_hybrid_specs(with_mtp_layer=True)
    with caplog.at_level(logging.WARNING, logger="dflash_lab.kv_cache.groups"):
        groups = kv.kv_cache_groups(specs, method=method, model_type="qwen3_5", rules="vllm-0.33")
    assert flagged(groups) == []
    assert not warned(caplog)
    with caplog.at_level(logging.WARNING, logger="dflash_lab.kv_cache.groups"):
        kv.kv_cache_groups(specs, method=method, model_type="qwen3_5", rules="seed")
    assert warned(caplog)  # ... while the seed's rules warn


@pytest.mark.parametrize("method", [None, "ngram", "draft_model"])
def test_no_warning_without_an_eagle_family_drafter(method, caplog):
    with caplog.at_level(logging.WARNING):
        groups = kv.kv_cache_groups(kv_specs.qwen3_5_hybrid_specs(), method=method, model_type="qwen3_5")
    assert flagged(groups) == []
    assert not warned(caplog)


@pytest.mark.parametrize("rules", ["seed", "vllm-0.33"])
@pytest.mark.parametrize("method", ["eagle3", "dspark"])
def test_no_warning_when_no_group_holds_mamba(caplog, method, rules):
    # A sliding + full hybrid never warns, under either rule set (kv_cache_planning.py:1057-1065).
    specs = kv_specs.laguna_target_specs(kv_specs.EXAMPLE_LAGUNA_CONFIG)
    with caplog.at_level(logging.WARNING):
        groups = kv.kv_cache_groups(specs, method=method, model_type="laguna", rules=rules)
    assert flagged(groups) == []
    assert not warned(caplog)


def test_captured_warnings_collects_the_message_instead_of_logging_it(caplog):
    with caplog.at_level(logging.WARNING), kv.captured_warnings() as messages:
        kv.kv_cache_groups(kv_specs.qwen3_5_hybrid_specs(), method="eagle", model_type="qwen3_5")
    assert len(messages) == 1 and kv.DRAFT_GROUP_WARNING in messages[0]
    assert not warned(caplog)


# ---------------------------------------------------------------------------
# The seed's own test file (seeds/004, tests/v1/core/test_kv_cache_utils.py), case by case:
# each passes under rules="seed"; what rules="seed-gated" (the same rules behind 0.33's gate) and
# rules="vllm-0.33" (0.33's own get_global_kv_cache_groups) do with the same case beside it.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "model_type"), [("mtp", "deepseek_v4"), ("dspark", "deepseek_v4"),
                                                    ("dspark", "deepseek_v41")])
def test_seed_deepseek_v4_draft_group_annotated_on_packed_path(method, model_type):
    specs = kv_specs.deepseek_v4_specs()
    (draft,) = flagged(kv.kv_cache_groups(specs, method=method, model_type=model_type, layout="BLHNC", rules="seed"))
    assert DSV4_DRAFT_LAYER in draft.layer_names
    behind_the_gate = flagged(kv.kv_cache_groups(specs, method=method, model_type=model_type, layout="BLHNC",
                                                 rules="seed-gated"))
    assert len(behind_the_gate) == (1 if method == "mtp" else 0)  # dspark has no block drop in 0.33
    # 0.33 itself has no trailing-layer rule: the unmarked draft layer is found by nothing.
    assert flagged(kv.kv_cache_groups(specs, method=method, model_type=model_type, layout="BLHNC",
                                      rules="vllm-0.33")) == []


@pytest.mark.parametrize("rules", ["seed", "seed-gated"])
def test_seed_trailing_layer_fallback_applies_to_any_mtp_model(rules):
    (draft,) = flagged(kv.kv_cache_groups(kv_specs.deepseek_v4_specs(), method="mtp", model_type="other", rules=rules))
    assert DSV4_DRAFT_LAYER in draft.layer_names
    assert flagged(kv.kv_cache_groups(kv_specs.deepseek_v4_specs(), method="mtp", model_type="other",
                                      rules="vllm-0.33")) == []


@pytest.mark.parametrize("rules", ["seed", "seed-gated"])
def test_seed_qwen3_5_mtp_draft_group_annotated_on_hybrid_path(rules, caplog):
    with caplog.at_level(logging.WARNING, logger="dflash_lab.kv_cache.groups"):
        groups = kv.kv_cache_groups(kv_specs.qwen3_5_hybrid_specs(with_mtp_layer=True), method="mtp",
                                    model_type="qwen3_5", rules=rules)
    (draft,) = flagged(groups)
    assert MTP_LAYER in draft.layer_names
    assert not any(g.is_eagle_group for g in groups if holds_mamba(g))
    assert not warned(caplog)


@pytest.mark.parametrize("method", ["eagle", "eagle3", "dspark"])
def test_seed_non_mtp_eagle_hybrid_still_warns(method, caplog):
    specs = kv_specs.qwen3_5_hybrid_specs(with_mtp_layer=True)
    with caplog.at_level(logging.WARNING, logger="dflash_lab.kv_cache.groups"):
        groups = kv.kv_cache_groups(specs, method=method, model_type="qwen3_5", rules="seed")
    assert flagged(groups) == [] and warned(caplog)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_lab.kv_cache.groups"):
        kv.kv_cache_groups(specs, method=method, model_type="qwen3_5", rules="vllm-0.33")
    assert warned(caplog) is (method != "dspark")  # 0.33 warns only where the drop runs


@pytest.mark.parametrize("rules", ["seed", "seed-gated"])
def test_seed_trailing_layer_fallback_requires_exact_partition(rules):
    specs = kv_specs.qwen3_5_hybrid_specs(with_mtp_layer=True)
    trimmed = _regroup(kv.vllm_kv_cache_groups(specs), lambda names: [n for n in names if n != "model.layers.0.linear_attn"])
    kv.annotate_draft_groups("mtp", "qwen3_5", specs, trimmed, use_trailing_layer_fallback=True, rules=rules)
    assert flagged(trimmed) == []


def test_vllm_033_rules_have_no_trailing_layer_rule_to_switch_on():
    specs = kv_specs.qwen3_5_hybrid_specs(with_mtp_layer=True)
    with pytest.raises(ValueError, match="use_trailing_layer_fallback: vLLM 0.33 has no trailing-layer rule"):
        kv.annotate_draft_groups("mtp", "qwen3_5", specs, kv.vllm_kv_cache_groups(specs),
                                 use_trailing_layer_fallback=True, rules="vllm-0.33")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", kv.EAGLE_METHODS)
def test_unmarked_mtp_hybrid_under_vllm_033_is_vllms_own_answer(method, layout):
    """Issue 31: rules="vllm-0.33" is 0.33's get_global_kv_cache_groups, run: the unmarked Qwen3.5
    hybrid with mtp gets no flag and vLLM's warning, where the seed's trailing-layer rule (also
    behind the gate, "seed-gated") flags the MTP group and stays silent."""
    specs = kv_specs.qwen3_5_hybrid_specs(with_mtp_layer=True)
    with kv.captured_warnings() as ours:
        lab = kv.kv_cache_groups(specs, method=method, model_type="qwen3_5", layout=layout, rules="vllm-0.33")
    engine, theirs = kv_engine.engine_kv_cache_groups(specs, method=method, layout=layout)
    assert [g.is_eagle_group for g in lab] == [g.is_eagle_group for g in engine]
    assert [m.removeprefix("vLLM 0.33: ") for m in ours] == theirs
    assert flagged(lab) == [] and bool(ours) is kv.use_eagle_block_drop(method)
    with kv.captured_warnings() as gated_warned:
        gated = kv.kv_cache_groups(specs, method=method, model_type="qwen3_5", layout=layout, rules="seed-gated")
    if method == "mtp":
        (draft,) = flagged(gated)
        assert MTP_LAYER in draft.layer_names and not gated_warned


def test_rules_must_be_named():
    with pytest.raises(ValueError, match=r"rules 'lab' is not one of \['seed', 'seed-gated', 'vllm-0.33'\]"):
        kv.kv_cache_groups(kv_specs.laguna_dflash_specs(), method="dflash", rules="lab")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", [*kv.EAGLE_METHODS, None, "ngram"])
@pytest.mark.parametrize("build", [lambda: kv_specs.qwen3_5_hybrid_specs(mark_draft=True),
                                   lambda: kv_specs.deepseek_v4_specs(mark_draft=True),
                                   lambda: kv_presets.preset_specs("laguna_xs2_dflash")],
                         ids=["qwen3_5-marked", "deepseek_v4-marked", "xs2-dflash"])
def test_033_gate_flags_and_warns_as_vllms_own_engine(build, method, layout):
    """Where #55390's trailing-layer rule has nothing to add (the runtime's marked specs),
    rules="seed-gated" is vLLM 0.33's get_global_kv_cache_groups, flag for flag, warning for warning."""
    specs = build()
    with kv.captured_warnings() as ours:
        lab = kv.kv_cache_groups(specs, method=method, model_type="glm4_moe", layout=layout, rules="seed-gated")
    engine, theirs = kv_engine.engine_kv_cache_groups(specs, method=method, layout=layout)
    assert [g.is_eagle_group for g in lab] == [g.is_eagle_group for g in engine]
    assert bool(ours) == bool(theirs)


def test_the_table_sets_the_seed_beside_vllm_033s_own_annotation():
    """Issue 31: the "vllm-0.33" column is 0.33's engine, run. dflash and dspark differ on every model
    (the gate); eagle, eagle3 and mtp differ exactly where the seed's trailing-layer rule finds an
    unmarked drafter (MTP on the Qwen3.5 hybrid, every method on unmarked DeepSeek V4/V4.1) and
    agree where 0.33's runtime markers are there."""
    from dflash_lab.kv_cache import compare

    rows = compare.rule_table()
    for r in rows:
        engine, warned = kv_engine.engine_kv_cache_groups(compare.MODELS[r.model][0](), method=r.method,
                                                          layout=compare.MODELS[r.model][2])
        assert (r.vllm_flags, r.vllm_warns) == ([f"g{i}" for i, g in enumerate(engine) if g.is_eagle_group], bool(warned))
    differ = {(r.model, r.method): r for r in rows if r.differs}
    assert {k for k in differ if k[1] in ("dflash", "dspark")} == {(m, x) for m in compare.MODELS for x in ("dflash", "dspark")}
    trailing = {k for k in differ if k[1] in ("eagle", "eagle3", "mtp")}
    assert trailing == {("Qwen3.5 hybrid, unmarked", "mtp")} | {(m, x) for m in ("DeepSeek-V4, unmarked", "DeepSeek-V4.1, unmarked")
                                                              for x in ("eagle", "eagle3", "mtp")}
    for key in trailing:
        assert kv.uses_trailing_mtp_layers(key[1], compare.MODELS[key[0]][1]) and differ[key].vllm_flags == []
        assert differ[key].why == compare.WHY_TRAILING
    qwen_mtp = differ[("Qwen3.5 hybrid, unmarked", "mtp")]
    assert (qwen_mtp.seed_flags, qwen_mtp.seed_warns, qwen_mtp.vllm_flags, qwen_mtp.vllm_warns) == (["g2"], False, [], True)
    unmarked = differ[("Qwen3.5 hybrid, unmarked", "dspark")]
    assert (unmarked.seed_flags, unmarked.seed_warns, unmarked.vllm_flags, unmarked.vllm_warns) == ([], True, [], False)
    assert "kv_cache_planning.py:1656" in unmarked.why
    xs2 = differ[("Laguna-XS.2 + DFlash", "dflash")]
    assert xs2.seed_flags == ["g0"] and xs2.vllm_flags == [] and not xs2.seed_warns
    assert "config/speculative.py:2122-2149" in xs2.why
    text = compare.format_differences(rows)
    assert text.count("\n") == len(differ) + 1 + len({r.why for r in differ.values()})


# ---------------------------------------------------------------------------
# The exact-partition guard of rule 2
# ---------------------------------------------------------------------------


def _regroup(groups, edit):
    return [KVCacheGroupSpec(edit(list(g.layer_names)), g.kv_cache_spec) for g in groups]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trailing_layer_rule_needs_an_exact_partition(layout):
    specs = kv_specs.qwen3_5_hybrid_specs(with_mtp_layer=True)
    groups = kv.vllm_kv_cache_groups(specs, layout=layout)
    assert kv.groups_partition_layers_exactly(specs, groups)
    kv.annotate_draft_groups("mtp", "qwen3_5", specs, groups, use_trailing_layer_fallback=True)
    assert len(flagged(groups)) == 1  # the untouched groups are flagged

    dropped = _regroup(groups, lambda names: [n for n in names if n != "model.layers.0.linear_attn"])
    first = groups[0].layer_names[0]
    duplicated = _regroup(groups, lambda names: names if first in names else names + [first])
    for bad in (dropped, duplicated):
        assert not kv.groups_partition_layers_exactly(specs, bad)
        kv.annotate_draft_groups("mtp", "qwen3_5", specs, bad, use_trailing_layer_fallback=True)
        assert flagged(bad) == []  # the last layer is still in a group, but the rule must not fire


def test_partition_check_rejects_a_layer_the_spec_does_not_have():
    specs = kv_specs.qwen3_5_hybrid_specs()
    groups = kv.vllm_kv_cache_groups(specs)
    renamed = _regroup(groups, lambda names: [n.replace("mtp.layers.0", "mtp.layers.9") for n in names])
    assert not kv.groups_partition_layers_exactly(specs, renamed)


def test_trailing_layer_rule_only_when_enabled():
    specs = kv_specs.deepseek_v4_specs()
    groups = kv.vllm_kv_cache_groups(specs, layout="BLHNC")
    kv.annotate_draft_groups("mtp", "deepseek_v4", specs, groups)
    assert flagged(groups) == []


# ---------------------------------------------------------------------------
# Rule 1: the marker (DFlash on Laguna)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("drafter_sliding", [False, True])
def test_dflash_drafter_group_is_found_by_its_marker(layout, drafter_sliding):
    specs = kv_specs.laguna_dflash_specs(drafter_sliding=drafter_sliding)
    drafter = {n for n, s in specs.items() if s.is_draft}
    assert drafter == {f"model.layers.{6 + j}.self_attn.attn" for j in range(3)}
    assert not kv.uses_trailing_mtp_layers("dflash", "laguna")

    groups = kv.kv_cache_groups(specs, method="dflash", model_type="laguna", layout=layout)

    assert [g for g in groups if drafter & set(g.layer_names)] == flagged(groups) != []
    # The drafter's layers sit with the target's full-attention layers 2 and 5: one
    # block table for all of them, so they share the draft group's treatment.
    (draft,) = flagged(groups)
    assert {"model.layers.2.self_attn.attn", "model.layers.5.self_attn.attn"} <= set(draft.layer_names)


def test_marker_rule_does_not_depend_on_registration_order():
    specs = kv_specs.laguna_dflash_specs()
    drafter_first = dict(sorted(specs.items(), key=lambda item: not item[1].is_draft))
    groups = kv.kv_cache_groups(drafter_first, method="dflash", model_type="laguna")
    (draft,) = flagged(groups)
    assert "model.layers.6.self_attn.attn" in draft.layer_names


def test_drafter_with_other_kv_heads_gets_groups_of_its_own_only_on_the_general_path():
    drafter = dict(kv_specs.example_dflash_drafter_config(kv_specs.EXAMPLE_LAGUNA_CONFIG), num_key_value_heads=4)
    specs = kv_specs.laguna_dflash_specs(drafter_config=drafter)
    drafter_layers = {n for n, s in specs.items() if s.is_draft}

    # General path: pages are unified by giving the target a larger block, and the
    # drafter's 3 layers form groups of their own (2 + 1): the marker finds both.
    general = kv.kv_cache_groups(specs, method="dflash", model_type="laguna", layout="LBHNC")
    assert len(flagged(general)) == 2
    assert {n for g in flagged(general) for n in g.layer_names} == drafter_layers

    packed = kv.kv_cache_groups(specs, method="dflash", model_type="laguna", layout="BLHNC")
    (draft,) = flagged(packed)
    assert drafter_layers < set(draft.layer_names)  # packed next to the target's full attention


def test_vllm_033_grouping_flags_no_group_itself():
    # In vLLM 0.33 get_kv_cache_groups leaves is_eagle_group False everywhere: the
    # flags in this lab come from our annotation.
    for name in kv_presets.PRESETS:
        for layout in LAYOUTS:
            assert flagged(kv.vllm_kv_cache_groups(kv_presets.preset_specs(name), layout=layout)) == []


def test_annotation_sets_every_flag_afresh():
    specs = kv_specs.laguna_dflash_specs()
    groups = kv.vllm_kv_cache_groups(specs)
    for g in groups:
        g.is_eagle_group = True
    kv.annotate_draft_groups(None, None, specs, groups)
    assert flagged(groups) == []
    kv.annotate_draft_groups("eagle", "laguna", specs, groups)
    assert len(flagged(groups)) == 1


def test_hybrid_manager_disabled_puts_the_whole_laguna_pair_in_the_draft_group():
    specs = kv_specs.laguna_dflash_specs()
    (group,) = kv.kv_cache_groups(specs, method="dflash", model_type="laguna", hybrid_manager_disabled=True)
    assert group.is_eagle_group and set(group.layer_names) == set(specs)
    assert isinstance(group.kv_cache_spec, FullAttentionSpec)


# ---------------------------------------------------------------------------
# Our method lists agree with vLLM 0.33's
# ---------------------------------------------------------------------------


def test_eagle_methods_are_vllms_use_eagle_methods():
    from vllm.config import SpeculativeConfig

    for method in kv.SPEC_METHODS:
        assert SpeculativeConfig.use_eagle(SimpleNamespace(method=method)) == (method in kv.EAGLE_METHODS)


def test_spec_methods_are_vllms_methods_without_mtp_aliases():
    from vllm.config import speculative

    def leaves(tp):
        args = typing.get_args(tp)
        return {leaf for a in args for leaf in (leaves(a) if typing.get_args(a) else {a})}

    aliases = leaves(speculative.MTPModelTypes) - {"mtp"}
    assert set(kv.SPEC_METHODS) == leaves(speculative.SpeculativeMethod) - aliases


# ---------------------------------------------------------------------------
# Spec builders
# ---------------------------------------------------------------------------


def test_laguna_target_layers_follow_layer_types():
    specs = kv_specs.laguna_target_specs(kv_specs.EXAMPLE_LAGUNA_CONFIG, dtype="float16", kv_block_size=32)
    kinds = [type(s) for s in specs.values()]
    assert list(specs) == [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    assert kinds == [SlidingWindowSpec, SlidingWindowSpec, FullAttentionSpec] * 2
    assert specs["model.layers.0.self_attn.attn"].sliding_window == 64
    assert all(s.block_size == 32 and s.num_kv_heads == 2 and s.head_size == 64 for s in specs.values())
    assert specs["model.layers.2.self_attn.attn"].page_size_bytes == 32 * 2 * 2 * 64 * 2  # tokens*K,V*heads*dim*fp16


def test_dflash_drafter_cache_is_full_attention_even_when_its_layers_slide():
    drafter = {"num_hidden_layers": 2, "num_key_value_heads": 4, "head_dim": 32,
               "layer_types": ["sliding_attention"] * 2, "sliding_window": 16}
    specs = kv_specs.dflash_drafter_specs(drafter, target_layer_count=40)
    assert list(specs) == ["model.layers.40.self_attn.attn", "model.layers.41.self_attn.attn"]
    for spec in specs.values():
        assert type(spec) is FullAttentionSpec and spec.sliding_window is None
        assert spec.is_draft and (spec.num_kv_heads, spec.head_size) == (4, 32)


def test_dflash_drafter_specs_read_a_config_object():
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=2, head_dim=64, layer_types=["full_attention"])
    assert list(kv_specs.dflash_drafter_specs(config, target_layer_count=6)) == ["model.layers.6.self_attn.attn"]


def test_mtp_layer_is_the_targets_full_attention_without_a_marker():
    specs = kv_specs.qwen3_5_hybrid_specs(with_mtp_layer=True)
    assert specs[MTP_LAYER] == specs["model.layers.3.self_attn.attn"]
    assert not specs[MTP_LAYER].is_draft
    assert next(reversed(specs)) == MTP_LAYER


def test_qwen3_5_pages_are_aligned_like_vllms_platform_does():
    specs = kv_specs.qwen3_5_hybrid_specs()
    mamba = specs["model.layers.0.linear_attn"]
    attn = specs["model.layers.3.self_attn.attn"]
    assert attn.block_size % 16 == 0
    assert attn.page_size_bytes >= mamba.real_page_size_bytes > attn.page_size_bytes * (attn.block_size - 16) / attn.block_size
    assert {s.page_size_bytes for s in specs.values()} == {attn.page_size_bytes}
    assert list(specs)[:4] == [f"model.layers.{i}.linear_attn" for i in range(3)] + ["model.layers.3.self_attn.attn"]


def test_deepseek_v4_draft_layer_reuses_the_target_decoder_layer():
    specs = kv_specs.deepseek_v4_specs(num_target_layers=3)
    for cache in ("swa_attn", "attn"):
        assert specs[f"model.layers.3.self_attn.{cache}"] == specs[f"model.layers.0.self_attn.{cache}"]
    assert len(specs) == 8


# ---------------------------------------------------------------------------
# Memory per group
# ---------------------------------------------------------------------------


def test_group_memory_uses_one_pool_sized_by_the_widest_group():
    specs = kv_specs.laguna_dflash_specs()  # 4 sliding layers | 2 full + 3 drafter layers
    groups = kv.kv_cache_groups(specs, method="dflash", model_type="laguna")
    budget = 10 << 20
    sliding, full = kv_layout.group_memory(groups, kv_budget_bytes=budget)
    page = 16 * 2 * 2 * 64 * 2  # block * (K, V) * kv heads * head dim * bf16
    assert (sliding.num_layers, full.num_layers) == (4, 5)
    assert full.pool_bytes_per_block == sliding.pool_bytes_per_block == 5 * page
    assert (sliding.unused_bytes_per_block, full.unused_bytes_per_block) == (page, 0)
    assert full.kv_block_size == sliding.kv_block_size == 16  # tokens per KV page, not the draft block
    assert full.num_blocks == budget // (5 * page) and full.tokens == full.num_blocks * 16
    assert full.bytes_per_token == 5 * page / 16 and full.is_draft_group and not sliding.is_draft_group


def test_group_memory_reports_mamba_state_without_a_per_token_size():
    memory = kv_layout.group_memory(kv.kv_cache_groups(kv_specs.qwen3_5_hybrid_specs(), method="mtp", model_type="qwen3_5"))
    assert [m.bytes_per_token is None for m in memory] == [True, True, False]
    assert [m.tokens is None for m in memory] == [True, True, False]


def test_group_memory_rejects_a_budget_below_one_block():
    groups = kv.kv_cache_groups(kv_specs.laguna_dflash_specs())
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        kv_layout.group_memory(groups, kv_budget_bytes=1000)


# ---------------------------------------------------------------------------
# Figures, rows and the widget
# ---------------------------------------------------------------------------


def test_layout_figure_draws_one_row_per_group_and_one_cell_per_layer():
    specs = kv_specs.deepseek_v4_specs()
    groups = kv.kv_cache_groups(specs, method="mtp", model_type="deepseek_v4", layout="BLHNC")
    rows = kv_layout.describe_groups(groups, specs)
    fig = viz.kv_group_layout_figure(rows, title="DSv4", warning="careful")

    assert sum(len(t.y) for t in fig.data) == len(specs)
    assert len(set(y for t in fig.data for y in t.y)) == len(groups)
    assert {t.name for t in fig.data} == {"sliding_window_mla", "mla_attention"}
    hovers = [h for t in fig.data for h in t.hovertext]
    assert all(any(h.startswith(name + "<br>") for h in hovers) for name in specs)
    assert [r.is_draft_group for r in rows].count(True) == 1
    assert sum("DRAFT" in label for label in fig.layout.yaxis.categoryarray) == 1
    assert "careful" in fig.layout.title.text


def test_layout_figure_outlines_marked_draft_layers():
    specs = kv_specs.laguna_dflash_specs()
    fig = viz.kv_group_layout_figure(kv_layout.describe_groups(kv.kv_cache_groups(specs, method="dflash", model_type="laguna"), specs))
    widths = {text: w for t in fig.data for text, w in zip(t.text, t.marker.line.width)}
    assert {text for text, w in widths.items() if w > 1} == {"L6", "L7", "L8"}


def test_padding_figure_shows_the_share_of_the_pool_left_empty():
    toy = kv_layout.group_memory(kv.kv_cache_groups(kv_specs.laguna_dflash_specs()))  # groups of 4 and 5 layers
    xs2 = kv_layout.group_memory(kv.kv_cache_groups(kv_presets.preset_specs("laguna_xs2_dflash")))  # 15, 15, 15
    filled, empty = viz.kv_padding_figure([("toy", toy), ("XS.2", xs2)]).data
    assert list(filled.y) == list(empty.y) == ["toy", "XS.2"]
    assert list(empty.x) == pytest.approx([10.0, 0.0])  # one padding page of ten; none
    assert [f + e for f, e in zip(filled.x, empty.x)] == pytest.approx([100.0, 100.0])
    assert list(empty.text) == ["10.0 % empty", "0.0 % empty"]


def test_memory_figure_lists_every_group_and_its_unused_share_of_a_block():
    groups = kv.kv_cache_groups(kv_specs.laguna_dflash_specs(), method="dflash", model_type="laguna")
    memory = kv_layout.group_memory(groups)
    used, unused = viz.kv_group_memory_figure(memory).data
    assert list(used.y) == ["g0", "g1 ⚑"]
    assert list(used.x) == [32.0, 40.0] and list(unused.x) == [8.0, 0.0]  # KiB of a 40 KiB pool block
    table = viz.kv_group_memory_table_html(memory)
    assert table.count("<th ") == 11 and all(f">{h}</th>" in table for h in viz.kv_groups.MEMORY_HEADER)
    assert table.count("<tr>") == 1 + 2 and "<b>⚑</b>" in table and "8.0\u00a0KiB\u00a0of\u00a040.0\u00a0KiB" in table


def test_format_groups_marks_the_draft_group_and_the_marked_layers():
    specs = kv_specs.laguna_dflash_specs()
    text = kv_layout.format_groups(kv.kv_cache_groups(specs, method="dflash", model_type="laguna"), specs)
    sliding, full = text.splitlines()
    assert "draft group" not in sliding and full.endswith("<- draft group")
    assert "L6*, L7*, L8*" in full


def _explorer():
    from dflash_lab.widgets import kv_groups_explorer

    box = kv_groups_explorer()
    (preset, method, layout), (flagger,), (sliding, marked, hybrid_off) = (c.children for c in box.children[:3])
    controls = SimpleNamespace(preset=preset, method=method, layout=layout, flagger=flagger, sliding=sliding,
                               marked=marked, hybrid_off=hybrid_off, status=box.children[3])
    return controls, box.children[4], box.children[6]


def _rows(fig):
    return len(set(y for t in fig.data for y in t.y))


def test_explorer_redraws_for_every_control():
    c, layout_fig, memory_fig = _explorer()
    assert c.preset.value == "shipped_pair"  # the student's own pair comes first
    assert _rows(layout_fig) == len(kv.vllm_kv_cache_groups(kv_presets.preset_specs("shipped_pair")))
    for name in kv_presets.PRESETS:
        c.preset.value = name
        assert c.method.value == kv_presets.PRESETS[name]["method"]
        for value in ("BLHNC", "LBHNC"):
            c.layout.value = value
        for flagger in kv_groups_explorer_flaggers():
            c.flagger.value = flagger
            assert kv_groups_explorer_title_names(flagger) in layout_fig.layout.title.text
    c.preset.value = "laguna_dflash"
    c.sliding.value = True
    c.hybrid_off.value = True
    assert _rows(layout_fig) == 1 and "hybrid manager disabled" in layout_fig.layout.title.text
    assert len(memory_fig.data) == 2  # used and left empty; the numbers are the HTML table above it


def kv_groups_explorer_flaggers():
    from dflash_lab.widgets.kv_groups import FLAGGERS

    assert set(FLAGGERS) == {"seed", "seed-gated", "vllm-0.33"}
    return list(FLAGGERS)


def kv_groups_explorer_title_names(flagger):
    from dflash_lab.widgets.kv_groups import FLAGGERS

    return FLAGGERS[flagger]


def test_explorer_never_shows_a_hybrid_manager_state_it_did_not_apply():
    # Issue 14: vLLM 0.33 cannot disable the hybrid manager for the Mamba hybrid or the
    # DeepSeek shape; the box must then be unticked and greyed out, not ticked over an
    # enabled grouping.
    c, layout_fig, _ = _explorer()
    c.hybrid_off.value = True
    assert _rows(layout_fig) == 1
    for name in ("qwen3_5_mtp", "deepseek_v4"):
        c.preset.value = name
        assert c.hybrid_off.disabled and c.hybrid_off.value is False
        assert "hybrid manager disabled" not in layout_fig.layout.title.text
        assert "cannot disable the hybrid manager" in c.status.value
        c.hybrid_off.value = True  # ticked by code anyway: put back, and the figure says nothing of it
        assert c.hybrid_off.value is False and "hybrid manager disabled" not in layout_fig.layout.title.text
    c.preset.value = "laguna_s21_dflash"
    assert not c.hybrid_off.disabled


def test_explorer_clears_a_stale_draft_shading_in_the_browser():
    # A layout assignment reaches plotly.js as a relayout, which keeps shapes the new layout
    # lacks; the explorer must send an explicit clear when the draft group goes away.
    c, layout_fig, _ = _explorer()
    c.preset.value = "laguna_xs2_dflash"
    assert len(layout_fig.layout.shapes) == 1  # the lab flags the XS.2 DFlash group
    sent = []
    original = layout_fig._send_relayout_msg
    layout_fig._send_relayout_msg = lambda data, *a, **k: (sent.append(data), original(data, *a, **k))[1]
    c.flagger.value = "vllm-0.33"  # vLLM 0.33 flags nothing for DFlash
    assert len(layout_fig.layout.shapes) == 0
    assert any(d.get("shapes") == [] for d in sent)


def test_explorer_runs_what_the_marker_and_flagger_controls_say():
    c, layout_fig, _ = _explorer()
    c.preset.value = "qwen3_5_mtp"
    assert not c.marked.disabled and c.sliding.disabled
    c.flagger.value = "vllm-0.33"
    assert "DRAFT" not in " ".join(layout_fig.layout.yaxis.categoryarray)  # unmarked: vLLM finds nothing
    assert "could be identified" in layout_fig.layout.title.text  # ... and warns
    c.marked.value = True
    assert sum("DRAFT" in y for y in layout_fig.layout.yaxis.categoryarray) == 1
    c.preset.value = "laguna_xs2_dflash"
    assert c.marked.disabled and c.marked.value is False
    assert "DRAFT" not in " ".join(layout_fig.layout.yaxis.categoryarray)  # 0.33 flags no DFlash group


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "names"),
    [
        (lambda: kv.kv_cache_groups(kv_specs.laguna_dflash_specs(), method="medusa"), ValueError, "method 'medusa'"),
        (lambda: kv.uses_trailing_mtp_layers("mtp", "  "), ValueError, "model_type is empty"),
        (lambda: kv.uses_trailing_mtp_layers("mtp", 7), TypeError, "model_type must be a string or None"),
        (lambda: kv.annotate_draft_groups(3, None, kv_specs.laguna_dflash_specs(), []), TypeError, "method must be"),
        (lambda: kv.kv_cache_groups(kv_specs.laguna_dflash_specs(), layout="LBXYZ"), ValueError, "layout 'LBXYZ'"),
        (lambda: kv.kv_cache_groups({}), ValueError, "kv_cache_spec is empty"),
        (lambda: kv.kv_cache_groups({"": kv_specs.laguna_dflash_specs()["model.layers.0.self_attn.attn"]}), ValueError,
         "kv_cache_spec: a layer name is empty"),
        (lambda: kv.kv_cache_groups({"model.layers.0.attn": "full"}), TypeError, "kv_cache_spec['model.layers.0.attn']"),
        (lambda: kv_layout.group_memory([], kv_budget_bytes=1 << 20), ValueError, "groups is empty"),
    ],
    ids=["unknown-method", "empty-model-type", "model-type-type", "method-type", "layout", "empty-spec", "empty-name",
         "not-a-spec", "no-groups"],
)
def test_bad_arguments_are_rejected_by_name(call, error, names):
    with pytest.raises(error) as info:
        call()
    assert names in str(info.value)


def test_duplicate_layer_names_are_rejected():
    spec = kv_specs.laguna_dflash_specs()["model.layers.0.self_attn.attn"]
    pairs = [("model.layers.0.self_attn.attn", spec), ("model.layers.0.self_attn.attn", spec)]
    with pytest.raises(ValueError, match=r"kv_cache_spec: layer name 'model\.layers\.0\.self_attn\.attn' appears twice"):
        kv.kv_cache_groups(pairs)
    with pytest.raises(ValueError, match="appears twice"):
        kv.groups_partition_layers_exactly(pairs, [])


@pytest.mark.parametrize("where", ["target", "drafter"])
def test_layer_types_of_the_wrong_length_are_rejected(where):
    target = dict(kv_specs.EXAMPLE_LAGUNA_CONFIG)
    drafter = kv_specs.example_dflash_drafter_config(target)
    (target if where == "target" else drafter)["layer_types"] = ["full_attention"] * 5
    with pytest.raises(ValueError, match=f"{where} config: `layer_types` has 5 entries but num_hidden_layers is"):
        kv_specs.laguna_dflash_specs(target, drafter)


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        ({"num_hidden_layers": None}, ValueError, "`num_hidden_layers` is missing"),
        ({"num_hidden_layers": "6"}, TypeError, "`num_hidden_layers` must be an integer"),
        ({"layer_types": ["sliding_attention", "global"] * 3}, ValueError, "unknown types ['global']"),
        ({"sliding_window": None}, ValueError, "`sliding_window` is missing"),
        ({"num_key_value_heads": 0}, ValueError, "`num_key_value_heads` must be >= 1"),
    ],
)
def test_bad_target_config_values_name_their_key(edit, error, message):
    config = {**kv_specs.EXAMPLE_LAGUNA_CONFIG, **edit}
    with pytest.raises(error) as info:
        kv_specs.laguna_target_specs(config)
    assert message in str(info.value)


def test_deepseek_v4_compress_ratio_must_divide_the_block():
    with pytest.raises(ValueError, match="compress_ratio 128 must divide kv_block_size 64"):
        kv_specs.deepseek_v4_specs(compress_ratio=128)


def test_unknown_dtype_and_preset_are_rejected():
    with pytest.raises(ValueError, match="dtype 'bf17'"):
        kv_specs.laguna_target_specs(kv_specs.EXAMPLE_LAGUNA_CONFIG, dtype="bf17")
    with pytest.raises(ValueError, match="preset 'llama'"):
        kv_presets.preset_specs("llama")
    with pytest.raises(ValueError, match=r"layer_names: \['model.layers.99.self_attn.attn'\] are not layers"):
        kv_specs.mark_draft_layers(kv_specs.laguna_dflash_specs(), ["model.layers.99.self_attn.attn"])


def test_hybrid_manager_disabled_failure_is_a_clear_error():
    # vLLM 0.33 cannot promote Mamba layers to one spec type; say so, with the setting.
    with pytest.raises(ValueError, match="hybrid_manager_disabled=True"):
        kv.kv_cache_groups(kv_specs.qwen3_5_hybrid_specs(), method="mtp", model_type="qwen3_5", hybrid_manager_disabled=True)


def test_load_config_names_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=str(bad)):
        kv_presets.load_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        kv_presets.load_config(tmp_path / "nope.json")


# ---------------------------------------------------------------------------
# What chapter 4 says about vLLM 0.33 itself (FIDELITY §6, §9 items 1-6)
# ---------------------------------------------------------------------------


def _vllm_source(module: str) -> str:
    import importlib.util
    from pathlib import Path

    return Path(importlib.util.find_spec(module).origin).read_text()


def test_vllm_033_marks_every_drafter_attention_layer_mtp_included():
    """§9.1: the proposer marks each attention layer the drafter added (no method test),
    and the runner copies the mark into the spec."""
    proposer = _vllm_source("vllm.v1.spec_decode.llm_base_proposer")
    assert "draft_attn_layer_names = set(all_attn_layers) - target_attn_layer_names" in proposer
    assert "all_attn_layers[name].is_draft_layer = True" in proposer
    runner = _vllm_source("vllm.v1.worker.gpu_model_runner")
    assert "if attn_module.is_draft_layer:\n                    spec = replace(spec, is_draft=True)" in runner


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("build", [kv_specs.qwen3_5_hybrid_specs, kv_specs.deepseek_v4_specs])
def test_the_marker_never_compares_so_marked_and_unmarked_specs_group_alike(build, layout):
    """§9.1: ``is_draft`` has compare=False (kv_cache_interface.py:215); the lab's unmarked
    MTP dict is #55390's test premise, the marked one 0.33's runtime; both group the same."""
    import dataclasses

    unmarked, marked = build(), build(mark_draft=True)
    draft = {n for n, s in marked.items() if s.is_draft}
    assert draft and not any(s.is_draft for s in unmarked.values())
    assert next(f for f in dataclasses.fields(FullAttentionSpec) if f.name == "is_draft").compare is False
    assert all(marked[n] == unmarked[n] for n in draft)
    names = lambda specs: [g.layer_names for g in kv.vllm_kv_cache_groups(specs, layout=layout)]  # noqa: E731
    assert names(marked) == names(unmarked)


def test_needs_eagle_block_drop_is_vllms_predicate():
    """§9.2: False for dflash and dspark in 0.33 (config/speculative.py:2122-2149), read from
    vLLM's own SpeculativeConfig methods; and the scheduler's lookahead-hash rule."""
    from vllm.config import SpeculativeConfig

    source = _vllm_source("vllm.config.speculative")
    assert "return self.use_eagle() and not (self.use_dflash() or self.use_dspark())" in source
    stub_cls = type(kv.speculative_config_stub("eagle"))
    assert stub_cls.needs_eagle_block_drop is SpeculativeConfig.needs_eagle_block_drop
    for method in (*kv.SPEC_METHODS, None):
        assert kv.needs_eagle_block_drop(method) is (method in ("eagle", "eagle3", "mtp")), method
    for method in kv.EAGLE_METHODS:
        default, no_hashes = kv_engine.block_drop(method), kv_engine.block_drop(method, disable_lookahead_block_hashes=True)
        assert default.use_eagle and not default.drops_last_block  # lookahead hashes replace the drop by default
        assert default.num_hash_lookahead_tokens == (1 if default.needs_eagle_block_drop else 0)
        assert no_hashes.drops_last_block is kv.needs_eagle_block_drop(method)
    scheduler = _vllm_source("vllm.v1.core.sched.scheduler")
    assert "if self.num_hash_lookahead_tokens:\n            # Lookahead hashes prove the boundary token, so EAGLE needs no drop.\n" \
           "            self.use_eagle_block_drop = False" in scheduler


@pytest.mark.parametrize("layout", LAYOUTS)
def test_033s_gate_flags_no_dflash_or_dspark_group(layout):
    """§9.2: 0.33 annotates only under use_eagle_block_drop(); behind that gate #55390's rules
    flag no DFlash or dspark group, while the seed's rules (the default) do."""
    xs2 = kv_presets.preset_specs("laguna_xs2_dflash")
    assert flagged(kv.kv_cache_groups(xs2, method="dflash", model_type="laguna", layout=layout,
                                      rules="vllm-0.33")) == []
    assert len(flagged(kv.kv_cache_groups(xs2, method="dflash", model_type="laguna", layout=layout))) == 1
    dsv4 = kv_specs.deepseek_v4_specs()
    for method in ("dflash", "dspark"):
        for rules in ("seed-gated", "vllm-0.33"):
            assert flagged(kv.kv_cache_groups(dsv4, method=method, model_type="deepseek_v4", layout=layout,
                                              rules=rules)) == []
    for method in ("eagle", "eagle3", "mtp"):
        (draft,) = flagged(kv.kv_cache_groups(dsv4, method=method, model_type="deepseek_v4", layout=layout,
                                              rules="seed-gated"))
        assert DSV4_DRAFT_LAYER in draft.layer_names
        assert flagged(kv.kv_cache_groups(dsv4, method=method, model_type="deepseek_v4", layout=layout,
                                          rules="vllm-0.33")) == []  # unmarked: 0.33 has only the marker


def test_vllm_033_engine_annotation():
    """§9.1-9.3, run through vLLM's own get_global_kv_cache_groups: nothing for DFlash (no drop),
    nothing plus vLLM's warning for the unmarked MTP dict, the marked group at runtime."""
    xs2 = kv_presets.preset_specs("laguna_xs2_dflash")
    groups, warnings = kv_engine.engine_kv_cache_groups(xs2, method="dflash")
    assert flagged(groups) == [] and warnings == []

    groups, warnings = kv_engine.engine_kv_cache_groups(kv_specs.qwen3_5_hybrid_specs(), method="mtp")
    assert flagged(groups) == []
    assert len(warnings) == 1 and "no KV cache group could be identified as the draft model's" in warnings[0]

    for layout in LAYOUTS:
        groups, warnings = kv_engine.engine_kv_cache_groups(kv_specs.qwen3_5_hybrid_specs(mark_draft=True),
                                                            method="mtp", layout=layout)
        (draft,) = flagged(groups)
        assert MTP_LAYER in draft.layer_names and not holds_mamba(draft) and warnings == []

        # DeepSeek V4: the draft layer's two caches land in two groups; the marker finds both.
        dsv4 = kv_specs.deepseek_v4_specs(mark_draft=True)
        groups, _ = kv_engine.engine_kv_cache_groups(dsv4, method="mtp", layout=layout)
        assert {n for g in flagged(groups) for n in g.layer_names} >= {DSV4_DRAFT_LAYER, "model.layers.3.self_attn.swa_attn"}
        assert len(flagged(groups)) == 2

    groups, _ = kv_engine.engine_kv_cache_groups(kv_specs.laguna_dflash_specs(), method=None)
    assert flagged(groups) == []


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trailing_layer_rule_misses_the_draft_layers_other_cache_on_the_packed_path(layout):
    """The missed flag chapter 4 points at: rule 2 finds only the group of the very last layer."""
    groups = kv.kv_cache_groups(kv_specs.deepseek_v4_specs(), method="mtp", model_type="deepseek_v4", layout=layout)
    (draft,) = flagged(groups)
    assert DSV4_DRAFT_LAYER in draft.layer_names
    assert "model.layers.3.self_attn.swa_attn" not in draft.layer_names


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("preset", "group_size", "target_full", "drafter"),
                         [("laguna_xs2_dflash", 15, 10, 5), ("laguna_s21_dflash", 18, 12, 6)])
def test_real_laguna_pairs_form_three_equal_groups(preset, group_size, target_full, drafter, layout):
    """§9.5: XS.2 + 5-layer drafter gives three groups of 15, S-2.1 + 6 three of 18
    (kv_cache_planning.py:522-532); "two groups" holds for the toy's 4 + 5 only."""
    specs = kv_presets.preset_specs(preset)
    groups = kv.kv_cache_groups(specs, method="dflash", model_type="laguna", layout=layout)
    assert [len(g.layer_names) for g in groups] == [group_size] * 3
    (draft,) = flagged(groups)
    markers = [specs[n].is_draft for n in draft.layer_names]
    assert (markers.count(False), markers.count(True)) == (target_full, drafter)
    assert all(type(specs[n]) is FullAttentionSpec for n in draft.layer_names)
    others = [g for g in groups if not g.is_eagle_group]
    assert all(isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in others)
    assert sorted(len(g.layer_names) for g in kv.vllm_kv_cache_groups(kv_presets.preset_specs("laguna_dflash"))) == [4, 5]


def test_vllm_033_registers_dflash_layers_after_the_target_with_a_full_kv_cache():
    """What the chapter says of DFlashLagunaModel: attention prefix layers.{j + target count},
    and sliding layers keep a full KV allocation (the window limits compute only)."""
    source = _vllm_source("vllm.model_executor.models.laguna_dflash")
    assert 'prefix, f"layers.{layer_idx + target_layer_count}"' in source
    assert "layer.self_attn.attn.sliding_window = None" in source


def test_poolside_pairs_use_the_published_attention_geometry():
    specs = kv_presets.preset_specs("laguna_s21_dflash")
    assert len(specs) == 48 + 6
    assert [n for n, s in specs.items() if s.is_draft] == [f"model.layers.{48 + j}.self_attn.attn" for j in range(6)]
    assert {(s.num_kv_heads, s.head_size) for s in specs.values()} == {(8, 128)}
    assert {s.sliding_window for s in specs.values() if isinstance(s, SlidingWindowSpec)} == {512}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_asserts_an_exact_partition_before_any_annotation(layout):
    """§9.6: every grouping passes get_kv_cache_groups_from_builder's _check_exact_partition
    (kv_cache_planning.py:1203-1230); #55390 re-checks it as a gate on rule 2."""
    specs = kv_specs.qwen3_5_hybrid_specs()
    groups = kv.vllm_kv_cache_groups(specs, layout=layout)
    assert kv_engine.partition_check(specs, groups) is None
    dropped = _regroup(groups, lambda names: [n for n in names if n != "model.layers.0.linear_attn"])
    assert kv_engine.partition_check(specs, dropped) == "KV cache groups miss layers: ['model.layers.0.linear_attn']."
    first = groups[0].layer_names[0]
    twice = _regroup(groups, lambda names: names if first in names else names + [first])
    assert kv_engine.partition_check(specs, twice).startswith("KV cache group overlaps")
    # A name the spec lacks passes vLLM's check but not #55390's gate.
    extra = _regroup(groups, lambda names: names + (["mtp.layers.9.self_attn.attn"] if MTP_LAYER in names else []))
    assert kv_engine.partition_check(specs, extra) is None
    assert not kv.groups_partition_layers_exactly(specs, extra)


def test_case_5_figure_marks_the_dropped_layer():
    specs = kv_specs.qwen3_5_hybrid_specs()
    groups = _regroup(kv.vllm_kv_cache_groups(specs), lambda names: [n for n in names if n != "model.layers.0.linear_attn"])
    (missing,) = kv_layout.ungrouped_layers(groups, specs)
    assert missing.name == "model.layers.0.linear_attn" and missing.kind == "mamba"
    fig = viz.kv_group_layout_figure(kv_layout.describe_groups(groups, specs), missing=[missing])
    (row,) = [t for t in fig.data if t.name == "in no group (dropped)"]
    assert list(row.text) == ["L0:gdn"] and row.marker.pattern.shape == "x"
    from dflash_lab.viz.kv_groups import MISSING_LABEL

    assert fig.layout.yaxis.categoryarray[-1] == MISSING_LABEL


def test_figure_titles_are_wrapped_not_clipped():
    title = "Case 1 · mtp on deepseek_v4, packed, unmarked: only the group holding the last layer " * 2
    specs = kv_specs.deepseek_v4_specs()
    fig = viz.kv_group_layout_figure(kv_layout.describe_groups(kv.vllm_kv_cache_groups(specs), specs), title=title,
                                     warning="w " * 100)
    lines = [line for line in fig.layout.title.text.split("<br>")]
    assert len(lines) >= 3 and all(len(line) <= 80 for line in lines if "<span" not in line)
    assert fig.layout.margin.t >= 22 * len(lines)


# ---------------------------------------------------------------------------
# vLLM stays optional for the rest of the lab
# ---------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)


def test_importing_the_lab_does_not_import_vllm():
    run = _python("""
        import sys
        import dflash_lab, dflash_lab.kv_cache.specs, dflash_lab.kv_cache.groups, dflash_lab.kv_cache.layout, dflash_lab.viz, dflash_lab.widgets
        import dflash_lab.kv_cache.presets, dflash_lab.kv_cache.engine
        print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
    """)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_missing_vllm_raises_an_import_error_that_says_how_to_install_it():
    run = _python("""
        import sys
        sys.modules["vllm"] = None  # as if vLLM were not installed
        from dflash_lab.kv_cache import groups as kv_groups, layout as kv_layout, specs as kv_specs
        from dflash_lab import viz, widgets
        try:
            kv_groups.kv_cache_groups({"model.layers.0.self_attn.attn": None})
        except ImportError as exc:
            print(exc)
    """)
    assert run.returncode == 0, run.stderr
    assert 'pip install "vllm==0.33.*"' in run.stdout and "make setup" in run.stdout


def test_v2_speculator_gives_a_split_laguna_drafter_one_groups_slots():
    """FIDELITY §10.2, the candidate V2 defect, with V2's own set_attn/_precompute_context_kv on the
    CPU (scripts/vllm_defects/repro_v2_laguna_split_groups.py). Fails once vLLM fixes it."""
    import json as _json
    from pathlib import Path

    script = Path(__file__).parents[1] / "scripts" / "vllm_defects" / "repro_v2_laguna_split_groups.py"
    run = subprocess.run([sys.executable, str(script), "--json"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert run.returncode == 1, run.stderr[-2000:]
    result = _json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(set(result["drafter_layer_groups"])) == [1, 2]  # the drafter is split
    assert result["slots_with_layer_names"] == result["slots_needed_per_layer"]  # Qwen3's way works
    assert not result["DFlashLagunaForCausalLM_defines_get_draft_kv_cache_layer_names"]
    assert len({tuple(r) for r in result["slots_laguna"]}) == 1  # one group's slots for every layer
    assert result["laguna_layers_with_wrong_slots"] == ["model.layers.7.self_attn.attn", "model.layers.9.self_attn.attn"]


# ---------------------------------------------------------------------------
# Chapter 4's shipped pair and its split case: presets read from checkpoints/
# ---------------------------------------------------------------------------


def test_the_shipped_pair_preset_is_the_checkpoints_pair_and_comes_first():
    from dflash_lab.runtime import drafter_path, target_path

    assert list(kv_presets.PRESETS)[:2] == ["shipped_pair", "shipped_target_4_layer_drafter"]
    specs = kv_presets.preset_specs("shipped_pair")
    expected = kv_specs.laguna_dflash_specs(kv_presets.load_config(target_path()), kv_presets.load_config(drafter_path()))
    assert specs == expected and list(specs) == list(expected)
    assert kv_presets.shipped_drafter_config() == kv_presets.load_config(drafter_path())


@pytest.mark.parametrize("depth", [1, 3, 4, 7])
def test_shipped_drafter_config_changes_only_the_depth(depth):
    shipped = kv_presets.shipped_drafter_config()
    deeper = kv_presets.shipped_drafter_config(depth)
    per_layer = {k for k, v in shipped.items() if isinstance(v, list) and len(v) == shipped["num_hidden_layers"]
                 and k.endswith(("layer_types", "_per_layer"))}
    assert "layer_types" in per_layer
    assert deeper["num_hidden_layers"] == depth and all(len(deeper[k]) == depth for k in per_layer)
    assert {k: v for k, v in deeper.items() if k not in per_layer | {"num_hidden_layers"}} == {
        k: v for k, v in shipped.items() if k not in per_layer | {"num_hidden_layers"}}
    target = kv_presets.load_config(kv_presets.target_path())
    specs = kv_specs.laguna_dflash_specs(target, deeper)
    assert sum(s.is_draft for s in specs.values()) == depth
    assert len({s.page_size_bytes for s in specs.values()}) == 1  # only the layer counts reach the grouping
    with pytest.raises(ValueError, match="num_layers"):
        kv_presets.shipped_drafter_config(0)


def test_on_the_shipped_target_a_3_layer_drafter_sits_in_one_group_and_a_4_layer_one_is_split():
    # 4 sliding + 2 full target layers. 3 drafter layers: full 5 < 1.5 x 4, group size 5, one group.
    # 4 drafter layers: full 6 >= 1.5 x 4, group size 4, the six full layers cut into 2 groups (strided).
    target = kv_presets.load_config(kv_presets.target_path())
    kinds = [kv_layout.spec_kind(s) for s in kv_specs.laguna_target_specs(target).values()]
    assert (kinds.count("sliding_window"), kinds.count("full_attention")) == (4, 2)
    three = kv_specs.laguna_dflash_specs(target, kv_presets.shipped_drafter_config(3))
    groups = kv.vllm_kv_cache_groups(three)
    assert [len(g.layer_names) for g in groups] == [4, 5] and kv.drafter_layers_per_group(three, groups) == [3]
    assert v1_refusal(three, groups) is None
    four = kv_presets.preset_specs("shipped_target_4_layer_drafter")
    assert sum(s.is_draft for s in four.values()) == kv_presets.PRESETS["shipped_target_4_layer_drafter"]["drafter_layers"] == 4
    groups = kv.vllm_kv_cache_groups(four)
    names = list(four)
    full = [n for n in names if kv_layout.spec_kind(four[n]) == "full_attention"]
    assert [g.layer_names for g in groups][1:] == [full[0::2], full[1::2]]
    assert kv.drafter_layers_per_group(four, groups) == [2, 2]
    assert v1_refusal(four, groups) == "All drafting layers should belong to the same kv cache group"
    off = kv.vllm_kv_cache_groups(four, hybrid_manager_disabled=True)
    assert len(off) == 1 and v1_refusal(four, off) is None


def test_vllm_notes_the_padding_of_the_split_case(caplog):
    with caplog.at_level(logging.WARNING, logger=kv_engine.VLLM_PLANNING_LOGGER):
        kv.vllm_kv_cache_groups(kv_presets.preset_specs("shipped_target_4_layer_drafter"))
    assert "Add 2 padding layers, may waste at most 33.33% KV cache memory" in caplog.text


def test_the_explorer_offers_the_split_case_and_its_way_out():
    c, layout_fig, _ = _explorer()
    assert ("the shipped target + a 4-layer drafter (the split case)", "shipped_target_4_layer_drafter") in [
        tuple(o) for o in c.preset.options]
    c.preset.value = "shipped_target_4_layer_drafter"
    assert _rows(layout_fig) == 3 and not c.hybrid_off.disabled
    c.hybrid_off.value = True
    assert _rows(layout_fig) == 1 and "hybrid manager disabled" in layout_fig.layout.title.text.replace("<br>", " ")


def test_only_the_worked_example_splits_its_drafter_over_groups():
    """Issue 31: the V2 split-group candidate defect (a Laguna drafter over two KV-cache groups gets the
    first group's context slots) needs a split drafter. vLLM 0.33's own grouping keeps the shipped pair's
    and Poolside's XS.2 / S-2.1 drafters in one group (their full-attention bucket is one group); of the
    chapter's DFlash models only the 4-layer worked example splits, and V1 refuses it."""
    split = {}
    for name, preset in kv_presets.PRESETS.items():
        if preset.get("method") != "dflash":
            continue
        specs = kv_presets.preset_specs(name)
        groups = kv.vllm_kv_cache_groups(specs)
        split[name] = len(kv.drafter_layers_per_group(specs, groups)) > 1
        assert (kv.v1_refusal(specs, groups) is not None) is split[name], name
    assert {"shipped_pair", "laguna_xs2_dflash", "laguna_s21_dflash"} <= {n for n, s in split.items() if not s}
    assert {n for n, s in split.items() if s} == {"shipped_target_4_layer_drafter"}


def test_the_engine_wrapper_asks_v1s_own_check_whether_the_drafter_is_in_one_group(tmp_path):
    """One answer to "is the drafter in one KV-cache group": the serve/offline wrappers turn the hybrid manager
    off exactly where vLLM V1's validate_same_kv_cache_group refuses the pair's groups."""
    import json

    from dflash_lab.runtime import DEFAULT_DRAFTER, DEFAULT_TARGET
    from dflash_lab.vllm_engine.kv_grouping import drafter_kv_groups, needs_hybrid_manager_disabled

    target = kv_presets.load_config(DEFAULT_TARGET)
    for depth, split in ((3, False), (4, True), (1, False)):
        drafter_dir = tmp_path / f"d{depth}"
        drafter_dir.mkdir()
        config = kv_presets.shipped_drafter_config(depth, path=DEFAULT_DRAFTER)
        (drafter_dir / "config.json").write_text(json.dumps(config))
        specs = kv_specs.laguna_dflash_specs(target, config)
        refused = kv.v1_refusal(specs, kv.vllm_kv_cache_groups(specs))
        assert needs_hybrid_manager_disabled(DEFAULT_TARGET, drafter_dir) is split is (refused is not None), depth
        per_group = drafter_kv_groups(DEFAULT_TARGET, drafter_dir)
        assert [len(g) for g in per_group] == kv.drafter_layers_per_group(specs, kv.vllm_kv_cache_groups(specs))
        assert sorted(n for g in per_group for n in g) == sorted(kv.draft_layer_names(specs))


def test_a_spec_dict_with_no_draft_layer_is_refused_by_v1_as_vllm_would():
    """V1's check asks for exactly one group among the draft layers: with none marked it refuses (vLLM's answer)."""
    specs = kv_specs.laguna_target_specs(kv_presets.load_config(kv_presets.target_path()))
    assert kv.drafter_layers_per_group(specs, kv.vllm_kv_cache_groups(specs)) == []
    assert kv.v1_refusal(specs, kv.vllm_kv_cache_groups(specs)) == "All drafting layers should belong to the same kv cache group"


def test_the_default_kv_page_is_vllms_default_block_size():
    from vllm.config import CacheConfig

    assert kv_specs.KV_BLOCK_SIZE == CacheConfig.DEFAULT_BLOCK_SIZE
    specs = kv_specs.laguna_dflash_specs()
    assert {s.block_size for s in specs.values()} == {CacheConfig.DEFAULT_BLOCK_SIZE}
