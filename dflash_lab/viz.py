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
