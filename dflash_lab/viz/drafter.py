"""Chapter 1 (and the masks of 2 and 5): the drafter's visibility mask and its parameters."""

from __future__ import annotations

import html

import numpy as np
import plotly.graph_objects as go

from dflash_lab.viz.common import PALETTE, _array, html_table, titled


def visibility_mask_figure(mask, *, query_positions, key_positions, context_len: int,
                           title: str | None = None) -> go.Figure:
    """Which keys each block query attends to.

    ``mask`` is (Q, N+Q) bool for one block (``block_attention.dflash_attention_mask``
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
    fig.update_layout(xaxis=dict(title="key position (context | block)", type="category"),
                      yaxis=dict(autorange="reversed", type="category", automargin=True))
    return titled(fig, title or "Which keys each block query sees", height=160 + 26 * len(ys))


# Where a drafter tensor belongs, by its vLLM checkpoint name (first match wins).
PARAMETER_GROUPS = [
    ("self_attn.qkv_proj", "attention: qkv"),
    ("self_attn.o_proj", "attention: output"),
    ("self_attn.g_proj", "attention: gate"),
    ("mlp.", "MLP"),
    ("fc.", "fc: target features -> context"),
    ("", "norms"),
]


def _group_counts(rows) -> tuple[dict[str, int], int]:
    total = sum(int(r[2]) for r in rows)
    by_group: dict[str, int] = {}
    for name, _, count in rows:
        group = next(label for key, label in PARAMETER_GROUPS if key in name)
        by_group[group] = by_group.get(group, 0) + int(count)
    return {label: by_group[label] for _, label in PARAMETER_GROUPS if label in by_group}, total


def parameter_table_html(rows, *, caption: str | None = None, max_height: int | None = 360) -> str:
    """``rows`` of (name, shape, count) as an HTML table with a total line."""
    rows = list(rows)
    total = sum(int(r[2]) for r in rows)
    body = [(f"<code>{html.escape(r[0])}</code>", " × ".join(map(str, r[1])), f"{int(r[2]):,}") for r in rows]
    return html_table(["tensor (vLLM checkpoint name)", "shape", "parameters"], body, align=["left", "left", "right"],
                      caption=caption, max_height=max_height, total=(f"total: {len(rows)} tensors", "", f"{total:,}"))


def parameter_bars_figure(rows, *, title: str | None = None) -> go.Figure:
    """The parameter count per kind of tensor (attention, MLP, fc, norms) as bars."""
    by_group, total = _group_counts(list(rows))
    fig = go.Figure(go.Bar(
        orientation="h", y=list(by_group), x=list(by_group.values()), marker_color=PALETTE["blue"],
        text=[f"{n:,} ({n / max(total, 1):.0%})" for n in by_group.values()], textposition="auto",
        hovertemplate="%{y}: %{x:,} parameters<extra></extra>",
    ))
    fig.update_yaxes(autorange="reversed", automargin=True)
    fig.update_xaxes(title_text="parameters")
    fig.update_layout(showlegend=False)
    return titled(fig, title or f"Drafter parameters by kind: {total:,} in all", height=110 + 34 * len(by_group))


def layer_table_html(layers) -> str:
    """Per drafter layer, as vLLM resolves it: ``layers`` are dicts with name, layer_type, causal,
    rule (what decided causality), window, rope_theta and rotary (rotated / head channels)."""
    body = []
    for L in layers:
        causal = "causal (query j sees block keys 0..j)" if L["causal"] else "not causal (whole block)"
        window = ("none" if L["window"] is None
                  else f"last {L['window']}" if L["causal"] else f"±{L['window']} (symmetric)")
        body.append((f"<code>{html.escape(L['name'])}</code>", L["layer_type"], f"<b>{causal}</b>",
                     html.escape(L["rule"]), window, f"{L['rope_theta']:g}", L["rotary"]))
    return html_table(["vLLM attention layer", "layer type", "inside the block", "decided by", "window",
                       "RoPE θ served",
                       "rotated channels"], body)


def rope_table_html(rows) -> str:
    """``config.rope_resolution_table`` rows: θ in the file vs θ vLLM serves, which key supplied it,
    flagged when they differ."""
    body = []
    for r in rows:
        flag = '<b style="color:#D55E00">⚠ differs from the file</b>' if r["differs"] else "same"
        in_file = "—" if r["rope_theta_in_file"] is None else f"{float(r['rope_theta_in_file']):g}"
        body.append((r["layer_type"], in_file, f"{r['rope_theta_served']:g}", f"{r['partial_rotary_factor']:g}",
                     html.escape(r.get("rope_from", "")), flag))
    return html_table(["layer type", "θ in config.json", "θ vLLM serves", "partial rotary", "from", ""], body)
