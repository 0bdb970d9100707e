"""Chapter 9: draft trees (DDTree) — one tree drawn node by node, τ against the node budget, and where the tree
stops paying for its wider verify forward.

Every function takes plain data: a tree as lists (``tree_data`` turns a ``spec_decode.tree.DraftTree`` row into
them), records in the timing-record format of ``measure.tree`` (method, prompt_set, tree_budget, ...).

    draft_tree_figure       one block's tree: depth across, best prefixes first, nodes coloured by log path
                            probability, the chain's nodes square, the accepted path in green, and a lane
                            with the target's choice after each node of the path
    tau_vs_budget_figure    τ against the budget, one line per (drafter, prompt set), each chain flat
    tree_speed_figure       from a speed record: × target-only and the verify forward's ms against the budget
    tree_speedups           {budget (None: the chain): × target-only} of one method, batch and prompt set
    where_tree_stops_paying the best budget, and the first budget whose speed-up is below the chain's
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dflash_lab.viz.acceptance import TOKEN_COLORS, _raw_token_text
from dflash_lab.viz.common import PALETTE, titled

METHOD_COLORS = {"dflash": PALETTE["blue"], "dflash_poolside": PALETTE["green"], "target_only": PALETTE["grey"]}
SET_DASH = {"heldout": "solid", "docstring": "dot"}
MAX_LABEL = 8  # characters of a token shown on the figure (the hover has all of it)
ROW_PX = 22  # vertical room per leaf of the tree
LEGEND_PX = 100  # under the tree: the depth axis, its title and the legend (two rows where the page is narrow)


def tree_data(tree, row: int = 0) -> dict:
    """One row of a ``DraftTree`` as plain lists: token_ids, parents (0 = the root, j = node j - 1), depths,
    log_weights."""
    def column(t):
        return [x.item() if hasattr(x, "item") else x for x in t[row].detach().cpu()]
    return {"token_ids": column(tree.token_ids), "parents": column(tree.parents), "depths": column(tree.depths),
            "log_weights": [float(w) for w in column(tree.log_weights)]}


def _label(tokenizer, token_id: int) -> str:
    """A token on one short line: · for a space, ↵ for a newline, cut at MAX_LABEL characters."""
    if tokenizer is None:
        return str(token_id)
    text = _raw_token_text(tokenizer, token_id).replace("\n", "").replace(" ", "·")
    return text if len(text) <= MAX_LABEL else text[:MAX_LABEL - 1] + "…"


def _rows(parents) -> list[float]:
    """The vertical place of every tree index (root first): leaves one row apart in depth-first order (a node's
    children best first), a parent midway between its first and last child."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents, start=1):
        children.setdefault(int(p), []).append(i)
    rows = [0.0] * (len(parents) + 1)
    next_leaf = 0
    stack = [(0, False)]
    while stack:  # iterative post-order: a deep chain of nodes needs no recursion
        node, seen = stack.pop()
        kids = children.get(node, [])
        if not kids:
            rows[node] = float(next_leaf)
            next_leaf += 1
        elif seen:
            rows[node] = (rows[kids[0]] + rows[kids[-1]]) / 2
        else:
            stack.append((node, True))
            stack.extend((k, False) for k in reversed(kids))
    return rows


