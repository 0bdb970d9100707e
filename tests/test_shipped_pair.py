"""The shipped pair has learned: greedy DFlash decoding on the held-out prompts accepts long drafts."""

from __future__ import annotations

import pytest
import torch

from dflash_lab.assets import heldout_prompts, load_default_pair
from dflash_lab.spec_decode import SpecDecodeStats, speculative_generate

MIN_MEAN_ACCEPTANCE_LENGTH = 4.5  # the shipped pair measures 5.02 at block 16 on a CPU (all 48 prompts)


@pytest.fixture(scope="module")
def pair():
    return load_default_pair("cpu")


def test_shipped_pair_loads_in_float32_on_the_cpu_and_matches(pair):
    target, drafter, tokenizer = pair
    assert next(target.parameters()).dtype == torch.float32 and next(drafter.parameters()).dtype == torch.float32
    assert drafter.config.block_size == 16 and drafter.config.mask_token_id == tokenizer.mask_token_id
    assert drafter.config.draft_vocab_size == target.config.vocab_size == len(tokenizer)


def test_greedy_dflash_on_heldout_prompts_accepts_long_drafts(pair):
    target, drafter, tokenizer = pair
    stats, threads = SpecDecodeStats(), torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: one thread is fastest, and fair to a busy CI box
    try:
        for p in heldout_prompts():
            ids = torch.tensor([tokenizer.encode(p["text"], add_special_tokens=False)])
            stats = stats + speculative_generate(target, drafter, ids, max_new_tokens=64, block_size=16).stats
    finally:
        torch.set_num_threads(threads)
    rates = " ".join(f"{r:.2f}" for r in stats.per_position_acceptance_rate)
    print(f"\nmean acceptance length {stats.mean_acceptance_length:.3f} over {stats.num_drafts} drafts; "
          f"per position {rates}")
    assert stats.mean_acceptance_length >= MIN_MEAN_ACCEPTANCE_LENGTH
    # Acceptance can only fall along the block: position i needs every position before it.
    assert all(a >= b for a, b in zip(stats.per_position_acceptance_rate, stats.per_position_acceptance_rate[1:]))


def test_a_benchmark_record_knows_which_pair_it_was_measured_on():
    import json

    from dflash_lab.assets import measured_on_this_pair, pair_fingerprint
    from dflash_lab.runtime import BENCHMARKS_DIR

    here = pair_fingerprint()
    assert set(here) == {"target", "paper", "poolside"} and here["paper"]["weights"] != here["poolside"]["weights"]
    assert measured_on_this_pair({"pair": here}) and not measured_on_this_pair({})
    for stem in ("spec_decode", "verification_methods", "verification_fly_b16"):  # every H200 record names its pair
        record = json.loads((BENCHMARKS_DIR / f"{stem}.json").read_text())
        assert set(record["pair"]) == set(here), stem
        if not measured_on_this_pair(record):  # then its markdown must say so
            assert "Measured on the previous shipped drafters" in (BENCHMARKS_DIR / f"{stem}.md").read_text(), stem
