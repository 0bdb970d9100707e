"""What every explorer shares: the dtypes it offers, redrawing a figure in place, and
running one context-K/V path against the reference (chapters 2 and 5 measure alike)."""

from __future__ import annotations

import copy

import plotly.graph_objects as go
import torch

from dflash_lab.context_kv import context_kv_agreement
from dflash_lab.runtime import synchronized_time

CONTEXT_KV_DTYPES = ("float32", "bfloat16")
WIDE = {"description_width": "initial"}  # a control's label takes the width it needs: never truncated
WIDE_BUTTONS = {**WIDE, "button_width": "auto"}  # ToggleButtons: each button as wide as its text


def figure_widget(fig) -> go.FigureWidget:
    """A FigureWidget that fills its output's width (plotly's responsive mode; no fixed 700 px)."""
    widget = go.FigureWidget(fig)
    widget._config = {"responsive": True, "displaylogo": False}
    widget.layout.autosize = True
    return widget


def _redraw_figure_widget(fig_widget, fig) -> None:
    """Put ``fig``'s traces and layout into an existing FigureWidget (same trace count)."""
    with fig_widget.batch_update():
        for old, new in zip(fig_widget.data, fig.data):
            old.update(new.to_plotly_json(), overwrite=True)
        fig_widget.layout.update(fig.layout.to_plotly_json(), overwrite=True)
        fig_widget.layout.autosize = True  # keep filling the width


def _measure_context_kv(copies: dict, drafter, context, positions, path: str, dtype_name: str, *,
                        fused: bool | None = None):
    """Run ``path`` and the reference path in ``dtype_name``; judge them with ``context_kv_agreement``.

    ``copies`` holds one drafter per dtype name, made on first use. ``fused`` goes
    to ``precompute_context_kv`` as given (folded path only; None follows
    $DFLASH_LAB_FUSED), so no process-wide switch changes. Returns
    ((K, V), (K_ref, V_ref), the agreement dict, milliseconds ``path`` took).
    """
    dt = getattr(torch, dtype_name)
    if dtype_name not in copies:
        copies[dtype_name] = drafter if next(drafter.parameters()).dtype == dt else copy.deepcopy(drafter).to(dt)
    model, ctx = copies[dtype_name], context.to(dt)
    with torch.no_grad():
        ref = model.precompute_context_kv(ctx, positions, path="reference")
        start = synchronized_time(ctx.device)
        out = model.precompute_context_kv(ctx, positions, path=path, fused=fused)
        ms = 1e3 * (synchronized_time(ctx.device) - start)
    return out, ref, context_kv_agreement(out, ref), ms


def _agreement_html(agree: dict) -> str:
    """The largest |ΔK| and |ΔV|, the mean error, the tolerance rule and the verdict, as one line."""
    errors, max_tol, mean_tol = agree["errors"], agree["max_tol"], agree["mean_tol"]
    rule = f"max ≤ {max_tol:.3g}" + (f", mean ≤ {mean_tol:g}" if mean_tol else "")
    return (f"max |ΔK| = {errors[0].max():.2e}, max |ΔV| = {errors[1].max():.2e}, mean {agree['mean_err']:.1e} "
            f"(tolerance {rule}) → {'<b>agree</b> ✓' if agree['ok'] else '<b>DISAGREE</b> ✗'}")
