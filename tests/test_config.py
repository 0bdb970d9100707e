"""DFlashDrafterConfig enforces vLLM 0.33's Laguna DFlash rules with errors that name the key."""

from __future__ import annotations

import json

import pytest

from dflash_lab.config import ConfigError, DFlashDrafterConfig
from dflash_lab.target import tiny_laguna_config


def target_dict(**overrides) -> dict:
    """A target that the small drafter config (tests/conftest.py) can serve."""
    return {"vocab_size": 128, "num_hidden_layers": 6, "hidden_size": 64, **overrides}


# --- the valid config ---------------------------------------------------------


def test_small_config_reads_and_round_trips(drafter_config_dict):
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict())
    assert (cfg.num_hidden_layers, cfg.target_layer_ids, cfg.mask_token_id, cfg.block_size) == (2, [1, 3], 5, 4)
    assert cfg.rotary_dim == 8  # full attention: Laguna rotates half of each head
    assert DFlashDrafterConfig.from_dict(cfg.to_dict()) == cfg


def test_to_dict_is_what_vllm_reads(drafter_config_dict):
    d = DFlashDrafterConfig.from_dict(drafter_config_dict()).to_dict()
    assert d["architectures"] == ["DFlashLagunaForCausalLM"]
    assert d["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": 5, "block_size": 4}
    assert d["eagle_aux_hidden_state_layer_ids"] == [2, 4]
    assert d["draft_vocab_size"] == d["vocab_size"] == 128
    assert d["mlp_layer_types"] == ["dense", "dense"]


# --- vLLM's rules, one test each ---------------------------------------------------


def test_missing_layer_types_is_rejected(drafter_config_dict):
    d = drafter_config_dict()
    del d["layer_types"]
    with pytest.raises(ValueError, match="`layer_types` is missing"):
        DFlashDrafterConfig.from_dict(d)


def test_layer_types_length_must_match_num_hidden_layers(drafter_config_dict):
    d = drafter_config_dict(num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"`layer_types` has length 2.*num_hidden_layers 3"):
        DFlashDrafterConfig.from_dict(d)


def test_mixed_layer_types_are_rejected(drafter_config_dict):
    d = drafter_config_dict(layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(NotImplementedError) as e:
        DFlashDrafterConfig.from_dict(d)
    msg = str(e.value)
    assert "`layer_types`" in msg and "full_attention" in msg and "sliding_attention" in msg


def test_empty_target_layer_ids_is_rejected(drafter_config_dict):
    d = drafter_config_dict(dflash_config={"target_layer_ids": [], "mask_token_id": 5})
    with pytest.raises(ValueError, match=r"`dflash_config\.target_layer_ids` is empty"):
        DFlashDrafterConfig.from_dict(d)


def test_missing_draft_vocab_size_is_rejected(drafter_config_dict):
    d = drafter_config_dict()
    del d["draft_vocab_size"]
    with pytest.raises(ValueError, match="`draft_vocab_size` is missing"):
        DFlashDrafterConfig.from_dict(d)


def test_mask_token_outside_draft_vocab_is_rejected(drafter_config_dict):
    d = drafter_config_dict(dflash_config={"target_layer_ids": [1], "mask_token_id": 128})
    with pytest.raises(ValueError, match=r"`dflash_config\.mask_token_id` \(128\) is outside the vocabulary"):
        DFlashDrafterConfig.from_dict(d)


def test_sliding_drafter_needs_a_window(drafter_config_dict):
    d = drafter_config_dict(layer_types=["sliding_attention"] * 2)
    del d["sliding_window"]
    with pytest.raises(ValueError, match="`sliding_window` is missing"):
        DFlashDrafterConfig.from_dict(d)


@pytest.mark.parametrize("key,value,exc", [
    ("num_key_value_heads", 3, ValueError),  # 4 heads are not divisible into 3 groups
    ("gating", "per-channel", ValueError),
    ("hidden_act", "gelu", ValueError),
    ("hidden_size", "64", TypeError),
])
def test_bad_values_name_their_key(drafter_config_dict, key, value, exc):
    with pytest.raises(exc, match=f"`{key}`|{key}"):
        DFlashDrafterConfig.from_dict(drafter_config_dict(**{key: value}))


def test_errors_name_the_file(tmp_path, drafter_config_dict):
    d = drafter_config_dict()
    del d["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"{tmp_path / 'config.json'}.*`layer_types`"):
        DFlashDrafterConfig.from_pretrained(tmp_path)


def test_invalid_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,,}')
    with pytest.raises(ConfigError) as e:
        DFlashDrafterConfig.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and "not valid JSON" in str(e.value)


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "config.json")):
        DFlashDrafterConfig.from_pretrained(tmp_path)


