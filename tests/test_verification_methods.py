"""vLLM 0.33's four rejection_sample_methods: the lossless ones keep the target's distribution, the lossy ones are measured.

Distribution tests run the accept rule many times on one block whose distributions are the
shipped pair's own (the target's p rows over a real draft, the drafter's q rows), and
compare what is emitted at each index with the target's row there (chi-square). With
greedy drafts (q one-hot) the draft is fixed, so row j is exactly the target's
distribution for emitted index j; with sampled drafts the target is run on every sampled
draft, and index 0 (whose distribution does not depend on the draft) is tested.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dflash_lab.assets import heldout_prompts, load_default_pair
from dflash_lab.spec_decode import speculative_generate
from dflash_lab.spec_decode.proposers import dflash_draft_logits
from dflash_lab.spec_decode.sampling import (
    block_verify,
    fly_accept,
    fly_entropy,
    make_verifier,
    rejection_sample,
    synthetic_accept,
    unconditional_to_conditional_rates,
)

N = 4000  # accept-rule calls per distribution test


def chi2_pvalue(samples, probs) -> float:
    """Goodness of fit of integer samples to probs; cells expected < 5 are pooled."""
    probs = np.asarray(probs, dtype=np.float64)
    counts = np.bincount(np.asarray(samples), minlength=len(probs)).astype(np.float64)
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def emitted_by_index(accept, draft, q, p, n, seed=0):
    """tokens[j]: the j-th token emitted by one verification of the fixed draft, over n runs."""
    g = torch.Generator().manual_seed(seed)
    tokens = [[] for _ in range(draft.shape[0] + 1)]
    for _ in range(n):
        k, nxt = accept(draft, q, p, g)
        for j, tok in enumerate(draft[:k].tolist() + [nxt]):
            tokens[j].append(tok)
    return tokens


# ---------------------------------------------------------------------------
# One real block of the shipped pair
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    target, drafter, tok = load_default_pair("cpu", dtype=torch.float32)
    return target, drafter, tok


def real_block(shipped, block_size=8, prompt_index=10, temperature=1.0):
    """(prompt + x1 ids, draft logits (K, V), target logits over the greedy draft (K+1, V))."""
    target, drafter, tok = shipped
    prompt = tok(heldout_prompts()[prompt_index]["text"])["input_ids"][-32:]
    r = speculative_generate(target, drafter, prompt, max_new_tokens=1, block_size=block_size)
    ids = r.output_ids[0].tolist()
    with torch.no_grad():
        draft_logits = dflash_draft_logits(drafter, target, r.context, ids[-1], block_size) / temperature
        draft = draft_logits.argmax(-1)
        logits = target(torch.tensor([ids + draft.tolist()])).logits[0, len(ids) - 1:] / temperature
    return ids, draft_logits, logits


@pytest.fixture(scope="module")
def greedy_block(shipped):
    ids, draft_logits, logits = real_block(shipped)
    return draft_logits.argmax(-1), logits.softmax(-1)  # drafts, p (K+1, V)


@pytest.mark.parametrize("accept", [rejection_sample, block_verify], ids=["standard", "block"])
def test_lossless_methods_emit_the_targets_distribution_on_the_shipped_pair(greedy_block, accept):
    draft, p = greedy_block
    tokens = emitted_by_index(accept, draft, None, p, N)
    tested = 0
    for j, toks in enumerate(tokens):
        if len(toks) >= 200:
            assert chi2_pvalue(toks, p[j]) > 1e-3, f"emitted index {j} is not distributed as the target's row {j}"
            tested += 1
    assert tested >= 3, f"only {tested} indices were emitted often enough: the block is too short to test"


def test_with_greedy_drafts_block_verification_accepts_exactly_as_standard(greedy_block):
    """A one-hot q leaves block verification nothing to gain: P(n >= j) = w_j = prod_{i<=j} p_i(d_i) for both
    rules (vLLM's default draft_sample_method="greedy"). Both are checked against that exact law."""
    draft, p = greedy_block
    w = torch.cumprod(p[torch.arange(len(draft)), draft].double(), 0).numpy()
    for accept in (rejection_sample, block_verify):
        g = torch.Generator().manual_seed(1)
        kept = np.array([accept(draft, None, p, g)[0] for _ in range(N)])
        for j, wj in enumerate(w):
            assert abs((kept > j).mean() - wj) < 4.5 * math.sqrt(wj * (1 - wj) / N) + 1e-9, (accept.__name__, j)


def toy_block(V=6, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)  # target rows (fixed: a valid target)
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)  # drafter rows
    return p, q, torch.multinomial(q, N, replacement=True, generator=g).T  # drafts d_j ~ q_j


