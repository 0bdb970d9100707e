"""Chapter 9: one DFlash block's draft tree at every node budget.

    replay_block         one tree step of a ``speculative_generate(..., tree_budget=)`` run, again: the same
                         drafter logits (the run's context K/V up to that step), a tree at each budget, each
                         verified by the target in one forward with its tree mask, the walk along the target's
                         choices; and the chain (each depth's argmax) verified the same way
    draft_tree_explorer  a budget slider over a replayed block: the tree at that budget, its accepted path and
                         the target's choices (``viz.draft_tree_figure``), beside what the chain keeps
"""

from __future__ import annotations

import copy

import ipywidgets as widgets
import torch

from dflash_lab.spec_decode.loop import crop_cache, new_target_cache, verify_forward
from dflash_lab.spec_decode.proposers import dflash_draft_logits
from dflash_lab.spec_decode.tree import accept_path, build_draft_tree
from dflash_lab.viz.tree import draft_tree_figure, tree_data
from dflash_lab.widgets.common import WIDE, _redraw_figure_widget, figure_widget


@torch.no_grad()
def replay_block(target, drafter, result, step_index: int, budgets) -> dict:
    """Step ``step_index`` of a greedy tree run (``result`` of ``speculative_generate(..., tree_budget=)``, with
    the drafter module ``drafter`` it ran), at every one of ``budgets``.

    Returns {"position": the step's first emitted position, "root": x_t's id, "depth_limit": K, "logits": the
    block's (K, V) drafter logits, "chain": {token_ids (K), num_accepted, target_choices}, "trees": {budget:
    tree_data's lists + path (tree indices, depth 0 .. n), num_accepted, target_choices (the target's token
    after each index of the path; the last is the bonus)}}. The drafter forward is the run's own (the same
    context K/V, the same block), so the tree at the run's budget is the run's tree."""
    if not 0 < step_index < len(result.steps) or result.steps[step_index].tree is None:
        raise ValueError(f"step_index must name a tree step of the run (1 .. {len(result.steps) - 1}), "
                         f"got {step_index!r}")
    step = result.steps[step_index]
    ids = result.output_ids[0]
    t, K = step.position - 1, step.tree.depth_limit  # x_t sits at position t; the context holds 0 .. t-1
    context = copy.copy(result.context)  # the run's context K/V; slots below t were written once and kept
    context.length = t
    logits = dflash_draft_logits(drafter, target, context, int(ids[t]), K + 1)  # (K, V)
    cache = new_target_cache()
    verify_forward(target, ids[None, :t], cache, 0, [])  # the prefix, as the run's cache held it

    def choices(nodes, tree=None) -> torch.Tensor:
        out, _ = verify_forward(target, torch.cat([ids[t:t + 1], nodes])[None], cache, t, [], tree=tree)
        crop_cache(cache, t)
        return out.argmax(-1)  # the target's token after each index (greedy)

    chain = logits.argmax(-1)
    target_chain = choices(chain)
    m = 0
    while m < K and int(chain[m]) == int(target_chain[m]):
        m += 1
    block = {"position": step.position, "root": int(ids[t]), "depth_limit": K, "logits": logits,
             "chain": {"token_ids": chain.tolist(), "num_accepted": m, "target_choices": target_chain[:m + 1].tolist()},
             "trees": {}}
    for budget in budgets:
        tree = build_draft_tree(logits, budget)
        target_tree = choices(tree.token_ids[0], tree)
        n, path, _ = accept_path(tree, target_tree[None])
        n = int(n[0])
        path = path[0, :n + 1].tolist()
        block["trees"][budget] = {**tree_data(tree), "path": path, "num_accepted": n,
                                  "target_choices": [int(target_tree[i]) for i in path]}
    return block


def draft_tree_explorer(block: dict, tokenizer=None, *, budget: int | None = None) -> widgets.VBox:
    """A slider over the budgets of ``block`` (``replay_block``'s): each redraws that budget's tree with its
    accepted path and the target's choices, and says what the tree and the chain keep of this block.

    The returned box exposes ``.budget`` (the slider), ``.figure`` and ``.summary``."""
    budgets = sorted(block["trees"])
    if not budgets:
        raise ValueError("the block holds no tree")
    start = budget if budget in budgets else budgets[len(budgets) // 2]
    slider = widgets.SelectionSlider(options=budgets, value=start, description="node budget N",
                                     continuous_update=False, style=WIDE)
    summary = widgets.HTML()
    chain, K = block["chain"], block["depth_limit"]

    def draw():
        view, n_nodes = block["trees"][slider.value], slider.value
        n, m = view["num_accepted"], chain["num_accepted"]
        summary.value = (f"budget {n_nodes}: the target verifies {n_nodes + 1} tokens (the chain: {K + 1}) and "
                         f"keeps <b>{n}</b> drafts along the tree's path; the chain would keep <b>{m}</b>"
                         + (f" (the tree gains {n - m})" if n > m else " (the tree loses here)" if n < m else ""))
        return draft_tree_figure(view, tokenizer, root_id=block["root"], path=view["path"],
                                 target_choices=view["target_choices"], chain=chain["token_ids"],
                                 title=f"The block at position {block['position']}, budget {n_nodes}: "
                                       f"{n} drafts accepted (chain: {m})")

    fig = figure_widget(draw())

    def redraw(_change=None):
        _redraw_figure_widget(fig, draw())

    slider.observe(redraw, names="value")
    box = widgets.VBox([slider, summary, fig])
    box.budget, box.figure, box.summary = slider, fig, summary
    return box