# --- pairing with a target ------------------------------------------------------


def test_matching_target_is_accepted(drafter_config_dict):
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict())
    cfg.validate_against_target(target_dict())
    cfg.validate_against_target(tiny_laguna_config(vocab_size=128, hidden_size=64))  # a LagunaConfig works too


def test_vocab_mismatch_is_rejected(drafter_config_dict):
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict())
    with pytest.raises(ValueError, match=r"`draft_vocab_size` 128 != target vocab_size 4096"):
        cfg.validate_against_target(tiny_laguna_config(vocab_size=4096, hidden_size=64))


def test_target_layer_id_out_of_range_is_rejected(drafter_config_dict):
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict(dflash_config={"target_layer_ids": [1, 6], "mask_token_id": 5}))
    with pytest.raises(ValueError, match=r"`dflash_config\.target_layer_ids` \[6\] do not exist.*6 layers"):
        cfg.validate_against_target(target_dict())


def test_mask_token_outside_target_vocab_is_rejected(drafter_config_dict):
    # from_dict already keeps mask_token_id < draft_vocab_size; a config built or
    # edited in code is still checked against the target.
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict())
    cfg.mask_token_id = 128
    with pytest.raises(ValueError, match=r"`dflash_config\.mask_token_id` 128 is outside the target vocabulary"):
        cfg.validate_against_target(target_dict())


def test_target_hidden_size_must_fit_fc(drafter_config_dict):
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict())
    with pytest.raises(ValueError, match=r"`fc` expects target hidden size 64.*hidden_size is 96"):
        cfg.validate_against_target(target_dict(hidden_size=96))


def test_target_layer_count_must_match_target_depth(drafter_config_dict):
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict())
    with pytest.raises(ValueError, match=r"`target_layer_count` 6 != target num_hidden_layers 8"):
        cfg.validate_against_target(target_dict(num_hidden_layers=8))


def test_incomplete_target_config_is_rejected(drafter_config_dict):
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict())
    with pytest.raises(ValueError, match="vocab_size, num_hidden_layers and hidden_size"):
        cfg.validate_against_target({"vocab_size": 128})


# --- as vLLM resolves them: causality, layer ids, windows, RoPE (FIDELITY §1, §3, §5) ----------


@pytest.mark.parametrize("layer_type,is_causal,dflash_causal,expected", [
    # vLLM's _dflash_layer_causal, first match wins (ported from vLLM's test_dflash_causality.py)
    ("full_attention", None, None, False),
    ("sliding_attention", None, None, True),
    ("full_attention", True, None, True),
    ("sliding_attention", False, None, False),
    ("full_attention", None, True, True),
    ("sliding_attention", None, False, False),
    ("sliding_attention", False, False, False),
])
def test_causality_follows_vllms_rule(drafter_config_dict, layer_type, is_causal, dflash_causal, expected):
    d = drafter_config_dict(layer_types=[layer_type] * 2)
    if is_causal is not None:
        d["is_causal"] = is_causal
    if dflash_causal is not None:
        d["dflash_config"]["causal"] = dflash_causal
    cfg = DFlashDrafterConfig.from_dict(d)
    assert cfg.is_causal is expected
    again = DFlashDrafterConfig.from_dict(cfg.to_dict())  # what the lab writes reads back the same
    assert again.is_causal is expected and again == cfg


