"""vLLM's own DFlash tests, ported to the lab (issue 12 item 7, FIDELITY §8).

Each test names, in its docstring, the vLLM test (repository vllm-project/vllm) whose
behaviour it asserts of the lab. The tests are the lab's own: vLLM's use GPU kernels,
fake proposers or speculators checkpoints; these check the same rule on the lab's code,
on the CPU. vLLM cases with no counterpart in the lab are listed at the end of the file.
"""

from __future__ import annotations

import pytest
import torch

from dflash_lab.kv_cache import groups as kv_groups, specs as kv_specs
from dflash_lab.config import ConfigError, DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter, dflash_attention_mask
from dflash_lab.spec_decode.metrics import prometheus_text, stats_from_prometheus_text
from dflash_lab.spec_decode import SpecDecodeStats, loop, speculative_generate
from dflash_lab.target import build_target, tiny_laguna_config


def drafter_config(layer_type="full_attention", *, layers=2, **top_level) -> DFlashDrafterConfig:
    """A small drafter config; ``top_level`` keys (is_causal, dflash_config, ...) override."""
    d = {
        "hidden_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "layer_types": [layer_type] * layers, "draft_vocab_size": 128,
        "dflash_config": {"target_layer_ids": [1, 3], "mask_token_id": 5, "block_size": 4},
        "target_layer_count": 6, "sliding_window": 8,
    }
    dflash = top_level.pop("dflash_config", {})
    d["dflash_config"] = {**d["dflash_config"], **dflash}
    d.update(top_level)
    return DFlashDrafterConfig.from_dict(d)


# ---------------------------------------------------------------------------
# tests/v1/spec_decode/test_dflash_causality.py
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("layer_type,overrides,causal", [
    # An explicit dflash_config.causal wins over the layer type, both ways.
    ("full_attention", {"dflash_config": {"causal": True}}, True),
    ("sliding_attention", {"dflash_config": {"causal": False}}, False),
    # DFlash2-style top-level is_causal wins too.
    ("sliding_attention", {"is_causal": False}, False),
    ("full_attention", {"is_causal": True}, True),
    # No override: causal exactly for sliding layers.
    ("sliding_attention", {}, True),
    ("full_attention", {}, False),
])
def test_causality_table(layer_type, overrides, causal):
    """Port of vllm-project/vllm tests/v1/spec_decode/test_dflash_causality.py::
    test_dflash_has_any_non_causal (and ::test_dflash_layer_causal_honors_top_level_override):
    the override / layer-type table of `_dflash_layer_causal`, on uniform Laguna drafters."""
    cfg = drafter_config(layer_type, **overrides)
    assert cfg.is_causal is causal
    # The config's answer is the mask the drafter uses: lower-triangular inside the block iff causal.
    positions = torch.arange(10, 14)[None]  # one block of 4 after 10 context positions
    mask = dflash_attention_mask(positions, torch.arange(10), 4, None, causal=cfg.is_causal)[0, :, 10:]  # (Q, Q)
    expected = torch.ones(4, 4, dtype=torch.bool)
    assert torch.equal(mask, expected.tril() if causal else expected)


def test_causality_is_per_layer_type_in_the_drafter_forward():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_dflash_causality.py::
    test_dflash_layer_causal_is_per_layer: a sliding layer is causal, a full-attention one
    is not. Checked on the drafter's output: block query i of a sliding drafter does not
    change when block tokens after i change; a full-attention drafter's does."""
    torch.manual_seed(0)
    ctx = torch.randn(6, 64)  # (N, H) context from the target
    block = torch.randn(1, 4, 64)  # (1, B, H) noise embeddings
    changed = block.clone()
    changed[0, 2:] = torch.randn(2, 64)  # only the last two block tokens differ
    positions = torch.arange(6, 10)[None]
    for layer_type, query0_moves in (("sliding_attention", False), ("full_attention", True)):
        drafter = DFlashLagunaDrafter(drafter_config(layer_type)).eval()
        with torch.no_grad():
            k, v = drafter.precompute_context_kv(ctx, torch.arange(6))
            a = drafter(block, positions, k, v, torch.arange(6))
            b = drafter(changed, positions, k, v, torch.arange(6))
        assert torch.allclose(a[0, :2], b[0, :2], atol=1e-6) is not query0_moves, layer_type


