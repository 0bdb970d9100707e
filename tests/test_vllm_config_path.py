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
from dflash_lab.config import DFlashDrafterConfig, rope_resolution_table  # noqa: E402
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


# ---------------------------------------------------------------------------
# The keys vLLM reads in more than one way (FIDELITY §10.4, §10.5): vLLM's own drafter,
# built from vLLM's own reading of the same dict, against the lab's resolution.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process_world(tmp_path_factory):
    """A world of one gloo process (file:// rendezvous), so vLLM's layers can be built on the CPU."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import (destroy_distributed_environment, destroy_model_parallel,
                                                 model_parallel_is_initialized)

    ours = not model_parallel_is_initialized()
    if ours:
        with set_current_vllm_config(VllmConfig()):
            rendezvous = tmp_path_factory.mktemp("gloo") / "rendezvous"
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{rendezvous}")
            initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    yield
    if ours:
        destroy_model_parallel()
        destroy_distributed_environment()


def vllm_reads(tmp_path, d: dict):
    """vLLM's hf_config for ``d`` (get_config on a directory holding it)."""
    folder = tmp_path / f"cfg{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(d))
    return get_config(str(folder), trust_remote_code=False)


def vllm_builds(hf):
    """vLLM 0.33's own DFlashLagunaForCausalLM for ``hf``, with only the target's model config and the
    speculative config standing in (what its constructor reads)."""
    import torch
    from vllm.config import CompilationMode, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.laguna_dflash import DFlashLagunaForCausalLM
    from vllm.utils.torch_utils import set_default_torch_dtype

    vc = VllmConfig()
    vc.compilation_config.mode = CompilationMode.NONE
    vc.model_config = SimpleNamespace(
        dtype=torch.float32, head_dtype=torch.float32, quantization=None, is_moe=False, is_mm_prefix_lm=False,
        rswa_window=None, word_embeddings_untied_by_checkpoint=False, get_hidden_size=lambda: hf.hidden_size,
        get_total_num_hidden_layers=lambda: 6, get_vocab_size=lambda: hf.vocab_size)
    vc.speculative_config = SimpleNamespace(method="dflash", num_speculative_tokens=3, enable_adaptive_verification=False,
                                            draft_model_config=SimpleNamespace(hf_config=hf, quantization=None))
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.float32):
        return DFlashLagunaForCausalLM(vllm_config=vc)


def shipped_dict(**changes) -> dict:
    d = json.loads((DEFAULT_DRAFTER / "config.json").read_text())
    if changes.pop("sliding", False):
        d.update(layer_types=["sliding_attention"] * d["num_hidden_layers"], sliding_window=8)
    for key, value in changes.items():
        if value is None:
            d.pop(key, None)
        else:
            d[key] = value
    return d