@pytest.mark.parametrize("key,value", [("is_causal", "yes"), ("is_causal", 1), ("dflash_config.causal", "true")])
def test_causal_must_be_a_bool(drafter_config_dict, key, value):
    d = drafter_config_dict()
    if key == "is_causal":
        d["is_causal"] = value
    else:
        d["dflash_config"]["causal"] = value
    with pytest.raises(TypeError, match=f"`{key}` must be true or false"):
        DFlashDrafterConfig.from_dict(d, source="cfg.json")


def test_disagreeing_causal_keys_are_rejected_naming_both(drafter_config_dict):
    d = drafter_config_dict(is_causal=True)
    d["dflash_config"]["causal"] = False
    with pytest.raises(ConfigError, match=r"`is_causal` \(True\) disagrees with `dflash_config.causal` \(False\)"):
        DFlashDrafterConfig.from_dict(d)


def test_aux_layer_ids_alone_are_refused_as_vllms_drafter_refuses_them(drafter_config_dict):
    # vLLM's get_config reads such a file, but DFlashLagunaModel indexes
    # dflash_config["target_layer_ids"] (laguna_dflash.py:78) and fails: the lab says so up front.
    d = drafter_config_dict(eagle_aux_hidden_state_layer_ids=[2, 4])
    del d["dflash_config"]["target_layer_ids"]
    with pytest.raises(ConfigError, match=r"`dflash_config.target_layer_ids` is missing: vLLM's DFlashLagunaModel"):
        DFlashDrafterConfig.from_dict(d)


def test_eagle_aux_layer_ids_mean_target_ids_plus_one_and_both_are_written(drafter_config_dict):
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict(eagle_aux_hidden_state_layer_ids=[4, 2]))
    assert cfg.target_layer_ids == [1, 3] and cfg.aux_hidden_state_layer_ids == [2, 4]
    written = cfg.to_dict()  # both keys, consistent
    assert written["eagle_aux_hidden_state_layer_ids"] == [2, 4]
    assert written["dflash_config"]["target_layer_ids"] == [1, 3]


def test_an_empty_aux_list_counts_as_absent(drafter_config_dict):
    # eagle3_utils.py:120: `if not layer_ids` falls back to dflash_config.target_layer_ids + 1.
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict(eagle_aux_hidden_state_layer_ids=[]))
    assert cfg.target_layer_ids == [1, 3] and cfg.aux_hidden_state_layer_ids == [2, 4]


def test_aux_id_zero_is_refused_saying_that_vllm_takes_it(drafter_config_dict):
    d = drafter_config_dict(eagle_aux_hidden_state_layer_ids=[0, 2])
    d["dflash_config"]["target_layer_ids"] = [0, 1]
    with pytest.raises(ConfigError, match=r"`eagle_aux_hidden_state_layer_ids` \[0, 2\] holds id 0, the embedding "
                                          r"output: vLLM 0.33 captures it"):
        DFlashDrafterConfig.from_dict(d)


@pytest.mark.parametrize("ids,message", [([], "is empty"), (None, "is missing"), ("1,3", "must be a list of integers")])
def test_target_layer_ids_must_be_a_non_empty_list(drafter_config_dict, ids, message):
    d = drafter_config_dict()
    d["dflash_config"]["target_layer_ids"] = ids
    with pytest.raises((ValueError, TypeError), match=f"`dflash_config.target_layer_ids` {message}"):
        DFlashDrafterConfig.from_dict(d)


def test_disagreeing_layer_id_keys_are_rejected_naming_both(drafter_config_dict):
    d = drafter_config_dict(eagle_aux_hidden_state_layer_ids=[2, 5])  # target_layer_ids [1, 3] -> expects [2, 4]
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids.*disagrees with `dflash_config.target_layer_ids`"):
        DFlashDrafterConfig.from_dict(d, source="x/config.json")


