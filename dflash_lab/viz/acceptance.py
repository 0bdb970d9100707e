"""Chapter 3: per-position acceptance.

Every figure takes SpecDecodeStats: from speculative_generate, or from a vLLM
server's /metrics through dflash_lab.metrics; both draw the same way.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dflash_lab.viz.common import PALETTE, _tau

# drafted-and-accepted / drafted-and-rejected / the target's own token
TOKEN_COLORS = {"accepted": PALETTE["green"], "rejected": PALETTE["red"], "bonus": PALETTE["blue"]}
_METHOD_COLORS = [PALETTE["blue"], PALETTE["orange"], PALETTE["purple"], PALETTE["green"], PALETTE["sky"], PALETTE["red"]]


def per_position_acceptance_figure(stats, *, title: str | None = None) -> go.Figure:
    """Bars: vLLM's per-position acceptance rate (drafts whose first i tokens were
    all accepted); line: the conditional rate P(position i accepted | i-1 accepted)."""
    rates = stats.per_position_acceptance_rate
    positions = list(range(1, len(rates) + 1))
    conditional = [None if r != r else r for r in stats.conditional_acceptance_rate]  # NaN -> gap
    fig = go.Figure([
        go.Bar(x=positions, y=rates, name="accepted through position i (vLLM)", marker_color=PALETTE["blue"],
               text=[f"{r:.2f}" for r in rates], textposition="outside",
               hovertemplate="position %{x}: %{y:.3f} of drafts<extra></extra>"),
        go.Scatter(x=positions, y=conditional, name="accepted at i | accepted at i−1", mode="lines+markers",
                   line=dict(color=PALETTE["orange"]),
                   hovertemplate="position %{x}: %{y:.3f}<extra>conditional</extra>"),
    ])
    fig.update_layout(
        title=title or f"Per-position acceptance · {_tau(stats)} · {stats.num_drafts:,} drafts",
        xaxis=dict(title="draft position i (1 = first drafted token)", dtick=1),
        yaxis=dict(title="rate", range=[0, 1.1]), legend=dict(orientation="h", y=-0.2),
        height=380, margin=dict(l=10, r=10, t=60, b=10),
    )
    return fig


def acceptance_length_histogram(stats, *, title: str | None = None) -> go.Figure:
    """Share of drafts by acceptance length (tokens a verification yields, the bonus included).

    Computed from the per-position counters alone, so it works for vLLM /metrics too.
    """
    counts = stats.acceptance_length_counts()
    share = [c / stats.num_drafts if stats.num_drafts else 0.0 for c in counts]
    lengths = list(range(1, len(counts) + 1))
    fig = go.Figure(go.Bar(x=lengths, y=share, marker_color=PALETTE["green"], customdata=counts,
                           hovertemplate="length %{x}: %{y:.3f} (%{customdata} drafts)<extra></extra>"))
    fig.add_vline(x=stats.mean_acceptance_length if stats.num_drafts else 1, line_dash="dash",
                  line_color=PALETTE["grey"], annotation_text=_tau(stats), annotation_position="top")
    fig.update_layout(
        title=title or "Acceptance length per draft (1 = only the target's token)",
        xaxis=dict(title="acceptance length", dtick=1), yaxis=dict(title="share of drafts", rangemode="tozero"),
        height=340, margin=dict(l=10, r=10, t=60, b=10), showlegend=False,
    )
    return fig


def acceptance_sweep_figure(stats_by_method: dict, *, x_title: str, title: str | None = None) -> go.Figure:
    """Mean acceptance length against a setting: ``{method: {setting: SpecDecodeStats}}``."""
    fig = go.Figure()
    for i, (method, by_x) in enumerate(stats_by_method.items()):
        xs = sorted(by_x)
        fig.add_trace(go.Scatter(
            x=xs, y=[by_x[x].mean_acceptance_length for x in xs], name=method, mode="lines+markers",
            line=dict(color=_METHOD_COLORS[i % len(_METHOD_COLORS)]),
            customdata=[[by_x[x].num_drafts, by_x[x].target_forwards_per_token] for x in xs],
            hovertemplate="%{x}: τ = %{y:.2f}<br>%{customdata[0]} drafts, %{customdata[1]:.2f} target forwards/token"
                          f"<extra>{method}</extra>",
        ))
    fig.update_layout(title=title or f"Mean acceptance length vs {x_title}", xaxis=dict(title=x_title),
                      yaxis=dict(title="mean acceptance length τ", rangemode="tozero"),
                      height=340, margin=dict(l=10, r=10, t=60, b=10))
    return fig


def acceptance_vs_block_size_figure(stats_by_method: dict, *, title: str | None = None) -> go.Figure:
    """``{method: {block_size: SpecDecodeStats}}`` -> τ against block size."""
    fig = acceptance_sweep_figure(stats_by_method, x_title="block size", title=title)
    fig.update_xaxes(type="log", tickvals=sorted({b for by_x in stats_by_method.values() for b in by_x}))
    return fig


def acceptance_vs_temperature_figure(stats_by_method: dict, *, title: str | None = None) -> go.Figure:
    """``{method: {temperature: SpecDecodeStats}}`` -> τ against sampling temperature (0 = greedy)."""
    return acceptance_sweep_figure(stats_by_method, x_title="temperature", title=title)


def compare_acceptance_figure(stats_by_method: dict, *, title: str | None = None) -> go.Figure:
    """Methods side by side (e.g. DFlash vs prompt lookup): per-position rates and acceptance lengths."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("accepted through draft position i", "acceptance length"),
                        horizontal_spacing=0.1)
    for i, (method, stats) in enumerate(stats_by_method.items()):
        color, name = _METHOD_COLORS[i % len(_METHOD_COLORS)], f"{method} ({_tau(stats)})"
        rates = stats.per_position_acceptance_rate
        fig.add_trace(go.Bar(x=list(range(1, len(rates) + 1)), y=rates, name=name, legendgroup=method,
                             marker_color=color, hovertemplate="position %{x}: %{y:.3f}<extra>" + method + "</extra>"), 1, 1)
        counts = stats.acceptance_length_counts()
        share = [c / stats.num_drafts if stats.num_drafts else 0.0 for c in counts]
        fig.add_trace(go.Bar(x=list(range(1, len(counts) + 1)), y=share, name=name, legendgroup=method,
                             marker_color=color, showlegend=False,
                             hovertemplate="length %{x}: %{y:.3f}<extra>" + method + "</extra>"), 1, 2)
    fig.update_layout(title=title or "Drafters side by side", barmode="group", height=380,
                      legend=dict(orientation="h", y=-0.2), margin=dict(l=10, r=10, t=80, b=10))
    fig.update_xaxes(title_text="draft position i", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="acceptance length", dtick=1, row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], row=1, col=1)
    fig.update_yaxes(title_text="share of drafts", rangemode="tozero", row=1, col=2)
    return fig