def emitted_with_sampled_drafts(accept, p, q, drafts, seed=2):
    gen = torch.Generator().manual_seed(seed)
    tokens, kept = [[] for _ in range(q.shape[0] + 1)], []
    for d in drafts:
        k, nxt = accept(d, q, p, gen)
        kept.append(k)
        for j, tok in enumerate(d[:k].tolist() + [nxt]):
            tokens[j].append(tok)
    return tokens, np.array(kept)


def test_with_sampled_drafts_block_verification_is_lossless_and_keeps_more():
    p, q, drafts = toy_block()
    tokens, kept = emitted_with_sampled_drafts(block_verify, p, q, drafts)
    for j, toks in enumerate(tokens):
        assert chi2_pvalue(toks, p[j]) > 1e-3, f"emitted index {j} is not distributed as the target's row {j}"
    beta = torch.minimum(p[:-1], q).sum(-1).double()  # standard accepts position j with prob beta_j
    standard_exact = float(torch.cumprod(beta, 0).sum())
    assert kept.mean() - standard_exact > 5 * kept.std() / math.sqrt(N), (kept.mean(), standard_exact)


def test_a_block_rule_without_the_joint_weight_in_its_residual_fails_the_same_test():
    """The test has the power to catch a wrong residual (here: p_n - q_n instead of w_n p_n - q_n)."""
    p, q, drafts = toy_block()

    def unweighted(d, q_, p_, gen):
        n, _ = block_verify(d, q_, p_, gen)
        if n == 3:
            return n, int(torch.multinomial(p_[3], 1, generator=gen))
        r = (p_[n] - q_[n]).clamp_min(0)
        return n, int(torch.multinomial(r / r.sum(), 1, generator=gen))

    tokens, _ = emitted_with_sampled_drafts(unweighted, p, q, drafts)
    assert min(chi2_pvalue(toks, p[j]) for j, toks in enumerate(tokens)) < 1e-3


@pytest.fixture(scope="module")
def sampled_block(shipped):
    """Drafts sampled from the shipped drafter's q (block 4), each with its own target rows (one batched forward)."""
    target, drafter, _ = shipped
    ids, draft_logits, _ = real_block(shipped, block_size=4)
    q = draft_logits.softmax(-1)  # (3, V); DFlash drafts every position at once, so q does not depend on the draft
    drafts = torch.multinomial(q, 800, replacement=True, generator=torch.Generator().manual_seed(5)).T  # (n, 3)
    with torch.no_grad():
        seqs = torch.cat([torch.tensor([ids]).expand(drafts.shape[0], -1), drafts], 1)
        p_all = target(seqs).logits[:, len(ids) - 1:].softmax(-1)  # (n, 4, V)
    return q, drafts, p_all


@pytest.mark.slow
@pytest.mark.parametrize("accept", [rejection_sample, block_verify], ids=["standard", "block"])
def test_lossless_methods_with_sampled_drafts_keep_the_first_token_distributed_as_the_target(sampled_block, accept):
    q, drafts, p_all = sampled_block
    g = torch.Generator().manual_seed(6)
    first = [(d[0].item() if k > 0 else nxt) for d, p in zip(drafts, p_all) for k, nxt in [accept(d, q, p, g)]]
    assert chi2_pvalue(first, p_all[0, 0]) > 1e-3


# ---------------------------------------------------------------------------
# FLy: lossy, and by how much
# ---------------------------------------------------------------------------


