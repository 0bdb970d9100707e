"""Speculative decoding is lossless, counts acceptance the way vLLM does, and refuses bad input.

Exactness tests run in float32 (bf16 greedy comparisons flip on near-ties).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from dflash_lab import spec_decode
from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.spec_decode import (
    PromptLookupDrafter,
    SpecDecodeStats,
    crop_cache,
    greedy_accept,
    logits_to_probs,
    new_target_cache,
    prompt_lookup,
    rejection_sample,
    speculative_generate,
)
from dflash_lab.target import build_target, target_forward, tiny_laguna_config

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# Small pairs
# ---------------------------------------------------------------------------


def small_target(vocab=512, max_positions=256, seed=0, lm_head_std=None, layers=4):
    """A small hybrid Laguna (sliding window 8, so every test crosses the window)."""
    cfg = tiny_laguna_config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        sliding_window=8, mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, max_position_embeddings=max_positions,
    )
    target = build_target(cfg, seed=seed).float()
    if lm_head_std is not None:  # sharper, more distinct distributions for the sampling tests
        with torch.no_grad():
            target.lm_head.weight.normal_(0, lm_head_std, generator=torch.Generator().manual_seed(seed + 1))
    return target


def small_drafter(target, block_size=8, seed=1, layers=2):
    c = target.config
    cfg = DFlashDrafterConfig(
        hidden_size=c.hidden_size, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, layer_types=["full_attention"] * layers, draft_vocab_size=c.vocab_size,
        target_layer_ids=[0, c.num_hidden_layers - 1], mask_token_id=3, block_size=block_size, target_layer_count=c.num_hidden_layers,
    )
    torch.manual_seed(seed)
    return DFlashLagunaDrafter(cfg).eval()


@pytest.fixture(scope="module")
def pair():
    target = small_target()
    return target, small_drafter(target)


PROMPTS = [[5, 17, 99, 230, 17, 99], [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411], [42] * 3]


def target_greedy(target, prompt, max_new_tokens, eos=None):
    ids = torch.tensor([prompt])
    return target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)


def oracle_draft_logits(reference: list[int], vocab: int):
    """A stand-in for the drafter that proposes the target's own greedy continuation with
    one deliberate error per block, at a position that cycles 0, 1, .., K-1, none, none:
    every acceptance length from 1 to K+1 occurs, so every crop/append path runs."""
    calls = {"n": 0}

    def draft(drafter, target, context, last_token, block_size):
        t, K = context.length, block_size - 1
        tokens = torch.tensor(reference[t + 1:t + 1 + K])
        wrong = calls["n"] % (K + 2)
        calls["n"] += 1
        if wrong < len(tokens):
            tokens[wrong] = (tokens[wrong] + 1) % vocab
        return torch.nn.functional.one_hot(tokens, vocab).float() * 10  # (K, V) logits

    return draft


# ---------------------------------------------------------------------------
# Greedy: token-for-token the target's own output
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_greedy_output_matches_target_generate(pair, block_size):
    target, drafter = pair
    for prompt in PROMPTS:
        expected = target_greedy(target, prompt, 20)
        result = speculative_generate(target, drafter, torch.tensor([prompt]), max_new_tokens=20, block_size=block_size)
        assert torch.equal(result.output_ids, expected), f"prompt {prompt}, block {block_size}"


@pytest.mark.parametrize("block_size", [2, 5, 8])
def test_greedy_is_lossless_for_every_acceptance_length(pair, block_size, monkeypatch):
    target, drafter = pair
    prompt, n_new = PROMPTS[1], 30
    reference = target_greedy(target, prompt, n_new + block_size)[0].tolist()
    monkeypatch.setattr(spec_decode.proposers, "dflash_draft_logits", oracle_draft_logits(reference, target.config.vocab_size))
    result = speculative_generate(target, drafter, torch.tensor([prompt]), max_new_tokens=n_new, block_size=block_size)
    assert result.output_ids[0].tolist() == reference[:len(prompt) + n_new]
    lengths = set(result.stats.acceptance_lengths)
    assert lengths == set(range(1, block_size + 1)), f"acceptance lengths seen: {sorted(lengths)}"


def test_drafter_context_grows_by_accepted_positions_only(pair, monkeypatch):
    """The context K/V built step by step equals one precompute over the accepted sequence."""
    target, drafter = pair
    prompt, n_new, block_size = PROMPTS[0], 25, 6
    reference = target_greedy(target, prompt, n_new + block_size)[0].tolist()
    monkeypatch.setattr(spec_decode.proposers, "dflash_draft_logits", oracle_draft_logits(reference, target.config.vocab_size))
    result = speculative_generate(target, drafter, torch.tensor([prompt]), max_new_tokens=n_new, block_size=block_size)
    context = result.context
    assert context.length == result.steps[-1].position - 1  # everything before the last step's x_t
    with torch.no_grad():
        aux = target_forward(target, result.output_ids[:, :context.length], drafter.config.target_layer_ids).aux_hidden[0]
        k, v = drafter.precompute_context_kv(drafter.combine_hidden_states(aux), torch.arange(context.length))
    got_k, got_v = context.kv()
    torch.testing.assert_close(got_k, k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_v, v, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size", [3, 8])
def test_prompt_lookup_greedy_matches_target_generate(pair, block_size):
    target, _ = pair
    for prompt in PROMPTS:
        expected = target_greedy(target, prompt, 24)
        result = speculative_generate(target, "ngram", torch.tensor([prompt]), max_new_tokens=24, block_size=block_size)
        assert torch.equal(result.output_ids, expected)


class OracleProposer:
    """A model-free proposer (like prompt lookup) that knows the target's greedy continuation.
    Its drafts cycle through: wrong at position 0, 1, .., K-1; all right; short; none."""

    block_size, max_block_size = 6, None

    def __init__(self, reference: list[int]):
        self.reference, self.calls = reference, 0

    def propose(self, tokens, num_draft):
        draft = self.reference[len(tokens):len(tokens) + num_draft]
        case, self.calls = self.calls % (num_draft + 3), self.calls + 1
        if case < num_draft:
            draft[case] += 1
        return {num_draft + 1: draft[:2], num_draft + 2: []}.get(case, draft)


def test_a_proposer_object_drafts_in_the_same_loop_and_statistics(pair):
    target, _ = pair
    prompt, n_new = PROMPTS[0], 40
    reference = target_greedy(target, prompt, n_new + 8)[0].tolist()
    r = speculative_generate(target, OracleProposer(reference), prompt, max_new_tokens=n_new)
    assert r.output_ids[0].tolist() == reference[:len(prompt) + n_new]
    drafted = [st for st in r.steps if st.draft_ids]
    assert len(drafted) < len(r.steps) - 1  # some steps found no draft: they are not drafts
    assert r.stats.num_drafts == len(drafted)
    assert r.stats.num_draft_tokens == sum(len(st.draft_ids) for st in drafted)
    assert r.stats.num_accepted_tokens_per_pos == [sum(st.num_accepted > i for st in drafted) for i in range(5)]
    assert set(r.stats.acceptance_lengths) == set(range(1, 7))


def test_prompt_lookup_proposes_what_vllms_ngram_proposer_proposes():
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as vllm_ngram

    rng = np.random.default_rng(0)
    for trial in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()  # a small alphabet: many matches
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        expected = vllm_ngram(np.array(tokens, dtype=np.int32), lo, hi, 10_000, k).tolist()
        assert prompt_lookup(tokens, k, lo, hi) == expected, (tokens, lo, hi, k)


# ---------------------------------------------------------------------------
# Sampling: the output is distributed as the target's own samples
# ---------------------------------------------------------------------------


def chi2_pvalue(samples, probs) -> float:
    """Goodness of fit of integer samples to probs; cells expected < 5 are pooled."""
    probs = np.asarray(probs, dtype=np.float64)
    counts = np.bincount(np.asarray(samples), minlength=len(probs)).astype(np.float64)
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def toy_distributions(V=6, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(K + 1, V, generator=g) * 1.5, -1)  # target, one row per block position
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)  # drafter
    return p, q


def blind_accept(draft_ids, draft_probs, target_probs, generator=None):
    """WRONG: keep every draft."""
    K = draft_ids.shape[0]
    return K, int(torch.multinomial(target_probs[K], 1, generator=generator))


def resample_from_target(draft_ids, draft_probs, target_probs, generator=None):
    """WRONG: the right acceptance test, but on rejection draw from p instead of the residual (p - q)+."""
    K = draft_ids.shape[0]
    rows = torch.arange(K)
    p, q = target_probs[rows, draft_ids], draft_probs[rows, draft_ids]
    u = torch.rand(K, generator=generator)
    n = int((u * q < p).int().cumprod(0).sum())
    return n, int(torch.multinomial(target_probs[n], 1, generator=generator))


def emitted_tokens_by_index(accept, p, q, n_samples, seed=0):
    """Run one block many times; tokens[j] = the j-th emitted token over the runs that emitted one."""
    g = torch.Generator().manual_seed(seed)
    K = q.shape[0]
    tokens = [[] for _ in range(K + 1)]
    drafts = torch.multinomial(q, n_samples, replacement=True, generator=g).T  # (n, K): d_j ~ q_j
    for d in drafts:
        n, nxt = accept(d, q, p, g)
        for j, tok in enumerate(d[:n].tolist() + [nxt]):
            tokens[j].append(tok)
    return tokens


def test_rejection_sampling_emits_the_target_distribution_at_every_index():
    p, q = toy_distributions()
    tokens = emitted_tokens_by_index(rejection_sample, p, q, 8_000)
    for j, toks in enumerate(tokens):
        assert len(toks) > 300, f"index {j} emitted only {len(toks)} times: the toy pair is too far apart"
        assert chi2_pvalue(toks, p[j]) > 1e-3, f"emitted index {j} is not distributed as the target's row {j}"


def test_rejection_sampling_with_deterministic_drafts_emits_the_target_distribution():
    """Prompt-lookup drafts carry no probabilities (q is one-hot), as in vLLM."""
    p, _ = toy_distributions()
    g = torch.Generator().manual_seed(3)
    draft = torch.tensor([2, 0, 4])
    first = []
    for _ in range(8_000):
        n, nxt = rejection_sample(draft, None, p, g)
        first.append(draft[0].item() if n > 0 else nxt)
    assert chi2_pvalue(first, p[0]) > 1e-3


@pytest.mark.parametrize("wrong", [blind_accept, resample_from_target], ids=lambda f: f.__name__)
def test_a_wrong_acceptance_rule_fails_the_same_test(wrong):
    p, q = toy_distributions()
    tokens = emitted_tokens_by_index(wrong, p, q, 8_000)
    assert chi2_pvalue(tokens[0], p[0]) < 1e-6


@pytest.fixture(scope="module")
def toy_pair():
    """A 16-token vocabulary with a sharp lm_head, so target and drafter disagree a lot."""
    target = small_target(vocab=16, max_positions=64, seed=3, lm_head_std=0.25, layers=2)
    drafter = small_drafter(target, block_size=4, seed=4, layers=1)
    return target, drafter


def first_speculated_tokens(toy_pair, n_samples, draft_sample_method="greedy"):
    """Sample prompt -> x1 (from the prefill) -> x2 (the first drafted position) n times."""
    target, drafter = toy_pair
    prompt = torch.tensor([[1, 7, 9, 4, 12]])
    pairs = []
    for seed in range(n_samples):
        r = speculative_generate(target, drafter, prompt, max_new_tokens=2, block_size=4, temperature=1.0, seed=seed,
                                 draft_sample_method=draft_sample_method)
        pairs.append(r.new_token_ids)
    return np.array(pairs)


def target_marginals(target, prompt=(1, 7, 9, 4, 12)):
    """Exact P(x1) and P(x2) = sum_x1 P(x1) P(x2 | x1) under the target."""
    V = target.config.vocab_size
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([list(prompt)])).logits[0, -1].double(), -1)  # (V,)
        ids = torch.cat([torch.tensor([list(prompt)]).expand(V, -1), torch.arange(V)[:, None]], 1)  # every x1
        p2_given_1 = torch.softmax(target(ids).logits[:, -1].double(), -1)  # (V, V)
    return p1.numpy(), (p1[:, None] * p2_given_1).sum(0).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_speculative_sampling_follows_the_target_distribution(toy_pair, monkeypatch, draft_sample_method):
    """The first generated token comes from the target's prefill; the second is the first
    drafted position, so its marginal is where a wrong acceptance rule shows. Both of vLLM's
    draft_sample_methods must be lossless."""
    target, drafter = toy_pair
    p1, p2 = target_marginals(target)
    samples = first_speculated_tokens(toy_pair, 400, draft_sample_method)
    assert chi2_pvalue(samples[:, 0], p1) > 1e-3
    assert chi2_pvalue(samples[:, 1], p2) > 1e-3

    monkeypatch.setattr(spec_decode.sampling, "rejection_sample", blind_accept)  # the rule the verifier calls
    wrong = first_speculated_tokens(toy_pair, 400, draft_sample_method)
    assert chi2_pvalue(wrong[:, 1], p2) < 1e-6, "the test cannot tell blind acceptance from rejection sampling"


@pytest.mark.parametrize("draft_sample_method", ["greedy", "probabilistic"])
def test_draft_sample_method_decides_how_drafts_are_chosen(pair, monkeypatch, draft_sample_method):
    """vLLM's default ("greedy") drafts the drafter's argmax even when sampling; "probabilistic" samples from q."""
    target, drafter = pair
    seen = []
    original = spec_decode.proposers.dflash_draft_logits

    def recording(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(spec_decode.proposers, "dflash_draft_logits", recording)
    r = speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=24, block_size=8, temperature=1.0, seed=3,
                             draft_sample_method=draft_sample_method)
    drafts = [torch.tensor(s.draft_ids) for s in r.steps if s.draft_ids]
    argmax_drafts = [logits.argmax(-1) for logits in seen]
    assert len(drafts) == len(argmax_drafts) >= 3
    same = all(torch.equal(d, a[: len(d)]) for d, a in zip(drafts, argmax_drafts))
    assert same is (draft_sample_method == "greedy")
    assert r.stats.draft_sample_method == draft_sample_method


def test_sampled_drafts_and_their_q_use_the_temperature_only_as_vllms(pair, monkeypatch):
    """Issue 31: vLLM drafts with the temperature only, for the draft sample and for q (V1's
    compute_probs_and_sample_next_token, run here on the CPU; V2 the same); top-k / top-p shape
    the target's p alone. With top_k=1 the target keeps one token, so a sampled draft off the
    target's argmax is always rejected, while q still spreads over the whole vocabulary."""
    from types import SimpleNamespace

    from vllm.v1.spec_decode.llm_base_proposer import compute_probs_and_sample_next_token

    target, drafter = pair
    seen = []
    original = spec_decode.loop._propose

    def recording(*args, **kwargs):
        draft, q, proposal = original(*args, **kwargs)
        seen.append((draft, q))
        return draft, q, proposal

    logits_seen = []
    original_logits = spec_decode.proposers.dflash_draft_logits
    monkeypatch.setattr(spec_decode.proposers, "dflash_draft_logits",
                        lambda *a, **k: logits_seen.append(original_logits(*a, **k)) or logits_seen[-1])
    monkeypatch.setattr(spec_decode.loop, "_propose", recording)
    T = 0.7
    r = speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=24, block_size=8, temperature=T, top_k=1,
                             seed=5, draft_sample_method="probabilistic")
    assert len(seen) == len(logits_seen) >= 3
    for (_, q), logits in zip(seen, logits_seen):
        metadata = SimpleNamespace(all_greedy=False, all_random=True, temperature=torch.full((logits.shape[0],), T),
                                   top_k=torch.ones(logits.shape[0], dtype=torch.long), top_p=None)
        _, vllm_q = compute_probs_and_sample_next_token(logits.clone(), metadata)
        torch.testing.assert_close(q, vllm_q)
        assert ((q > 0).sum(-1) > 1).all()  # not cut to the target's top-1
    for step in r.steps[1:]:  # top_k=1: the target's kept set is its argmax, so only argmax drafts survive
        assert step.draft_ids[:step.num_accepted] == step.target_argmax[:step.num_accepted]
        if step.num_accepted < len(step.draft_ids):
            assert step.draft_ids[step.num_accepted] != step.target_argmax[step.num_accepted]
    assert r.output_ids.tolist() == target_greedy(target, PROMPTS[0], 24).tolist()  # top_k=1 is greedy, losslessly