def test_unsorted_target_layer_ids_are_used_in_layer_order(drafter_config_dict):
    d = drafter_config_dict()
    d["dflash_config"]["target_layer_ids"] = [4, 0, 2]
    # vLLM's target collects aux hidden states while it runs its layers: ascending order.
    assert DFlashDrafterConfig.from_dict(d).target_layer_ids == [0, 2, 4]


@pytest.mark.parametrize("value,exc,message", [
    (None, TypeError, "`sliding_window` is null, which vLLM cannot read"),
    (8.5, TypeError, "`sliding_window` must be an integer"),
    ("8", TypeError, "`sliding_window` must be an integer"),
    (0, ConfigError, "`sliding_window` must be >= 1"),
])
def test_bad_sliding_window_is_rejected(drafter_config_dict, value, exc, message):
    with pytest.raises(exc, match=message):
        DFlashDrafterConfig.from_dict(drafter_config_dict(sliding_window=value))


def test_no_null_is_ever_written(drafter_config_dict):
    d = drafter_config_dict()
    del d["sliding_window"], d["target_layer_count"]
    written = DFlashDrafterConfig.from_dict(d).to_dict()
    assert None not in written.values() and None not in written["dflash_config"].values()
    assert "sliding_window" not in written


def test_flat_rope_theta_is_read_as_transformers_reads_it():
    from dflash_lab.config import rope_resolution_table
    from dflash_lab.presets import drafter_preset

    d, _ = drafter_preset("laguna-s-2.1-dflash")
    cfg = DFlashDrafterConfig.from_dict(d)
    # The file says 500000; LagunaConfig leaves a flat rope_theta out of rope_parameters, whose
    # defaults then stand: sliding layers run theta 10000.
    assert cfg.rope["rope_theta"] == 10000.0
    sliding = next(r for r in rope_resolution_table(d) if r["layer_type"] == "sliding_attention")
    assert sliding == {"layer_type": "sliding_attention", "rope_theta_in_file": 500000.0, "rope_theta_served": 10000.0,
                       "partial_rotary_in_file": None, "partial_rotary_factor": 1.0,
                       "rope_from": "rope_parameters.sliding_attention (LagunaConfig's default)",
                       "partial_rotary_from": "rope_parameters.sliding_attention (LagunaConfig's default)",
                       "differs": True}


def test_a_flat_rope_theta_reaches_no_layer_type(drafter_config_dict):
    d = drafter_config_dict(rope_theta=250000.0)  # no rope_parameters: the Laguna defaults stand
    assert DFlashDrafterConfig.from_dict(d).rope == {"rope_type": "default", "rope_theta": 500000.0,
                                                     "partial_rotary_factor": 0.5}


def sliding_dict(drafter_config_dict, **extra):
    return drafter_config_dict(layer_types=["sliding_attention"] * 2, **extra)


def test_swa_rope_parameters_set_the_sliding_layers_rope(drafter_config_dict):
    cfg = DFlashDrafterConfig.from_dict(sliding_dict(drafter_config_dict, swa_rope_parameters={"rope_theta": 250000.0}))
    assert cfg.rope == {"rope_type": "default", "rope_theta": 250000.0, "partial_rotary_factor": 1.0}
    full = DFlashDrafterConfig.from_dict(drafter_config_dict(swa_rope_parameters={"rope_theta": 250000.0}))
    assert full.rope["rope_theta"] == 500000.0  # full_attention layers never read it
    again = DFlashDrafterConfig.from_dict(cfg.to_dict())  # written as that layer type's rope_parameters entry
    assert again == cfg and "swa_rope_parameters" not in cfg.to_dict()


def test_a_sliding_layer_without_its_own_entry_takes_the_full_attention_entry(drafter_config_dict):
    d = sliding_dict(drafter_config_dict, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 123456.0}})
    assert DFlashDrafterConfig.from_dict(d).rope["rope_theta"] == 123456.0  # laguna.py:370-371