def total_variation(samples, probs) -> float:
    counts = np.bincount(np.asarray(samples), minlength=len(probs)) / len(samples)
    return 0.5 * float(np.abs(counts - np.asarray(probs, dtype=np.float64)).sum())


def test_fly_departs_from_the_target_where_its_gate_opens_and_nowhere_else():
    """A block built so that FLy's gate opens at index 0: the target is uncertain there (top-3 entropy
    ~1) and the next drafts are the target's near-certain choices. FLy then emits the draft at index 0
    far more often than the target would (measured as a total-variation distance); with an
    unreachable entropy threshold FLy is standard rejection sampling and the distance is noise."""
    V, K = 8, 4
    p = torch.full((K + 1, V), 1e-4)
    p[0, :4] = 0.25  # uncertain: entropy over the top 3 = 3 * 0.25 ln 4 ~ 1.04 > 0.3
    p[1:, 1] = 1.0  # the rest of the block: certain
    p = p / p.sum(-1, keepdim=True)
    draft = torch.tensor([0, 1, 1, 1])
    ent = fly_entropy(p[:-1])
    results = {}
    for threshold in (0.3, math.inf):
        accept = lambda d, q, p_, g, t=threshold: fly_accept(d, q, p_, ent, window=2, threshold=t, generator=g)  # noqa: E731
        first = emitted_by_index(accept, draft, None, p, N)[0]
        results[threshold] = (total_variation(first, p[0]), chi2_pvalue(first, p[0]))
    tv, pval = results[0.3]
    assert tv > 0.6 and pval < 1e-6, results  # the draft is kept ~always instead of 25 % of the time
    tv_off, pval_off = results[math.inf]
    assert tv_off < 0.05 and pval_off > 1e-3, results


def test_fly_at_greedy_keeps_a_deferred_draft_the_target_would_not_have_chosen():
    V = 8
    logits = torch.zeros(4, V)
    logits[0, :3] = 5.0  # flat top-3 at index 0: high entropy; argmax is token 0
    logits[0, 0] += 0.01
    logits[1:, 2] = 20.0  # later indices: the target surely picks 2
    probs = logits.softmax(-1)
    draft = torch.tensor([1, 2, 2])  # index 0 disagrees with the argmax, then 2 natively accepted drafts
    argmax = logits.argmax(-1)
    n, nxt = fly_accept(draft, None, probs, fly_entropy(probs[:-1]), window=2, target_argmax=argmax)
    assert (n, nxt) == (3, 2)  # deferred at 0, confirmed by the window, then the bonus
    n, nxt = fly_accept(draft, None, probs, fly_entropy(probs[:-1]), window=2, threshold=10.0, target_argmax=argmax)
    assert (n, nxt) == (0, 0)  # gate shut: the standard greedy answer
    n, _ = fly_accept(torch.tensor([1, 2, 5]), None, probs, fly_entropy(probs[:-1]), window=2, target_argmax=argmax)
    assert n == 0  # a window that is not all natively accepted does not defer


def test_fly_at_greedy_defers_on_a_finite_target_logit_even_where_its_softmax_underflows():
    """vLLM's greedy FLy kernel asks the target's raw logit of the draft to be above -inf
    (v1/spec_decode/fly.py:82-87), not its probability: a logit 200 below the rest underflows to
    p = 0 in float32 and still defers. Given no logits, fly_accept can only ask p > 0."""
    V = 8
    logits = torch.full((4, V), -200.0)
    logits[0, :3] = 5.0  # uncertain at index 0: high top-3 entropy
    logits[1:, 2] = 20.0
    draft = torch.tensor([3, 2, 2])  # index 0: a token whose softmax is exactly 0 in float32
    probs = logits.softmax(-1)
    assert probs[0, 3] == 0 and logits[0, 3] > -math.inf
    verifier = make_verifier("fly", 3, fly_window_size=2)
    assert verifier(draft, None, logits, None, greedy=True) == (3, 2)  # deferred, as vLLM
    logits[0, 3] = -math.inf  # impossible for the target: never deferred
    assert verifier(draft, None, logits, None, greedy=True)[0] == 0
    n, _ = fly_accept(draft, None, probs, fly_entropy(probs[:-1]), window=2, target_argmax=probs.argmax(-1))
    assert n == 0  # without the logits, p = 0 is all fly_accept can see


