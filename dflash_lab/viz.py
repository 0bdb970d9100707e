"""Figures for the lab: functions that take plain data and return a plotly Figure.

Each section below belongs to one chapter of the notebook suite. Functions here
never compute model outputs themselves; they draw what they are given.
"""

from __future__ import annotations

import plotly.graph_objects as go

# A small, colour-blind-safe palette shared by every figure.
PALETTE = {
    "blue": "#0072B2",
    "orange": "#E69F00",
    "green": "#009E73",
    "red": "#D55E00",
    "purple": "#CC79A7",
    "sky": "#56B4E9",
    "yellow": "#F0E442",
    "grey": "#999999",
}


# ---------------------------------------------------------------------------
# Chapter 1-2: the drafter and its context K/V
# ---------------------------------------------------------------------------
#
# K and V arrive as (L, N, nkv, hd) tensors (precompute_context_kv's layout);
# "norm" is the L2 norm over the channels that are left after the chosen axes.


def _array(x):
    """A torch tensor (any device/dtype) or array-like -> float numpy array."""
    import numpy as np

    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=float)


def _positions_axis(positions, n: int):
    return list(range(n)) if positions is None else [int(p) for p in _array(positions)]


def _side_by_side(left: go.Heatmap, right: go.Heatmap, titles, *, title: str, height: int) -> go.Figure:
    """Two heatmaps with their own colour bars."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=titles, horizontal_spacing=0.12)
    left.update(colorbar=dict(x=0.44, thickness=12))
    right.update(colorbar=dict(x=1.0, thickness=12))
    fig.add_trace(left, 1, 1)
    fig.add_trace(right, 1, 2)
    fig.update_layout(title=title, height=height, margin=dict(l=10, r=10, t=80, b=10))
    fig.update_xaxes(title_text="context position")
    return fig


def _norm_maps(left, right, *, rows, positions, titles, title: str, what: str = "norm",
               colorscales=("Viridis", "Cividis")) -> go.Figure:
    """Two (rows, N) arrays of norms as heatmaps over context positions."""
    xs = _positions_axis(positions, left.shape[1])
    hover = f"%{{y}}, position %{{x}}<br>{what} %{{z:.3f}}<extra></extra>"
    return _side_by_side(
        go.Heatmap(z=left, x=xs, y=rows, colorscale=colorscales[0], hovertemplate=hover),
        go.Heatmap(z=right, x=xs, y=rows, colorscale=colorscales[1], hovertemplate=hover),
        titles, title=title, height=180 + 28 * len(rows),
    )


def context_kv_norms_figure(k, v, *, positions=None, title: str | None = None) -> go.Figure:
    """‖K‖ and ‖V‖ per drafter layer × context position (norm over every head and channel)."""
    kn, vn = (((_array(a) ** 2).sum(axis=(2, 3))) ** 0.5 for a in (k, v))  # (L, N) from (L, N, nkv, hd)
    return _norm_maps(kn, vn, rows=[f"layer {l}" for l in range(len(kn))], positions=positions,
                      titles=("‖K‖ (after K-norm and RoPE)", "‖V‖ (as projected)"),
                      title=title or "Context K/V norms per layer and position")


def context_kv_head_norms_figure(k, v, *, layer: int = 0, positions=None, title: str | None = None) -> go.Figure:
    """‖K‖ and ‖V‖ per KV head × context position, for one drafter layer."""
    kn, vn = ((((_array(a)[layer] ** 2).sum(axis=-1)) ** 0.5).T for a in (k, v))  # (nkv, N)
    return _norm_maps(kn, vn, rows=[f"kv head {h}" for h in range(len(kn))], positions=positions,
                      titles=(f"‖K‖ per head, layer {layer}", f"‖V‖ per head, layer {layer}"),
                      title=title or f"Context K/V norms per KV head and position (layer {layer})")


def k_norm_effect_figure(k_before, k_after, *, positions=None, title: str | None = None) -> go.Figure:
    """Per-head ‖K‖ before and after K-norm, averaged over heads, per layer × position.

    Before: the raw projection, whose size follows the context state. After:
    every head vector has unit RMS times the K-norm weight (RoPE keeps norms), so
    each layer's row becomes flat.
    """
    b, a = ((((_array(x) ** 2).sum(axis=-1)) ** 0.5).mean(axis=-1) for x in (k_before, k_after))  # (L, N)
    return _norm_maps(b, a, rows=[f"layer {l}" for l in range(len(b))], positions=positions,
                      titles=("before K-norm (raw projection)", "after K-norm and RoPE"),
                      title=title or "What K-norm does: per-head ‖K‖ before and after",
                      what="mean per-head norm", colorscales=("Magma", "Viridis"))


def context_kv_path_figure(k, v, k_ref, v_ref, *, path: str, positions=None, title: str | None = None) -> go.Figure:
    """One path's ‖K‖ next to its largest |K - K_reference| per layer × position."""
    k, v, k_ref, v_ref = (_array(x) for x in (k, v, k_ref, v_ref))
    L, N = k.shape[:2]
    xs, ys = _positions_axis(positions, N), [f"layer {l}" for l in range(L)]
    dk, dv = abs(k - k_ref), abs(v - v_ref)
    err = dk.max(axis=(2, 3))  # (L, N)
    heading = title or (f"path = {path}: max |ΔK| = {dk.max():.2e}, max |ΔV| = {dv.max():.2e} "
                        f"(mean {dk.mean():.1e} / {dv.mean():.1e}) against the reference")
    return _side_by_side(
        go.Heatmap(z=((k**2).sum(axis=(2, 3))) ** 0.5, x=xs, y=ys, colorscale="Viridis",
                   hovertemplate="%{y}, position %{x}<br>‖K‖ %{z:.4f}<extra></extra>"),
        go.Heatmap(z=err, x=xs, y=ys, colorscale="Reds", zmin=0, zmax=max(float(err.max()), 1e-12),
                   hovertemplate="%{y}, position %{x}<br>max |ΔK| %{z:.2e}<extra></extra>"),
        (f"‖K‖, {path} path", f"max |K_{path} − K_reference|"),
        title=heading, height=190 + 28 * L,
    )