def test_a_block_larger_than_the_trained_one_runs_as_in_vllm(pair):
    """vLLM checks num_speculative_tokens against nothing but the config's presence (issue 31):
    the lab runs a block above dflash_config.block_size too, still the target's greedy output."""
    target, drafter = pair
    trained = drafter.config.block_size
    r = speculative_generate(target, drafter, torch.tensor([PROMPTS[1]]), max_new_tokens=20, block_size=trained + 3)
    assert torch.equal(r.output_ids, target_greedy(target, PROMPTS[1], 20))
    assert len(r.stats.num_accepted_tokens_per_pos) == trained + 2
    assert max(len(s.draft_ids) for s in r.steps) == trained + 2


def test_greedy_decoding_records_no_draft_sample_method(pair):
    target, drafter = pair
    r = speculative_generate(target, drafter, PROMPTS[0], max_new_tokens=6, block_size=4)
    assert r.stats.draft_sample_method is None


def test_seeded_sampling_is_reproducible(pair):
    target, drafter = pair
    kw = dict(max_new_tokens=12, block_size=4, temperature=0.8, top_p=0.9, top_k=50)
    a = speculative_generate(target, drafter, PROMPTS[0], seed=7, **kw)
    b = speculative_generate(target, drafter, PROMPTS[0], seed=7, **kw)
    assert torch.equal(a.output_ids, b.output_ids)


