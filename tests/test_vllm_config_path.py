"""Every config the lab ships or writes goes through vLLM 0.33's own config path.

`vllm serve TARGET --speculative-config '{"method": "dflash", "model": DRAFTER, ...}'`
first reads the drafter directory with `get_config` (transformers' strict LagunaConfig:
a `sliding_window: null` is refused there) and builds a `SpeculativeConfig` against the
target's `ModelConfig`. Both run on the CPU. Then vLLM's own resolution functions —
causality per layer (`_dflash_layer_causal`) and the aux hidden-state layers
(`get_eagle3_aux_layers_from_config`) — must agree with what the lab resolved.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402

pytest.importorskip("vllm", reason="vLLM is not importable")

from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig  # noqa: E402
from vllm.model_executor.models.qwen3_dflash import _dflash_layer_causal, _resolve_layer_attention  # noqa: E402
from vllm.transformers_utils.config import get_config  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config  # noqa: E402

from dflash_lab.checkpoint import save_drafter  # noqa: E402
from dflash_lab.config import DFlashDrafterConfig  # noqa: E402
from dflash_lab.drafter import DFlashLagunaDrafter  # noqa: E402
from dflash_lab.presets import DRAFTER_PRESETS, drafter_preset  # noqa: E402
from dflash_lab.runtime import DEFAULT_DRAFTER, DEFAULT_TARGET  # noqa: E402


@pytest.fixture(scope="module")
def target_model_config():
    return ModelConfig(model=str(DEFAULT_TARGET), tokenizer=str(DEFAULT_TARGET), dtype="float32", max_model_len=512)


def speculative_config(drafter_dir, target_model_config, num_speculative_tokens: int) -> SpeculativeConfig:
    return SpeculativeConfig(method="dflash", model=str(drafter_dir), num_speculative_tokens=num_speculative_tokens,
                             target_model_config=target_model_config, target_parallel_config=ParallelConfig())


def assert_vllm_resolves_as_the_lab(hf_config, cfg: DFlashDrafterConfig) -> None:
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf_config))
    assert list(get_eagle3_aux_layers_from_config(spec)) == cfg.aux_hidden_state_layer_ids
    for i in range(cfg.num_hidden_layers):
        assert _dflash_layer_causal(hf_config, i) is cfg.is_causal, f"layer {i}"
    own = hf_config.rope_parameters.get(cfg.layer_type, hf_config.rope_parameters)
    assert float(own["rope_theta"]) == cfg.rope["rope_theta"]
    assert float(own.get("partial_rotary_factor", 1.0)) == cfg.rope["partial_rotary_factor"]


def shipped_variant(tmp_path, name: str, **changes) -> tuple:
    """The shipped drafter's config with ``changes``, saved by save_drafter (random weights)."""
    d = json.loads((DEFAULT_DRAFTER / "config.json").read_text())
    dflash = changes.pop("dflash_config", {})
    if isinstance(changes.get("layer_types"), str):  # one type for every layer of the shipped drafter
        changes["layer_types"] = [changes["layer_types"]] * d["num_hidden_layers"]
    d.update(changes)
    d["dflash_config"].update(dflash)
    cfg = DFlashDrafterConfig.from_dict(d)
    save_drafter(DFlashLagunaDrafter(cfg), tmp_path / name)
    return tmp_path / name, cfg


@pytest.mark.parametrize("num_speculative_tokens", [15, 7])
def test_shipped_pair_passes_vllms_config_path(target_model_config, num_speculative_tokens):
    hf = get_config(str(DEFAULT_DRAFTER), trust_remote_code=False)
    cfg = DFlashDrafterConfig.from_pretrained(DEFAULT_DRAFTER)
    assert_vllm_resolves_as_the_lab(hf, cfg)
    sc = speculative_config(DEFAULT_DRAFTER, target_model_config, num_speculative_tokens)
    assert sc.method == "dflash" and sc.num_speculative_tokens == num_speculative_tokens
    assert sc.draft_sample_method == "greedy"  # vLLM's default: drafts are the drafter's argmax (FIDELITY §4)


@pytest.mark.parametrize("name,changes", [
    ("full", {}),
    ("sliding-causal-by-type", {"layer_types": "sliding_attention", "sliding_window": 8}),
    ("sliding-made-non-causal", {"layer_types": "sliding_attention", "sliding_window": 8,
                                 "dflash_config": {"causal": False}}),
    ("full-made-causal", {"is_causal": True}),
])
def test_freshly_saved_drafters_pass_vllms_config_path(tmp_path, target_model_config, name, changes):
    ckpt, cfg = shipped_variant(tmp_path, name, **changes)
    written = json.loads((ckpt / "config.json").read_text())
    assert None not in written.values(), "a null in config.json (vLLM's LagunaConfig refuses it)"
    hf = get_config(str(ckpt), trust_remote_code=False)
    assert_vllm_resolves_as_the_lab(hf, cfg)
    window, causal = _resolve_layer_attention(hf, 0)
    assert (window, causal) == (cfg.window, cfg.is_causal)
    speculative_config(ckpt, target_model_config, 15)


@pytest.mark.parametrize("name", sorted(DRAFTER_PRESETS))
def test_real_poolside_configs_are_read_by_vllm_as_by_the_lab(tmp_path, name):
    d, _ = drafter_preset(name)
    (tmp_path / "config.json").write_text(json.dumps(d))  # verbatim, as published
    hf = get_config(str(tmp_path), trust_remote_code=False)
    cfg = DFlashDrafterConfig.from_dict(d, source=name)
    assert_vllm_resolves_as_the_lab(hf, cfg)
    assert _resolve_layer_attention(hf, 0) == (512, True)


def test_vllm_refuses_a_null_window_as_the_lab_does(tmp_path):
    """The defect the shipped config used to have: vLLM's reader refuses `sliding_window: null`."""
    d = json.loads((DEFAULT_DRAFTER / "config.json").read_text())
    d["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(Exception, match="sliding_window"):
        get_config(str(tmp_path), trust_remote_code=False)
    with pytest.raises(TypeError, match="`sliding_window` is null"):
        DFlashDrafterConfig.from_pretrained(tmp_path)
