"""Chapter 3: per-position acceptance.

Every figure takes SpecDecodeStats: from speculative_generate, or from a vLLM
server's /metrics through dflash_lab.spec_decode.metrics; both draw the same way.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dflash_lab.viz.common import PALETTE, _tau, method_color, titled

# drafted-and-accepted / drafted-and-rejected / the target's own token
# Rejected drafts in a true red: the palette's "red" (vermilion) reads as orange, prompt lookup's colour.
TOKEN_COLORS = {"accepted": PALETTE["green"], "rejected": "#C41E3A", "bonus": PALETTE["blue"]}
CONDITIONAL_COLOR = "#333333"  # the conditional-rate line: no method's colour
FEW_DRAFTS = 20  # a conditional rate over fewer drafts than this is drawn faded


def _gaps(values) -> list:
    """A rate SpecDecodeStats leaves undefined (NaN) becomes a gap in the figure, never a point at 0."""
    return [None if v != v else v for v in values]


def per_position_acceptance_figure(stats, *, title: str | None = None, color: str | None = None) -> go.Figure:
    """Bars: vLLM's per-position acceptance rate (drafts whose first i tokens were
    all accepted); line: the conditional rate P(position i accepted | i-1 accepted).

    Under each position, the number of drafts that reached it (the conditional rate's
    denominator); where fewer than FEW_DRAFTS stand behind a point it is drawn faded.
    """
    rates = stats.per_position_acceptance_rate
    positions = list(range(1, len(rates) + 1))
    conditional = _gaps(stats.conditional_acceptance_rate)  # no draft got to i: no point
    reached = stats.num_drafts_reaching_pos  # the conditional rate's denominator
    opacity = [1.0 if m >= FEW_DRAFTS else 0.25 + 0.75 * m / FEW_DRAFTS for m in reached]
    fig = go.Figure([
        go.Bar(x=positions, y=rates, name="accepted through position i (vLLM's counter)",
               marker_color=color or PALETTE["blue"], text=[f"{r:.2f}" for r in rates], textposition="outside",
               customdata=stats.num_accepted_tokens_per_pos,
               hovertemplate="position %{x}: %{y:.3f} of drafts (%{customdata})<extra></extra>"),
        go.Scatter(x=positions, y=conditional, mode="lines+markers",
                   name=f"accepted at i, given accepted through i−1 (faded: under {FEW_DRAFTS} drafts)",
                   line=dict(color="rgba(51, 51, 51, 0.35)", width=1.5),  # light: the points carry the weight
                   marker=dict(color=CONDITIONAL_COLOR, size=[6 + min(m, 60) / 6 for m in reached], opacity=opacity),
                   customdata=[[c, m] for c, m in zip(stats.num_accepted_tokens_per_pos, reached)],
                   hovertemplate="position %{x}: %{y:.3f} = %{customdata[0]} of the %{customdata[1]} drafts "
                                 "that reached it<extra>conditional</extra>"),
    ])
    fig.update_layout(
        xaxis=dict(title="draft position i (1 = first drafted token); under it: drafts that reached i",
                   tickvals=positions, ticktext=[f"{i}<br>{m}" for i, m in zip(positions, reached)]),
        yaxis=dict(title="rate", range=[0, 1.12]), legend=dict(orientation="h", y=-0.3),
    )
    return titled(fig, title or f"Per-position acceptance · {_tau(stats)} · {stats.num_drafts:,} drafts",
                  height=400)


def acceptance_length_histogram(stats, *, title: str | None = None) -> go.Figure:
    """Share of drafts by acceptance length (tokens a verification yields, the bonus included).

    Computed from the per-position counters alone, so it works for vLLM /metrics too.
    """
    counts, share = stats.acceptance_length_counts(), _gaps(stats.acceptance_length_shares)
    lengths = list(range(1, len(counts) + 1))
    fig = go.Figure(go.Bar(x=lengths, y=share, marker_color=PALETTE["green"], customdata=counts,
                           hovertemplate="length %{x}: %{y:.3f} (%{customdata} drafts)<extra></extra>"))
    fig.add_vline(x=stats.mean_acceptance_length if stats.num_drafts else 1, line_dash="dash",
                  line_color=PALETTE["grey"], annotation_text=_tau(stats), annotation_position="top")
    fig.update_layout(xaxis=dict(title="acceptance length (tokens per verification, the target's own included)",
                                 dtick=1),
                      yaxis=dict(title="share of drafts", rangemode="tozero"), showlegend=False)
    return titled(fig, title or "Acceptance length per draft (1 = only the target's token)", height=340)


def acceptance_sweep_figure(stats_by_method: dict, *, x_title: str, title: str | None = None) -> go.Figure:
    """Mean acceptance length against a setting: ``{method: {setting: SpecDecodeStats}}``."""
    fig = go.Figure()
    used = set()
    for i, (method, by_x) in enumerate(stats_by_method.items()):
        xs = sorted(by_x)
        color = method_color(method, i)
        dash = "dash" if color in used else "solid"  # a second line of one method (e.g. probabilistic drafts)
        used.add(color)
        fig.add_trace(go.Scatter(
            x=xs, y=[by_x[x].mean_acceptance_length for x in xs], name=method, mode="lines+markers",
            line=dict(color=color, dash=dash),
            customdata=[[by_x[x].num_drafts, by_x[x].target_forwards_per_token] for x in xs],
            hovertemplate="%{x}: τ = %{y:.2f}<br>%{customdata[0]} drafts, %{customdata[1]:.2f} target forwards/token"
                          f"<extra>{method}</extra>",
        ))
    fig.update_layout(xaxis=dict(title=x_title), yaxis=dict(title="mean acceptance length τ", rangemode="tozero"))
    return titled(fig, title or f"Mean acceptance length vs {x_title}", height=340)


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
        color, name = method_color(method, i), f"{method} ({_tau(stats)})"
        rates = stats.per_position_acceptance_rate
        fig.add_trace(go.Bar(x=list(range(1, len(rates) + 1)), y=rates, name=name, legendgroup=method,
                             marker_color=color, hovertemplate="position %{x}: %{y:.3f}<extra>" + method + "</extra>"),
                      1, 1)
        share = _gaps(stats.acceptance_length_shares)
        fig.add_trace(go.Bar(x=list(range(1, len(share) + 1)), y=share, name=name, legendgroup=method,
                             marker_color=color, showlegend=False,
                             hovertemplate="length %{x}: %{y:.3f}<extra>" + method + "</extra>"), 1, 2)
    fig.update_layout(barmode="group", legend=dict(orientation="h", y=-0.25))
    titled(fig, title or "Drafters side by side", height=400)
    fig.update_annotations(yshift=4)  # subplot titles clear of the bars
    fig.update_xaxes(title_text="draft position i", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="acceptance length", dtick=1, row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], row=1, col=1)
    fig.update_yaxes(title_text="share of drafts", rangemode="tozero", row=1, col=2)
    return fig


def _raw_token_text(decode, token_id: int) -> str:
    """A token as text (not escaped), newlines and tabs made visible."""
    text = decode.decode([token_id]) if hasattr(decode, "decode") else decode([token_id])
    return text.replace("\n", "↵\n").replace("\t", "⇥") or "∅"


def _token_text(decode, token_id: int) -> str:
    """A token as HTML text (escaped once)."""
    return html.escape(_raw_token_text(decode, token_id))


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
                rest = ", ".join(repr(_raw_token_text(tokenizer, t)) for t in step.draft_ids[n:])  # escaped by span()
                parts.append(span(step.draft_ids[n], "rejected", f"drafted at block position {n + 1}, rejected; "
                                                                 f"discarded draft: {rest}"))
                hover = "the target's correction"
            else:
                hover = "the target's token (bonus)" if step.draft_ids else "the target's token (no draft)"
            parts.append(span(tok, "bonus", hover))
    legend = " · ".join(f'<span style="color:{c}">■ {k}</span>' for k, c in
                        (("drafted, accepted", TOKEN_COLORS["accepted"]),
                         ("drafted, rejected", TOKEN_COLORS["rejected"]),
                         ("target's token (bonus / correction)", TOKEN_COLORS["bonus"])))
    body = "".join(parts)
    return (f'<div style="font-size:12px;margin-bottom:4px">{legend}</div>'
            f'<pre style="white-space:pre-wrap;font-family:monospace;font-size:12px;line-height:1.5">{body}</pre>')


# ---------------------------------------------------------------------------
# Why it is faster: tokens per target forward, and what the clock says
# ---------------------------------------------------------------------------

_WHERE_SYMBOLS = ["circle", "diamond", "square", "triangle-up"]
_WHERE_PATTERNS = ["", "/", "x", "."]  # bar hatching per machine, in the same order


def _label_side(x: float, lo: float, hi: float) -> str:
    """Where a point's label goes so that it stays inside the x range [lo, hi]: away from the near edge."""
    at = (x - lo) / (hi - lo)
    return "top right" if at < 0.25 else "top left" if at > 0.6 else "top center"