def _token_text(decode, token_id: int) -> str:
    text = decode.decode([token_id]) if hasattr(decode, "decode") else decode([token_id])
    return html.escape(text).replace("\n", "↵\n").replace("\t", "⇥") or "∅"


def acceptance_tokens_html(result, tokenizer, *, prompt_tail: int = 40) -> str:
    """The generated text, each token coloured by where it came from.

    green: drafted and accepted; blue: the target's own token (the bonus after
    a fully accepted block, or the correction after a rejection); red, struck
    through: the drafted token the target rejected at that spot (hover it for
    the rest of the discarded draft). ``tokenizer`` has ``decode(ids)`` (or is
    such a callable). The prompt's last ``prompt_tail`` tokens lead in grey.
    """
    def span(tok, kind, hover):
        color = TOKEN_COLORS[kind]
        style = f"color:{color};background:{color}22;border-radius:3px;margin:0 1px;"  # 22: a light tint
        if kind == "rejected":
            style += "text-decoration:line-through;"
        return f'<span style="{style}" title="{html.escape(hover)}">{_token_text(tokenizer, tok)}</span>'

    prompt = result.output_ids[0, :result.prompt_length].tolist()[-prompt_tail:]
    parts = [f'<span style="color:{PALETTE["grey"]}">{"".join(_token_text(tokenizer, t) for t in prompt)}</span>']
    for step in result.steps:
        n, emitted = step.num_accepted, step.token_ids
        for j, tok in enumerate(emitted):
            if j < n:
                parts.append(span(tok, "accepted", f"drafted at block position {j + 1}, accepted"))
                continue
            if j == n and n < len(step.draft_ids):  # a rejection happened here
                rest = ", ".join(repr(_token_text(tokenizer, t)) for t in step.draft_ids[n:])
                parts.append(span(step.draft_ids[n], "rejected", f"drafted at block position {n + 1}, rejected; "
                                                                 f"discarded draft: {rest}"))
                hover = "the target's correction"
            else:
                hover = "the target's token (bonus)" if step.draft_ids else "the target's token (no draft)"
            parts.append(span(tok, "bonus", hover))
    legend = " · ".join(f'<span style="color:{c}">■ {k}</span>' for k, c in
                        (("drafted, accepted", TOKEN_COLORS["accepted"]), ("drafted, rejected", TOKEN_COLORS["rejected"]),
                         ("target's token (bonus / correction)", TOKEN_COLORS["bonus"])))
    body = "".join(parts)
    return (f'<div style="font-size:12px;margin-bottom:4px">{legend}</div>'
            f'<pre style="white-space:pre-wrap;font-family:monospace;font-size:12px;line-height:1.5">{body}</pre>')
