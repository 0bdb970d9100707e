"""DDTree (``spec_decode/tree.py``): the tree is the paper's, its verification is lossless.

    construction  the fixed-shape build equals the paper's best-first heap, node for node, on random
                  blocks; every tree is a tree (parents first, depth + 1, distinct siblings)
    the walk      a hand-made tree: the path follows the target's choices and stops where they leave it
    greedy        both shipped drafters, float32, several budgets: every token equals target.generate,
                  and the counters are a tree's (one draft per step, the budget in draft tokens)
    fast path     the graphed tree step (one prompt, and a ragged batch) gives the eager loop's tokens and
                  counters; on a GPU, graphed float32 equals target.generate (``gpu`` mark)
    sampling      the target's rule at each node: the first two emitted tokens are distributed as
                  the target's own (chi-square, against the exact two-token distribution)
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dflash_lab.assets import heldout_prompts, load_default_pair
from dflash_lab.spec_decode import FastDecoder, speculative_generate
from dflash_lab.spec_decode.tree import DraftTree, _ancestors, accept_path, best_first_tree, build_draft_tree


def prefixes(parents, tokens) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for p, tok in zip(parents, tokens):
        out.append((out[p - 1] if p else ()) + (tok,))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_build_is_the_papers_best_first_heap(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        K, V = int(torch.randint(1, 9, (), generator=g)), int(torch.randint(3, 80, (), generator=g))
        most = min(3 * V, sum(V ** d for d in range(1, K + 1)))  # budgets above the vocabulary too
        budget = int(torch.randint(1, most + 1, (), generator=g))
        logits = torch.randn(K, V, generator=g) * float(torch.rand((), generator=g)) * 8
        tree = build_draft_tree(logits, budget)
        heap = best_first_tree(torch.log_softmax(logits, -1), budget)
        got = list(zip(tree.parents[0].tolist(), tree.depths[0].tolist(), tree.token_ids[0].tolist()))
        assert got == heap, (K, V, budget)



BEAM_KERNEL_SCRIPT = r"""
import json, torch
from dflash_lab.measure.launches import count_launches
from dflash_lab.spec_decode.tree import best_first_tree, build_draft_tree
from dflash_lab.spec_decode.fast.tree_build import beam_kernel
from dflash_lab.spec_decode.fast.tree_accept import walk
from dflash_lab.spec_decode.tree import accept_path
g = torch.Generator().manual_seed(0)
out, walks = [], []
for b, K, V, budget in [(2, 15, 4096, 16), (1, 15, 4096, 32), (3, 7, 300, 64), (1, 15, 4096, 128), (2, 4, 5, 16),
                        (1, 1, 50, 8), (1, 6, 40, 24)]:
    logits = torch.randn(b, K, V, generator=g) * 3
    with count_launches() as loop:
        ref = build_draft_tree(logits, budget)
    with count_launches() as one:
        got = build_draft_tree(logits, budget, beams=beam_kernel)
    same = all(torch.equal(getattr(ref, f), getattr(got, f))
               for f in ("token_ids", "parents", "depths", "log_weights", "ancestors"))
    heap = sorted((d, t) for _, d, t in best_first_tree(torch.log_softmax(logits[0].float(), -1), budget))
    out.append([budget, K, same, heap == sorted(zip(got.depths[0].tolist(), got.token_ids[0].tolist())),
                loop.total, one.total])
    # the walk in one kernel (``tree_accept.walk``) against ``accept_path``, the target following a random node's
    # prefix in each row; row 0 without a length limit, the others with a random one
    N = got.num_nodes
    choice = torch.randint(0, V, (b, N + 1), generator=g)
    for r in range(b):
        i = int(torch.randint(1, N + 1, (1,), generator=g))
        while i > 0:
            parent = int(got.parents[r, i - 1])
            choice[r, parent] = got.token_ids[r, i - 1]
            i = parent
    max_depth = torch.randint(0, K + 1, (b,), generator=g)
    max_depth[0] = K
    drafts, argmax = torch.empty(b, K, dtype=torch.long), torch.empty(b, K + 1, dtype=torch.long)
    with count_launches() as walked:
        n, path = walk(got, choice, max_depth, drafts, argmax)
    with count_launches() as reference:
        rn, rpath, _ = accept_path(got, choice, max_depth=max_depth)
    on_path = torch.arange(K) < rn[:, None]
    rdrafts = torch.where(on_path, got.token_ids.gather(1, (rpath[:, 1:] - 1).clamp(min=0)), -1)
    walks.append([torch.equal(n, rn) and torch.equal(path, rpath) and torch.equal(drafts, rdrafts)
                  and torch.equal(argmax, choice.gather(1, rpath)), rn.tolist(), walked.total, reference.total])