def test_logits_processing_greedy_top_k_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    assert logits_to_probs(logits, 0.0).tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    top2 = logits_to_probs(logits, 1.0, top_k=2)
    assert (top2[0, 2:] == 0).all() and math.isclose(top2.sum().item(), 1.0, rel_tol=1e-6)
    probs = logits_to_probs(logits, 1.0)
    top_p = logits_to_probs(logits, 1.0, top_p=float(probs[0, :2].sum()) - 1e-3)  # needs the top 2 to reach it
    assert (top_p[0, :2] > 0).all() and (top_p[0, 2:] == 0).all()
    assert logits_to_probs(logits, 1.0, top_p=1e-6)[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # always the top token
    hot = logits_to_probs(logits, 0.5)
    assert hot[0, 0] > probs[0, 0]  # a lower temperature sharpens


def test_greedy_accept_keeps_the_agreeing_prefix_then_the_targets_token():
    assert greedy_accept(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 9, 1])) == (2, 9)
    assert greedy_accept(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 6, 1])) == (3, 1)  # bonus
    assert greedy_accept(torch.tensor([4, 5, 6]), torch.tensor([7, 5, 6, 1])) == (0, 7)  # a later match does not count
    assert greedy_accept(torch.tensor([], dtype=torch.long), torch.tensor([3])) == (0, 3)


