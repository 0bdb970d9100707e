"""The bad-input matrix: every bad input fails loudly and names what is wrong.

Each case is a name, a function that provokes the failure (it gets pytest's
``tmp_path``), the exception type, and a regular expression the message must
match. The expression always names the offending file, key, tensor or argument,
so a researcher who edited a config by hand or downloaded a damaged checkpoint
is told where to look.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from unittest import mock

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_lab.assets import load_default_pair
from dflash_lab.checkpoint import CheckpointError, load_drafter, save_drafter
from dflash_lab.config import ConfigError, DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.kv_cache.groups import kv_cache_groups
from dflash_lab.kv_cache.specs import laguna_target_specs
from dflash_lab.spec_decode.metrics import MetricsError, prometheus_text, stats_from_prometheus_text
from dflash_lab.spec_decode import SpecDecodeStats, speculative_generate
from dflash_lab.target import build_target, load_target, tiny_laguna_config

VOCAB = 128


# ---------------------------------------------------------------------------
# Tiny inputs to break
# ---------------------------------------------------------------------------


def config_dict(**overrides) -> dict:
    """A valid, tiny drafter config.json (as a dict); ``overrides`` replace keys."""
    d = {
        "architectures": ["DFlashLagunaForCausalLM"],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "intermediate_size": 64,
        "layer_types": ["full_attention"] * 2,
        "draft_vocab_size": VOCAB,
        "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 3, "block_size": 4},
    }
    d.update(overrides)
    return d


def dflash(**overrides) -> dict:
    return {**config_dict()["dflash_config"], **overrides}


def without(key: str) -> dict:
    d = config_dict()
    del d[key]
    return d


def target_config(**overrides) -> dict:
    return {"vocab_size": VOCAB, "num_hidden_layers": 4, "hidden_size": 32, **overrides}


def tiny_drafter(**overrides) -> DFlashLagunaDrafter:
    torch.manual_seed(0)
    return DFlashLagunaDrafter(DFlashDrafterConfig.from_dict(config_dict(**overrides)))


def from_dict(d: dict):
    return lambda tmp: DFlashDrafterConfig.from_dict(d)


def config_file(text: str) -> Callable[[Path], object]:
    def provoke(tmp: Path):
        (tmp / "config.json").write_text(text)
        return DFlashDrafterConfig.from_pretrained(tmp)

    return provoke


def checkpoint(tmp: Path) -> Path:
    """A valid tiny drafter checkpoint directory."""
    save_drafter(tiny_drafter(), tmp / "drafter")
    return tmp / "drafter"


def edited_tensors(edit: Callable[[dict], None]) -> Callable[[Path], object]:
    """Save a checkpoint, let ``edit`` change its tensors in place, then load it."""

    def provoke(tmp: Path):
        ckpt = checkpoint(tmp)
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        edit(tensors)
        save_file(tensors, str(ckpt / "model.safetensors"))
        return load_drafter(ckpt)

    return provoke


def edited_config(**changes) -> Callable[[Path], object]:
    """Save a checkpoint, change keys of its config.json, then load it."""

    def provoke(tmp: Path):
        ckpt = checkpoint(tmp)
        d = json.loads((ckpt / "config.json").read_text())
        d.update(changes)
        (ckpt / "config.json").write_text(json.dumps(d))
        return load_drafter(ckpt)

    return provoke


def damaged_weights(damage: Callable[[bytes], bytes]) -> Callable[[Path], object]:
    def provoke(tmp: Path):
        weights = checkpoint(tmp) / "model.safetensors"
        weights.write_bytes(damage(weights.read_bytes()))
        return load_drafter(weights.parent)

    return provoke


@functools.cache
def tiny_target():
    """A 4-layer Laguna target matching ``config_dict()`` (vocab 128, hidden 32)."""
    cfg = tiny_laguna_config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
        mlp_layer_types=["dense"] * 4, num_experts=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        max_position_embeddings=64,
    )
    return build_target(cfg, seed=0)


def generate(drafter=None, prompt=(5, 6, 7), **kwargs):
    """speculative_generate on the tiny pair; ``kwargs`` override the (valid) arguments."""
    args = {"max_new_tokens": 2, **kwargs}
    prompt = torch.tensor([list(prompt)], dtype=torch.long)
    return lambda tmp: speculative_generate(tiny_target(), tiny_drafter() if drafter is None else drafter, prompt, **args)


def target_specs() -> dict:
    """vLLM KV-cache specs of the tiny target's layers."""
    return laguna_target_specs(tiny_target().config)


