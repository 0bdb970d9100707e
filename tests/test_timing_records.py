"""One timing record format for both backends: ``measure.decoding.measure_fast_decoding`` (the static path) and
``measure_eager_loop`` (the eager teaching loop) write records with the same keys, built in one place
(``timing_record``), told apart by ``backend``; the committed eager rows read in that format. CPU, a tiny pair,
a few tokens."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.measure.decoding import (
    EXTRA_KEYS, RECORD_KEYS, backend_of, measure_eager_loop, measure_fast_decoding, timing_record,
)
from dflash_lab.runtime import REPO_ROOT
from dflash_lab.spec_decode.stats import SpecDecodeStats
from dflash_lab.target import build_target, tiny_laguna_config
from dflash_lab.tools.bench_fast_decode import fast_markdown
from dflash_lab.tools.bench_spec_decode import eager_lines, eager_record_of_row, eager_records_of

NEW_TOKENS = 4


def keys_of(backend: str) -> set[str]:
    return set(RECORD_KEYS) | set(EXTRA_KEYS[backend])


@pytest.fixture(scope="module")
def both_backends():
    """The same tiny pair and prompts through both harnesses: target-only, DFlash and prompt lookup at block 4."""
    cfg = tiny_laguna_config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=8,
        mlp_layer_types=["dense", "sparse"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=32, max_position_embeddings=128)
    target = build_target(cfg, seed=0).float()
    torch.manual_seed(1)
    drafter = DFlashLagunaDrafter(DFlashDrafterConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, layer_types=["full_attention"], draft_vocab_size=256, target_layer_ids=[0, 1],
        mask_token_id=3, block_size=4, target_layer_count=2)).eval()
    # two prompts ending where this target's greedy continuation loops (207 254 46 ..., 132 132 ...): prompt
    # lookup drafts and some drafts are accepted, so the counters compared below are not all zero
    prompts = [torch.tensor([40, 41, 42, 43, 44] * 2 + [215, 130, 142, 9, 13, 124, 21, 142, 9, 214, 210, 71, 145, 202,
                                                        27, 252, 127, 207, 254, 46]),
               torch.tensor([7] * 6 + [159, 182, 254, 107, 5, 43, 211, 119, 132, 132, 132])]
    common = dict(block_sizes=[4], max_new_tokens=NEW_TOKENS, prompt_set="docstring", progress=lambda s: None)
    static = measure_fast_decoding(target, {"paper": drafter}, prompts, batches=[1], graphs=(False,), **common)
    eager = measure_eager_loop(target, {"paper": drafter}, prompts, **common)
    return static, eager


def test_both_harnesses_write_the_same_record_keys(both_backends):
    static, eager = both_backends
    assert [backend_of(r) for r in static] == ["static"] * 3 and [r["backend"] for r in eager] == ["eager"] * 3
    for r in static + eager:  # the shared keys, then the backend's own, nothing else
        assert set(r) == keys_of(r["backend"]), sorted(set(r) ^ keys_of(r["backend"]))
        assert list(r)[:len(RECORD_KEYS)] == list(RECORD_KEYS)
    runs = [("target_only", 1), ("dflash", 4), ("prompt_lookup", 4)]  # target-only: one token verified a step
    assert [(r["method"], r["block_size"]) for r in static] == [(r["method"], r["block_size"]) for r in eager] == runs
    assert {(r["batch"], r["prompt_set"], r["dtype"], r["tokens"]) for r in static + eager} == \
        {(1, "docstring", "float32", 2 * NEW_TOKENS)}
    assert [r["mean_acceptance_length"] is None for r in static + eager] == [True, False, False] * 2
    assert static[2]["mean_acceptance_length"] > 1 and eager[2]["mean_acceptance_length"] > 1  # lookup accepted
    assert static[0]["target_forwards_per_token"] == eager[0]["target_forwards_per_token"] == 1.0
    assert eager[0]["per_position_acceptance_rate"] is None and len(eager[1]["per_position_acceptance_rate"]) == 3


def test_both_backends_count_the_same_greedy_run(both_backends):
    """Greedy decoding is lossless on both backends, and both count a generation the same way."""
    static, eager = both_backends
    for s, e in zip(static, eager):
        assert s["outputs_equal_target_only"] == e["outputs_equal_target_only"] == "2/2", (s["method"], s, e)
        assert s["mean_acceptance_length"] == e["mean_acceptance_length"], s["method"]
        assert s["target_forwards_per_token"] == e["target_forwards_per_token"], s["method"]
        assert s["tokens_per_s"] > 0 and e["tokens_per_s"] > 0


def test_a_record_is_built_in_one_place_and_refuses_foreign_keys():
    stats = SpecDecodeStats(num_generated_tokens=10)
    common = dict(batch=1, stats=stats, seconds=2.0, outputs=[[1], [2]], reference=[[1], [3]], device="cpu",
                  dtype="float32", prompt_set="heldout")
    r = timing_record("eager", "target_only", 1, **common)
    assert (r["tokens_per_s"], r["outputs_equal_target_only"], r["mean_acceptance_length"]) == (5.0, "1/2", None)
    with pytest.raises(ValueError, match="cuda_graphs"):
        timing_record("eager", "target_only", 1, cuda_graphs=False, **common)  # a static path's key
    with pytest.raises(ValueError, match="backend"):
        timing_record("vllm", "target_only", 1, **common)
    with pytest.raises(ValueError, match="method"):
        timing_record("static", "dflash_b16", 16, **common)  # the eager loop's earlier method names are gone


def test_the_committed_eager_records_are_in_the_one_format():
    result = json.loads((REPO_ROOT / "benchmarks" / "spec_decode.json").read_text())
    assert "shipped_pair" not in result and result["eager_records"]
    for r in result["eager_records"]:
        assert r["backend"] == "eager" and set(r) == keys_of("eager"), r["method"]
    assert {backend_of(r) for r in result["records"]} == {"static"}  # written before ``backend``: static
    target_only = next(r for r in result["eager_records"] if r["method"] == "target_only")
    assert target_only["block_size"] == 1 and target_only["target_forwards_per_token"] == 1.0


def test_rows_of_the_earlier_eager_format_read_as_records_with_no_number_changed():
    rows = [{"method": "target_only", "block_size": None, "tokens": 768, "seconds": 26.667, "tokens_per_s": 28.8,
             "target_forwards_per_token": 1.0, "mean_acceptance_length": None, "per_position_acceptance_rate": None,
             "outputs_equal_target_only": "8/8", "target_ms_per_forward": 34.302, "drafter_ms_per_step": 0.049,
             "device": "NVIDIA H200", "dtype": "bfloat16"},
            {"method": "prompt_lookup_b16", "block_size": 16, "tokens": 768, "seconds": 7.162, "tokens_per_s": 107.2,
             "target_forwards_per_token": 0.4544, "mean_acceptance_length": 4.7731,
             "per_position_acceptance_rate": [0.6218] * 15, "outputs_equal_target_only": "4/8",
             "target_ms_per_forward": 20.068, "drafter_ms_per_step": 0.12, "device": "NVIDIA H200",
             "dtype": "bfloat16"}]
    records = eager_records_of({"shipped_pair": rows})
    assert [(r["method"], r["block_size"], r["backend"], r["batch"]) for r in records] == \
        [("target_only", 1, "eager", 1), ("prompt_lookup", 16, "eager", 1)]
    for old, new in zip(rows, records):
        assert set(new) == keys_of("eager")
        assert all(new[k] == v for k, v in old.items() if k not in ("method", "block_size"))
    assert eager_record_of_row(records[1]) == records[1]  # a record already in the format is kept as it is
    assert eager_records_of({"eager_records": records, "shipped_pair": rows}) == records


def test_each_markdown_table_takes_its_own_backend(both_backends):
    static, eager = both_backends
    settings = dict(n_prompts=2, max_new_tokens=NEW_TOKENS)
    assert fast_markdown(static + eager, **settings) == fast_markdown(static, **settings)
    assert fast_markdown(eager, **settings) == []
    table = "\n".join(eager_lines(eager, carried_over=True))
    assert "(carried over from an earlier run)" in table and "docstring-first prompts" in table
    assert f"| dflash | 4 | {eager[1]['tokens_per_s']:.1f} | " in table and "| target_only | 1 |" in table
    assert eager_lines([]) == []
