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


def context_kv_norms_figure(k, v, *, positions=None, title: str | None = None) -> go.Figure:
    """‖K‖ and ‖V‖ per drafter layer × context position (norm over every head and channel)."""
    k, v = _array(k), _array(v)  # (L, N, nkv, hd)
    L, N = k.shape[:2]
    xs, ys = _positions_axis(positions, N), [f"layer {l}" for l in range(L)]
    kn, vn = (((a**2).sum(axis=(2, 3))) ** 0.5 for a in (k, v))  # (L, N)
    hover = "%{y}, position %{x}<br>norm %{z:.3f}<extra></extra>"
    return _side_by_side(
        go.Heatmap(z=kn, x=xs, y=ys, colorscale="Viridis", hovertemplate=hover),
        go.Heatmap(z=vn, x=xs, y=ys, colorscale="Cividis", hovertemplate=hover),
        ("‖K‖ (after K-norm and RoPE)", "‖V‖ (as projected)"),
        title=title or "Context K/V norms per layer and position", height=180 + 28 * L,
    )


def context_kv_head_norms_figure(k, v, *, layer: int = 0, positions=None, title: str | None = None) -> go.Figure:
    """‖K‖ and ‖V‖ per KV head × context position, for one drafter layer."""
    k, v = _array(k)[layer], _array(v)[layer]  # (N, nkv, hd)
    N, nkv = k.shape[:2]
    xs, ys = _positions_axis(positions, N), [f"kv head {h}" for h in range(nkv)]
    kn, vn = ((((a**2).sum(axis=-1)) ** 0.5).T for a in (k, v))  # (nkv, N)
    hover = "%{y}, position %{x}<br>norm %{z:.3f}<extra></extra>"
    return _side_by_side(
        go.Heatmap(z=kn, x=xs, y=ys, colorscale="Viridis", hovertemplate=hover),
        go.Heatmap(z=vn, x=xs, y=ys, colorscale="Cividis", hovertemplate=hover),
        (f"‖K‖ per head, layer {layer}", f"‖V‖ per head, layer {layer}"),
        title=title or f"Context K/V norms per KV head and position (layer {layer})", height=180 + 28 * nkv,
    )


def k_norm_effect_figure(k_before, k_after, *, positions=None, title: str | None = None) -> go.Figure:
    """Per-head ‖K‖ before and after K-norm, averaged over heads, per layer × position.

    Before: the raw projection, whose size follows the context state. After:
    every head vector has unit RMS times the K-norm weight (RoPE keeps norms), so
    each layer's row becomes flat.
    """
    before, after = _array(k_before), _array(k_after)  # (L, N, nkv, hd)
    L, N = before.shape[:2]
    xs, ys = _positions_axis(positions, N), [f"layer {l}" for l in range(L)]
    b, a = ((((x**2).sum(axis=-1)) ** 0.5).mean(axis=-1) for x in (before, after))  # (L, N)
    hover = "%{y}, position %{x}<br>mean per-head norm %{z:.3f}<extra></extra>"
    return _side_by_side(
        go.Heatmap(z=b, x=xs, y=ys, colorscale="Magma", hovertemplate=hover),
        go.Heatmap(z=a, x=xs, y=ys, colorscale="Viridis", hovertemplate=hover),
        ("before K-norm (raw projection)", "after K-norm and RoPE"),
        title=title or "What K-norm does: per-head ‖K‖ before and after", height=180 + 28 * L,
    )


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


def parameter_table_figure(rows, *, title: str | None = None) -> go.Figure:
    """``rows`` of (name, shape, count) as a table, with a total line."""
    rows = list(rows)
    total = sum(int(r[2]) for r in rows)
    names = [r[0] for r in rows] + ["<b>total</b>"]
    shapes = [" × ".join(map(str, r[1])) for r in rows] + [""]
    counts = [f"{int(r[2]):,}" for r in rows] + [f"<b>{total:,}</b>"]
    fig = go.Figure(go.Table(
        header=dict(values=["tensor (vLLM checkpoint name)", "shape", "parameters"],
                    fill_color=PALETTE["grey"], font=dict(color="white"), align="left"),
        cells=dict(values=[names, shapes, counts], align=["left", "left", "right"]),
        columnwidth=[4, 2, 1.4],
    ))
    fig.update_layout(title=title or "Drafter parameters", height=min(110 + 26 * len(names), 900),
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


# ---------------------------------------------------------------------------
# Chapter 3: per-position acceptance
# ---------------------------------------------------------------------------


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
    return f"{n / 1024:,.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):,.2f} MiB"


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
        heading += f"<br><span style='font-size:12px;color:{PALETTE['red']}'>⚠ {warning}</span>"
    top = 40 + 22 * heading.count("<br>")  # room for every title line
    fig.update_layout(
        title=heading, barmode="overlay", bargap=0.25, height=110 + top + 42 * max(len(rows), 1),
        xaxis=dict(title="position in the group", range=[-0.1, widest + 0.1], dtick=1, showgrid=False),
        yaxis=dict(categoryorder="array", categoryarray=labels, autorange="reversed"),
        legend=dict(title="spec kind", orientation="h", y=-0.25), margin=dict(l=10, r=10, t=top + 20, b=10),
    )
    return fig


def kv_group_memory_table(memory, *, title: str | None = None) -> go.Figure:
    """Per-group memory (``kv_groups.group_memory`` rows) as a table figure."""
    header = ["group", "kind", "layers", "draft", "tokens/block", "page", "group bytes/block",
              "bytes/token", "pool bytes/block", "unused/block", "blocks", "tokens held"]
    columns = [
        [f"g{m.group}" for m in memory],
        [m.kind for m in memory],
        [m.num_layers for m in memory],
        ["⚑" if m.is_draft_group else "" for m in memory],
        [m.block_size for m in memory],
        [_kib(m.page_size_bytes) for m in memory],
        [_kib(m.bytes_per_block) for m in memory],
        ["state" if m.bytes_per_token is None else f"{m.bytes_per_token:,.0f} B" for m in memory],
        [_kib(m.pool_bytes_per_block) for m in memory],
        [_kib(m.unused_bytes_per_block) for m in memory],
        [f"{m.num_blocks:,}" for m in memory],
        ["one state per block" if m.tokens is None else f"{m.tokens:,}" for m in memory],
    ]
    fill = [[("#fbe3d6" if m.is_draft_group else "white") for m in memory]] * len(header)
    fig = go.Figure(go.Table(
        header=dict(values=header, fill_color=PALETTE["grey"], font=dict(color="white")),
        cells=dict(values=columns, fill_color=fill),
        columnwidth=[1, 3, 1, 1, 1.3, 1.3, 1.5, 1.3, 1.5, 1.3, 1.2, 1.8],
    ))
    fig.update_layout(title=title or "Memory per KV-cache group", height=120 + 32 * max(len(memory), 1),
                      margin=dict(l=10, r=10, t=50, b=10))
    return fig


# ---------------------------------------------------------------------------
# Chapter 5: fused kernels and the sliding window
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Training logs
# ---------------------------------------------------------------------------