print(json.dumps({"beams": out, "walks": walks}))
"""


def test_the_one_kernel_beam_search_builds_the_same_trees(interpreted):
    """The fast path's beam search (``fast.tree_build``, Triton's CPU interpreter) against ``beam_loop``: the
    same nodes, parents, depths, weights and ancestors, the paper's heap set, at budgets 8 .. 128, a vocabulary
    smaller than the budget, one drafted depth, and a budget that is not a power of two (``beam_loop`` then);
    a block of 16 builds in 42 launches fewer. The accepted path's walk in one kernel (``fast.tree_accept``):
    ``accept_path``'s n and path, the drafts and target choices the chain reads, in one launch."""
    res = interpreted(BEAM_KERNEL_SCRIPT)
    rows, walks = res["beams"], res["walks"]
    assert all(same for same, _, _, _ in walks), walks
    assert sum(max(n) for _, n, _, _ in walks) >= 10, walks  # paths were accepted, several deep
    assert all(one == 1 < ref for _, _, one, ref in walks), walks
    assert all(same and heap for _, _, same, heap, _, _ in rows), rows
    for budget, K, _, _, loop, one in rows:
        fewer = 3 * (K - 1) if budget & (budget - 1) == 0 and K > 1 else 0  # 3 a depth and 2 stacks, against 2
        assert loop - one == fewer, (budget, K, loop, one)

def test_a_batch_of_blocks_builds_each_rows_own_tree():
    logits = torch.randn(3, 5, 50) * 3
    batched = build_draft_tree(logits, 24)
    for b in range(3):
        one = build_draft_tree(logits[b], 24)
        for name in ("token_ids", "parents", "depths", "ancestors"):
            assert torch.equal(getattr(batched, name)[b], getattr(one, name)[0]), name


def test_every_tree_is_a_tree_of_the_best_prefixes():
    logits = torch.randn(2, 7, 40) * 2
    logits[1, 2] = 0  # a flat depth: ties everywhere
    tree = build_draft_tree(logits, 32)
    log_q = torch.log_softmax(logits, -1)
    for b in range(2):
        parents, depths, tokens = (t[b].tolist() for t in (tree.parents, tree.depths, tree.token_ids))
        for i, (p, d) in enumerate(zip(parents, depths), start=1):
            assert p < i and d == (depths[p - 1] + 1 if p else 1)
        pre = prefixes(parents, tokens)
        assert len(set(pre)) == len(pre)  # siblings differ
        weights = [sum(float(log_q[b, j, tok]) for j, tok in enumerate(x)) for x in pre]
        assert np.allclose(weights, tree.log_weights[b].tolist(), atol=1e-5)
        # no prefix outside the tree scores more than the worst inside (over one-token extensions)
        worst = min(weights)
        for x in pre:
            if len(x) < 7:
                outside = [t for t in range(40) if x + (t,) not in set(pre)]
                best_out = max(float(log_q[b, len(x), t]) for t in outside) + weights[pre.index(x)]
                assert best_out <= worst + 1e-5
        anc = tree.ancestors[b]
        for i in range(1, 33):
            chain, j = {0, i}, i
            while j:
                j = parents[j - 1]
                chain.add(j)
            assert set(torch.nonzero(anc[i]).flatten().tolist()) == chain


def hand_tree() -> DraftTree:
    """Root x_t; depth 1: 5 (index 1), 7 (index 2); depth 2: 6 under 5 (index 3), 8 under 7 (index 4);
    depth 3: 9 under 6 (index 5)."""
    tokens = torch.tensor([[5, 7, 6, 8, 9]])
    parents = torch.tensor([[0, 0, 1, 2, 3]])
    depths = torch.tensor([[1, 1, 2, 2, 3]])
    tree = DraftTree(tokens, parents, depths, torch.zeros(1, 5), None, 3)
    tree.ancestors = _ancestors(tree.parents_with_root(), 3)
    return tree