def tau_vs_speedup_figure(rows, *, title: str | None = None) -> go.Figure:
    """Left: target forwards per generated token; right: τ against the measured speedup.

    ``rows``: dicts with ``label`` (e.g. "DFlash b16"), ``method`` ("plain greedy", "DFlash",
    "prompt lookup"), ``where`` (e.g. "this CPU", "H200"), ``tau`` (None for plain decoding),
    ``target_forwards_per_token`` and ``tokens_per_s``. Speedup is tokens/s over plain greedy's
    on the same ``where``. The dashed diagonal is speedup = τ: what drafting for free and
    verifying a block at the price of one plain forward would give.
    """
    rows = list(rows)
    wheres = list(dict.fromkeys(r["where"] for r in rows))
    base = {w: next((r["tokens_per_s"] for r in rows if r["where"] == w and r["method"] == "plain greedy"), None)
            for w in wheres}
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=("target forwards per generated token (lower is better)",
                                        "mean acceptance length τ vs measured speedup"))
    top = max([r["tau"] or 1.0 for r in rows] + [1.0]) + 0.5
    for wi, where in enumerate(wheres):
        mine = [r for r in rows if r["where"] == where]
        fig.add_trace(go.Bar(
            x=[r["label"] for r in mine], y=[r["target_forwards_per_token"] for r in mine], name=where,
            marker=dict(color=[method_color(r["method"]) for r in mine], pattern_shape=_WHERE_PATTERNS[wi % 4],
                        line=dict(color="black", width=0.5)),
            legendgroup=where, offsetgroup=str(wi),
            hovertemplate="%{x}: %{y:.3f} target forwards per token<extra>" + where + "</extra>"), 1, 1)
        points = [r for r in mine if base[where]]
        fig.add_trace(go.Scatter(
            x=[r["tau"] if r["tau"] is not None else 1.0 for r in points],
            y=[r["tokens_per_s"] / base[where] for r in points], mode="markers+text", name=f"{where} (speedup)",
            text=[r["label"] for r in points], legendgroup=where, showlegend=False,
            textposition=[_label_side(r["tau"] or 1.0, 0.5, top) for r in points],  # no label cut at an edge
            marker=dict(size=11, symbol=_WHERE_SYMBOLS[wi % len(_WHERE_SYMBOLS)],
                        color=[method_color(r["method"]) for r in points], line=dict(color="black", width=1)),
            customdata=[[r["tokens_per_s"]] for r in points],
            hovertemplate="%{text}: τ %{x:.2f}, %{y:.2f}× plain greedy (%{customdata[0]:.1f} tokens/s)"
                          "<extra>" + where + "</extra>"), 1, 2)
    fig.add_trace(go.Scatter(x=[1, top], y=[1, top], mode="lines", line=dict(color="black", dash="dash", width=1),
                             name="speedup = τ (drafting free, a block verified at one forward's price)",
                             hoverinfo="skip"), 1, 2)
    hatches = {"/": "hatched /", "x": "cross-hatched", ".": "dotted"}
    fig.update_xaxes(title_text="; ".join(["method"] + [f"{hatches[_WHERE_PATTERNS[i % 4]]}: {w}"
                                                        for i, w in enumerate(wheres) if i % 4]), row=1, col=1)
    fig.update_yaxes(title_text="target forwards / token", rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="τ (plain greedy drawn at 1)", range=[0.5, top], row=1, col=2)
    fig.update_yaxes(title_text="tokens/s ÷ plain greedy's", rangemode="tozero", row=1, col=2)
    fig.update_layout(barmode="group", legend=dict(orientation="h", y=-0.3))
    symbols = ", ".join(f"{s.replace('-up', '')}: {w}" for s, w in zip(_WHERE_SYMBOLS, wheres))
    return titled(fig, title or f"Why it is faster: fewer target forwards, and what the clock says ({symbols})",
                  height=440, width_chars=110)


