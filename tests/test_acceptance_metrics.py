"""One run, every metric: a hand-made run whose numbers are worked out by hand, reported every community's way.

The run: K = 3 drafted tokens per step, five steps that kept 3, 0, 1, 3 and 2 drafts, after a
prefill that emitted one token. By hand:
    D = 5 drafts, 15 draft tokens, A = 9 accepted; τ = 1 + 9/5 = 2.8; accepted per step 1.8
    per_pos (kept >= 1, >= 2, >= 3) = [4, 3, 2]; r = [0.8, 0.6, 0.4]; c = [0.8, 0.75, 2/3]
    lengths a = n + 1 = [4, 1, 2, 4, 3]: histogram over a = 1..4 = [0.2, 0.2, 0.2, 0.4]
    draft acceptance rate 9/15 = 0.6; SGLang (9 + 5)/5 = 2.8; emitted 1 + 9 + 5 = 15, per request 15/5 = 3
    at the ceiling (kept all 3): 2 of 5 = 0.4, so τ = 2.8 is censored (ceiling 4)
"""

from __future__ import annotations

import math

import pytest

from dflash_lab.spec_decode import SpecDecodeStats
from dflash_lab.spec_decode import acceptance as acc
from dflash_lab.spec_decode.metrics import prometheus_text, stats_from_prometheus_text

KEPT = [3, 0, 1, 3, 2]
TEACHER = [[1, 1, 1], [0, 1, 1], [1, 0, 1], [1, 1, 1], [1, 1, 0]]  # leading runs 3, 0, 1, 3, 2: the same blocks


def hand_made_run() -> SpecDecodeStats:
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0, 0, 0])
    stats.observe_drafts([3] * len(KEPT), KEPT)
    stats.num_generated_tokens = 1 + sum(KEPT) + len(KEPT)  # the prefill's token, then kept + 1 per step
    stats.num_target_forwards = 1 + len(KEPT)
    return stats


def test_the_hand_made_run_every_way():
    m = acc.every_metric(hand_made_run(), teacher_forced=TEACHER)
    assert m["vllm_counters"] == {"num_drafts": 5, "num_draft_tokens": 15, "num_accepted_tokens": 9,
                                  "num_accepted_tokens_per_pos": [4, 3, 2]}
    assert m["tau"] == pytest.approx(2.8)
    assert m["accepted_per_draft"] == pytest.approx(1.8)
    assert m["draft_acceptance_rate"] == pytest.approx(0.6)
    assert m["unconditional_rates"] == pytest.approx([0.8, 0.6, 0.4])
    assert m["conditional_rates"] == pytest.approx([0.8, 0.75, 2 / 3])
    assert m["acceptance_length_histogram"] == pytest.approx([0.2, 0.2, 0.2, 0.4])
    assert m["sglang_accept_length"] == pytest.approx(2.8)
    assert m["sglang_request_accept_length"] == pytest.approx(3.0)
    assert m["ceiling"]["tau_ceiling"] == 4 and m["ceiling"]["share_at_ceiling"] == pytest.approx(0.4)
    assert m["ceiling"]["censored"] is True
    # the trainer's two views of the same five blocks
    assert m["teacher_forced_acceptance_length"] == pytest.approx(2.8)  # leading runs: the run's own τ
    assert m["per_position_accuracy"] == pytest.approx([0.8, 0.8, 0.8])
    assert m["acceptance_length_from_accuracies"] == pytest.approx(1 + 0.8 + 0.64 + 0.512)  # 2.952 > 2.8


def test_the_conversions_round_trip():
    stats = hand_made_run()
    r = acc.unconditional_rates(stats)
    assert acc.rates_from_conditional(acc.conditional_rates(stats)) == pytest.approx(r)
    assert acc.rates_from_histogram(acc.acceptance_length_histogram(stats)) == pytest.approx(r)
    assert acc.tau_from_rates(r) == pytest.approx(acc.tau(stats))
    hist = acc.acceptance_length_histogram(stats)
    assert sum((a + 1) * h for a, h in enumerate(hist)) == pytest.approx(acc.tau(stats))
    assert acc.accepted_per_draft(stats) == pytest.approx(acc.tau(stats) - 1)
    assert stats.draft_acceptance_rate == pytest.approx((acc.tau(stats) - 1) / stats.num_speculative_tokens)


def test_a_metrics_page_gives_every_decoding_metric_but_the_per_request_one():
    """vLLM's /metrics carries the four counters: every run metric but SGLang's per-request one follows."""
    stats = hand_made_run()
    scraped = stats_from_prometheus_text(prometheus_text(stats))
    ours, theirs = acc.every_metric(stats), acc.every_metric(scraped)
    for key in ("tau", "unconditional_rates", "conditional_rates", "acceptance_length_histogram",
                "sglang_accept_length", "draft_acceptance_rate"):
        assert theirs[key] == pytest.approx(ours[key]), key
    assert math.isclose(theirs["ceiling"]["share_at_ceiling"], ours["ceiling"]["share_at_ceiling"])


def test_tau_at_the_ceiling_is_censored_and_a_longer_block_shows_it():
    """Every block kept whole: τ = K+1 for K = 3, and the same drafter with K = 7 gets further."""
    full = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 3)
    full.observe_drafts([3] * 4, [3] * 4)
    c = acc.ceiling(full)
    assert c["tau"] == c["tau_ceiling"] == 4 and c["share_at_ceiling"] == 1.0 and c["censored"]
    longer = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 7)
    longer.observe_drafts([7] * 4, [5, 7, 4, 6])
    assert acc.tau(longer) > acc.tau(full)
    none_full = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 7)
    none_full.observe_drafts([7] * 2, [5, 6])
    assert acc.ceiling(none_full)["censored"] is False


def test_the_independent_error_estimate_is_biased_both_ways_by_correlated_errors():
    """From the same per-position accuracies it cannot tell clustered errors from spread ones."""
    clustered = [[1, 1, 1, 1]] * 5 + [[0, 0, 0, 0]] * 5
    assert acc.teacher_forced_acceptance_length(clustered) == pytest.approx(1 + 4 * 0.5)
    assert acc.acceptance_length_from_accuracies(acc.per_position_accuracy(clustered)) == pytest.approx(
        1 + 0.5 + 0.25 + 0.125 + 0.0625)  # clustered: it understates (1.94 vs 3)
    scattered = [[1, 0, 1, 1], [0, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]]
    tf = acc.teacher_forced_acceptance_length(scattered)
    assert tf == pytest.approx(1 + (1 + 0 + 2 + 3) / 4)
    assert acc.acceptance_length_from_accuracies(acc.per_position_accuracy(scattered)) > tf
    assert acc.stats_from_teacher_forcing(scattered).mean_acceptance_length == pytest.approx(tf)


def test_the_conversion_table_covers_every_metric_and_renders():
    names = " ".join(row["metric"] for row in acc.CONVERSIONS)
    for word in ("τ", "conditional", "unconditional", "histogram", "spec_accept_length", "teacher-forced", "ceiling"):
        assert word in names
    md = acc.conversion_table_markdown()
    assert md.count("\n") == len(acc.CONVERSIONS) + 1 and md.startswith("| metric |")


def test_bad_teacher_forced_tables_are_refused():
    with pytest.raises(ValueError, match="every row of length K"):
        acc.teacher_forced_acceptance_length([[1, 1], [1]])
    with pytest.raises(ValueError, match="non-empty"):
        acc.per_position_accuracy([])