def visibility_mask_figure(mask, *, query_positions, key_positions, context_len: int,
                           title: str | None = None) -> go.Figure:
    """Which keys each block query attends to.

    ``mask`` is (Q, N+Q) bool for one block (``drafter.dflash_attention_mask``
    without the batch axis): N context keys then the Q block keys.
    """
    import numpy as np

    m = _array(mask) > 0.5
    kinds = np.zeros(m.shape)  # 0 hidden, 1 visible context key, 2 visible block key
    kinds[:, :context_len][m[:, :context_len]] = 1
    kinds[:, context_len:][m[:, context_len:]] = 2
    qs = [int(p) for p in _array(query_positions)]
    ys = [f"q{j} @ {p}" + (" (last token)" if j == 0 else " (mask)") for j, p in enumerate(qs)]
    xs = [str(int(p)) for p in _array(key_positions)]
    colours = [[0, "#f2f2f2"], [0.33, "#f2f2f2"], [0.33, PALETTE["blue"]], [0.67, PALETTE["blue"]],
               [0.67, PALETTE["orange"]], [1, PALETTE["orange"]]]
    fig = go.Figure(go.Heatmap(
        z=kinds, x=xs, y=ys, zmin=0, zmax=2, colorscale=colours, xgap=1, ygap=1,
        colorbar=dict(tickvals=[0.33, 1, 1.67], ticktext=["hidden", "context key", "block key"], thickness=12),
        hovertemplate="%{y} → key position %{x}<extra></extra>",
    ))
    fig.add_vline(x=context_len - 0.5, line=dict(color="black", dash="dot"))
    fig.update_layout(
        title=title or "Which keys each block query sees", height=160 + 26 * len(ys),
        xaxis=dict(title="key position (context | block)", type="category"),
        yaxis=dict(autorange="reversed", type="category"), margin=dict(l=10, r=10, t=60, b=10),
    )
    return fig