# ---------------------------------------------------------------------------
# Statistics: vLLM's definitions
# ---------------------------------------------------------------------------


def test_stats_follow_vllms_definitions():
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    ours, theirs = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 4), SpecDecodingStats.new(4)
    for accepted in [0, 4, 2, 1, 4, 3, 0]:
        ours.observe_draft(4, accepted)
        theirs.observe_draft(4, accepted)
    assert ours.num_drafts == theirs.num_drafts == 7
    assert ours.num_draft_tokens == theirs.num_draft_tokens == 28
    assert ours.num_accepted_tokens == theirs.num_accepted_tokens == 14
    # per_pos[i] = drafts whose first i+1 tokens were all accepted
    assert ours.num_accepted_tokens_per_pos == theirs.num_accepted_tokens_per_pos == [5, 4, 3, 2]
    assert ours.mean_acceptance_length == 1 + 14 / 7 == 3.0
    assert ours.per_position_acceptance_rate == [5 / 7, 4 / 7, 3 / 7, 2 / 7]
    assert ours.conditional_acceptance_rate == [5 / 7, 4 / 5, 3 / 4, 2 / 3]
    assert ours.acceptance_lengths == [1, 5, 3, 2, 5, 4, 1]
    assert ours.acceptance_length_counts() == [2, 1, 1, 1, 2]  # lengths 1..5, from per_pos alone
    assert math.isclose(np.mean(ours.acceptance_lengths), ours.mean_acceptance_length)