def kv_groups_of(specs: Callable[[], object], **kwargs) -> Callable[[Path], object]:
    def provoke(tmp: Path):
        return kv_cache_groups(specs(), **kwargs)

    return provoke


def first_layer_twice() -> list:
    name, spec = next(iter(target_specs().items()))
    return [(name, spec), (name, spec)]


def short_layer_types(tmp: Path):
    config = {**tiny_target().config.to_dict(), "layer_types": ["full_attention"] * 3}
    return laguna_target_specs(config)


def metrics_page() -> str:
    """A valid vLLM /metrics page: 2 drafts of 3 tokens, 5 accepted."""
    stats = SpecDecodeStats()
    stats.observe_draft(3, 2)
    stats.observe_draft(3, 3)
    return prometheus_text(stats, model_name="laguna", engine="0")


def counter_line(metric: str) -> str:
    return f'vllm:spec_decode_{metric}_total{{engine="0",model_name="laguna"}}'


def metrics_from(edit: Callable[[str], str], **kwargs) -> Callable[[Path], object]:
    def provoke(tmp: Path):
        return stats_from_prometheus_text(edit(metrics_page()), **kwargs)

    return provoke


def set_counter(metric: str, value: str) -> Callable[[str], str]:
    line = counter_line(metric)
    return lambda text: re.sub(re.escape(line) + r" \S+", f"{line} {value}", text)


def default_pair_with(**env) -> Callable[[Path], object]:
    """load_default_pair with environment variables set; ``tmp`` in a value is the test's tmp_path."""

    def provoke(tmp: Path):
        values = {k: v.replace("tmp", str(tmp)) for k, v in env.items()}
        with mock.patch.dict(os.environ, values):
            return load_default_pair()

    return provoke