def engine_vs_lab_figure(engine_stats, lab_stats, *, engine_label: str = "vLLM server",
                         lab_label: str = "lab", title: str | None = None) -> go.Figure:
    """Per-position accepted counts of vLLM's engine next to the lab's, on the same prompts.

    The title says whether every counter is equal; hover shows both rates.
    """
    n = max(len(engine_stats.num_accepted_tokens_per_pos), len(lab_stats.num_accepted_tokens_per_pos))
    positions = list(range(1, n + 1))
    fig = go.Figure()
    for label, stats, color in ((engine_label, engine_stats, method_color("vLLM server")),
                                (lab_label, lab_stats, method_color("DFlash"))):
        pad = [0] * (n - stats.num_speculative_tokens)
        counts = stats.num_accepted_tokens_per_pos + pad
        fig.add_trace(go.Bar(
            x=positions, y=counts, name=f"{label}: {stats.num_drafts} drafts, {_tau(stats)}", marker_color=color,
            text=counts, textposition="outside", customdata=stats.per_position_acceptance_rate + pad,
            hovertemplate="position %{x}: %{y} drafts accepted through it (rate %{customdata:.3f})<extra>"
                          + label + "</extra>"))
    same = (engine_stats.num_drafts, engine_stats.num_draft_tokens, engine_stats.num_accepted_tokens,
            engine_stats.num_accepted_tokens_per_pos) == (lab_stats.num_drafts, lab_stats.num_draft_tokens,
                                                          lab_stats.num_accepted_tokens,
                                                          lab_stats.num_accepted_tokens_per_pos)
    verdict = "every counter equal" if same else "counters differ"
    fig.update_layout(barmode="group", xaxis=dict(title="draft position i", dtick=1),
                      yaxis=dict(title="drafts accepted through position i", rangemode="tozero"),
                      legend=dict(orientation="h", y=-0.25))
    return titled(fig, title or f"vLLM's engine vs the lab, same prompts and settings: {verdict}", height=400)