def draft_tree_figure(tree: dict, tokenizer=None, *, root_id: int | None = None, path=(), target_choices=(),
                      chain=(), title: str | None = None) -> go.Figure:
    """One draft tree. ``tree``: token_ids, parents, depths, log_weights (``tree_data``'s lists).

    path: the tree indices of the accepted path, depth 0 (the root, 0) to n. target_choices: the target's token
    after each index of ``path`` (n + 1 of them; the last is the bonus token). chain: the chain's drafts, one
    per depth (its nodes in the tree are drawn square). Always six traces, so a widget can redraw in place.
    """
    tokens, parents, depths, weights = (list(tree[k]) for k in ("token_ids", "parents", "depths", "log_weights"))
    n_nodes, path = len(tokens), [int(i) for i in path]
    if path and path[0] != 0:
        raise ValueError("path starts at the root, tree index 0")
    if target_choices and len(target_choices) != len(path):
        raise ValueError(f"one target choice per index of the path: {len(path)} indices, {len(target_choices)} "
                         "choices")
    ys = [-r for r in _rows(parents)]  # best first at the top
    xs = [0] + [int(d) for d in depths]
    prefix = [()]  # each tree index's prefix of tokens, to find the chain's nodes
    for p, tok in zip(parents, tokens):
        prefix.append(prefix[int(p)] + (int(tok),))
    chain = [int(t) for t in chain]
    on_chain = [i for i in range(1, n_nodes + 1) if chain and list(prefix[i]) == chain[:len(prefix[i])]]
    chain_set = set(on_chain)
    on_path = set(path)

    def segments(indices):
        ex, ey = [], []
        for i in indices:
            p = int(parents[i - 1])
            ex += [xs[p], xs[i], None]
            ey += [ys[p], ys[i], None]
        return ex, ey

    fig = go.Figure()
    ex, ey = segments(range(1, n_nodes + 1))
    fig.add_trace(go.Scatter(x=ex, y=ey, mode="lines", line=dict(color="#bbbbbb", width=1), hoverinfo="skip",
                             name="tree edge", showlegend=False))
    px_, py_ = segments(path[1:])
    fig.add_trace(go.Scatter(x=px_, y=py_, mode="lines", line=dict(color=TOKEN_COLORS["accepted"], width=4),
                             hoverinfo="skip", name="accepted path"))
    labels = [_label(tokenizer, t) for t in tokens]
    finite = [w for w in weights if math.isfinite(w)] or [0.0]
    fig.add_trace(go.Scatter(
        x=xs[1:], y=ys[1:], mode="markers+text", text=labels, textposition="top center", textfont=dict(size=10),
        cliponaxis=False, name="node (colour: log path prob)", showlegend=False,
        marker=dict(size=12, color=weights, colorscale="Viridis", cmin=min(finite), cmax=max(finite),
                    symbol=["square" if i in chain_set else "circle" for i in range(1, n_nodes + 1)],
                    line=dict(width=[3 if i in on_path else 0.5 for i in range(1, n_nodes + 1)],
                              color=[TOKEN_COLORS["accepted"] if i in on_path else "#444444"
                                     for i in range(1, n_nodes + 1)]),
                    colorbar=dict(title=dict(text="log q(prefix)", side="right"), thickness=12, len=0.8)),
        hovertext=[f"depth {d}, {'chain, ' if i + 1 in chain_set else ''}token {_label(tokenizer, t)!r}<br>"
                   f"log path prob {w:.2f} ({math.exp(w):.1%})"
                   for i, (d, t, w) in enumerate(zip(depths, tokens, weights))], hoverinfo="text"))
    root = _label(tokenizer, root_id) if root_id is not None else "x_t"
    fig.add_trace(go.Scatter(x=[0], y=[ys[0]], mode="markers+text", text=[root], textposition="top center",
                             cliponaxis=False, marker=dict(size=14, color="black", symbol="diamond"),
                             name="root x_t", hovertext=[f"root x_t: {root!r}"], hoverinfo="text"))
    lane = min(ys) - 1.5
    kinds = ["accepted"] * (len(target_choices) - 1) + ["bonus"] if target_choices else []
    fig.add_trace(go.Scatter(
        x=list(range(1, len(target_choices) + 1)), y=[lane] * len(target_choices), mode="markers+text",
        text=[_label(tokenizer, t) for t in target_choices], textposition="bottom center", cliponaxis=False,
        marker=dict(size=11, symbol="triangle-up", color=[TOKEN_COLORS[k] for k in kinds]),
        name="the target's choice after each path node (blue: the bonus token)",
        hovertext=[f"after depth {d}: the target chose {_label(tokenizer, t)!r}" for d, t in enumerate(target_choices)],
        hoverinfo="text"))
    fig.add_trace(go.Scatter(x=[xs[i] for i in on_chain], y=[ys[i] for i in on_chain], mode="markers",
                             marker=dict(size=16, symbol="square-open", color=PALETTE["orange"]),
                             name="the chain's drafts (the rank-0 path)", hoverinfo="skip"))
    width = max(xs + [len(target_choices)])
    fig.update_xaxes(range=[-0.7, width + 0.9], dtick=1, title_text="depth (draft position after x_t)",
                     zeroline=False)
    fig.update_yaxes(visible=False, range=[lane - 1.4, max(ys) + 1.2])
    # the legend at the figure's foot, under the axis (in container units: the plot's height varies with the tree)
    fig.update_layout(legend=dict(orientation="h", yref="container", y=0.005, yanchor="bottom", x=0),
                      plot_bgcolor="white")
    leaves = int(-min(ys)) + 1
    height = min(1200, max(380, 170 + ROW_PX * (leaves + 3)))
    n = len(path) - 1 if path else 0
    return titled(fig, title or f"A draft tree of {n_nodes} nodes: {n} drafts accepted", height=height,
                  bottom=LEGEND_PX)