# Where a drafter tensor belongs, by its vLLM checkpoint name (first match wins).
PARAMETER_GROUPS = [
    ("self_attn.qkv_proj", "attention: qkv"),
    ("self_attn.o_proj", "attention: output"),
    ("self_attn.g_proj", "attention: gate"),
    ("mlp.", "MLP"),
    ("fc.", "fc: target features -> context"),
    ("", "norms"),
]


def parameter_table_figure(rows, *, title: str | None = None) -> go.Figure:
    """``rows`` of (name, shape, count): a table with a total line, and under it
    the parameter count per kind of tensor (attention, MLP, fc, norms) as bars."""
    from plotly.subplots import make_subplots

    rows = list(rows)
    total = sum(int(r[2]) for r in rows)
    by_group: dict[str, int] = {}
    for name, _, count in rows:
        group = next(label for key, label in PARAMETER_GROUPS if key in name)
        by_group[group] = by_group.get(group, 0) + int(count)
    by_group = {label: by_group[label] for _, label in PARAMETER_GROUPS if label in by_group}
    table_height = 40 + 24 * (len(rows) + 1)
    bars_height = 60 + 30 * len(by_group)
    fig = make_subplots(rows=2, cols=1, specs=[[{"type": "table"}], [{"type": "xy"}]],
                        row_heights=[table_height, bars_height], vertical_spacing=0.04)
    fig.add_trace(go.Table(
        header=dict(values=["tensor (vLLM checkpoint name)", "shape", "parameters"],
                    fill_color=PALETTE["grey"], font=dict(color="white"), align="left"),
        cells=dict(values=[[r[0] for r in rows] + ["<b>total</b>"],
                           [" × ".join(map(str, r[1])) for r in rows] + [""],
                           [f"{int(r[2]):,}" for r in rows] + [f"<b>{total:,}</b>"]],
                   align=["left", "left", "right"], height=24),
        columnwidth=[4, 2, 1.4],
    ), row=1, col=1)
    fig.add_trace(go.Bar(
        orientation="h", y=list(by_group), x=list(by_group.values()), marker_color=PALETTE["blue"],
        text=[f"{n:,} ({n / max(total, 1):.0%})" for n in by_group.values()], textposition="auto",
        hovertemplate="%{y}: %{x:,} parameters<extra></extra>",
    ), row=2, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    fig.update_xaxes(title_text="parameters", row=2, col=1)
    fig.update_layout(title=title or "Drafter parameters", showlegend=False,
                      height=90 + table_height + bars_height, margin=dict(l=10, r=10, t=50, b=10))
    return fig


# ---------------------------------------------------------------------------
# Chapter 3: per-position acceptance
# ---------------------------------------------------------------------------
#
# Every figure takes SpecDecodeStats: from speculative_generate, or from a vLLM
# server's /metrics through dflash_lab.metrics; both draw the same way.

# drafted-and-accepted / drafted-and-rejected / the target's own token
TOKEN_COLORS = {"accepted": PALETTE["green"], "rejected": PALETTE["red"], "bonus": PALETTE["blue"]}
_METHOD_COLORS = [PALETTE["blue"], PALETTE["orange"], PALETTE["purple"], PALETTE["green"], PALETTE["sky"], PALETTE["red"]]


def _tau(stats) -> str:
    return f"τ = {stats.mean_acceptance_length:.2f}" if stats.num_drafts else "no drafts"


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
    from plotly.subplots import make_subplots

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
    import html

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
    import html

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


# ---------------------------------------------------------------------------
# Chapter 4: hybrid KV-cache groups
# ---------------------------------------------------------------------------

# One colour per vLLM spec kind (KVCacheSpecKind values).
KV_KIND_COLORS = {
    "full_attention": PALETTE["blue"],
    "sliding_window": PALETTE["sky"],
    "mamba": PALETTE["green"],
    "mla_attention": PALETTE["purple"],
    "sliding_window_mla": PALETTE["orange"],
}


def _kib(n: float | None) -> str:
    if n is None:
        return "-"
    text = f"{n / 1024:,.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):,.2f} MiB"
    return text.replace(" ", "\u00a0")  # a table cell must not wrap "8.0 / KiB"


def kv_group_layout_figure(rows, *, title: str | None = None, warning: str | None = None) -> go.Figure:
    """KV-cache groups as a grid: one row per group, one cell per layer.

    ``rows`` are ``kv_groups.describe_groups`` rows (index, kind, block_size,
    page_size_bytes, is_draft_group, layers with name/short_name/kind/is_draft/
    page_size_bytes). Cells are coloured by spec kind; a layer carrying the draft
    marker gets a thick black outline; the drafter's group is shaded red and
    labelled DRAFT; hovering a cell shows the layer's full name.
    """
    labels = [
        f"g{r.index} · {r.block_size} tok/block · {_kib(r.page_size_bytes)}/page" + ("  ⚑ DRAFT" if r.is_draft_group else "")
        for r in rows
    ]
    cells: dict[str, dict[str, list]] = {}
    for label, row in zip(labels, rows):
        for pos, cell in enumerate(row.layers):
            c = cells.setdefault(cell.kind, {k: [] for k in ("y", "base", "text", "hover", "line")})
            c["y"].append(label)
            c["base"].append(pos)
            c["text"].append(cell.short_name)
            c["hover"].append(
                f"{cell.name}<br>{cell.kind} · {_kib(cell.page_size_bytes)}/page"
                + ("<br><b>draft marker (is_draft)</b>" if cell.is_draft else "")
            )
            c["line"].append(4 if cell.is_draft else 0.5)
    fig = go.Figure()
    for kind, c in cells.items():
        fig.add_trace(go.Bar(
            orientation="h", y=c["y"], x=[0.94] * len(c["y"]), base=c["base"], name=kind,
            marker=dict(color=KV_KIND_COLORS.get(kind, PALETTE["grey"]), line=dict(color="black", width=c["line"])),
            text=c["text"], textposition="inside", insidetextanchor="middle",
            hovertext=c["hover"], hoverinfo="text",
        ))
    for i, row in enumerate(rows):
        if row.is_draft_group:  # shade the drafter's row behind its cells
            fig.add_shape(type="rect", xref="paper", x0=0, x1=1, yref="y", y0=i - 0.5, y1=i + 0.5,
                          fillcolor=PALETTE["red"], opacity=0.15, line_width=0, layer="below")
    widest = max((len(r.layers) for r in rows), default=1)
    heading = title or "KV-cache groups"
    if warning:
        import textwrap

        lines = textwrap.wrap(f"⚠ {warning}", 120)
        heading += "".join(f"<br><span style='font-size:12px;color:{PALETTE['red']}'>{line}</span>" for line in lines)
    top = 40 + 22 * heading.count("<br>")  # room for every title line
    fig.update_layout(
        title=heading, barmode="overlay", bargap=0.25, height=110 + top + 42 * max(len(rows), 1),
        xaxis=dict(title="position in the group", range=[-0.1, widest + 0.1], dtick=1, showgrid=False),
        yaxis=dict(categoryorder="array", categoryarray=labels, autorange="reversed"),
        legend=dict(title="spec kind"), margin=dict(l=10, r=10, t=top + 20, b=10),
    )
    return fig


def kv_group_memory_figure(memory, *, title: str | None = None) -> go.Figure:
    """Per-group memory (``kv_groups.group_memory`` rows): a table, and under it each
    group's share of one pool block (used by its layers, left empty) as stacked bars."""
    from plotly.subplots import make_subplots

    header = ["group", "kind", "layers", "draft", "tokens/block", "page", "bytes/block",
              "unused of pool block", "bytes/token", "blocks", "tokens held"]
    columns = [
        [f"g{m.group}" for m in memory],
        [m.kind for m in memory],
        [m.num_layers for m in memory],
        ["⚑" if m.is_draft_group else "" for m in memory],
        [m.block_size for m in memory],
        [_kib(m.page_size_bytes) for m in memory],
        [_kib(m.bytes_per_block) for m in memory],
        [f"{_kib(m.unused_bytes_per_block)}\u00a0of\u00a0{_kib(m.pool_bytes_per_block)}" for m in memory],
        ["state" if m.bytes_per_token is None else f"{m.bytes_per_token:,.0f}\u00a0B" for m in memory],
        [f"{m.num_blocks:,}" for m in memory],
        ["state" if m.tokens is None else f"{m.tokens:,}" for m in memory],
    ]
    fill = [[("#fbe3d6" if m.is_draft_group else "white") for m in memory]] * len(header)
    table_height = 60 + 26 * max(len(memory), 1)  # header (two lines) + one line per group
    bars_height = 60 + 28 * max(len(memory), 1)
    fig = make_subplots(rows=2, cols=1, specs=[[{"type": "table"}], [{"type": "xy"}]],
                        row_heights=[table_height, bars_height], vertical_spacing=0.06)
    fig.add_trace(go.Table(
        header=dict(values=header, fill_color=PALETTE["grey"], font=dict(color="white"), height=36),
        cells=dict(values=columns, fill_color=fill, height=24),
        columnwidth=[0.8, 2.4, 0.9, 0.7, 1.4, 1.3, 1.3, 2.6, 1.3, 1.1, 1.9],
    ), row=1, col=1)
    groups = [f"g{m.group}" + (" ⚑" if m.is_draft_group else "") for m in memory]
    for name, values, color in [
        ("used by the group's layers", [m.bytes_per_block / 1024 for m in memory], PALETTE["blue"]),
        ("left empty (pool block is wider)", [m.unused_bytes_per_block / 1024 for m in memory], PALETTE["grey"]),
    ]:
        fig.add_trace(go.Bar(orientation="h", y=groups, x=values, name=name, marker_color=color,
                             hovertemplate="%{y}: %{x:,.1f} KiB<extra>" + name + "</extra>"), row=2, col=1)
    fig.update_xaxes(title_text="KiB of one pool block: used by the group (blue), left empty (grey)", row=2, col=1)
    fig.update_yaxes(autorange="reversed", row=2, col=1)
    fig.update_layout(title=title or "Memory per KV-cache group", barmode="stack", showlegend=False,
                      height=90 + table_height + bars_height, margin=dict(l=10, r=10, t=50, b=10))
    return fig


# ---------------------------------------------------------------------------
# Chapter 5: fused kernels and the sliding window
# ---------------------------------------------------------------------------
#
# Timing records are benchmarks/context_kv.json's: {"path", "layers", "context", "ms", "device"}.

# path -> (label, colour), in the order the legend lists them
CONTEXT_KV_PATH_STYLE = {
    "reference": ("reference (per-layer loop)", PALETTE["grey"]),
    "batched": ("batched (vLLM's structure, eager)", PALETTE["sky"]),
    "batched_compiled": ("batched + torch.compile", PALETTE["blue"]),
    "folded": ("folded (torch)", PALETTE["yellow"]),
    "folded_triton": ("folded + fused Triton epilogue", PALETTE["green"]),
    "gemm_floor": ("the GEMM alone (floor)", "black"),
}


def _tokens_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def context_kv_timing_figure(records, *, layers: int = 5, highlight: str | None = None,
                             title: str | None = None) -> go.Figure:
    """Median time of every context-K/V path against context length, for one drafter depth.

    Left: milliseconds (log scale), the GEMM floor as a dashed line. Right: each
    path's time over the floor. ``highlight`` (a path name) fades the others.
    """
    from plotly.subplots import make_subplots

    rows = [r for r in records if r["layers"] == layers]
    if not rows:
        raise ValueError(f"no timing records for {layers} layers; have {sorted({r['layers'] for r in records})}")
    contexts = sorted({r["context"] for r in rows})
    ms = {(r["path"], r["context"]): r["ms"] for r in rows}
    floor = [ms.get(("gemm_floor", n)) for n in contexts]
    xs = [_tokens_label(n) for n in contexts]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("median time (ms)", "time / GEMM floor"), horizontal_spacing=0.1)
    for path, (label, colour) in CONTEXT_KV_PATH_STYLE.items():
        ys = [ms.get((path, n)) for n in contexts]
        if all(y is None for y in ys):
            continue
        ratio = [y / f if y and f else None for y, f in zip(ys, floor)]
        if path == "gemm_floor":
            fig.add_trace(go.Scatter(x=xs, y=ys, name=label, mode="lines+markers", line=dict(color=colour, dash="dash"),
                                     hovertemplate="N = %{x}: %{y:.3f} ms<extra>GEMM floor</extra>"), 1, 1)
            continue
        opacity = 1.0 if highlight in (None, path) else 0.25
        hover = "N = %{x}: %{customdata[0]:.3f} ms, %{customdata[1]:.2f}× the floor<extra>" + label + "</extra>"
        custom = [[y, r] for y, r in zip(ys, ratio)]
        fig.add_trace(go.Bar(x=xs, y=ys, name=label, legendgroup=path, marker_color=colour, opacity=opacity,
                             customdata=custom, hovertemplate=hover), 1, 1)
        fig.add_trace(go.Bar(x=xs, y=ratio, name=label, legendgroup=path, marker_color=colour, opacity=opacity,
                             showlegend=False, customdata=custom, hovertemplate=hover), 1, 2)
    fig.add_hline(y=1, line=dict(color="black", dash="dash"), row=1, col=2)
    fig.update_layout(
        title=title or f"Context K/V precompute, {layers} drafter layers · {rows[0].get('device', '?')}",
        barmode="group", height=430, legend=dict(orientation="h", y=-0.22), margin=dict(l=10, r=10, t=80, b=10),
    )
    fig.update_yaxes(type="log", title_text="ms", row=1, col=1)
    fig.update_yaxes(type="log", title_text="× floor", row=1, col=2)
    fig.update_xaxes(title_text="context tokens N")
    return fig


