"""Chapter 6: a drafter learning its target, drawn while it trains.

One figure, three panels: the training loss (the DFlash objective), the held-out
mean acceptance length τ after every evaluation, and the per-position acceptance
rate of the latest evaluation next to the untrained drafter's. The trace count
never changes, so ``update_live_training_figure`` can move a FigureWidget in
place from a training callback.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dflash_lab.viz.common import PALETTE


def _panels(loss_curve, evals):
    """Plain lists for every trace: (loss x, y), (τ x, y), (positions, latest rates, first rates)."""
    loss_x, loss_y = [c[0] for c in loss_curve], [c[1] for c in loss_curve]
    tau_x = [step for step, _ in evals]
    tau_y = [stats.mean_acceptance_length for _, stats in evals]
    first = evals[0][1].per_position_acceptance_rate if evals else []
    latest = evals[-1][1].per_position_acceptance_rate if evals else []
    return (loss_x, loss_y), (tau_x, tau_y), (list(range(1, len(latest) + 1)), latest, first)


def tau_axis_range(taus) -> list[float]:
    """The τ panel's y range: from just below the lowest τ (never below 1, the least a draft
    step yields) to just above the highest, at least 0.5 tall, on 0.1 steps: the axis starts
    near the data, so a rise from 1.0 to 1.7 fills the panel instead of its top third."""
    taus = [t for t in taus if t is not None] or [1.0]
    lo = max(1.0, math.floor((min(taus) - 0.05) * 10) / 10)
    hi = max(lo + 0.5, math.ceil((max(taus) + 0.05) * 10) / 10)
    return [lo, hi]


def _title(evals, label: str) -> str:
    if not evals:
        return f"{label}: training…"
    (s0, before), (s1, after) = evals[0], evals[-1]
    return (f"{label}: held-out τ {before.mean_acceptance_length:.2f} at step {s0} → "
            f"{after.mean_acceptance_length:.2f} at step {s1}")


def live_training_figure(loss_curve=(), evals=(), *, label: str = "drafter",
                         total_steps: int | None = None) -> go.Figure:
    """Loss, held-out τ and per-position acceptance of a drafter in training.

    loss_curve: the training log's ``loss_curve`` ([step, loss, lr] rows);
    evals: [(step, SpecDecodeStats)] held-out measurements, the first one before training.
    """
    (lx, ly), (tx, ty), (pos, latest, first) = _panels(list(loss_curve), list(evals))
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08, column_widths=[0.34, 0.28, 0.38],
                        subplot_titles=("training loss", "held-out τ", "held-out acceptance per position"))
    fig.add_trace(go.Scatter(x=lx, y=ly, mode="lines", name="loss", line=dict(color=PALETTE["blue"]),
                             hovertemplate="step %{x}: %{y:.3f}<extra>loss</extra>"), 1, 1)
    fig.add_trace(go.Scatter(x=tx, y=ty, mode="lines+markers", name="τ", line=dict(color=PALETTE["orange"]),
                             hovertemplate="step %{x}: τ %{y:.2f}<extra></extra>"), 1, 2)
    fig.add_trace(go.Bar(x=pos, y=latest, name="latest evaluation", marker_color=PALETTE["green"],
                         hovertemplate="position %{x}: %{y:.2f}<extra>latest</extra>"), 1, 3)
    fig.add_trace(go.Scatter(x=pos, y=first, mode="lines+markers", name="before training",
                             line=dict(color=PALETTE["grey"], dash="dot"),
                             hovertemplate="position %{x}: %{y:.2f}<extra>before</extra>"), 1, 3)
    if total_steps:
        fig.update_xaxes(range=[0, total_steps], row=1, col=1)
        fig.update_xaxes(range=[0, total_steps], row=1, col=2)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_xaxes(title_text="step", row=1, col=2)
    fig.update_xaxes(title_text="block position i", dtick=1, row=1, col=3)
    fig.update_yaxes(title_text="cross-entropy (nats)", row=1, col=1)
    fig.update_yaxes(range=tau_axis_range(ty), title_text="τ (mean acceptance length)", row=1, col=2)
    fig.update_yaxes(range=[0, 1], title_text="rate", row=1, col=3)
    # A fixed width: a FigureWidget does not stretch to the page by itself, and three panels need room.
    fig.update_layout(title=_title(list(evals), label), height=380, width=1000, margin=dict(l=10, r=10, t=80, b=10),
                      legend=dict(orientation="h", y=-0.25), bargap=0.2)
    return fig


def update_live_training_figure(fig, loss_curve, evals, *, label: str = "drafter") -> None:
    """Move the traces of a figure made by ``live_training_figure`` (a FigureWidget redraws at once)."""
    (lx, ly), (tx, ty), (pos, latest, first) = _panels(list(loss_curve), list(evals))
    with fig.batch_update():
        fig.data[0].x, fig.data[0].y = lx, ly
        fig.data[1].x, fig.data[1].y = tx, ty
        fig.data[2].x, fig.data[2].y = pos, latest
        fig.data[3].x, fig.data[3].y = pos, first
        fig.layout.yaxis2.range = tau_axis_range(ty)
        fig.layout.title.text = _title(list(evals), label)


def drafter_comparison_figure(results: dict, *, title: str | None = None) -> go.Figure:
    """Per-position acceptance of several drafters, one panel per block size.

    results: {drafter name: {block size: SpecDecodeStats}}.
    """
    blocks = sorted({bs for by_block in results.values() for bs in by_block})
    fig = make_subplots(rows=1, cols=len(blocks), shared_yaxes=True, horizontal_spacing=0.05,
                        subplot_titles=[f"block {bs}" for bs in blocks])
    colours = [PALETTE["blue"], PALETTE["red"], PALETTE["green"], PALETTE["purple"]]
    for (name, by_block), colour in zip(results.items(), colours):
        for col, bs in enumerate(blocks, start=1):
            stats = by_block.get(bs)
            if stats is None:
                continue
            rates = stats.per_position_acceptance_rate
            fig.add_trace(go.Scatter(x=list(range(1, len(rates) + 1)), y=rates, mode="lines+markers",
                                     name=f"{name} (τ {stats.mean_acceptance_length:.2f})", legendgroup=name,
                                     showlegend=True, line=dict(color=colour),
                                     hovertemplate=f"{name}, block {bs}, position %{{x}}: %{{y:.2f}}<extra></extra>"),
                          1, col)
            fig.update_xaxes(title_text="block position i", row=1, col=col)
    fig.update_yaxes(range=[0, 1], title_text="acceptance rate", row=1, col=1)
    fig.update_layout(title=title or "Per-position acceptance on the held-out prompts", height=360,
                      margin=dict(l=10, r=10, t=80, b=10), legend=dict(orientation="h", y=-0.25))
    return fig
