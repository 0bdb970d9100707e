"""Chapter 2: the three context-K/V paths side by side, and the sliding-window mask."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from dflash_lab import viz
from dflash_lab.context_kv import CONTEXT_KV_PATHS
from dflash_lab.drafter import dflash_attention_mask
from dflash_lab.widgets.common import CONTEXT_KV_DTYPES, _agreement_html, _measure_context_kv, _redraw_figure_widget


def context_kv_path_explorer(drafter, context, positions) -> widgets.VBox:
    """Switch among the three context-K/V paths (and float32/bfloat16); see that they agree.

    Each change re-runs ``drafter.precompute_context_kv`` with the chosen path
    and dtype, redraws ``viz.context_kv_path_figure`` against the reference path
    in the same dtype, and reports the largest error against the shared
    tolerance (``context_kv.context_kv_agreement``). The returned box exposes
    ``.path``, ``.dtype``, ``.figure`` and ``.agreement`` for scripted use.
    """
    path = widgets.Dropdown(options=list(CONTEXT_KV_PATHS), value="reference", description="path")
    dtype = widgets.Dropdown(options=list(CONTEXT_KV_DTYPES), value="float32", description="dtype")
    agreement = widgets.HTML()
    copies = {}  # one drafter copy per dtype, made on first use

    def figure(path_name, dtype_name):
        (k, v), (k_ref, v_ref), agree, ms = _measure_context_kv(copies, drafter, context, positions,
                                                                path_name, dtype_name)
        agreement.value = f"<b>{path_name}</b> in {dtype_name}: {_agreement_html(agree)} · {ms:.1f} ms"
        return viz.context_kv_path_figure(k, v, k_ref, v_ref, path=f"{path_name} ({dtype_name})", positions=positions)

    fig = go.FigureWidget(figure(path.value, dtype.value))

    def redraw(*_):
        _redraw_figure_widget(fig, figure(path.value, dtype.value))

    path.observe(redraw, names="value")
    dtype.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox([path, dtype]), agreement, fig])
    box.path, box.dtype, box.figure, box.agreement = path, dtype, fig, agreement
    return box


def sliding_window_explorer(*, context_len: int = 24, block_size: int = 8, window: int = 8,
                            causal: bool = True) -> widgets.VBox:
    """Toggle the sliding window, its size and causality; see which keys each block query sees.

    The block starts right after ``context_len`` context positions. Each change
    recomputes ``drafter.dflash_attention_mask`` (no window when it is off; causal inside
    the block as vLLM makes sliding layers, or non-causal with vLLM's symmetric window)
    and redraws ``viz.visibility_mask_figure``. The returned box exposes ``.sliding``,
    ``.window``, ``.causal``, ``.figure`` and ``.summary``.
    """
    sliding = widgets.Checkbox(value=True, description="sliding window")
    causal_box = widgets.Checkbox(value=causal, description="causal inside the block (vLLM: sliding layers)",
                                  layout=widgets.Layout(width="auto"), style={"description_width": "initial"})
    size = widgets.IntSlider(value=window, min=1, max=context_len + block_size, description="window")
    summary = widgets.HTML()
    ctx_pos = torch.arange(context_len)
    q_pos = torch.arange(context_len, context_len + block_size)

    def figure(on: bool, w: int):
        mask = dflash_attention_mask(q_pos[None], ctx_pos, block_size, w if on else None, causal=causal_box.value)[0]
        seen = mask[:, :context_len].sum(-1).tolist()  # mask: (Q, N+Q)
        summary.value = ("context keys seen per block query: " + ", ".join(map(str, seen))
                         + "; block keys: " + ", ".join(map(str, mask[:, context_len:].sum(-1).tolist()))
                         + (f" (window {w})" if on else " (no window)"))
        label = (f"sliding window {w}" if on else "no window") + (", causal" if causal_box.value else ", non-causal")
        return viz.visibility_mask_figure(mask, query_positions=q_pos, key_positions=torch.cat([ctx_pos, q_pos]),
                                          context_len=context_len, title=f"Which keys each block query sees: {label}")

    fig = go.FigureWidget(figure(sliding.value, size.value))

    def redraw(*_):
        _redraw_figure_widget(fig, figure(sliding.value, size.value))

    def resize(_):
        if sliding.value:
            redraw()
        else:
            sliding.value = True  # moving the window switches it on (the checkbox observer redraws)

    sliding.observe(redraw, names="value")
    causal_box.observe(redraw, names="value")
    size.observe(resize, names="value")
    box = widgets.VBox([widgets.HBox([sliding, size, causal_box]), summary, fig])
    box.sliding, box.window, box.causal, box.figure, box.summary = sliding, size, causal_box, fig, summary
    return box