def _series_name(method: str, prompt_set: str, sets: int) -> str:
    name = {"dflash": "paper's drafter", "dflash_poolside": "Poolside-style drafter"}.get(method, method)
    return f"{name}, {prompt_set} prompts" if sets > 1 else name


def tau_vs_budget_figure(records, *, title: str | None = None) -> go.Figure:
    """τ against the node budget (log axis) for each (method, prompt set) in ``records``; each chain
    (tree_budget None) drawn flat across the budgets, dashed, in its drafter's colour."""
    records = [r for r in records if r["method"] != "target_only"]
    sets = sorted({r.get("prompt_set", "heldout") for r in records}, key=lambda s: (s != "heldout", s))
    budgets = sorted({r["tree_budget"] for r in records if r["tree_budget"] is not None})
    fig = go.Figure()
    for method in sorted({r["method"] for r in records}, key=lambda m: (m != "dflash", m)):
        for s in sets:
            rows = [r for r in records if r["method"] == method and r.get("prompt_set", "heldout") == s]
            tree = sorted((r for r in rows if r["tree_budget"] is not None), key=lambda r: r["tree_budget"])
            chain = [r for r in rows if r["tree_budget"] is None]
            colour, name = METHOD_COLORS.get(method, PALETTE["purple"]), _series_name(method, s, len(sets))
            if tree:
                fig.add_trace(go.Scatter(x=[r["tree_budget"] for r in tree],
                                         y=[r["mean_acceptance_length"] for r in tree], mode="lines+markers",
                                         name=f"tree, {name}",
                                         line=dict(color=colour, dash=SET_DASH.get(s, "solid"))))
            if chain and budgets:
                tau = chain[0]["mean_acceptance_length"]
                fig.add_trace(go.Scatter(x=[budgets[0], budgets[-1]], y=[tau, tau], mode="lines",
                                         name=f"chain ({chain[0]['block_size'] - 1} drafts), {name}: τ {tau:.2f}",
                                         line=dict(color=colour, dash="dash", width=1.5), opacity=0.8))
    fig.update_xaxes(type="log", tickvals=budgets, title_text="node budget N (tokens verified: N + 1)")
    fig.update_yaxes(title_text="τ (tokens per target forward)", rangemode="tozero")
    fig.update_layout(legend=dict(orientation="h", y=-0.25, yanchor="top"))
    return titled(fig, title or "τ against the tree's node budget; dashed: the chain", height=440)


def _pick(records, method, batch, prompt_set):
    return [r for r in records if r["method"] == method and r.get("batch", 1) == batch
            and r.get("prompt_set", "heldout") == prompt_set]