def window_acceptance_figure(stats_by_window: dict, *, title: str | None = None) -> go.Figure:
    """Mean acceptance length against the drafter's attention window.

    ``stats_by_window`` maps a window (int) or None (full attention) to
    SpecDecodeStats; full attention is drawn as a dashed line.
    """
    windows = sorted(w for w in stats_by_window if w is not None)
    fig = go.Figure(go.Scatter(
        x=windows, y=[stats_by_window[w].mean_acceptance_length for w in windows], mode="lines+markers",
        name="sliding window", line=dict(color=PALETTE["orange"]),
        customdata=[[stats_by_window[w].num_drafts, (stats_by_window[w].per_position_acceptance_rate or [0])[0]]
                    for w in windows],
        hovertemplate="window %{x}: τ = %{y:.3f}<br>%{customdata[0]} drafts, first draft kept %{customdata[1]:.2f}"
                      "<extra></extra>",
    ))
    if None in stats_by_window:
        full = stats_by_window[None]
        fig.add_hline(y=full.mean_acceptance_length, line=dict(color=PALETTE["blue"], dash="dash"),
                      annotation_text=f"full attention: {_tau(full)}", annotation_position="bottom right")
    fig.update_layout(
        title=title or "Acceptance with the drafter's attention limited to a window",
        xaxis=dict(title="window (tokens a block query may look back)", type="log", tickvals=windows),
        yaxis=dict(title="mean acceptance length τ", rangemode="tozero"),
        height=360, margin=dict(l=10, r=10, t=60, b=10), showlegend=False,
    )
    return fig