def test_fc_input_is_one_target_hidden_per_layer_id():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_dflash_causality.py::
    test_dflash_fc_uses_aux_layer_count: the fc reads len(target_layer_ids) x target hidden."""
    cfg = drafter_config(dflash_config={"target_layer_ids": [0, 2, 4]})
    drafter = DFlashLagunaDrafter(cfg)
    assert drafter.fc.in_features == 3 * cfg.target_hidden_size


def test_target_layer_ids_map_to_the_hidden_state_after_each_layer():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_dflash_causality.py::
    test_dflash_target_layers_map_to_post_layer_boundaries: dflash_config.target_layer_ids
    [0, 16, 31] are vLLM's aux layers (1, 17, 32), the hidden state entering layer t+1."""
    cfg = drafter_config(dflash_config={"target_layer_ids": [0, 16, 31]}, target_layer_count=40)
    assert cfg.target_layer_ids == [0, 16, 31]
    assert cfg.aux_hidden_state_layer_ids == [1, 17, 32]


def test_aux_layer_ids_and_target_layer_ids_name_the_same_layers():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_dflash_swa.py::
    test_dflash_compile_hash_uses_checkpoint_layer_id_semantics: target_layer_ids [0, 2]
    and eagle_aux_hidden_state_layer_ids [1, 3] are one drafter; [0, 3] is another."""
    by_ids = drafter_config(dflash_config={"target_layer_ids": [0, 2]})
    # (vLLM's DFlashLagunaModel needs target_layer_ids beside the aux ids, laguna_dflash.py:78.)
    by_aux = drafter_config(dflash_config={"target_layer_ids": [2, 0]}, eagle_aux_hidden_state_layer_ids=[3, 1])
    other = drafter_config(dflash_config={"target_layer_ids": [0, 3]})
    assert by_ids.target_layer_ids == by_aux.target_layer_ids == [0, 2]
    assert by_ids.aux_hidden_state_layer_ids == by_aux.aux_hidden_state_layer_ids == [1, 3]
    assert other.target_layer_ids != by_ids.target_layer_ids
    # Both keys present but naming different layers: the lab refuses, naming both keys.
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids.*target_layer_ids"):
        drafter_config(dflash_config={"target_layer_ids": [0, 2]}, eagle_aux_hidden_state_layer_ids=[1, 4])


# ---------------------------------------------------------------------------
# tests/v1/spec_decode/test_dflash_swa.py
# ---------------------------------------------------------------------------

def test_sliding_drafter_layers_are_causal_but_cache_full_attention():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_dflash_swa.py::
    test_dflash_swa_layers_use_full_kv_cache_spec and ::test_dflash_swa_layers_use_causal_metadata:
    a sliding drafter layer attends causally, and its KV spec is full attention with the
    geometry the sliding spec would have had. (The spec alone from a plain dict is also
    pinned by tests/test_kv_groups.py::test_dflash_drafter_cache_is_full_attention_even_when_its_layers_slide.)"""
    from vllm.v1.kv_cache_interface import FullAttentionSpec  # lazy: vLLM is heavy

    cfg = drafter_config("sliding_attention")
    assert cfg.is_causal and cfg.window == 8
    specs = kv_specs.dflash_drafter_specs(cfg, target_layer_count=6, kv_block_size=16)
    assert list(specs) == DFlashLagunaDrafter(cfg).attention_layer_names()
    for spec in specs.values():
        assert type(spec) is FullAttentionSpec and spec.sliding_window is None
        assert (spec.block_size, spec.num_kv_heads, spec.head_size) == (16, 2, 16)
    # In vLLM's grouping the sliding drafter's layers share a group with the target's
    # full-attention layers, never with its sliding ones.
    all_specs = kv_specs.laguna_dflash_specs(drafter_sliding=True)
    draft_layers = {n for n, s in all_specs.items() if s.is_draft}
    groups = kv_groups.kv_cache_groups(all_specs, method="dflash", model_type="laguna")
    holding = [set(g.layer_names) for g in groups if draft_layers & set(g.layer_names)]
    assert holding and all(type(all_specs[n]) is FullAttentionSpec for names in holding for n in names)


# ---------------------------------------------------------------------------
# tests/v1/spec_decode/test_metrics.py
# ---------------------------------------------------------------------------

def test_new_stats_are_zero_and_independent():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_metrics.py::
    test_new_initializes_zeroed_counters and ::test_new_creates_independent_per_pos_lists."""
    a, b = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 3), SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 3)
    assert (a.num_drafts, a.num_draft_tokens, a.num_accepted_tokens) == (0, 0, 0)
    a.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    assert b.num_accepted_tokens_per_pos == [0, 0, 0] and b.num_drafts == 0


def test_observe_draft_records_one_draft():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_metrics.py::
    test_observe_draft_records_single_draft: accepted tokens fill the first positions."""
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 4)
    stats.observe_draft(num_draft_tokens=4, num_accepted_tokens=2)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 4, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0, 0]


