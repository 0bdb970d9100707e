"""Chapter 4: hybrid KV-cache groups, as a layer grid and as memory per group."""

from __future__ import annotations

import textwrap

import plotly.graph_objects as go

from dflash_lab.viz.common import PALETTE, html_table

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


def wrapped_title(text: str, *, width: int = 80) -> tuple[str, int]:
    """``text`` broken into lines of at most ``width`` characters (plotly never wraps a
    title, it clips it), and the number of lines; existing ``<br>`` breaks are kept."""
    lines = [line for part in text.split("<br>") for line in (textwrap.wrap(part, width) or [""])]
    return "<br>".join(lines), len(lines)


def _title(text: str, n_lines: int) -> tuple[dict, int]:
    """A title placed under plotly's toolbar (never behind it), and the top margin it needs."""
    toolbar = 34  # px: the modebar's strip at the top of the figure
    return (dict(text=text, x=0, xanchor="left", y=1, yref="container", yanchor="top", pad=dict(t=toolbar, l=10)),
            toolbar + 22 * n_lines + 16)


MISSING_LABEL = "✗ in no group"


def kv_group_layout_figure(rows, *, title: str | None = None, warning: str | None = None,
                           missing=()) -> go.Figure:
    """KV-cache groups as a grid: one row per group, one cell per layer.

    ``rows`` are ``kv_layout.describe_groups`` rows (index, kind, kv_block_size,
    page_size_bytes, is_draft_group, layers with name/short_name/kind/is_draft/
    page_size_bytes). Cells are coloured by spec kind; a layer carrying the draft
    marker gets a thick black outline; the drafter's group is shaded red and
    labelled DRAFT; hovering a cell shows the layer's full name. ``missing`` cells
    (``kv_layout.ungrouped_layers``: layers no group holds) get a last row of their own,
    crossed out in red.
    """
    labels = [
        f"g{r.index} · {r.kv_block_size} tok/block · {_kib(r.page_size_bytes)}/page"
        + ("  ⚑ DRAFT" if r.is_draft_group else "")
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
    if missing:
        labels.append(MISSING_LABEL)
        fig.add_trace(go.Bar(
            orientation="h", y=[MISSING_LABEL] * len(missing), x=[0.94] * len(missing), base=list(range(len(missing))),
            name="in no group (dropped)", text=[c.short_name for c in missing], textposition="inside",
            insidetextanchor="middle", hoverinfo="text",
            hovertext=[f"{c.name}<br>{c.kind}: held by no group" for c in missing],
            marker=dict(color=[KV_KIND_COLORS.get(c.kind, PALETTE["grey"]) for c in missing],
                        pattern=dict(shape="x", fgcolor=PALETTE["red"], size=8, solidity=0.4),
                        line=dict(color=PALETTE["red"], width=3)),
        ))
    for i, row in enumerate(rows):
        if row.is_draft_group:  # shade the drafter's row behind its cells
            fig.add_shape(type="rect", xref="paper", x0=0, x1=1, yref="y", y0=i - 0.5, y1=i + 0.5,
                          fillcolor=PALETTE["red"], opacity=0.15, line_width=0, layer="below")
    widest = max((len(r.layers) for r in rows), default=1)
    widest = max(widest, len(missing))
    heading, n_lines = wrapped_title(title or "KV-cache groups")
    if warning:
        text, extra = wrapped_title(f"⚠ {warning}", width=100)
        heading += "".join(f"<br><span style='font-size:12px;color:{PALETTE['red']}'>{line}</span>"
                           for line in text.split("<br>"))
        n_lines += extra
    title, top = _title(heading, n_lines)  # room for every title line
    fig.update_layout(
        title=title, barmode="overlay", bargap=0.25, height=100 + top + 42 * max(len(labels), 1),
        xaxis=dict(title="position in the group", range=[-0.1, widest + 0.1], dtick=1, showgrid=False),
        yaxis=dict(categoryorder="array", categoryarray=labels, autorange="reversed", automargin=True),
        legend=dict(title="spec kind"), margin=dict(l=10, r=10, t=top, b=10),
    )
    return fig


MEMORY_HEADER = ["group", "kind", "layers", "draft", "tokens/block", "page", "bytes/block", "unused of pool block",
                 "bytes/token", "blocks", "tokens held"]


def kv_group_memory_rows(memory) -> list[list[str]]:
    """One row per group (``kv_layout.group_memory`` rows), in MEMORY_HEADER's order, as text."""
    return [[f"g{m.group}", m.kind, str(m.num_layers), "⚑" if m.is_draft_group else "", str(m.kv_block_size),
             _kib(m.page_size_bytes), _kib(m.bytes_per_block),
             f"{_kib(m.unused_bytes_per_block)}\u00a0of\u00a0{_kib(m.pool_bytes_per_block)}",
             "state" if m.bytes_per_token is None else f"{m.bytes_per_token:,.0f}\u00a0B",
             f"{m.num_blocks:,}", "state" if m.tokens is None else f"{m.tokens:,}"] for m in memory]


def kv_group_memory_table_html(memory, *, caption: str | None = None) -> str:
    """The per-group memory table as HTML (every cell shows on first draw); the draft group's row in bold."""
    rows = [[f"<b>{c}</b>" if m.is_draft_group and c else c for c in row]
            for m, row in zip(memory, kv_group_memory_rows(memory))]
    align = ["left", "left"] + ["right"] * (len(MEMORY_HEADER) - 2)
    return html_table(MEMORY_HEADER, rows, align=align, caption=caption)


def kv_group_memory_figure(memory, *, title: str | None = None) -> go.Figure:
    """Each group's share of one pool block (``kv_layout.group_memory`` rows): used by its layers
    and left empty, as stacked bars. The numbers beside it: ``kv_group_memory_table_html``."""
    groups = [f"g{m.group}" + (" ⚑" if m.is_draft_group else "") for m in memory]
    fig = go.Figure()
    for name, values, color in [
        ("used by the group's layers", [m.bytes_per_block / 1024 for m in memory], PALETTE["blue"]),
        ("left empty (pool block is wider)", [m.unused_bytes_per_block / 1024 for m in memory], PALETTE["grey"]),
    ]:
        fig.add_trace(go.Bar(orientation="h", y=groups, x=values, name=name, marker_color=color,
                             hovertemplate="%{y}: %{x:,.1f} KiB<extra>" + name + "</extra>"))
    fig.update_xaxes(title_text="KiB of one pool block: used by the group (blue), left empty (grey)")
    fig.update_yaxes(autorange="reversed", automargin=True)
    heading, top = _title(*wrapped_title(title or "Memory per KV-cache group"))
    fig.update_layout(title=heading, barmode="stack", showlegend=False, height=top + 110 + 28 * max(len(memory), 1),
                      margin=dict(l=10, r=10, t=top, b=10))
    return fig


def kv_padding_figure(cases, *, title: str | None = None) -> go.Figure:
    """How much of the KV pool vLLM's padding leaves empty, one bar per case.

    ``cases``: (label, ``kv_layout.group_memory`` rows) pairs. A bar is one pool block in
    every group: the part the groups' layers fill (blue) and the part left empty because a
    group holds fewer layers than the widest one (grey, vLLM's padding layers), as a share of
    the whole. That is the most padding can waste: every group holding as many blocks.
    """
    labels, used, empty, hover = [], [], [], []
    for label, memory in cases:
        total = sum(m.pool_bytes_per_block for m in memory)
        filled = sum(m.bytes_per_block for m in memory)
        labels.append(label)
        used.append(100 * filled / total)
        empty.append(100 * (total - filled) / total)
        hover.append(f"{len(memory)} groups · {_kib(filled)} of {_kib(total)} used per pool block in every group")
    fig = go.Figure()
    for name, values, color, text in [
        ("filled by layers", used, PALETTE["blue"], [""] * len(used)),
        ("left empty (padding)", empty, PALETTE["grey"], [f"{e:.1f} % empty" for e in empty]),
    ]:
        fig.add_trace(go.Bar(orientation="h", y=labels, x=values, name=name, marker_color=color, text=text,
                             textposition="outside" if name.startswith("left") else "none", cliponaxis=False,
                             hovertext=hover, hovertemplate="%{y}: %{x:.1f} %<br>%{hovertext}<extra>" + name
                             + "</extra>"))
    fig.update_xaxes(title_text="% of one pool block in every group: filled (blue), padding (grey)",
                     range=[0, 118], tickvals=[0, 25, 50, 75, 100])
    fig.update_yaxes(autorange="reversed", automargin=True)
    heading, top = _title(*wrapped_title(title or "KV pool left empty by vLLM's padding"))
    fig.update_layout(title=heading, barmode="stack", height=top + 120 + 34 * max(len(labels), 1),
                      legend=dict(orientation="h", y=-0.25, traceorder="normal"), margin=dict(l=10, r=10, t=top, b=60))
    return fig
