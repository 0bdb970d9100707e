"""One accept-and-count core: the kept prefix, the residual and the conditional rate, each defined once.

Every verification rule (standard, block, FLy, synthetic) and every backend (the eager loop's
``greedy_accept``, the fast decoder's ``greedy_accept_batch``, the teacher-forced views of
``acceptance``) counts its accepted drafts with ``sampling.accepted_prefix_length``; the
rejected position is resampled from ``sampling.residual_distribution``; ``SpecDecodeStats``
owns the rates, and the synthetic schedule's conditional rates come from the same definition.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dflash_lab.spec_decode import acceptance as acc
from dflash_lab.spec_decode.sampling import (
    accepted_prefix_length,
    block_verify,
    fly_accept,
    greedy_accept,
    greedy_accept_batch,
    logits_to_probs,
    make_verifier,
    rejection_sample,
    residual_distribution,
    synthetic_accept,
    unconditional_to_conditional_rates,
)
from dflash_lab.spec_decode.stats import SpecDecodeStats, conditional_acceptance_rates


def python_leading_run(row) -> int:
    """The rule spelled as a loop: count until the first False."""
    n = 0
    for ok in row:
        if not ok:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------
# The kept prefix
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (5, 0), (6, 9), (3, 4, 5)])
def test_the_prefix_length_is_the_leading_run_of_trues(shape):
    g = torch.Generator().manual_seed(sum(shape) + len(shape))
    for density in (0.3, 0.8, 1.0):
        kept = torch.rand(shape, generator=g) < density
        n = accepted_prefix_length(kept)
        assert n.shape == shape[:-1] and n.dtype == torch.long
        rows = kept.reshape(math.prod(shape[:-1]), shape[-1]).tolist()
        assert n.reshape(-1).tolist() == [python_leading_run(r) for r in rows]


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([1, 1, 0]), "torch.int64"),
    (torch.tensor(True), "shape ()"),
    ([True, False], "list"),
])
def test_the_prefix_length_refuses_anything_but_per_position_booleans(bad, message):
    with pytest.raises(TypeError, match=r"kept must be a bool tensor") as err:
        accepted_prefix_length(bad)
    assert message in str(err.value)


def deterministic_block(agree: list[bool], vocab: int = 11):
    """Drafts, the target's argmax and one-hot p such that draft j passes every rule's test exactly when agree[j]."""
    K = len(agree)
    argmax = torch.tensor([random.randrange(vocab) for _ in range(K + 1)])
    draft = torch.tensor([int(argmax[j]) if ok else (int(argmax[j]) + 1) % vocab for j, ok in enumerate(agree)],
                         dtype=torch.long)
    p = torch.nn.functional.one_hot(argmax, vocab).float()  # (K+1, V): the target is certain
    return draft, argmax, p


def test_every_rule_keeps_the_prefix_of_its_per_position_decisions():
    """With a certain target every rule decides position j by whether the draft is the argmax: each n is the prefix."""
    random.seed(0)
    for trial in range(60):
        K = random.randrange(0, 9)
        agree = [random.random() < 0.75 for _ in range(K)]
        draft, argmax, p = deterministic_block(agree)
        want = python_leading_run(agree)
        g = torch.Generator().manual_seed(trial)
        got = {
            "greedy_accept": greedy_accept(draft, argmax),
            "standard": rejection_sample(draft, None, p, g),
            "block": block_verify(draft, None, p, g),
            "fly (greedy)": fly_accept(draft, None, p, torch.zeros(K), window=1, threshold=1.0, target_argmax=argmax),
            "fly (sampling)": fly_accept(draft, None, p, torch.zeros(K), window=1, threshold=1.0, generator=g),
            "synthetic": synthetic_accept(draft, None, p, [float(a) for a in agree], generator=g),
            "synthetic (greedy)": synthetic_accept(draft, None, p, [float(a) for a in agree], target_argmax=argmax,
                                                   generator=g),
        }
        for rule, (n, nxt) in got.items():
            assert n == want, (rule, agree, n)
            assert nxt == int(argmax[n]), (rule, agree, nxt)  # the correction, or the bonus after K kept


def test_the_batched_greedy_rule_counts_each_row_and_stops_at_its_padding():
    g = torch.Generator().manual_seed(3)
    b, K, V = 16, 6, 5
    drafts = torch.randint(0, V, (b, K), generator=g)
    argmax = torch.randint(0, V, (b, K + 1), generator=g)
    argmax[: b // 2, :K] = drafts[: b // 2]  # half the rows agree everywhere ...
    num_draft = torch.randint(0, K + 1, (b,), generator=g)  # ... up to what each row proposed
    n, nxt = greedy_accept_batch(drafts, argmax, num_draft)
    for i in range(b):
        agree = [bool(drafts[i, j] == argmax[i, j]) and j < int(num_draft[i]) for j in range(K)]
        assert int(n[i]) == python_leading_run(agree) and int(nxt[i]) == int(argmax[i, n[i]])


def test_rejection_sampling_keeps_the_prefix_of_its_uniform_draws():
    """Random p and q: n is the prefix of u_j q_j(d_j) < p_j(d_j), the uniforms drawn in the rule's own order."""
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        K, V = 1 + seed % 7, 6
        q = torch.rand(K, V, generator=g).softmax(-1)
        p = (3 * torch.rand(K + 1, V, generator=g)).softmax(-1)
        draft = torch.multinomial(q, 1, generator=g)[:, 0]
        state = g.get_state()
        n, _ = rejection_sample(draft, q, p, g)
        g.set_state(state)
        u = torch.rand(K, generator=g)
        rows = torch.arange(K)
        assert n == python_leading_run((u * q[rows, draft] < p[rows, draft]).tolist())