def test_stats_merge_by_addition():
    a, b = SpecDecodeStats(), SpecDecodeStats()
    a.observe_draft(3, 2)
    b.observe_draft(5, 5)
    b.num_generated_tokens, b.num_target_forwards, b.target_time_s = 6, 2, 0.5
    merged = a + b
    assert merged.num_drafts == 2 and merged.num_draft_tokens == 8 and merged.num_accepted_tokens == 7
    assert merged.num_accepted_tokens_per_pos == [2, 2, 1, 1, 1]
    assert merged.acceptance_lengths == [3, 6]
    assert (merged.num_generated_tokens, merged.num_target_forwards, merged.target_time_s) == (6, 2, 0.5)
    assert sum([a, b]) == merged


def test_stats_of_a_run_agree_with_its_steps(pair, monkeypatch):
    target, drafter = pair
    prompt, n_new, block_size = PROMPTS[1], 30, 5
    reference = target_greedy(target, prompt, n_new + block_size)[0].tolist()
    monkeypatch.setattr(spec_decode.proposers, "dflash_draft_logits", oracle_draft_logits(reference, target.config.vocab_size))
    r = speculative_generate(target, drafter, prompt, max_new_tokens=n_new, block_size=block_size)
    s, drafted = r.stats, [st for st in r.steps if st.draft_ids]
    assert s.num_drafts == len(drafted) == len(r.steps) - 1  # every step but the prefill drafts
    assert s.num_draft_tokens == (block_size - 1) * s.num_drafts
    assert s.num_accepted_tokens_per_pos == [sum(st.num_accepted > i for st in drafted) for i in range(block_size - 1)]
    assert s.acceptance_lengths == [1 + st.num_accepted for st in drafted]
    assert s.num_generated_tokens == sum(len(st.token_ids) for st in r.steps) == n_new
    assert s.num_target_forwards == len(r.steps)
    assert s.target_forwards_per_token < 1 and s.drafter_time_s > 0 and s.target_time_s > 0


# ---------------------------------------------------------------------------
# Stopping
# ---------------------------------------------------------------------------


def test_stop_token_ends_generation_right_after_it(pair):
    target, drafter = pair
    prompt = PROMPTS[1]
    free = target_greedy(target, prompt, 20)[0, len(prompt):].tolist()
    stop = free[7]
    expected = target_greedy(target, prompt, 20, eos=stop)
    for block_size in (2, 8):
        r = speculative_generate(target, drafter, prompt, max_new_tokens=20, block_size=block_size, stop_token_ids=[stop])
        assert torch.equal(r.output_ids, expected)
        assert r.new_token_ids[-1] == stop and stop not in r.new_token_ids[:-1]
        r = speculative_generate(target, "ngram", prompt, max_new_tokens=20, block_size=block_size, stop_token_ids=stop)
        assert torch.equal(r.output_ids, expected)


