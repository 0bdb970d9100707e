"""Chapter 9's figures and explorer (``viz.tree``, ``widgets.tree``).

    the tree figure   a hand-made tree: leaves one row apart, a parent between its children, the accepted
                      path and only it in green, the chain's nodes square, the target's choices under the path
                      (the last one the bonus), six traces whatever the tree
    τ and speed       records in the timing-record format: each chain drawn flat at its τ, speed-ups over
                      target-only, the best budget and the first one below the chain
    replay            the shipped pair: the replayed step is the run's tree, path and kept drafts at every step,
                      and its chain keeps what the chain's own run keeps at the first block
    explorer          the slider redraws the figure in place and says what the tree and the chain keep
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_lab import viz
from dflash_lab.measure.decoding import timing_record
from dflash_lab.spec_decode.stats import SpecDecodeStats
from dflash_lab.spec_decode.tree import build_draft_tree

# root -> 1 (depth 1) -> 3, 4 (depth 2); root -> 2 (depth 1) -> 5 (depth 2) -> 6 (depth 3)
TREE = {"token_ids": [10, 20, 11, 12, 21, 30], "parents": [0, 0, 1, 1, 2, 5], "depths": [1, 1, 2, 2, 2, 3],
        "log_weights": [-0.1, -1.0, -0.5, -1.5, -1.2, -2.0]}


def trace(fig, name_start):
    return next(t for t in fig.data if (t.name or "").startswith(name_start))


def test_the_tree_figure_draws_the_path_the_chain_and_the_targets_choices():
    fig = viz.draft_tree_figure(TREE, path=[0, 2, 5, 6], target_choices=[20, 21, 30, 99], chain=[10, 11, 7])
    assert len(fig.data) == 6
    nodes = fig.data[2]
    ys = dict(zip(range(1, 7), nodes.y))
    assert list(nodes.x) == TREE["depths"] and list(nodes.text) == ["10", "20", "11", "12", "21", "30"]
    assert ys[3] - ys[4] == 1 and ys[1] == (ys[3] + ys[4]) / 2 and ys[5] == ys[6]  # leaves a row apart
    assert ys[1] > ys[2]  # the better subtree on top
    path = trace(fig, "accepted path")
    drawn = [(x, y) for x, y in zip(path.x, path.y) if x is not None]
    assert drawn == [(0, fig.data[3].y[0]), (1, ys[2]), (1, ys[2]), (2, ys[5]), (2, ys[5]), (3, ys[6])]
    assert list(nodes.marker.symbol) == ["square", "circle", "square", "circle", "circle", "circle"]  # 10, 10-11
    assert [w > 1 for w in nodes.marker.line.width] == [False, True, False, False, True, True]
    assert list(nodes.marker.color) == TREE["log_weights"]
    lane = trace(fig, "the target's choice")
    assert list(lane.x) == [1, 2, 3, 4] and list(lane.text) == ["20", "21", "30", "99"]
    assert list(lane.marker.color) == [viz.acceptance.TOKEN_COLORS["accepted"]] * 3 + [
        viz.acceptance.TOKEN_COLORS["bonus"]]
    assert "3 drafts accepted" in fig.layout.title.text


def test_an_empty_path_or_chain_still_draws_six_traces_and_bad_paths_are_refused():
    fig = viz.draft_tree_figure(TREE)
    assert len(fig.data) == 6 and list(fig.data[5].x) == [] and list(fig.data[4].x) == []
    with pytest.raises(ValueError, match="root"):
        viz.draft_tree_figure(TREE, path=[2, 5])
    with pytest.raises(ValueError, match="one target choice per index"):
        viz.draft_tree_figure(TREE, path=[0, 2], target_choices=[20])


def test_tree_data_reads_one_row_of_a_built_tree():
    tree = build_draft_tree(torch.randn(2, 4, 30, generator=torch.Generator().manual_seed(0)) * 3, 12)
    data = viz.tree_data(tree, row=1)
    assert data["token_ids"] == tree.token_ids[1].tolist() and data["parents"] == tree.parents[1].tolist()
    assert data["depths"] == tree.depths[1].tolist() and len(data["log_weights"]) == 12
    fig = viz.draft_tree_figure(data)
    assert list(fig.data[2].x) == data["depths"]


def record(method, budget, tokens_per_s, tau=None, verify_ms=1.0, prompt_set="heldout", batch=1):
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * 15)
    stats.num_generated_tokens = 100
    rec = timing_record("tree", method, 1 if method == "target_only" else 16, batch=batch, stats=stats,
                        seconds=100 / tokens_per_s, outputs=[[1]], reference=[[1]], device=torch.device("cpu"),
                        dtype="bfloat16", prompt_set=prompt_set, path="static", tree_budget=budget,
                        verify_ms=verify_ms, step_ms=2 * verify_ms)
    if tau is not None:
        rec["mean_acceptance_length"] = tau
    return rec


SPEED = [record("target_only", None, 100.0, verify_ms=1.0),
         record("dflash", None, 300.0, 4.0, verify_ms=1.2),
         record("dflash", 16, 320.0, 4.5, verify_ms=1.3), record("dflash", 32, 340.0, 5.0, verify_ms=1.5),
         record("dflash", 64, 290.0, 5.4, verify_ms=2.0), record("dflash", 128, 200.0, 5.6, verify_ms=3.0),
         record("dflash", 32, 999.0, 5.0, prompt_set="docstring")]


def test_speedups_and_where_the_tree_stops_paying():
    ups = viz.tree_speedups(SPEED, "dflash")
    assert ups == {None: 3.0, 16: 3.2, 32: 3.4, 64: 2.9, 128: 2.0}  # the docstring row is another set
    verdict = viz.where_tree_stops_paying(ups)
    assert verdict == {"best": 32, "best_speedup": 3.4, "chain": 3.0, "first_below_chain": 64}
    assert viz.where_tree_stops_paying({None: 1.0, 8: 1.5})["first_below_chain"] is None
    assert viz.tree_speedups(SPEED, "dflash", batch=8) == {}  # no target-only row at that batch
    with pytest.raises(ValueError, match="no tree budget"):
        viz.where_tree_stops_paying({None: 2.0})


def test_the_speed_figure_draws_speedups_and_verify_times_with_flat_chains():
    fig = viz.tree_speed_figure(SPEED)
    tree = trace(fig, "tree, paper's drafter")
    assert list(tree.x) == [16, 32, 64, 128] and [round(y, 4) for y in tree.y] == [3.2, 3.4, 2.9, 2.0]
    chain = trace(fig, "chain, paper's drafter")
    assert list(chain.y) == [3.0, 3.0] and list(chain.x) == [16, 128]
    verify = [t for t in fig.data if t.xaxis == "x2"]
    assert [1.3, 1.5, 2.0, 3.0] in [list(t.y) for t in verify] and [1.0, 1.0] in [list(t.y) for t in verify]


def test_tau_against_budget_draws_each_chain_flat_at_its_tau():
    recs = [r for r in SPEED if r["method"] != "target_only"]
    recs.append(record("dflash", None, 1.0, 6.0, prompt_set="docstring"))
    fig = viz.tau_vs_budget_figure(recs)
    names = [t.name for t in fig.data]
    assert names[0] == "tree, paper's drafter, heldout prompts" and len(fig.data) == 4
    held = trace(fig, "chain (15 drafts), paper's drafter, heldout")
    assert list(held.y) == [4.0, 4.0] and list(held.x) == [16, 128]
    assert list(trace(fig, "chain (15 drafts), paper's drafter, docstring").y) == [6.0, 6.0]
    assert list(fig.layout.xaxis.tickvals) == [16, 32, 64, 128] and fig.layout.xaxis.type == "log"


@pytest.fixture(scope="module")
def shipped_run():
    from dflash_lab.assets import heldout_prompts, load_default_pair
    from dflash_lab.spec_decode import speculative_generate

    target, drafter, tok = load_default_pair("cpu", dtype=torch.float32)
    prompt = tok(heldout_prompts()[6]["text"])["input_ids"][-48:]
    run = speculative_generate(target, drafter, prompt, max_new_tokens=32, block_size=16, tree_budget=32)
    chain = speculative_generate(target, drafter, prompt, max_new_tokens=32, block_size=16)
    return target, drafter, tok, run, chain


def test_a_replayed_step_is_the_runs_step_and_its_chain_is_the_chains(shipped_run):
    from dflash_lab.widgets import replay_block

    target, drafter, _, run, chain = shipped_run
    for s in range(1, len(run.steps)):
        block = replay_block(target, drafter, run, s, [8, 32])
        step, view = run.steps[s], block["trees"][32]
        assert view["token_ids"] == step.tree.token_ids[0].tolist() and view["parents"] == step.tree.parents[0].tolist()
        assert view["num_accepted"] == step.num_accepted and len(view["path"]) == step.num_accepted + 1
        assert [view["token_ids"][i - 1] for i in view["path"][1:]] == step.draft_ids
        assert view["target_choices"] == [step.target_argmax[i] for i in view["path"]]
        assert block["position"] == step.position and len(block["trees"][8]["token_ids"]) == 8
    first = replay_block(target, drafter, run, 1, [32])["chain"]  # the first block is the chain run's too
    assert first["token_ids"] == chain.steps[1].draft_ids and first["num_accepted"] == chain.steps[1].num_accepted
    with pytest.raises(ValueError, match="tree step"):
        replay_block(target, drafter, run, 0, [32])


def test_the_explorer_redraws_each_budget_in_place(shipped_run):
    from dflash_lab.widgets import draft_tree_explorer, replay_block

    target, drafter, tok, run, _ = shipped_run
    block = replay_block(target, drafter, run, 2, [8, 32, 128])
    box = draft_tree_explorer(block, tok, budget=32)
    assert box.budget.value == 32 and "budget 32:" in box.summary.value and len(box.figure.data) == 6
    assert len(box.figure.data[2].x) == 32
    box.budget.value = 128
    assert len(box.figure.data) == 6 and len(box.figure.data[2].x) == 128
    assert "budget 128" in box.figure.layout.title.text and "129 tokens" in box.summary.value
    kept = block["trees"][128]["num_accepted"]
    assert f"keeps <b>{kept}</b>" in box.summary.value
    assert math.isclose(box.figure.layout.height, viz.draft_tree_figure(block["trees"][128]).layout.height)