def test_fly_when_sampling_never_defers_a_draft_the_drafter_gave_probability_zero():
    """vLLM's sampled FLy kernel defers only where q(d) > 0 and p(d) > 0 (fly.py:140-147)."""
    V, K = 8, 3
    p = torch.full((K + 1, V), 1e-3)
    p[0, :4] = 0.25
    p[1:, 1] = 1.0
    p = p / p.sum(-1, keepdim=True)
    draft = torch.tensor([5, 1, 1])
    q = torch.zeros(K, V)
    q[:, 1] = 1.0  # index 0's draft has q = 0 (it could not have been sampled from q) ...
    ent = fly_entropy(p[:-1])
    g = torch.Generator().manual_seed(0)
    assert all(fly_accept(draft, q, p, ent, window=2, generator=g)[0] == 0 for _ in range(50))
    q[0, 5], q[0, 1] = 0.5, 0.5  # ... with q > 0 the same block defers at index 0 whenever it is rejected
    assert all(fly_accept(draft, q, p, ent, window=2, generator=g)[0] == 3 for _ in range(50))


def test_fly_through_the_loop_matches_standard_when_the_gate_is_shut(shipped):
    target, drafter, tok = shipped
    prompt = tok(heldout_prompts()[2]["text"])["input_ids"][-32:]
    kw = dict(max_new_tokens=16, block_size=8, temperature=1.0, seed=3)
    std = speculative_generate(target, drafter, prompt, **kw)
    shut = speculative_generate(target, drafter, prompt, rejection_sample_method="fly", fly_entropy_threshold=1e9, **kw)
    greedy = speculative_generate(target, drafter, prompt, max_new_tokens=16, block_size=8)
    fly_greedy = speculative_generate(target, drafter, prompt, max_new_tokens=16, block_size=8,
                                      rejection_sample_method="fly", fly_entropy_threshold=1e9)
    assert std.new_token_ids == shut.new_token_ids  # same uniforms, same decisions
    assert greedy.new_token_ids == fly_greedy.new_token_ids


# ---------------------------------------------------------------------------
# Synthetic acceptance: the per-position rates are the ones asked for
# ---------------------------------------------------------------------------

RATES = [0.9, 0.75, 0.6, 0.4, 0.3, 0.15, 0.05]


def test_conditional_rates_are_vllms():
    """vLLM's c_i = r_i / r_{i-1} wherever a draft can get to i; where none can (r_{i-1} = 0) vLLM writes a 0.0
    its sampler never reads and the lab NaN, its one answer for a position no draft reached (test_accept_core.py)."""
    from vllm.v1.spec_decode.utils import unconditional_to_conditional_rates as vllms

    ours = unconditional_to_conditional_rates([0.8, 0.4, 0.0, 0.0])
    assert ours[:3] == pytest.approx([0.8, 0.5, 0.0]) == vllms([0.8, 0.4, 0.0, 0.0])[:3] and math.isnan(ours[3])


@pytest.mark.parametrize("greedy", [True, False])
def test_synthetic_acceptance_hits_the_given_per_position_rates(greedy_block, greedy):
    draft, p = greedy_block
    conditional = unconditional_to_conditional_rates(RATES)
    g = torch.Generator().manual_seed(4)
    argmax = p.argmax(-1) if greedy else None
    kept = np.array([synthetic_accept(draft, None, p, conditional, target_argmax=argmax, generator=g)[0]
                     for _ in range(N)])
    for i, r in enumerate(RATES):
        rate = (kept > i).mean()
        assert abs(rate - r) < 4.5 * math.sqrt(r * (1 - r) / N) + 1e-9, (i, rate, r)