def test_top_level_partial_rotary_factor_fills_an_entry_without_one(drafter_config_dict):
    entry = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict(rope_parameters=entry, partial_rotary_factor=0.5))
    assert cfg.rope["partial_rotary_factor"] == 0.5 and cfg.rotary_dim == 8
    entry["full_attention"]["partial_rotary_factor"] = 1.0  # the entry's own value wins
    cfg = DFlashDrafterConfig.from_dict(drafter_config_dict(rope_parameters=entry, partial_rotary_factor=0.5))
    assert cfg.rotary_dim == 16


def test_rope_dim_overrides_the_factor(drafter_config_dict):
    entry = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "rope_dim": 4, "partial_rotary_factor": 1.0}}
    assert DFlashDrafterConfig.from_dict(drafter_config_dict(rope_parameters=entry)).rotary_dim == 4


@pytest.mark.parametrize("key,value,exc,message", [
    ("swa_rope_parameters", 250000.0, TypeError, "`swa_rope_parameters` must be an object"),
    ("partial_rotary_factor", 1.5, ConfigError, "`partial_rotary_factor` must be in \\(0, 1\\]"),
    ("partial_rotary_factor", "half", ConfigError, "`partial_rotary_factor` must be in"),
    ("swa_attention_sink_enabled", "yes", TypeError, "`swa_attention_sink_enabled` must be true or false"),
])
def test_bad_rope_and_sink_keys_are_refused_by_name(drafter_config_dict, key, value, exc, message):
    with pytest.raises(exc, match=message):
        DFlashDrafterConfig.from_dict(sliding_dict(drafter_config_dict, **{key: value}))


def test_attention_sinks_on_sliding_layers_are_refused_naming_the_key(drafter_config_dict):
    with pytest.raises(NotImplementedError, match=r"`swa_attention_sink_enabled` is true: vLLM 0.33 then adds a "
                                                  r"learned attention sink per head to every sliding layer"):
        DFlashDrafterConfig.from_dict(sliding_dict(drafter_config_dict, swa_attention_sink_enabled=True))
    # vLLM gives sinks to sliding layers only (laguna.py:485-488): a full-attention drafter is unaffected.
    DFlashDrafterConfig.from_dict(drafter_config_dict(swa_attention_sink_enabled=True))
    DFlashDrafterConfig.from_dict(sliding_dict(drafter_config_dict, swa_attention_sink_enabled=False))


def test_the_key_table_names_every_key_and_what_each_side_does(drafter_config_dict):
    from dflash_lab.config import config_key_table

    d = sliding_dict(drafter_config_dict, swa_rope_parameters={"rope_theta": 250000.0}, partial_rotary_factor=0.5)
    rows = {r["key"]: r for r in config_key_table(d)}
    assert list(rows) == ["swa_rope_parameters", "partial_rotary_factor", "swa_attention_sink_enabled",
                          "eagle_aux_hidden_state_layer_ids", "dflash_config.target_layer_ids"]
    assert rows["swa_rope_parameters"]["lab"] == "the same: sliding_attention runs theta 250000 from swa_rope_parameters"
    assert rows["partial_rotary_factor"]["lab"] == "the same: 0.5 from partial_rotary_factor (top level)"
    assert rows["swa_attention_sink_enabled"]["in_file"] == "absent"
    assert rows["dflash_config.target_layer_ids"]["in_file"] == [1, 3]


@pytest.mark.parametrize("name", ["laguna-s-2.1-dflash", "laguna-xs-2.1-dflash (shape)"])
def test_real_poolside_configs_load_and_pair_with_their_targets(name):
    from dflash_lab.presets import drafter_preset

    d, target = drafter_preset(name)
    cfg = DFlashDrafterConfig.from_dict(d, source=name)
    cfg.validate_against_target(target)
    assert cfg.is_sliding and cfg.is_causal and cfg.window == 512 and cfg.gate_per_head
    assert cfg.target_layer_count == target["num_hidden_layers"]  # from dflash_config.num_target_layers
    assert cfg.aux_hidden_state_layer_ids == d["eagle_aux_hidden_state_layer_ids"]