FULL_ENTRY_NO_FACTOR = {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
ROPE_CASES = {
    "shipped": {},
    "swa_rope_parameters on sliding layers": dict(sliding=True, swa_rope_parameters={"rope_theta": 250000.0}),
    "swa_rope_parameters on full layers (ignored)": dict(swa_rope_parameters={"rope_theta": 250000.0}),
    "swa_rope_parameters with its own factor": dict(sliding=True, swa_rope_parameters={
        "rope_type": "default", "rope_theta": 40000.0, "partial_rotary_factor": 0.5}),
    "top-level partial_rotary_factor, entry without one": dict(rope_parameters=FULL_ENTRY_NO_FACTOR, partial_rotary_factor=0.5),
    "top-level partial_rotary_factor, entry with one": dict(partial_rotary_factor=0.5),
    "top-level factor into swa_rope_parameters": dict(sliding=True, swa_rope_parameters={"rope_theta": 250000.0},
                                                      partial_rotary_factor=0.25),
    "sliding layers, only a full_attention entry": dict(sliding=True, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 123456.0, "partial_rotary_factor": 0.5}}),
    "flat rope_parameters on sliding layers": dict(sliding=True, rope_parameters={"rope_type": "default", "rope_theta": 30000.0}),
    "flat rope_theta, no rope_parameters": dict(rope_parameters=None, rope_theta=250000.0),
    "flat rope_theta, sliding": dict(sliding=True, rope_parameters=None, rope_theta=250000.0),
    "rotary_pct alias, entry without a factor": dict(rope_parameters=FULL_ENTRY_NO_FACTOR, rotary_pct=0.5),
    "rotary_emb_fraction alias, entry without a factor": dict(rope_parameters=FULL_ENTRY_NO_FACTOR,
                                                             rotary_emb_fraction=0.25),
    "rotary_pct alias into swa_rope_parameters": dict(sliding=True, swa_rope_parameters={"rope_theta": 250000.0},
                                                      rotary_pct=0.5),
    "partial_rotary_factor wins over rotary_pct": dict(rope_parameters=FULL_ENTRY_NO_FACTOR, partial_rotary_factor=0.5,
                                                       rotary_pct=0.25),
    "rope_dim in the entry": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                      "rope_dim": 16}}),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_each_layers_rope_is_what_vllms_own_drafter_builds(one_process_world, tmp_path, case):
    d = shipped_dict(**ROPE_CASES[case])
    model = vllm_builds(vllm_reads(tmp_path, d))
    cfg = DFlashDrafterConfig.from_dict(d)
    for layer in model.model.layers:
        rotary = layer.self_attn.rotary_emb  # built by vLLM's get_rope from the entry LagunaAttention picked
        assert float(rotary.base) == cfg.rope["rope_theta"], case
        assert rotary.rotary_dim == cfg.rotary_dim, case
    theta_row = next(r for r in rope_resolution_table(d) if r["layer_type"] == cfg.layer_type)
    assert theta_row["rope_theta_served"] == cfg.rope["rope_theta"]
    # What the lab writes, vLLM reads back to the same RoPE.
    again = vllm_builds(vllm_reads(tmp_path, cfg.to_dict())).model.layers[0].self_attn.rotary_emb
    assert (float(again.base), again.rotary_dim) == (cfg.rope["rope_theta"], cfg.rotary_dim)


def test_vllm_gives_sliding_layers_attention_sinks_and_the_lab_refuses_them(one_process_world, tmp_path):
    sliding = shipped_dict(sliding=True, swa_attention_sink_enabled=True)
    attn = vllm_builds(vllm_reads(tmp_path, sliding)).model.layers[0].self_attn
    assert attn.sink.shape == (attn.total_num_heads,)  # one learned sink per head, loaded from the checkpoint
    with pytest.raises(NotImplementedError, match="`swa_attention_sink_enabled` is true"):
        DFlashDrafterConfig.from_dict(sliding)
    full = shipped_dict(swa_attention_sink_enabled=True)
    assert not hasattr(vllm_builds(vllm_reads(tmp_path, full)).model.layers[0].self_attn, "sink")
    DFlashDrafterConfig.from_dict(full)  # nothing to refuse: vLLM adds no sink to full-attention layers


def test_aux_ids_without_target_layer_ids_fail_in_vllms_drafter_as_in_the_lab(one_process_world, tmp_path):
    d = shipped_dict(eagle_aux_hidden_state_layer_ids=[2, 4])
    del d["dflash_config"]["target_layer_ids"]
    hf = vllm_reads(tmp_path, d)  # get_config reads it ...
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
    assert get_eagle3_aux_layers_from_config(spec) == (2, 4)
    with pytest.raises(KeyError, match="target_layer_ids"):  # ... and DFlashLagunaModel fails (laguna_dflash.py:78)
        vllm_builds(hf)
    with pytest.raises(ValueError, match="`dflash_config.target_layer_ids` is missing"):
        DFlashDrafterConfig.from_dict(d)


