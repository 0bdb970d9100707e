"""What every figure shares: the palette, one colour per method, titles that fit, and saving a figure."""

from __future__ import annotations

import html
import textwrap
import warnings
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

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


def _array(x):
    """A torch tensor (any device/dtype) or array-like -> float numpy array."""
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=float)


def _positions_axis(positions, n: int):
    return list(range(n)) if positions is None else [int(p) for p in _array(positions)]


def _side_by_side(left: go.Heatmap, right: go.Heatmap, titles, *, title: str, height: int,
                  colorbar_titles=(None, None), shared_scale: bool = False) -> go.Figure:
    """Two heatmaps, each colour bar titled and clear of the other plot (or one shared bar)."""
    gap = 0.2
    fig = make_subplots(rows=1, cols=2, subplot_titles=titles, horizontal_spacing=gap)
    edge = (1 - gap) / 2  # right edge of the left plot, in paper units
    left.update(colorbar=dict(x=edge + 0.01, xanchor="left", thickness=12, len=0.9,
                              title=dict(text=colorbar_titles[0] or "", side="right")))
    right.update(colorbar=dict(x=1.01, xanchor="left", thickness=12, len=0.9,
                               title=dict(text=colorbar_titles[1] or "", side="right")))
    if shared_scale:  # one scale for both: the right map's bar tells it all
        lo = min(float(np.nanmin(left.z)), float(np.nanmin(right.z)))
        hi = max(float(np.nanmax(left.z)), float(np.nanmax(right.z)))
        left.update(zmin=lo, zmax=hi, showscale=False)
        right.update(zmin=lo, zmax=hi, colorscale=left.colorscale)
    fig.add_trace(left, 1, 1)
    fig.add_trace(right, 1, 2)
    fig.update_xaxes(title_text="context position")
    fig.update_yaxes(automargin=True)
    titled(fig, title, height=height, width_chars=100)
    fig.update_layout(margin=dict(r=90))
    return fig


def _tau(stats) -> str:
    """A SpecDecodeStats' mean acceptance length as a label."""
    return f"τ = {stats.mean_acceptance_length:.2f}" if stats.num_drafts else "no drafts"


# One colour per method, the same in every chapter (the text names these colours).
METHOD_COLORS = {
    "DFlash": PALETTE["blue"],
    "prompt lookup": PALETTE["orange"],
    "vLLM server": PALETTE["purple"],
    "plain greedy": PALETTE["grey"],
}
METHOD_COLOR_NAMES = {"DFlash": "blue", "prompt lookup": "orange", "vLLM server": "purple", "plain greedy": "grey"}
_FALLBACK_COLORS = [PALETTE["green"], PALETTE["sky"], PALETTE["red"], "#555555"]


def method_color(name: str, index: int = 0) -> str:
    """The suite's colour for a method label: the first METHOD_COLORS key the label starts with
    ("DFlash, block 16" is DFlash's blue; "vLLM ..." is the server's purple), else a spare colour."""
    lowered = name.lower()
    for method, color in METHOD_COLORS.items():
        if lowered.startswith(method.lower()) or (method == "vLLM server" and lowered.startswith("vllm")):
            return color
    return _FALLBACK_COLORS[index % len(_FALLBACK_COLORS)]


def wrap_title(text: str, *, width: int = 80) -> tuple[str, int]:
    """``text`` broken into lines of at most ``width`` characters (plotly clips a long title
    instead of wrapping it) and the number of lines; existing ``<br>`` breaks are kept."""
    lines = [line for part in text.split("<br>") for line in (textwrap.wrap(part, width) or [""])]
    return "<br>".join(lines), len(lines)


# px: plotly's mode bar (its toolbar), drawn across the top right of the figure; ``titled`` keeps
# this strip for it alone, so that it covers nothing: not the title, not a colour bar's labels
# (a vertical mode bar at the right edge sat on them), not a legend.
TOOLBAR_PX = 34