def test_the_residual_is_the_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.1, 0.2])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([0.3, 0.0, 0.1, 0.0]) / 0.4)
    assert torch.allclose(residual_distribution(p, q, scale=0.5), torch.tensor([0.05, 0.0, 0.0, 0.0]) / 0.05)
    assert torch.equal(residual_distribution(p, p), p)  # nothing left: p itself, not 0 / 0
    assert not residual_distribution(p, q).isnan().any()


# ---------------------------------------------------------------------------
# The teacher-forced views count with the same rule
# ---------------------------------------------------------------------------


def test_teacher_forced_runs_are_the_prefix_of_each_block():
    g = torch.Generator().manual_seed(5)
    correct = torch.rand(50, 8, generator=g) < 0.8
    runs = [python_leading_run(r) for r in correct.tolist()]
    assert acc.leading_runs(correct) == runs == accepted_prefix_length(correct).tolist()
    assert [acc.leading_run(r) for r in correct] == runs
    assert acc.teacher_forced_acceptance_length(correct) == pytest.approx(1 + sum(runs) / len(runs))
    stats = acc.stats_from_teacher_forcing(correct.tolist())
    assert stats.num_accepted_tokens == sum(runs) and stats.acceptance_lengths == [1 + r for r in runs]
    assert acc.leading_runs([[], []]) == [0, 0]


def test_a_ragged_or_empty_teacher_forced_table_is_refused_by_name():
    for bad in ([], [[True, False], [True]], [True, False]):
        with pytest.raises(ValueError, match="correct must be a non-empty"):
            acc.leading_runs(bad)


# ---------------------------------------------------------------------------
# One conditional rate: NaN where no draft got to the position, on counters and schedules alike
# ---------------------------------------------------------------------------


def same(xs, ys) -> bool:
    """Equal lists of rates, NaN matching NaN."""
    return len(xs) == len(ys) and all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y)
                                      for x, y in zip(xs, ys))