class Payload:
    """Unpickling this creates a file: proof that a loader ran a pickle."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def pickled_drafter(tmp: Path):
    ckpt = checkpoint(tmp)
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(tmp / "UNPICKLED")))
    return load_drafter(ckpt)


def pickled_target(tmp: Path):
    (tmp / "config.json").write_text(json.dumps({"model_type": "laguna"}))
    (tmp / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(tmp / "UNPICKLED")))
    return load_target(tmp)


def set_first_value(name: str, value: float):
    def edit(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] = value

    return edit


# ---------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    provoke: Callable[[Path], object]
    raises: type[BaseException]
    names: str  # regex that the message must match: the file, key, tensor or argument
    marks: tuple = ()


QKV = r"layers\.0\.self_attn\.qkv_proj\.weight"

CASES = [
    # --- drafter config.json ------------------------------------------------
    Case("config-invalid-json", config_file('{"hidden_size": 32,'), ConfigError, r"config\.json is not valid JSON: .* line 1"),
    Case("config-not-an-object", config_file("[1, 2]"), ConfigError, r"config\.json must be a JSON object, got list"),
    Case("config-missing-file", lambda tmp: DFlashDrafterConfig.from_pretrained(tmp), FileNotFoundError, r"no drafter config at .*config\.json"),
    Case("config-wrong-type", from_dict(config_dict(hidden_size="32")), TypeError, r"`hidden_size` must be an integer, got '32'"),
    Case("config-bool-for-int", from_dict(config_dict(num_hidden_layers=True)), TypeError, r"`num_hidden_layers` must be an integer"),
    Case("config-missing-key", from_dict(without("num_attention_heads")), ConfigError, r"`num_attention_heads` is missing"),
    Case("config-names-its-file", config_file(json.dumps(without("intermediate_size"))), ConfigError, r"config\.json: `intermediate_size` is missing"),
    Case("config-missing-layer-types", from_dict(without("layer_types")), ValueError, r"`layer_types` is missing"),
    Case("config-mixed-layer-types", from_dict(config_dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8)),
         NotImplementedError, r"`layer_types` must be uniform"),
    Case("config-short-layer-types", from_dict(config_dict(layer_types=["full_attention"])), ValueError,
         r"`layer_types` has length 1, which does not match num_hidden_layers 2"),
    Case("config-unknown-layer-type", from_dict(config_dict(layer_types=["linear_attention"] * 2)), ConfigError, r"`layer_types` holds unknown types \['linear_attention'\]"),
    Case("config-missing-draft-vocab", from_dict(without("draft_vocab_size")), ValueError, r"`draft_vocab_size` is missing"),
    Case("config-missing-dflash-config", from_dict(without("dflash_config")), ConfigError, r"`dflash_config` is missing"),
    Case("config-empty-target-layer-ids", from_dict(config_dict(dflash_config=dflash(target_layer_ids=[]))), ValueError,
         r"`dflash_config\.target_layer_ids` is empty"),
    Case("config-negative-target-layer-id", from_dict(config_dict(dflash_config=dflash(target_layer_ids=[-1, 2]))), ConfigError,
         r"`dflash_config\.target_layer_ids` must be distinct non-negative"),
    Case("config-target-layer-id-out-of-range", lambda tmp: tiny_drafter().config.validate_against_target(target_config(num_hidden_layers=2)),
         ConfigError, r"`dflash_config\.target_layer_ids` \[2\] do not exist in a target with 2 layers"),
    Case("config-mask-token-outside-vocab", from_dict(config_dict(dflash_config=dflash(mask_token_id=VOCAB))), ConfigError,
         r"`dflash_config\.mask_token_id` \(128\) is outside the vocabulary"),
    Case("config-draft-vocab-not-target-vocab", lambda tmp: tiny_drafter().config.validate_against_target(target_config(vocab_size=256)),
         ConfigError, r"`draft_vocab_size` 128 != target vocab_size 256"),
    Case("config-heads-not-divisible", from_dict(config_dict(num_attention_heads=3, num_key_value_heads=2)), ConfigError,
         r"`num_attention_heads` \(3\) must be divisible by num_key_value_heads \(2\)"),
    Case("config-block-size-below-2", from_dict(config_dict(dflash_config=dflash(block_size=1))), ConfigError, r"`dflash_config\.block_size` must be an integer >= 2"),
    Case("config-sliding-without-window", from_dict(config_dict(layer_types=["sliding_attention"] * 2)), ConfigError, r"`sliding_window` is missing"),
    Case("config-target-layer-ids-not-ints", from_dict(config_dict(dflash_config=dflash(target_layer_ids=["1"]))), TypeError,
         r"`dflash_config\.target_layer_ids` must be a list of integers, got \['1'\]"),
    Case("config-wrong-architecture", from_dict(config_dict(architectures=["LlamaForCausalLM"])), ConfigError, r"`architectures` must contain 'DFlashLagunaForCausalLM'"),
    # --- checkpoints --------------------------------------------------------
    Case("ckpt-head-dim-inconsistent-with-weights", edited_config(head_dim=8), CheckpointError, r"model\.safetensors .*mis-shaped tensors \[" + QKV),
    Case("ckpt-truncated-safetensors", damaged_weights(lambda b: b[: len(b) // 2]), CheckpointError, r"model\.safetensors is not a readable safetensors file"),
    Case("ckpt-corrupt-header", damaged_weights(lambda b: b"\xff" * 16 + b[16:]), CheckpointError, r"model\.safetensors is not a readable safetensors file"),
    Case("ckpt-missing-tensor", edited_tensors(lambda t: t.pop("fc.weight")), CheckpointError, r"model\.safetensors .*missing tensors \['fc\.weight'\]"),
    Case("ckpt-extra-tensor", edited_tensors(lambda t: t.update({"lm_head.weight": torch.zeros(VOCAB, 32)})), CheckpointError,
         r"model\.safetensors .*unexpected tensors \['lm_head\.weight'\]"),
    Case("ckpt-misshaped-tensor", edited_tensors(lambda t: t.update({"norm.weight": torch.ones(31)})), CheckpointError,
         r"mis-shaped tensors \[norm\.weight: checkpoint \(31,\) vs model \(32,\)"),
    Case("ckpt-nan-values", edited_tensors(set_first_value(QKV.replace("\\", ""), float("nan"))), CheckpointError, r"model\.safetensors holds non-finite values .*" + QKV),
    Case("ckpt-inf-values", edited_tensors(set_first_value("fc.weight", float("inf"))), CheckpointError, r"non-finite values .*fc\.weight"),
    Case("ckpt-pickle-instead-of-safetensors", pickled_drafter, CheckpointError, r"pickled weights \['pytorch_model\.bin'\]; only safetensors"),
    Case("ckpt-missing-config", lambda tmp: (checkpoint(tmp) / "config.json").unlink() or load_drafter(tmp / "drafter"), FileNotFoundError,
         r"no config\.json in drafter checkpoint .*drafter"),
    Case("ckpt-config-not-utf8", lambda tmp: (checkpoint(tmp) / "config.json").write_bytes(b"\xff\xfe{}") and load_drafter(tmp / "drafter"),
         ConfigError, r"config\.json is not UTF-8 text"),
    Case("ckpt-integer-tensor", edited_tensors(lambda t: t.update({"fc.weight": t["fc.weight"].to(torch.int32)})), CheckpointError,
         r"model\.safetensors .*non-floating tensors \[fc\.weight: int32\]"),
    Case("ckpt-missing-directory", lambda tmp: load_drafter(tmp / "nowhere"), FileNotFoundError, r"nowhere does not exist"),
    Case("ckpt-save-over-a-non-checkpoint-directory", lambda tmp: (tmp / "notes.txt").write_text("mine") and save_drafter(tiny_drafter(), tmp),
         FileExistsError, r"`out_dir` .* is not a checkpoint directory"),
    Case("load-dtype-not-floating", lambda tmp: load_drafter(checkpoint(tmp), dtype="int64"), TypeError, r"load_drafter: `dtype` must be a floating"),
    Case("load-device-unknown", lambda tmp: load_drafter(tmp, device="gpu0"), ValueError, r"load_drafter: `device` 'gpu0' is not a torch device"),
    Case("load-cuda-without-a-gpu", lambda tmp: load_drafter(tmp, device="cuda"), RuntimeError, r"load_drafter: `device` 'cuda' asked for CUDA",
         marks=(pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA"),)),
    Case("target-device-unknown", lambda tmp: load_target(tmp, device="gpu0"), ValueError, r"load_target: `device` 'gpu0'"),
    Case("target-pickle-instead-of-safetensors", pickled_target, FileNotFoundError, r"found \['pytorch_model\.bin'\]: pickled weights are refused"),
    Case("target-missing-config", lambda tmp: load_target(tmp), FileNotFoundError, r"no target config\.json in"),
    # --- target/drafter pairs -----------------------------------------------
    Case("pair-hidden-size-mismatch-with-fc", lambda tmp: tiny_drafter().config.validate_against_target(target_config(hidden_size=48)),
         ConfigError, r"`fc` expects target hidden size 32 .* target's hidden_size is 48"),
    Case("pair-fc-weight-for-another-target", edited_config(target_hidden_size=48), CheckpointError, r"mis-shaped tensors .*fc\.weight: checkpoint \(32, 64\) vs model \(32, 96\)"),
    Case("pair-aux-hidden-wrong-width", lambda tmp: tiny_drafter().combine_hidden_states(torch.zeros(3, 48)), ValueError,
         r"aux hidden states have last dim 48, expected 2 target layers x hidden 32"),
    Case("pair-dtype-mismatch", generate(tiny_drafter().to(torch.bfloat16)), ValueError,
         r"same dtype: target torch\.float32, drafter torch\.bfloat16"),
    Case("pair-device-mismatch", generate(tiny_drafter().to("meta")), ValueError, r"same device: target on cpu, drafter on meta"),
    Case("pair-vocab-mismatch-at-generation", generate(tiny_drafter(draft_vocab_size=256)), ConfigError,
         r"`draft_vocab_size` 256 != target vocab_size 128"),
    Case("drafter-unknown-context-kv-path", lambda tmp: tiny_drafter().precompute_context_kv(torch.zeros(3, 32), torch.arange(3), path="fast"),
         ValueError, r"path must be one of .* got 'fast'"),
    # --- generation arguments -----------------------------------------------
    Case("gen-block-size-below-2", generate(block_size=1), ValueError, r"block_size must be >= 2"),
    Case("gen-empty-prompt", generate(prompt=()), ValueError, r"input_ids is empty"),
    Case("gen-token-outside-vocab", generate(prompt=(5, VOCAB)), ValueError, r"input_ids holds token id 128, outside the vocabulary"),
    Case("gen-negative-temperature", generate(temperature=-0.5), ValueError, r"temperature must be a finite number >= 0 .* got -0\.5"),
    Case("gen-top-p-zero", generate(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0\.0"),
    Case("gen-top-p-above-one", generate(top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1\.5"),
    Case("gen-negative-max-new-tokens", generate(max_new_tokens=-1), ValueError, r"max_new_tokens must be a non-negative integer"),
    # --- KV-cache groups -------------------------------------------------------
    Case("kv-unknown-method", kv_groups_of(target_specs, method="medusa2"), ValueError, r"method 'medusa2' is not a speculative method"),
    Case("kv-empty-model-type", kv_groups_of(target_specs, method="mtp", model_type=""), ValueError, r"model_type is empty"),
    Case("kv-unknown-layout", kv_groups_of(target_specs, layout="XYZ"), ValueError, r"layout 'XYZ' is not a vLLM KV-cache layout"),
    Case("kv-duplicate-layer-name", kv_groups_of(first_layer_twice), ValueError,
         r"kv_cache_spec: layer name 'model\.layers\.0\.self_attn\.attn' appears twice"),
    Case("kv-empty-layer-name", kv_groups_of(lambda: {"": next(iter(target_specs().values()))}), ValueError, r"kv_cache_spec: a layer name is empty"),
    Case("kv-no-layers", kv_groups_of(dict), ValueError, r"kv_cache_spec is empty"),
    Case("kv-not-a-spec", kv_groups_of(lambda: {"model.layers.0.self_attn.attn": 3}), TypeError,
         r"kv_cache_spec\['model\.layers\.0\.self_attn\.attn'\] must be a vLLM KVCacheSpec, got int"),
    Case("kv-wrong-length-layer-types", short_layer_types, ValueError, r"target config: `layer_types` has 3 entries but num_hidden_layers is 4"),
    # --- /metrics text -----------------------------------------------------------
    Case("metrics-missing-counter", metrics_from(lambda t: "\n".join(l for l in t.splitlines() if "num_drafts" not in l)),
         MetricsError, r"/metrics text has no vllm:spec_decode_num_drafts_total counter"),
    Case("metrics-non-numeric-value", metrics_from(set_counter("num_draft_tokens", "six")), MetricsError,
         r"not valid Prometheus exposition: line \d+ 'vllm:spec_decode_num_draft_tokens_total.* six'"),
    Case("metrics-nan-counter", metrics_from(set_counter("num_accepted_tokens", "NaN")), MetricsError,
         r"vllm:spec_decode_num_accepted_tokens\{.*\} is nan; a counter must be a non-negative integer"),
    Case("metrics-fractional-counter", metrics_from(set_counter("num_drafts", "2.5")), MetricsError, r"vllm:spec_decode_num_drafts\{.*\} is 2\.5"),
    Case("metrics-inconsistent-counters", metrics_from(set_counter("num_accepted_tokens", "50")), MetricsError,
         r"vllm:spec_decode_num_accepted_tokens \(50\) exceeds vllm:spec_decode_num_draft_tokens \(6\)"),
    Case("metrics-bad-position-label", metrics_from(lambda t: t.replace('position="1"', 'position="one"')), MetricsError,
         r"num_accepted_tokens_per_pos has a series with position='one'"),
    Case("metrics-no-series-for-model", metrics_from(str, model_name="qwen"), MetricsError,
         r"no vllm:spec_decode_num_drafts series has labels \{'model_name': 'qwen'\}"),
    Case("metrics-not-text", lambda tmp: stats_from_prometheus_text(42), TypeError,
         r"text must be the /metrics exposition as str, got int"),
    # --- the shipped pair, pointed elsewhere --------------------------------------
    Case("pair-device-env-unknown", default_pair_with(DFLASH_LAB_DEVICE="gpu0"), ValueError, r"DFLASH_LAB_DEVICE='gpu0' is not a torch device"),
    Case("pair-device-argument-unknown", lambda tmp: load_default_pair(device="gpu0"), ValueError, r"load_default_pair: `device` 'gpu0'"),
    Case("pair-target-dir-missing", default_pair_with(DFLASH_LAB_TARGET="tmp/nowhere"), FileNotFoundError,
         r"target checkpoint directory .*nowhere does not exist \(set \$DFLASH_LAB_TARGET"),
    Case("pair-drafter-dir-missing", default_pair_with(DFLASH_LAB_DRAFTER="tmp/nowhere"), FileNotFoundError,
         r"drafter checkpoint directory .*nowhere does not exist \(set \$DFLASH_LAB_DRAFTER"),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=c.marks) for c in CASES])
def test_bad_input_is_rejected_with_a_message_naming_it(case: Case, tmp_path):
    with pytest.raises(case.raises) as info:
        case.provoke(tmp_path)
    assert info.type is case.raises, f"raised {info.type.__name__}: {info.value}"
    message = str(info.value)
    assert re.search(case.names, message), f"message does not name the culprit ({case.names!r}):\n{message}"


def test_the_matrix_is_wide_enough():
    assert len(CASES) >= 25 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("provoke", [pickled_drafter, pickled_target], ids=["drafter", "target"])
def test_a_pickle_offered_as_weights_is_never_unpickled(provoke, tmp_path):
    with pytest.raises((CheckpointError, FileNotFoundError)):
        provoke(tmp_path)
    assert not (tmp_path / "UNPICKLED").exists()