def titled(fig: go.Figure, title: str, *, height: int, width_chars: int = 100, bottom: int = 10) -> go.Figure:
    """Left-aligned, wrapped title with room above the plot, under a strip of its own for the mode bar
    (horizontal, at the top right), so that the mode bar covers no title, label or colour bar."""
    text, lines = wrap_title(title, width=width_chars)
    pad = TOOLBAR_PX + (12 if lines > 1 else 0)  # plotly sets a title of several lines ~12 px higher than one
    top = pad + 22 * lines + 22
    fig.update_layout(title=dict(text=text, x=0, xanchor="left", y=1, yref="container", yanchor="top",
                                 pad=dict(t=pad, l=8)),
                      height=height + pad - 14 + 20 * (lines - 1), margin=dict(l=10, r=20, t=top, b=bottom),
                      modebar=dict(orientation="h"))
    return fig


def save_figure(fig, path, *, width: int | None = None, height: int | None = None) -> Path:
    """Save a plotly figure (or FigureWidget) by the file's suffix, in one call.

    ``.html``: a standalone page with plotly.js inlined (opens offline); ``.json``: plotly's
    JSON; ``.svg`` / ``.pdf`` / ``.png``: drawn by kaleido, an optional package that is not one
    of the lab's dependencies (it drives a Chromium, such as the one ``make browser`` installs).
    Without kaleido an image suffix writes ``.html`` next to it instead and warns. Returns the
    path written.
    """
    path = Path(path)
    fig = go.Figure(fig)  # a FigureWidget's current state, as a plain figure
    suffix = path.suffix.lower()
    if suffix in (".htm", ".html"):
        fig.write_html(path, include_plotlyjs=True, full_html=True)  # inlined: no CDN
        return path
    if suffix == ".json":
        fig.write_json(path)
        return path
    if suffix not in (".svg", ".pdf", ".png"):
        raise ValueError(f"save_figure: path must end in .html, .json, .svg, .pdf or .png, got {path.name!r}")
    try:
        import kaleido  # noqa: F401  (optional: draws static images)
    except ImportError:
        fallback = path.with_suffix(".html")
        warnings.warn(f"save_figure: {suffix[1:].upper()} is drawn by kaleido, an optional package that is not "
                      f"installed here, so {fallback.name} was written instead of {path.name} (the lab's own "
                      "formats are .html and .json; pip install kaleido for .svg/.pdf/.png)", stacklevel=2)
        fig.write_html(fallback, include_plotlyjs=True, full_html=True)
        return fallback
    fig.write_image(path, width=width, height=height)
    return path


_TABLE_CSS = ("border-collapse:collapse;font-size:12px;margin:4px 0;")
_TH = "border:1px solid #ccc;padding:3px 8px;background:#eeeeee;text-align:left;"
_TD = "border:1px solid #ddd;padding:2px 8px;"


def html_table(header, rows, *, align=None, max_height: int | None = None, caption: str | None = None,
               total=None) -> str:
    """A plain HTML table (every cell shows on first draw, unlike plotly's Table); ``total`` is a last,
    bold row; ``max_height`` (px) scrolls a long table with its header kept in view."""
    align = align or ["left"] * len(header)
    esc = html.escape
    head = "".join(f'<th style="{_TH}position:sticky;top:0;text-align:{a}">{esc(str(h))}</th>'
                   for h, a in zip(header, align))
    body = "".join("<tr>" + "".join(f'<td style="{_TD}text-align:{a}">{c}</td>' for c, a in zip(r, align)) + "</tr>"
                   for r in rows)
    if total is not None:
        body += "<tr>" + "".join(f'<td style="{_TD}text-align:{a};font-weight:bold;border-top:2px solid #999">{c}</td>'
                                 for c, a in zip(total, align)) + "</tr>"
    cap = f'<caption style="caption-side:top;text-align:left;font-weight:bold;padding:2px 0">{esc(caption)}</caption>' \
        if caption else ""
    table = f'<table style="{_TABLE_CSS}">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    if max_height:
        return f'<div style="max-height:{max_height}px;overflow-y:auto;display:inline-block">{table}</div>'
    return table


def answer_table(header, rows, *, caption: str | None = None):
    """A small table a chapter's Answer displays: Markdown that JupyterLab renders as a table (never printed as
    raw pipes), kept in the committed notebook as text/markdown so nbval compares it. Cells are plain text."""
    from IPython.display import Markdown

    def cell(c) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")

    lines = ([f"**{caption}**", ""] if caption else []) + ["| " + " | ".join(cell(h) for h in header) + " |",
                                                          "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return Markdown("\n".join(lines))
