"""Drafter checkpoints: vLLM 0.33's DFlashLagunaForCausalLM layout, checked loading, atomic saving."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_lab.checkpoint import CheckpointError, load_drafter, save_drafter
from dflash_lab.config import ConfigError


def vllm_names(layers: int, n_aux: int, *, gating: bool = True) -> set[str]:
    """The tensor names vLLM's DFlashLagunaForCausalLM.load_weights expects (it adds `model.`)."""
    per_layer = ["input_layernorm", "post_attention_layernorm", "self_attn.qkv_proj", "self_attn.o_proj",
                 "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    per_layer += ["self_attn.g_proj"] if gating else []
    names = {f"layers.{j}.{m}.weight" for j in range(layers) for m in per_layer}
    names |= {f"aux_hidden_norms.{i}.weight" for i in range(n_aux)}
    return names | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def tensor_names(ckpt) -> set[str]:
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return set(f.keys())


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


# --- round trip and layout ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer_type,gating", [("full_attention", True), ("sliding_attention", "per-element")])
def test_save_load_round_trip(tmp_path, make_drafter, dtype, layer_type, gating):
    drafter = make_drafter(3, layer_type, gating, dtype=dtype)
    save_drafter(drafter, tmp_path / "ckpt")
    loaded = load_drafter(tmp_path / "ckpt")
    assert loaded.config == drafter.config
    assert next(loaded.parameters()).dtype == dtype
    assert_same_weights(loaded, drafter)
    states, positions = torch.randn(5, 64).to(dtype), torch.arange(5)
    for a, b in zip(loaded.precompute_context_kv(states, positions), drafter.precompute_context_kv(states, positions)):
        assert torch.equal(a, b)


def test_save_can_cast(tmp_path, make_drafter):
    save_drafter(make_drafter(1), tmp_path / "ckpt", dtype=torch.bfloat16)
    assert next(load_drafter(tmp_path / "ckpt").parameters()).dtype == torch.bfloat16
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert next(load_drafter(tmp_path / "ckpt", dtype=torch.float32).parameters()).dtype == torch.float32


@pytest.mark.parametrize("gating", [True, False])
def test_tensor_names_are_vllms_layout(tmp_path, make_drafter, gating):
    save_drafter(make_drafter(2, gating=gating), tmp_path / "ckpt")
    names = tensor_names(tmp_path / "ckpt")
    assert names == vllm_names(2, 2, gating=gating)
    for expected in ["layers.0.self_attn.qkv_proj.weight", "aux_hidden_norms.0.weight", "fc.weight",
                     "hidden_norm.weight", "norm.weight", "layers.1.mlp.gate_proj.weight"]:
        assert expected in names
    assert ("layers.0.self_attn.g_proj.weight" in names) == gating
    # Embeddings and lm_head are the target's; vLLM adds the `model.` prefix itself.
    assert not [n for n in names if "embed_tokens" in n or "lm_head" in n or n.startswith("model.")]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]


def test_config_json_is_what_vllm_reads(tmp_path, make_drafter):
    save_drafter(make_drafter(2, "sliding_attention"), tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashLagunaForCausalLM"]
    assert cfg["layer_types"] == ["sliding_attention"] * 2 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": 5, "block_size": 4}
    assert cfg["draft_vocab_size"] == 128 and cfg["target_layer_count"] == 6 and cfg["sliding_window"] == 8


def test_round_trip_keeps_an_unset_target_layer_count_unset(tmp_path, make_drafter):
    # Without target_layer_count the drafter guesses max(target_layer_ids) + 1 for its
    # layer names; saving must not turn that guess into a fact that a later
    # validate_against_target would hold against the real (deeper) target.
    drafter = make_drafter(1, target_layer_count=None)
    save_drafter(drafter, tmp_path / "ckpt")
    loaded = load_drafter(tmp_path / "ckpt")
    assert loaded.config == drafter.config and loaded.config.target_layer_count is None
    loaded.config.validate_against_target({"vocab_size": 128, "num_hidden_layers": 8, "hidden_size": 64})


def test_target_hidden_size_is_read_off_fc_when_the_config_omits_it(tmp_path, make_drafter):
    drafter = make_drafter(1)
    save_drafter(drafter, tmp_path / "ckpt")
    cfg_file = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["target_hidden_size"]  # real vLLM checkpoints need not state it
    cfg_file.write_text(json.dumps(cfg))
    assert load_drafter(tmp_path / "ckpt").config.target_hidden_size == 64


# --- loading proves alignment, by name --------------------------------------------------------


def rewrite_weights(ckpt, edit):
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path, make_drafter):
    save_drafter(make_drafter(2), tmp_path / "ckpt")

    def edit(t):
        del t["layers.1.mlp.up_proj.weight"]
        t["layers.0.self_attn.v_proj.weight"] = torch.zeros(32, 64)
        t["fc.weight"] = torch.zeros(64, 96)

    rewrite_weights(tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError) as e:
        load_drafter(tmp_path / "ckpt")
    msg = str(e.value)
    assert str(tmp_path / "ckpt" / "model.safetensors") in msg
    assert "missing tensors ['layers.1.mlp.up_proj.weight']" in msg
    assert "unexpected tensors ['layers.0.self_attn.v_proj.weight']" in msg
    assert "fc.weight: checkpoint (64, 96) vs model (64, 128)" in msg


def test_non_finite_weights_are_named(tmp_path, make_drafter):
    save_drafter(make_drafter(1), tmp_path / "ckpt")
    rewrite_weights(tmp_path / "ckpt", lambda t: t["norm.weight"].__setitem__(3, float("nan")))
    with pytest.raises(CheckpointError, match=r"non-finite.*\['norm.weight'\]"):
        load_drafter(tmp_path / "ckpt")


def test_pickled_weights_are_refused(tmp_path, make_drafter):
    save_drafter(make_drafter(1), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    (tmp_path / "ckpt" / "pytorch_model.bin").write_bytes(b"\x80\x04not read, never unpickled")
    with pytest.raises(CheckpointError, match=r"pickled weights \['pytorch_model.bin'\]; only safetensors"):
        load_drafter(tmp_path / "ckpt")


def test_corrupt_weights_name_the_file(tmp_path, make_drafter):
    save_drafter(make_drafter(1), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match=str(tmp_path / "ckpt" / "model.safetensors")):
        load_drafter(tmp_path / "ckpt")


def test_bad_config_json_names_the_file(tmp_path, make_drafter):
    save_drafter(make_drafter(1), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=str(tmp_path / "ckpt" / "config.json")):
        load_drafter(tmp_path / "ckpt")


def test_missing_directory_and_weights_are_named(tmp_path, make_drafter):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        load_drafter(tmp_path / "nope")
    save_drafter(make_drafter(1), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_drafter(tmp_path / "ckpt")


# Atomic saving (a failed save keeps the previous checkpoint) is pinned in test_atomic_save.py.
