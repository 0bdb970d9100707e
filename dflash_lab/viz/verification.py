"""Chapter 7: vLLM's verification rules side by side (per-position acceptance, τ with intervals)."""

from __future__ import annotations

import plotly.graph_objects as go

from dflash_lab.viz.common import PALETTE

METHOD_ORDER = ("standard", "block", "fly", "synthetic")


RULE_COLOURS = {"standard": PALETTE["blue"], "block": PALETTE["green"], "fly": PALETTE["orange"],
                "synthetic": PALETTE["grey"]}


def _colour(method: str) -> str:
    return RULE_COLOURS.get(method, PALETTE["purple"])


def verification_rates_figure(rows, *, title: str = "Per-position acceptance by verification rule") -> go.Figure:
    """vLLM's per-position rates, one bar group per row; rows carry method, draft mode, τ and per_position_rate."""
    fig = go.Figure()
    for r in rows:
        rates = r["per_position_rate"]
        name = f"{r['method']} · {r['draft_sample_method']} drafts · τ {r['tau']:.2f}"
        fig.add_bar(x=list(range(1, len(rates) + 1)), y=rates, name=name,
                    marker_color=_colour(r["method"]), opacity=1.0 if r["draft_sample_method"] == "greedy" else 0.55)
    fig.update_layout(title=title, barmode="group", xaxis_title="draft position i",
                      yaxis_title="drafts accepted through i / drafts", yaxis_range=[0, 1], legend_title="rule")
    return fig


def tau_interval_figure(rows, *, title: str = "τ per rule, 95 % interval over prompts") -> go.Figure:
    """τ with its interval, one point per row, grouped by temperature on the x axis."""
    fig = go.Figure()
    for method in METHOD_ORDER:
        for mode, symbol in (("greedy", "circle"), ("probabilistic", "diamond")):
            sel = [r for r in rows if r["method"] == method and r["draft_sample_method"] == mode]
            if not sel:
                continue
            fig.add_scatter(x=[f"T={r['temperature']:g}" for r in sel], y=[r["tau"] for r in sel], mode="markers",
                            name=f"{method} · {mode}", marker=dict(color=_colour(method), symbol=symbol, size=10),
                            error_y=dict(type="data", symmetric=False,
                                         array=[r["tau_high"] - r["tau"] for r in sel],
                                         arrayminus=[r["tau"] - r["tau_low"] for r in sel]))
    fig.update_layout(title=title, yaxis_title="τ (tokens per verification step)", scattermode="group")
    return fig
