"""Controls for the lab: ipywidgets wired to the figure functions in viz.py.

Widgets hold no logic of their own: each control re-runs a package function
and hands the result to a viz function. One section per chapter.
"""

from __future__ import annotations

import ipywidgets as widgets


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
