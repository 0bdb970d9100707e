"""What every figure shares: the palette and small array/layout helpers."""

from __future__ import annotations

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


def _side_by_side(left: go.Heatmap, right: go.Heatmap, titles, *, title: str, height: int) -> go.Figure:
    """Two heatmaps with their own colour bars."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=titles, horizontal_spacing=0.12)
    left.update(colorbar=dict(x=0.44, thickness=12))
    right.update(colorbar=dict(x=1.0, thickness=12))
    fig.add_trace(left, 1, 1)
    fig.add_trace(right, 1, 2)
    fig.update_layout(title=title, height=height, margin=dict(l=10, r=10, t=80, b=10))
    fig.update_xaxes(title_text="context position")
    return fig


def _tau(stats) -> str:
    """A SpecDecodeStats' mean acceptance length as a label."""
    return f"τ = {stats.mean_acceptance_length:.2f}" if stats.num_drafts else "no drafts"