@pytest.mark.parametrize("max_new_tokens", [0, 1, 2, 7, 13])
def test_max_new_tokens_is_exact_even_mid_block(pair, monkeypatch, max_new_tokens):
    target, drafter = pair
    prompt, block_size = PROMPTS[0], 6
    reference = target_greedy(target, prompt, 13 + block_size)[0].tolist()
    monkeypatch.setattr(spec_decode.proposers, "dflash_draft_logits", oracle_draft_logits(reference, target.config.vocab_size))
    r = speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens, block_size=block_size)
    assert r.output_ids[0].tolist() == reference[:len(prompt) + max_new_tokens]
    assert r.stats.num_generated_tokens == max_new_tokens


def test_generation_stops_at_max_position_embeddings(pair):
    target, drafter = pair
    max_pos = target.config.max_position_embeddings
    prompt = (list(range(10, 250)) * 2)[: max_pos - 5]
    r = speculative_generate(target, drafter, prompt, max_new_tokens=50, block_size=8)
    assert r.output_ids.shape[1] == max_pos
    assert torch.equal(r.output_ids, target_greedy(target, prompt, 5))


# ---------------------------------------------------------------------------
# The target's cache
# ---------------------------------------------------------------------------


def test_cache_crops_back_across_the_sliding_window(pair):
    target, _ = pair
    cache = new_target_cache()
    with torch.no_grad():
        target(input_ids=torch.arange(5, 25)[None], past_key_values=cache, use_cache=True)  # 20 > window 8
    crop_cache(cache, 20)  # a no-op, not "keep nothing"
    assert cache.get_seq_length() == 20
    crop_cache(cache, 13)
    assert cache.get_seq_length() == 13 and all(layer.keys.shape[-2] == 13 for layer in cache.layers)
    with pytest.raises(ValueError, match="cannot crop a cache of 13 positions to 14"):
        crop_cache(cache, 14)


# ---------------------------------------------------------------------------
# Bad input: clear errors naming the argument
# ---------------------------------------------------------------------------


class CappedProposer:
    """A proposer that says how large a block it can fill."""
    max_block_size = 4

    def propose(self, tokens, num_draft):
        return []