def test_synthetic_through_the_loop_counts_the_given_rates(shipped):
    target, drafter, tok = shipped
    stats = None
    for i, prompt in enumerate(heldout_prompts()[:1]):
        ids = tok(prompt["text"])["input_ids"][-32:]
        r = speculative_generate(target, drafter, ids, max_new_tokens=64, block_size=8, temperature=0.0, seed=i,
                                 rejection_sample_method="synthetic", synthetic_acceptance_rates=RATES)
        stats = r.stats if stats is None else stats + r.stats
    n = stats.num_drafts
    for i, (got, r) in enumerate(zip(stats.per_position_acceptance_rate, RATES)):
        assert abs(got - r) < 4.5 * math.sqrt(r * (1 - r) / n) + 1e-9, (i, got, r, n)


# ---------------------------------------------------------------------------
# Greedy stays greedy; bad settings are refused by name
# ---------------------------------------------------------------------------


def test_greedy_standard_and_block_are_the_targets_greedy_output(shipped):
    target, drafter, tok = shipped
    prompt = tok(heldout_prompts()[0]["text"])["input_ids"][-32:]
    expected = target.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    for method in ("standard", "block"):
        r = speculative_generate(target, drafter, prompt, max_new_tokens=16, block_size=8, rejection_sample_method=method)
        assert torch.equal(r.output_ids, expected), method


@pytest.mark.parametrize("kwargs, message", [
    (dict(rejection_sample_method="typical"), "rejection_sample_method must be one of"),
    (dict(rejection_sample_method="synthetic"), "exactly one of"),
    (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.5] * 6), "must have length 7"),
    (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=[1.5] + [0.5] * 6), "in [0, 1]"),
    (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.2, 0.5] + [0.1] * 5), "non-increasing"),
    (dict(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.5] * 7, synthetic_acceptance_length=2.0),
     "exactly one of"),
    (dict(rejection_sample_method="synthetic", synthetic_acceptance_length=9.5), "synthetic_acceptance_length"),
    (dict(rejection_sample_method="standard", synthetic_acceptance_rates=[0.5] * 7), "only valid with"),
    (dict(rejection_sample_method="fly", fly_window_size=7), "fly_window_size must be"),
    (dict(rejection_sample_method="block", fly_window_size=0), "fly_window_size must be None or an integer >= 1"),
    (dict(rejection_sample_method="fly", fly_entropy_top_k=0), "fly_entropy_top_k"),
])
def test_bad_verification_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        make_verifier(num_speculative_tokens=7, **kwargs)


def test_fly_needs_two_speculative_tokens_and_defaults_its_window_as_vllm():
    with pytest.raises(ValueError, match="block_size >= 3"):
        make_verifier("fly", 1)
    assert make_verifier("fly", 15).fly_window_size == 6 and make_verifier("fly", 3).fly_window_size == 2
    assert make_verifier("synthetic", 3, synthetic_acceptance_length=2.5).conditional_rates == \
        pytest.approx(unconditional_to_conditional_rates([1.0, 0.5, 0.0]))


def test_the_benchmarks_interval_is_a_t_interval_over_prompts():
    from dflash_lab.measure.verification import interval

    mean, lo, hi = interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5) and mean - lo == hi - mean
    assert math.isnan(interval([2.0])[1])


def test_the_verification_explorer_reruns_and_redraws_on_every_control():
    from test_spec_decode import small_drafter, small_target

    from dflash_lab.widgets import verification_explorer

    target = small_target(vocab=64, max_positions=128, layers=2)
    drafter = small_drafter(target, block_size=16, layers=1)
    box = verification_explorer(target, drafter, [[5, 6, 7, 8]], max_new_tokens=6)
    seen = {box.figure.layout.title.text}
    assert len(box.figure.data) == 2  # T = 1: greedy and probabilistic drafts
    box.method.value = "block"
    box.temperature.value = 0.0
    assert len(box.figure.data) == 1  # greedy decoding: one draft mode
    seen.add(box.figure.layout.title.text)
    box.block_size.value = 16
    seen.add(box.figure.layout.title.text)
    assert len(box.figure.data[0].y) == 15 and len(seen) == 3
    assert all(r["method"] == "block" and r["block_size"] == 16 for r in box.rows())