def tree_speedups(records, method: str = "dflash", *, batch: int = 1, prompt_set: str = "heldout") -> dict:
    """{tree_budget (None: the chain): tokens/s over target-only's} for one method, batch and prompt set of a
    speed record; empty when the record has no target-only row there."""
    base = _pick(records, "target_only", batch, prompt_set)
    if not base:
        return {}
    return {r["tree_budget"]: r["tokens_per_s"] / base[0]["tokens_per_s"] for r in _pick(records, method, batch,
                                                                                         prompt_set)}


def where_tree_stops_paying(speedups: dict) -> dict:
    """From ``tree_speedups``: the budget with the best speed-up ("best", "best_speedup"), the chain's
    ("chain"), and the first budget (in increasing order) whose speed-up is below the chain's
    ("first_below_chain", None when every budget beats it; also None without a chain)."""
    budgets = sorted(b for b in speedups if b is not None)
    if not budgets:
        raise ValueError("no tree budget among the speed-ups")
    best = max(budgets, key=lambda b: speedups[b])
    chain = speedups.get(None)
    below = next((b for b in budgets if chain is not None and speedups[b] < chain), None)
    return {"best": best, "best_speedup": speedups[best], "chain": chain, "first_below_chain": below}


def tree_speed_figure(records, *, batch: int = 1, prompt_set: str = "heldout", title: str | None = None) -> go.Figure:
    """Left: tokens/s over target-only against the budget, per drafter (its chain flat, dashed). Right: the
    verify forward alone (ms) against the budget, with the chain's and target-only's flat."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("× target-only (tokens/s)", "verify forward (ms)"),
                        horizontal_spacing=0.12)
    budgets = sorted({r["tree_budget"] for r in records if r.get("tree_budget") is not None})
    if not budgets:
        raise ValueError("the record holds no tree budget")
    ends = [budgets[0], budgets[-1]]
    methods = sorted({r["method"] for r in records} - {"target_only"}, key=lambda m: (m != "dflash", m))
    for method in methods:
        colour, name = METHOD_COLORS.get(method, PALETTE["purple"]), _series_name(method, prompt_set, 1)
        ups = tree_speedups(records, method, batch=batch, prompt_set=prompt_set)
        rows = {r["tree_budget"]: r for r in _pick(records, method, batch, prompt_set)}
        tree = [b for b in budgets if b in ups]
        fig.add_trace(go.Scatter(x=tree, y=[ups[b] for b in tree], mode="lines+markers", name=f"tree, {name}",
                                 line=dict(color=colour), legendgroup=method), 1, 1)
        if None in ups:
            fig.add_trace(go.Scatter(x=ends, y=[ups[None]] * 2, mode="lines", name=f"chain, {name}",
                                     line=dict(color=colour, dash="dash"), legendgroup=method), 1, 1)
        fig.add_trace(go.Scatter(x=tree, y=[rows[b]["verify_ms"] for b in tree], mode="lines+markers",
                                 line=dict(color=colour), showlegend=False, legendgroup=method), 1, 2)
        if None in rows:
            fig.add_trace(go.Scatter(x=ends, y=[rows[None]["verify_ms"]] * 2, mode="lines", showlegend=False,
                                     line=dict(color=colour, dash="dash"), legendgroup=method), 1, 2)
    base = _pick(records, "target_only", batch, prompt_set)
    if base:
        fig.add_trace(go.Scatter(x=ends, y=[base[0]["verify_ms"]] * 2, mode="lines", name="target-only",
                                 line=dict(color=METHOD_COLORS["target_only"], dash="dot")), 1, 2)
    fig.add_hline(y=1, line=dict(color="black", dash="dot", width=1), row=1, col=1)
    fig.update_xaxes(type="log", tickvals=budgets, title_text="node budget N")
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(legend=dict(orientation="h", y=-0.3, yanchor="top"))
    return titled(fig, title or f"Speed and verify cost against the budget (batch {batch}, {prompt_set} prompts)",
                  height=420)