BAD_ARGS = [
    ("block-size-1", dict(block_size=1), ValueError, r"block_size must be >= 2"),
    ("block-size-above-proposer", dict(drafter=CappedProposer(), block_size=5), ValueError,
     r"block_size 5 is larger than the drafter supports \(its max_block_size is 4\)"),
    ("block-size-not-int", dict(block_size=4.0), TypeError, r"block_size must be an integer"),
    ("empty-prompt", dict(input_ids=[]), ValueError, r"input_ids is empty"),
    ("prompt-too-long", dict(input_ids=[5] * 257), ValueError, r"input_ids has 257 tokens, longer than the target's max_position_embeddings \(256\)"),
    ("batch-of-two", dict(input_ids=[[5, 6], [7, 8]]), ValueError, r"input_ids must hold one sequence"),
    ("float-prompt", dict(input_ids=torch.tensor([[1.0, 2.0]])), TypeError, r"input_ids must hold integer token ids"),
    ("negative-temperature", dict(temperature=-0.1), ValueError, r"temperature must be a finite number >= 0"),
    ("nan-temperature", dict(temperature=float("nan")), ValueError, r"temperature must be a finite number >= 0"),
    ("top-p-zero", dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0\.0"),
    ("top-p-above-one", dict(top_p=1.01), ValueError, r"top_p must be in \(0, 1\], got 1\.01"),
    ("negative-top-k", dict(top_k=-1), ValueError, r"top_k must be an integer >= 0"),
    ("negative-max-new-tokens", dict(max_new_tokens=-3), ValueError, r"max_new_tokens must be a non-negative integer"),
    ("negative-seed", dict(seed=-1), ValueError, r"seed must be None or a non-negative integer"),
    ("stop-outside-vocab", dict(stop_token_ids=[512]), ValueError, r"stop_token_ids must be token ids in \[0, 512\)"),
    ("unknown-drafter-name", dict(drafter="eagle"), ValueError, r"drafter must be a DFlashLagunaDrafter, 'ngram', 'ngram_gpu', None or a proposer, got 'eagle'"),
    ("unknown-draft-sample-method", dict(draft_sample_method="typical"), ValueError,
     r"draft_sample_method must be one of \['greedy', 'probabilistic'\].*got 'typical'"),
    ("not-a-drafter", dict(drafter=object()), TypeError, r"drafter must be a DFlashLagunaDrafter, 'ngram', 'ngram_gpu', None or a proposer"),
]


@pytest.mark.parametrize("kwargs, error, message", [pytest.param(*c[1:], id=c[0]) for c in BAD_ARGS])
def test_bad_generation_arguments_are_rejected_by_name(pair, kwargs, error, message):
    target, drafter = pair
    args = dict(drafter=drafter, input_ids=[5, 6, 7], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        speculative_generate(target, args.pop("drafter"), args.pop("input_ids"), **args)


def test_mismatched_device_or_dtype_between_target_and_drafter_is_rejected(pair):
    target, drafter = pair
    bf16 = small_drafter(target).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"same dtype: target torch\.float32, drafter torch\.bfloat16"):
        speculative_generate(target, bf16, [5, 6], max_new_tokens=2)
    on_meta = small_drafter(target).to("meta")
    with pytest.raises(ValueError, match=r"same device: target on cpu, drafter on meta"):
        speculative_generate(target, on_meta, [5, 6], max_new_tokens=2)


def test_prompt_lookup_settings_are_checked():
    with pytest.raises(ValueError, match=r"prompt_lookup_min=4 must be <= prompt_lookup_max=2"):
        PromptLookupDrafter(prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match=r"prompt_lookup_min must be an integer >= 1"):
        PromptLookupDrafter(prompt_lookup_min=0)


# ---------------------------------------------------------------------------
# The shipped pair (skipped until it is in checkpoints/)
# ---------------------------------------------------------------------------


def shipped_pair(device="cpu"):
    try:
        from dflash_lab.assets import load_default_pair
    except ImportError:
        pytest.skip("dflash_lab.assets (the shipped pair) is not there yet")
    try:
        return load_default_pair(device=device)
    except FileNotFoundError as e:
        pytest.skip(f"shipped checkpoints missing: {e}")


def heldout_prompt_ids(tokenizer, n, max_tokens=96):
    prompts = json.loads((REPO / "checkpoints" / "heldout_prompts.json").read_text())["prompts"]
    return [tokenizer(p["text"])["input_ids"][-max_tokens:] for p in prompts[:n]]


def test_shipped_pair_generates_with_mean_acceptance_length_above_one():
    """vLLM's E2E smoke test for DFlash: the checkpoint pair generates and accepts drafts."""
    target, drafter, tokenizer = shipped_pair()
    target, drafter = target.float(), drafter.float()
    stats, results = spec_decode.generate_on_prompts(target, drafter, heldout_prompt_ids(tokenizer, 4), max_new_tokens=32,
                                                     block_size=drafter.config.block_size, progress=False)
    assert all(r.stats.num_generated_tokens == 32 for r in results)
    assert stats.mean_acceptance_length > 1, stats.summary()
    assert stats.num_accepted_tokens_per_pos[0] > 0


def test_shipped_pair_is_lossless_at_every_block_size():
    """A trained drafter gets long prefixes accepted, so every crop and append path runs for real."""
    target, drafter, tokenizer = shipped_pair()
    target, drafter = target.float(), drafter.float()
    accepted = 0
    for prompt in heldout_prompt_ids(tokenizer, 3, max_tokens=48):
        expected = target_greedy(target, prompt, 24)
        for proposer, block_size in [(drafter, 4), (drafter, 8), (drafter, drafter.config.block_size), ("ngram", 8)]:
            r = speculative_generate(target, proposer, prompt, max_new_tokens=24, block_size=block_size)
            assert torch.equal(r.output_ids, expected), f"block {block_size}, {proposer if isinstance(proposer, str) else 'DFlash'}"
            accepted += r.stats.num_accepted_tokens
    assert accepted > 0


# ---------------------------------------------------------------------------
# On a GPU (run with: pytest -m gpu -s tests/test_spec_decode.py)
# ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_is_lossless_in_float32_and_reports_bf16_agreement():
    try:
        target, drafter, tokenizer = shipped_pair("cuda")
        prompts = heldout_prompt_ids(tokenizer, 16)
    except pytest.skip.Exception:
        target = small_target().cuda()
        drafter = small_drafter(target).cuda()
        prompts = PROMPTS
    n_new = 48
    report = {}
    for dtype in (torch.float32, torch.bfloat16):
        target, drafter = target.to(dtype), drafter.to(dtype)
        same, stats = 0, SpecDecodeStats()
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            expected = target.generate(ids, max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
            for block_size in (4, 8, drafter.config.block_size):
                r = speculative_generate(target, drafter, ids, max_new_tokens=n_new, block_size=block_size)
                same += torch.equal(r.output_ids, expected)
                stats = stats + r.stats
        runs = 3 * len(prompts)
        report[str(dtype)] = {"identical": f"{same}/{runs}", "mean_acceptance_length": round(stats.mean_acceptance_length, 3)}
        if dtype == torch.float32:
            assert same == runs, f"float32 greedy speculative output differs from generate on {runs - same}/{runs} runs"
    print("\nGPU greedy agreement with target.generate:", json.dumps(report))


# ---------------------------------------------------------------------------
# Figures and the chapter-3 explorer draw what the counters say
# ---------------------------------------------------------------------------


def test_acceptance_figures_draw_the_counters():
    from dflash_lab import viz

    s = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 4)
    for n in [0, 4, 2, 1, 4, 3, 0]:
        s.observe_draft(4, n)
    bars, line = viz.per_position_acceptance_figure(s).data
    assert list(bars.x) == [1, 2, 3, 4] and list(bars.y) == s.per_position_acceptance_rate
    assert list(line.y) == s.conditional_acceptance_rate
    hist = viz.acceptance_length_histogram(s).data[0]
    assert list(hist.x) == [1, 2, 3, 4, 5] and math.isclose(sum(hist.y), 1.0)
    assert list(hist.customdata) == s.acceptance_length_counts()
    other = SpecDecodeStats()
    other.observe_draft(2, 1)
    side = viz.compare_acceptance_figure({"DFlash": s, "prompt lookup": other})
    assert [t.name for t in side.data if t.showlegend is not False] == ["DFlash (τ = 3.00)", "prompt lookup (τ = 2.00)"]
    sweep = viz.acceptance_vs_block_size_figure({"DFlash": {8: s, 4: other}})
    assert list(sweep.data[0].x) == [4, 8] and list(sweep.data[0].y) == [2.0, 3.0]
    assert viz.acceptance_vs_temperature_figure({"DFlash": {0.0: s}}).layout.xaxis.title.text == "temperature"


def test_tokens_are_coloured_by_origin(pair, monkeypatch):
    from dflash_lab import viz

    target, drafter = pair
    prompt, block_size = PROMPTS[1], 5
    reference = target_greedy(target, prompt, 30 + block_size)[0].tolist()
    monkeypatch.setattr(spec_decode.proposers, "dflash_draft_logits", oracle_draft_logits(reference, target.config.vocab_size))
    r = speculative_generate(target, drafter, prompt, max_new_tokens=30, block_size=block_size)
    page = viz.acceptance_tokens_html(r, lambda ids: f"<{ids[0]}>")
    accepted = sum(min(st.num_accepted, len(st.token_ids)) for st in r.steps)
    rejected = sum(st.num_accepted < len(st.draft_ids) and len(st.token_ids) > st.num_accepted for st in r.steps)
    assert page.count(f"background:{viz.TOKEN_COLORS['accepted']}") == accepted > 0
    assert page.count("line-through") == rejected > 0
    assert page.count(f"background:{viz.TOKEN_COLORS['bonus']}") == 30 - accepted
    assert "&lt;" in page and "<4" not in page  # token text is escaped


def test_acceptance_explorer_reruns_and_redraws(pair):
    from dflash_lab.widgets import acceptance_explorer

    target, drafter = pair
    box = acceptance_explorer(target, drafter, {"a": PROMPTS[:2], "b": PROMPTS[2:]}, tokenizer=lambda ids: str(ids[0]),
                              max_new_tokens=6, temperatures=(0.0, 1.0), block_size=8)
    per_position, lengths = box.figures
    assert len(per_position.data[0].y) == 7 and len(lengths.data[0].y) == 8
    box.block_size.value = 3
    assert len(per_position.data[0].y) == 2 and len(lengths.data[0].y) == 3
    box.method.value = "prompt lookup"
    box.prompt_set.value = "b"
    box.temperature.value = 1.0
    assert "prompt lookup" in box.summary.value and "temperature 1.0" in box.summary.value
    assert {k[:3] + k[4:5] for k in box.results} == {  # (method, block, temperature, prompt set)
        ("DFlash", 8, 0.0, "a"), ("DFlash", 3, 0.0, "a"), ("prompt lookup", 3, 0.0, "a"),
        ("prompt lookup", 3, 0.0, "b"), ("prompt lookup", 3, 1.0, "b")}
    assert "drafted, accepted" in box.tokens.value
    box.method.value, box.draft_sampling.value = "DFlash", "probabilistic"  # vLLM's draft_sample_method
    assert ("DFlash", 3, 1.0, "probabilistic", "b", None) in box.results and "probabilistic drafts" in box.summary.value
    assert box.stats() is box.results[("DFlash", 3, 1.0, "probabilistic", "b", None)][0]
