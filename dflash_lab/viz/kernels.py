"""Chapter 5: fused kernels (context-K/V timings) and the sliding window (acceptance per window).

Timing records are benchmarks/context_kv.json's: {"path", "layers", "context", "ms", "device"}.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dflash_lab.viz.common import PALETTE, _tau, titled

# path -> (label, colour), in the order the legend lists them
CONTEXT_KV_PATH_STYLE = {
    "reference": ("reference (per-layer loop)", "#6e6e6e"),
    "batched": ("batched (vLLM's structure, eager)", PALETTE["sky"]),
    "batched_compiled": ("batched + torch.compile", PALETTE["blue"]),
    "folded": ("folded (torch)", "#b07d00"),  # a dark gold: yellow bars vanish on white
    "folded_triton": ("folded + fused Triton epilogue", PALETTE["green"]),
    "gemm_floor": ("the GEMM alone (floor)", "black"),
}


def decade_ticks(values) -> dict:
    """Axis settings for a log axis: a tick at every power of ten the values span, labelled plainly."""
    finite = [v for v in values if v is not None and v > 0]
    if not finite:
        return {}
    lo, hi = math.floor(math.log10(min(finite))), math.ceil(math.log10(max(finite)))
    ticks = [10.0 ** e for e in range(lo, hi + 1)]
    return dict(tickvals=ticks, ticktext=[f"{t:g}" for t in ticks], minor=dict(showgrid=True, gridcolor="#eeeeee"))


def _tokens_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def context_kv_timing_figure(records, *, layers: int = 5, highlight: str | None = None,
                             title: str | None = None) -> go.Figure:
    """Median time of every context-K/V path against context length, for one drafter depth.

    Left: milliseconds (log scale), the GEMM floor as a dashed line. Right: each
    path's time over the floor. ``highlight`` (a path name) fades the others.
    """
    rows = [r for r in records if r["layers"] == layers]
    if not rows:
        raise ValueError(f"no timing records for {layers} layers; have {sorted({r['layers'] for r in records})}")
    contexts = sorted({r["context"] for r in rows})
    ms = {(r["path"], r["context"]): r["ms"] for r in rows}
    floor = [ms.get(("gemm_floor", n)) for n in contexts]
    xs = [_tokens_label(n) for n in contexts]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("median time (ms)", "time / GEMM floor"),
                        horizontal_spacing=0.1)
    all_ms, all_ratio = [], []
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
        marker = dict(color=colour, opacity=opacity, line=dict(color="black", width=0.6))
        fig.add_trace(go.Bar(x=xs, y=ys, name=label, legendgroup=path, marker=marker,
                             customdata=custom, hovertemplate=hover), 1, 1)
        fig.add_trace(go.Bar(x=xs, y=ratio, name=label, legendgroup=path, marker=marker,
                             showlegend=False, customdata=custom, hovertemplate=hover), 1, 2)
        all_ms += [y for y in ys if y]
        all_ratio += [r for r in ratio if r]
    fig.add_hline(y=1, line=dict(color="black", dash="dash"), row=1, col=2)
    fig.update_layout(barmode="group", legend=dict(orientation="h", y=-0.22))
    fig.update_yaxes(type="log", title_text="ms (log scale)", row=1, col=1, **decade_ticks(all_ms + floor))
    fig.update_yaxes(type="log", title_text="× floor (log scale)", row=1, col=2, **decade_ticks(all_ratio + [1.0]))
    fig.update_xaxes(title_text="context tokens N")
    return titled(fig, title or f"Context K/V precompute, {layers} drafter layers · {rows[0].get('device', '?')}",
                  height=450)


def _shape_label(rows) -> str:
    r = rows[0]
    hidden = f", hidden {r['hidden']}" if "hidden" in r else ""
    dtype = f", {r['dtype']}" if "dtype" in r else ""
    return f"{r['layers']} drafter layers{hidden}{dtype}"


def context_kv_live_figure(live, committed, *, committed_layers: int = 5, live_what: str = "the shipped drafter",
                           committed_what: str = "Laguna-XS.2 shapes", title: str | None = None) -> go.Figure:
    """Two panels, one unit (ms, log scale): the context-K/V paths timed now (left) beside a committed run (right).

    ``live``: ``measure.context_kv.time_context_kv_live`` records (one drafter depth);
    ``committed``: benchmarks/context_kv.json's, drawn at ``committed_layers``. Each
    panel's title names its device and shapes; a path keeps its colour in both.
    """
    if not live:
        raise ValueError("no live timing records")
    right = [r for r in committed if r["layers"] == committed_layers]
    if not right:
        raise ValueError(f"no committed timing records for {committed_layers} layers")
    panels = [(live, f"measured now · {live[0]['device']}<br>{live_what}, {_shape_label(live)}"),
              (right, f"committed run · {right[0]['device']}<br>{committed_what}, {_shape_label(right)}")]
    fig = make_subplots(rows=1, cols=2, subplot_titles=[t for _, t in panels], horizontal_spacing=0.09)
    shown = set()
    for col, (rows, _) in enumerate(panels, start=1):
        contexts = sorted({r["context"] for r in rows})
        ms = {(r["path"], r["context"]): r["ms"] for r in rows}
        xs = [_tokens_label(n) for n in contexts]
        values = []
        for path, (label, colour) in CONTEXT_KV_PATH_STYLE.items():
            ys = [ms.get((path, n)) for n in contexts]
            if all(y is None for y in ys):
                continue
            values += [y for y in ys if y]
            where = "measured now" if col == 1 else "committed run"
            hover = f"N = %{{x}}: %{{y:.3f}} ms<extra>{label} ({where})</extra>"
            if path == "gemm_floor":
                trace = go.Scatter(x=xs, y=ys, name=label, legendgroup=path, mode="lines+markers",
                                   line=dict(color=colour, dash="dash"), showlegend=path not in shown,
                                   hovertemplate=hover)
            else:
                trace = go.Bar(x=xs, y=ys, name=label, legendgroup=path, showlegend=path not in shown,
                               marker=dict(color=colour, line=dict(color="black", width=0.6)), hovertemplate=hover)
            fig.add_trace(trace, 1, col)
            shown.add(path)
        fig.update_yaxes(type="log", title_text="ms (log scale)", row=1, col=col, **decade_ticks(values))
    fig.update_annotations(font_size=12)
    fig.update_layout(barmode="group", legend=dict(orientation="h", y=-0.25))
    fig.update_xaxes(title_text="context tokens N")
    return titled(fig, title or f"Context K/V precompute: measured now on {live[0]['device']} (left) beside the "
                  f"committed {right[0]['device']} run (right)", height=480)


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
        xaxis=dict(title="window (tokens a block query may see; log scale)", type="log", tickvals=windows,
                   ticktext=[str(w) for w in windows]),
        yaxis=dict(title="mean acceptance length τ", rangemode="tozero"), showlegend=False,
    )
    return titled(fig, title or "Acceptance with the drafter's attention limited to a window", height=360)