@pytest.mark.parametrize("choices, n, path, nxt", [
    ([7, 0, 8, 0, 3, 0], 2, [0, 2, 4, 0], 3),  # root -> 7 -> 8, then the target says 3
    ([5, 6, 0, 9, 0, 4], 3, [0, 1, 3, 5], 4),  # the whole deepest branch, bonus 4
    ([1, 6, 8, 9, 0, 0], 0, [0, 0, 0, 0], 1),  # the target's first choice is in no child
    ([5, 2, 0, 9, 0, 4], 1, [0, 1, 0, 0], 2),  # off the tree at depth 2
])
def test_the_walk_follows_the_targets_choices(choices, n, path, nxt):
    got_n, got_path, got_next = accept_path(hand_tree(), torch.tensor([choices]))
    assert (int(got_n), got_path[0].tolist(), int(got_next)) == (n, path, nxt)


def test_the_walk_stops_at_max_depth():
    n, path, nxt = accept_path(hand_tree(), torch.tensor([[5, 6, 0, 9, 0, 4]]), max_depth=torch.tensor([1]))
    assert (int(n), path[0].tolist(), int(nxt)) == (1, [0, 1, 0, 0], 6)


# ---------------------------------------------------------------------------
# Lossless on the shipped pair
# ---------------------------------------------------------------------------

MAX_NEW = 40


@pytest.fixture(scope="module")
def shipped():
    target, paper, tok = load_default_pair("cpu", dtype=torch.float32)
    poolside = load_default_pair("cpu", dtype=torch.float32, drafter="poolside")[1]
    prompts = [torch.tensor(tok(p["text"])["input_ids"][-n:]) for p, n in zip(heldout_prompts(), (48, 21, 37))]
    refs = [target.generate(p[None], max_new_tokens=MAX_NEW, do_sample=False)[0, p.shape[0]:].tolist()
            for p in prompts]
    return target, {"paper": paper, "poolside": poolside}, prompts, refs


@pytest.mark.parametrize("drafter", ["paper", "poolside"])
def test_greedy_tree_decoding_is_target_only_for_both_shipped_drafters(shipped, drafter):
    target, drafters, prompts, refs = shipped
    taus = {}
    for budget in (1, 8, 48):
        stats = None
        for p, ref in zip(prompts, refs):
            r = speculative_generate(target, drafters[drafter], p, max_new_tokens=MAX_NEW, block_size=16,
                                     tree_budget=budget)
            assert r.new_token_ids == ref, (drafter, budget)
            s = r.stats
            assert s.num_draft_tokens == budget * s.num_drafts  # every node is a draft token
            assert len(s.num_accepted_tokens_per_pos) == 15  # positions are depths
            assert sum(s.num_accepted_tokens_per_pos) == s.num_accepted_tokens
            tree_steps = [st for st in r.steps if st.tree is not None]
            assert len(tree_steps) == s.num_drafts and all(st.tree.num_nodes == budget for st in tree_steps)
            stats = s if stats is None else stats + s
        taus[budget] = 1 + stats.num_accepted_tokens / stats.num_drafts
    assert taus[48] > taus[8] > taus[1], taus  # more nodes, longer accepted paths


@pytest.mark.parametrize("drafter", ["paper", "poolside"])
def test_the_fast_paths_tree_step_gives_the_eager_loops_tokens_and_counters(shipped, drafter):
    target, drafters, prompts, refs = shipped
    budget = 24
    eager = [speculative_generate(target, drafters[drafter], p, max_new_tokens=MAX_NEW, block_size=16,
                                  tree_budget=budget) for p in prompts]
    capacity = max(p.shape[0] for p in prompts) + MAX_NEW
    batched = FastDecoder(target, drafters[drafter], batch=len(prompts), block_size=16, capacity=capacity,
                          tree_budget=budget).generate(prompts, max_new_tokens=MAX_NEW)
    one = FastDecoder(target, drafters[drafter], batch=1, block_size=16, capacity=capacity, tree_budget=budget)
    for e, b, p, ref in zip(eager, batched, prompts, refs):
        alone = one.generate([p], max_new_tokens=MAX_NEW)[0]
        assert e.new_token_ids == b.new_token_ids == alone.new_token_ids == ref
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
            assert getattr(e.stats, name) == getattr(b.stats, name) == getattr(alone.stats, name), name