def test_observe_draft_accumulates_over_drafts():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_metrics.py::
    test_observe_draft_accumulates_across_drafts and ::test_observe_draft_accepts_all_spec_tokens."""
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 3)
    for drafted, accepted in ((3, 3), (3, 1), (2, 0)):
        stats.observe_draft(num_draft_tokens=drafted, num_accepted_tokens=accepted)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1]
    everything = SpecDecodeStats()
    everything.observe_draft(num_draft_tokens=2, num_accepted_tokens=2)
    assert everything.num_accepted_tokens_per_pos == [1, 1]


def test_observe_draft_rejects_more_accepted_than_drafted():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_metrics.py::
    test_observe_draft_rejects_more_accepted_than_spec_tokens (vLLM asserts; the lab raises)."""
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        SpecDecodeStats().observe_draft(num_draft_tokens=2, num_accepted_tokens=3)


def test_mean_acceptance_length_includes_the_bonus_token():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_metrics.py::
    test_logging_includes_bonus_token_in_mean_acceptance_length: tau = 1 + accepted / drafts."""
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 3)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=3)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=0)
    assert stats.mean_acceptance_length == pytest.approx(1 + 3 / 2)
    assert stats.acceptance_lengths == [4, 1]


def test_prometheus_counters_after_one_draft():
    """Port of vllm-project/vllm tests/v1/spec_decode/test_metrics.py::
    test_prom_observe_increments_counters: vLLM's counter names and per-position labels,
    written by the lab and read back."""
    from prometheus_client.parser import text_string_to_metric_families

    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 3)
    stats.observe_draft(num_draft_tokens=3, num_accepted_tokens=2)
    text = prometheus_text(stats, model_name="laguna", engine="0")
    values = {(s.name, s.labels.get("position")): s.value
              for family in text_string_to_metric_families(text) for s in family.samples
              if s.name.endswith("_total") and s.labels.get("engine") == "0"}
    assert values[("vllm:spec_decode_num_drafts_total", None)] == 1
    assert values[("vllm:spec_decode_num_draft_tokens_total", None)] == 3
    assert values[("vllm:spec_decode_num_accepted_tokens_total", None)] == 2
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [values[(per_pos, str(i))] for i in range(3)] == [1, 1, 0]
    back = stats_from_prometheus_text(text)
    assert (back.num_drafts, back.num_draft_tokens, back.num_accepted_tokens) == (1, 3, 2)
    assert back.num_accepted_tokens_per_pos == [1, 1, 0]


# ---------------------------------------------------------------------------
# tests/v1/spec_decode/test_dflash_prepare_inputs.py
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_pair():
    """A tiny hybrid Laguna target and an untrained drafter: drafts are mostly rejected."""
    cfg = tiny_laguna_config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8, mlp_layer_types=["dense"] + ["sparse"] * 3, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, max_position_embeddings=128,
    )
    target = build_target(cfg, seed=0).float().eval()
    drafter_cfg = DFlashDrafterConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, layer_types=["full_attention"] * 2, draft_vocab_size=256,
        target_layer_ids=[0, 3], mask_token_id=3, block_size=4, target_layer_count=4,
    )
    torch.manual_seed(1)
    return target, DFlashLagunaDrafter(drafter_cfg).eval()


def test_block_query_is_bonus_then_masks_after_the_accepted_context(small_pair, monkeypatch):
    """Port of vllm-project/vllm tests/v1/spec_decode/test_dflash_prepare_inputs.py::
    test_prepare_dflash_inputs_excludes_rejected_context_suffix: each block's query ids are
    [last sampled (bonus) token, mask, mask, ...] at positions last_accepted+1 ..., and the
    drafter's context holds exactly the accepted positions, never the rejected suffix."""
    target, drafter = small_pair
    seen = []  # per draft: (query ids, query positions, context positions)
    embed = target.get_input_embeddings()
    original_forward = type(drafter).forward

    def record_forward(self, noise_embeds, positions, context_k, context_v, context_positions, **kw):
        # Recover the query ids from the embeddings the drafter was given (rows of the target's table).
        ids = torch.cdist(noise_embeds[0], embed.weight).argmin(-1)
        seen.append((ids.tolist(), positions[0].tolist(), context_positions.tolist()))
        return original_forward(self, noise_embeds, positions, context_k, context_v, context_positions, **kw)

    monkeypatch.setattr(type(drafter), "forward", record_forward)
    prompt = torch.tensor([[7, 9, 11, 13, 15, 17]])
    result = speculative_generate(target, drafter, prompt, max_new_tokens=16, block_size=4)

    tokens, mask = result.output_ids[0].tolist(), drafter.config.mask_token_id
    drafting = [s for s in result.steps if s.draft_ids]
    assert len(seen) == len(drafting) > 1
    assert any(s.num_accepted < len(s.draft_ids) for s in drafting), "want at least one rejection"
    for (ids, positions, context), step in zip(seen, drafting):
        t = step.position - 1  # position of the bonus token; positions < t are accepted
        assert ids == [tokens[t]] + [mask] * 3
        assert positions == [t, t + 1, t + 2, t + 3]
        assert context == list(range(t))  # the accepted prefix, nothing the target rejected
    # And the next block starts right after what the previous one accepted.
    for prev, nxt in zip(drafting, drafting[1:]):
        assert nxt.position == prev.position + prev.num_accepted + 1