# ---------------------------------------------------------------------------
# Training logs
# ---------------------------------------------------------------------------
#
# A log is the training_log.json that `python -m dflash_lab.train target|drafter`
# writes next to its checkpoint (a dict, or the path of the file or its folder).


def read_training_log(log) -> dict:
    """A training log as a dict, from a dict, a training_log.json path or a checkpoint folder."""
    import json
    from pathlib import Path

    if isinstance(log, dict):
        return log
    path = Path(log)
    if path.is_dir():
        path = path / "training_log.json"
    if not path.is_file():
        raise FileNotFoundError(f"no training log at {path}")
    return json.loads(path.read_text())


def _acceptance_results(log: dict) -> list[dict]:
    """The held-out acceptance results in a drafter log, largest block first."""
    evs = [ev for ev in (log.get("final") or {}).values() if isinstance(ev, dict) and "mean_acceptance_length" in ev]
    return sorted(evs, key=lambda ev: -ev["block_size"])


def _training_summary(log: dict) -> str:
    where = log.get("device_name") or log.get("device", "?")
    parts = [f"{log.get('steps', '?')} steps", f"{log.get('train_seconds', 0):.0f} s on {where}"]
    final = log.get("final") or {}
    if log.get("stage") == "target" and "heldout_loss" in final:
        parts.append(f"held-out loss {final['heldout_loss']:.3f} (ppl {final['heldout_perplexity']:.1f})")
    for ev in _acceptance_results(log):
        parts.append(f"τ {ev['mean_acceptance_length']:.2f} at block {ev['block_size']}")
    return ", ".join(parts)


