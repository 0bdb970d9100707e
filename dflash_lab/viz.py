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


# ---------------------------------------------------------------------------
# Chapter 5: fused kernels and the sliding window
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Training logs
# ---------------------------------------------------------------------------