def test_final_context_is_what_a_prefill_of_the_accepted_tokens_gives(small_pair):
    """Port of vllm-project/vllm tests/v1/spec_decode/test_dflash_prepare_inputs.py::
    test_prepare_dflash_inputs_excludes_rejected_context_suffix (its K/V side): the
    rejected positions never contaminate the drafter's context K/V, so after a run with
    rejections it equals the context of one prefill over the accepted tokens."""
    target, drafter = small_pair
    prompt = torch.tensor([[21, 22, 23, 24, 25]])
    result = speculative_generate(target, drafter, prompt, max_new_tokens=16, block_size=4)
    assert any(s.num_accepted < len(s.draft_ids) for s in result.steps if s.draft_ids)
    ctx = result.context
    out = result.output_ids
    with torch.no_grad():
        _, aux = loop.verify_forward(target, out[:, :ctx.length], loop.new_target_cache(), 0,
                                     list(drafter.config.target_layer_ids))
        k, v = drafter.precompute_context_kv(drafter.combine_hidden_states(aux), torch.arange(ctx.length))
    got_k, got_v = ctx.kv()
    assert torch.allclose(got_k, k, atol=1e-4) and torch.allclose(got_v, v, atol=1e-4)


# ---------------------------------------------------------------------------
# tests/v1/core/test_kv_cache_utils.py (#55390 draft-group cases)
# ---------------------------------------------------------------------------
# Already pinned in tests/test_kv_groups.py, not repeated here: the DSpark/DeepSeek-V4
# trailing-layer rule (test_deepseek_v4_flags_exactly_the_group_holding_its_last_layer),
# the MTP cases (test_qwen3_5_mtp_flags_only_the_group_holding_the_mtp_layer), the
# exact-partition gate (test_trailing_layer_rule_needs_an_exact_partition) and the DFlash
# marker rule (test_dflash_drafter_group_is_found_by_its_marker).

@pytest.mark.parametrize("method", [None, "ngram"])
def test_no_draft_group_without_an_eagle_family_drafter(method):
    """Port of vllm-project/vllm tests/v1/core/test_kv_cache_utils.py (#55390)::
    test_no_eagle_flag_without_speculation: without an EAGLE-family drafter no group is
    flagged, even where layers carry the draft marker."""
    specs = kv_specs.laguna_dflash_specs()
    groups = kv_groups.kv_cache_groups(specs, method=method, model_type="laguna")
    assert groups and not any(g.is_eagle_group for g in groups)


# ---------------------------------------------------------------------------
# tests/v1/e2e/spec_decode/test_laguna_dflash.py
# ---------------------------------------------------------------------------
# test_laguna_dflash_hf_pair_smoke (a real pair generates and 1 + accepted/drafts > 1) is
# covered, more strictly, by tests/test_shipped_pair.py::
# test_greedy_dflash_on_heldout_prompts_accepts_long_drafts (tau >= 2.5 on the shipped pair).

# ---------------------------------------------------------------------------
# Not ported (no counterpart in the lab):
# - test_dflash_causality.py::test_speculators_swa_causality_is_per_layer,
#   test_dflash_swa.py::test_dflash_speculators_preserves_swa_config: the lab does not read
#   speculators-format checkpoints.
# - test_dflash_causality.py: mixed layer_types and the no-layer_types fallback: Laguna
#   drafter configs must list one uniform layer type (DFlashDrafterConfig refuses others).
# - test_dflash_causality.py::test_eagle_aux_layers_preserves_legacy_layer_ids: legacy
#   `layer_ids` keys are not read.
# - test_dflash_swa.py backend / per-KV-group slot-mapping tests, test_dflash_prepare_inputs.py
#   DCP, null-block, slot-compaction and padding-mask tests: paged-attention plumbing the lab's
#   single-sequence loop does not have.
# - test_metrics.py logging/diffusion/disabled-prom tests: vLLM's logger and diffusion mode.