def test_a_position_no_draft_reached_has_no_conditional_rate():
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 3)
    for accepted in (1, 1, 0, 1):
        stats.observe_draft(3, accepted)  # no draft got past position 0: position 2 was never reached
    assert stats.num_drafts_reaching_pos == [4, 3, 0]
    assert same(stats.conditional_acceptance_rate, [0.75, 0.0, math.nan])
    assert stats.per_position_acceptance_rate == [0.75, 0.0, 0.0]  # vLLM's logged rate: 0.000 there
    empty = SpecDecodeStats(num_accepted_tokens_per_pos=[0, 0])
    assert same(empty.conditional_acceptance_rate, [math.nan, math.nan])
    assert math.isnan(empty.mean_acceptance_length) and math.isnan(acc.accepted_per_draft(empty))


def test_the_synthetic_schedule_and_the_counters_give_the_same_conditional_rates():
    """The same run as counts (per_pos, drafts) or as shares (r_i) goes through the one definition."""
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 4)
    for accepted in (2, 1, 2, 0, 2):
        stats.observe_draft(4, accepted)
    shares = stats.per_position_acceptance_rate  # [0.8, 0.6, 0.0, 0.0]
    assert same(unconditional_to_conditional_rates(shares), stats.conditional_acceptance_rate)
    assert same(conditional_acceptance_rates(shares), [0.8, 0.75, 0.0, math.nan])
    assert same(acc.conditional_rates(stats), stats.conditional_acceptance_rate)


def test_the_unreachable_rate_draws_as_vllms_zero_does():
    """vLLM writes 0.0 where the lab has NaN; its loop never reads it, and the lab's draws give the same n."""
    from vllm.v1.spec_decode.utils import unconditional_to_conditional_rates as vllm_conditional

    rates = [0.9, 0.5, 0.0, 0.0, 0.0]
    ours, theirs = unconditional_to_conditional_rates(rates), vllm_conditional(rates)
    assert [o for o in ours if not math.isnan(o)] == pytest.approx(theirs[:3]) and all(map(math.isnan, ours[3:]))
    assert make_verifier("synthetic", 5, synthetic_acceptance_rates=rates).conditional_rates[3] != 0.0
    draft, argmax, p = deterministic_block([True] * 5)
    for seed in range(200):
        g_ours, g_theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        assert synthetic_accept(draft, None, p, ours, target_argmax=argmax, generator=g_ours) == \
            synthetic_accept(draft, None, p, theirs, target_argmax=argmax, generator=g_theirs)


def test_the_figure_draws_an_undefined_rate_as_a_gap():
    from dflash_lab import viz

    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 3)
    stats.observe_draft(3, 0)
    bars, line = viz.per_position_acceptance_figure(stats).data
    assert list(line.y) == [0.0, None, None] and list(bars.y) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------
# The verifier's "standard" is the eager loop's rule
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("greedy", [True, False])
def test_the_standard_verifier_is_the_loops_rule(greedy):
    """greedy: greedy_accept on the argmax; sampling: rejection_sample on to_probs(logits), the same draws."""
    verifier = make_verifier("standard", 6)
    to_probs = lambda logits: logits_to_probs(logits, 0.9, top_k=8)  # noqa: E731
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        logits = 3 * torch.randn(7, 12, generator=g)
        q = torch.randn(6, 12, generator=g).softmax(-1)
        draft = torch.where(torch.rand(6, generator=g) < 0.6, logits[:6].argmax(-1),
                            torch.multinomial(q, 1, generator=g)[:, 0])
        g_verifier, g_loop = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        got = verifier(draft, q, logits, to_probs, greedy=greedy, generator=g_verifier)
        want = greedy_accept(draft, logits.argmax(-1)) if greedy else rejection_sample(draft, q, to_probs(logits),
                                                                                        g_loop)
        assert got == want
        assert torch.equal(g_verifier.get_state(), g_loop.get_state())  # the same draws, so the runs stay in step