def test_a_tree_is_refused_where_it_has_no_meaning(shipped):
    target, drafters, prompts, _ = shipped
    with pytest.raises(ValueError, match="tree_budget builds a tree from a DFlash block"):
        speculative_generate(target, "ngram", prompts[0], max_new_tokens=4, tree_budget=8)
    with pytest.raises(ValueError, match="its own lossless rule"):
        speculative_generate(target, drafters["paper"], prompts[0], max_new_tokens=4, tree_budget=8,
                             temperature=1.0, rejection_sample_method="block")
    for bad in (0, -3, 2.5, 10 ** 6):
        with pytest.raises(ValueError, match="tree_budget"):
            speculative_generate(target, drafters["paper"], prompts[0], max_new_tokens=4, tree_budget=bad)
    with pytest.raises(ValueError, match="tree_budget needs a DFlash drafter"):
        FastDecoder(target, "ngram", batch=1, block_size=8, capacity=64, tree_budget=8)
    with pytest.raises(ValueError, match="tree_budget needs a DFlash drafter"):
        FastDecoder(target, drafters["paper"], batch=1, block_size=8, capacity=64, tree_budget=8, widths=(4,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphed_tree_steps_equal_generate_in_float32():
    target, paper, tok = load_default_pair("cuda", dtype=torch.float32)
    poolside = load_default_pair("cuda", dtype=torch.float32, drafter="poolside")[1]
    prompts = [torch.tensor(tok(p["text"])["input_ids"][-96:], device="cuda") for p in heldout_prompts()[:6]]
    refs = [target.generate(p[None], max_new_tokens=48, do_sample=False)[0, p.shape[0]:].tolist() for p in prompts]
    for name, drafter in (("paper", paper), ("poolside", poolside)):
        for budget in (16, 64):
            dec = FastDecoder(target, drafter, batch=len(prompts), block_size=16, capacity=160, tree_budget=budget)
            assert dec.cuda_graphs
            got = dec.generate(prompts, max_new_tokens=48)
            eager = [speculative_generate(target, drafter, p, max_new_tokens=48, tree_budget=budget, block_size=16)
                     for p in prompts[:2]]
            assert [r.new_token_ids for r in got] == refs, (name, budget)
            assert [r.stats.num_accepted_tokens for r in got[:2]] == [e.stats.num_accepted_tokens for e in eager]


# ---------------------------------------------------------------------------
# Sampling: the target's rule at each node is lossless
# ---------------------------------------------------------------------------


def test_sampled_walks_emit_the_targets_distribution():
    """A toy target p(. | prefix) over 5 tokens and a tree from unrelated draft logits; 40 000 walks.

    Each walk samples the target at every tree index, walks, and (when it emitted one token only)
    draws the second from the target after it, as the next step would. The pair (y1, y2) must follow
    p(y1) p(y2 | y1) exactly."""
    V, K, trials = 5, 3, 40_000
    g = torch.Generator().manual_seed(3)
    table = {x: torch.softmax(torch.randn(V, generator=g) * 1.3, -1)
             for d in range(K + 2) for x in itertools.product(range(V), repeat=d)}
    tree = build_draft_tree(torch.randn(K, V, generator=g) * 2, 9)
    pre = [()] + prefixes(tree.parents[0].tolist(), tree.token_ids[0].tolist())
    probs = torch.stack([table[x] for x in pre])  # (N+1, V): the target after each tree index
    choices = torch.multinomial(probs.repeat(trials, 1), 1, generator=g).view(trials, -1)
    many = DraftTree(*(t.expand(trials, *t.shape[1:]) for t in (tree.token_ids, tree.parents, tree.depths,
                                                                 tree.log_weights, tree.ancestors)), K)
    n, path, nxt = accept_path(many, choices)
    first = torch.where(n >= 1, many.token_ids.gather(1, (path[:, 1:2] - 1).clamp(min=0))[:, 0], nxt)
    second_tree = torch.where(n >= 2, many.token_ids.gather(1, (path[:, 2:3] - 1).clamp(min=0))[:, 0], nxt)
    second = second_tree.clone()
    if bool((n == 0).any()):  # y2 comes from the next step, which samples the target after y1 afresh
        after = torch.stack([table[(int(y),)] for y in first[n == 0]])
        second[n == 0] = torch.multinomial(after, 1, generator=g)[:, 0]
    from test_spec_decode import chi2_pvalue  # scipy: not on every machine this file runs on

    exact = torch.stack([table[()][a] * table[(a,)][b] for a in range(V) for b in range(V)])
    assert chi2_pvalue((first * V + second).numpy(), exact.numpy()) > 1e-3
    assert float((n >= 1).float().mean()) > 0.2  # the walk did enter the tree
