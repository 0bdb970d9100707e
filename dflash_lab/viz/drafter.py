"""Chapter 1 (and the masks of 2 and 5): the drafter's visibility mask and its parameters."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dflash_lab.viz.common import PALETTE, _array


def visibility_mask_figure(mask, *, query_positions, key_positions, context_len: int,
                           title: str | None = None) -> go.Figure:
    """Which keys each block query attends to.

    ``mask`` is (Q, N+Q) bool for one block (``drafter.dflash_attention_mask``
    without the batch axis): N context keys then the Q block keys.
    """
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