def plot_training_log(log, *, title: str | None = None) -> go.Figure:
    """Loss curve (and held-out loss) of a target log; loss + per-position agreement of a drafter log."""
    from plotly.subplots import make_subplots

    log = read_training_log(log)
    stage = log.get("stage", "?")
    curve = log.get("loss_curve") or []
    steps, losses = [c[0] for c in curve], [c[1] for c in curve]
    is_drafter = stage == "drafter"
    fig = make_subplots(rows=1, cols=2 if is_drafter else 1, horizontal_spacing=0.12,
                        subplot_titles=("training loss", "per block position") if is_drafter else None)
    fig.add_trace(go.Scatter(x=steps, y=losses, mode="lines", name="train loss", line=dict(color=PALETTE["blue"]),
                             hovertemplate="step %{x}: %{y:.3f}<extra>train</extra>"), 1, 1)
    evals = log.get("eval_curve") or []
    if evals:
        fig.add_trace(go.Scatter(x=[e[0] for e in evals], y=[e[1] for e in evals], mode="lines+markers",
                                 name="held-out loss", line=dict(color=PALETTE["orange"]),
                                 hovertemplate="step %{x}: %{y:.3f}<extra>held-out</extra>"), 1, 1)
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_yaxes(title_text="cross-entropy (nats)", row=1, col=1)
    if is_drafter:
        acc = log.get("accuracy_curve") or []
        if acc:
            last = acc[-1][1]
            fig.add_trace(go.Bar(x=list(range(1, len(last) + 1)), y=last, name="train: top-1 agrees with target",
                                 marker_color=PALETTE["sky"],
                                 hovertemplate="position %{x}: %{y:.2f}<extra>train agreement</extra>"), 1, 2)
        colours = [PALETTE["red"], PALETTE["orange"], PALETTE["green"], PALETTE["purple"]]
        for ev, colour in zip(_acceptance_results(log), colours):
            rates = ev["per_position_acceptance_rate"]
            fig.add_trace(go.Scatter(x=list(range(1, len(rates) + 1)), y=rates, mode="lines+markers",
                                     name=f"held-out acceptance (block {ev['block_size']})", line=dict(color=colour),
                                     hovertemplate="position %{x}: %{y:.2f}<extra>held-out</extra>"), 1, 2)
        fig.update_xaxes(title_text="block position j", row=1, col=2)
        fig.update_yaxes(title_text="rate", range=[0, 1], row=1, col=2)
    fig.update_layout(title=title or f"{stage} training: {_training_summary(log)}", height=380,
                      margin=dict(l=10, r=10, t=70, b=10), legend=dict(orientation="h", y=-0.2))
    return fig