def test_an_empty_aux_list_and_aux_id_zero_as_vllm_reads_them(tmp_path):
    d = shipped_dict(eagle_aux_hidden_state_layer_ids=[])
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=vllm_reads(tmp_path, d)))
    cfg = DFlashDrafterConfig.from_dict(d)
    assert list(get_eagle3_aux_layers_from_config(spec)) == cfg.aux_hidden_state_layer_ids  # empty = absent
    zero = shipped_dict(eagle_aux_hidden_state_layer_ids=[0, 2])
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=vllm_reads(tmp_path, zero)))
    assert get_eagle3_aux_layers_from_config(spec) == (0, 2)  # vLLM takes id 0 (the embedding output) ...
    with pytest.raises(ValueError, match="holds id 0, the embedding output"):  # ... the lab refuses it, saying so
        DFlashDrafterConfig.from_dict(zero)


# ---------------------------------------------------------------------------
# The mask token and the number of speculative tokens (issue 31)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["dflash_config", "top level", "both"])
def test_the_mask_token_is_read_where_vllm_reads_it(tmp_path, where):
    """vLLM falls back to a top-level mask_token_id when dflash_config has none
    (get_parallel_drafting_token_id, v1/worker/gpu/spec_decode/utils.py:99-109); so does the lab."""
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    d = shipped_dict()
    inner = d["dflash_config"].pop("mask_token_id")
    if where != "top level":
        d["dflash_config"]["mask_token_id"] = inner
    if where != "dflash_config":
        d["mask_token_id"] = inner + 1  # a different id, to see which one wins
    hf = vllm_reads(tmp_path, d)
    cfg = DFlashDrafterConfig.from_dict(d)
    assert cfg.mask_token_id == get_parallel_drafting_token_id(hf) == (inner + 1 if where == "top level" else inner)
    assert DFlashDrafterConfig.from_dict(cfg.to_dict()).mask_token_id == cfg.mask_token_id  # written back inside


def test_no_mask_token_anywhere_is_refused_by_both(tmp_path):
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    d = shipped_dict()
    del d["dflash_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id"):
        get_parallel_drafting_token_id(vllm_reads(tmp_path, d))
    with pytest.raises(ValueError, match=r"`dflash_config.mask_token_id` is missing"):
        DFlashDrafterConfig.from_dict(d)


def test_vllm_needs_num_speculative_tokens_and_never_caps_it_by_block_size(target_model_config):
    """vLLM 0.33 never reads dflash_config.block_size for DFlash: num_speculative_tokens is required
    (config/speculative.py:1614-1618) and a value above the trained block - 1 is accepted and run."""
    trained = DFlashDrafterConfig.from_pretrained(DEFAULT_DRAFTER).block_size
    with pytest.raises(ValueError, match="`num_speculative_tokens` was not provided"):
        SpeculativeConfig(method="dflash", model=str(DEFAULT_DRAFTER), target_model_config=target_model_config,
                          target_parallel_config=ParallelConfig())  # no num_speculative_tokens
    sc = speculative_config(DEFAULT_DRAFTER, target_model_config, trained + 4)
    assert sc.num_speculative_tokens == trained + 4 > trained - 1


def test_fly_window_size_without_fly_is_ignored_by_both(target_model_config):
    """vLLM validates fly_window_size (>= 1) and reads it only under FLy (config/speculative.py:2014-2030)."""
    from dflash_lab.spec_decode.sampling import make_verifier

    sc = SpeculativeConfig(method="dflash", model=str(DEFAULT_DRAFTER), num_speculative_tokens=7,
                           fly_window_size=3, target_model_config=target_model_config,
                           target_parallel_config=ParallelConfig())
    assert sc.rejection_sample_method == "standard"
    assert make_verifier("standard", 7, fly_window_size=3).method == "standard"
    with pytest.raises(Exception, match="fly_window_size"):
        SpeculativeConfig(method="dflash", model=str(DEFAULT_DRAFTER), num_speculative_tokens=7, fly_window_size=0,
                          target_model_config=target_model_config, target_parallel_config=ParallelConfig())
    with pytest.raises(ValueError, match="fly_window_size must be None or an integer >= 1"):
        make_verifier("standard", 7, fly_window_size=0)
