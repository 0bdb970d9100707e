"""Chapter 2: the three context-K/V paths side by side, and the sliding-window mask."""

from __future__ import annotations

import ipywidgets as widgets
import torch

from dflash_lab import viz
from dflash_lab.context_kv import CONTEXT_KV_PATHS
from dflash_lab.block_attention import dflash_attention_mask
from dflash_lab.widgets.common import (
    CONTEXT_KV_DTYPES,
    WIDE,
    _agreement_html,
    _measure_context_kv,
    _redraw_figure_widget,
    figure_widget,
)


def context_kv_path_explorer(drafter, context, positions) -> widgets.VBox:
    """Switch among the three context-K/V paths (and float32/bfloat16); see that they agree.

    Each change re-runs ``drafter.precompute_context_kv`` with the chosen path
    and dtype, redraws ``viz.context_kv_path_figure`` against the reference path
    in the same dtype, and reports the largest error against the shared
    tolerance (``context_kv.context_kv_agreement``). The returned box exposes
    ``.path``, ``.dtype``, ``.figure`` and ``.agreement`` for scripted use.
    """
    path = widgets.Dropdown(options=list(CONTEXT_KV_PATHS), value="reference", description="path", style=WIDE)
    dtype = widgets.Dropdown(options=list(CONTEXT_KV_DTYPES), value="float32", description="dtype", style=WIDE)
    agreement = widgets.HTML()
    copies = {}  # one drafter copy per dtype, made on first use

    def figure(path_name, dtype_name):
        (k, v), (k_ref, v_ref), agree, ms = _measure_context_kv(copies, drafter, context, positions,
                                                                path_name, dtype_name)
        agreement.value = f"<b>{path_name}</b> in {dtype_name}: {_agreement_html(agree)} · {ms:.1f} ms"
        return viz.context_kv_path_figure(k, v, k_ref, v_ref, path=f"{path_name} ({dtype_name})", positions=positions)

    fig = figure_widget(figure(path.value, dtype.value))

    def redraw(*_):
        _redraw_figure_widget(fig, figure(path.value, dtype.value))

    path.observe(redraw, names="value")
    dtype.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox([path, dtype]), agreement, fig])
    box.path, box.dtype, box.figure, box.agreement = path, dtype, fig, agreement
    return box


def sliding_window_explorer(*, context_len: int = 24, block_size: int = 8, window: int = 8,
                            causal: bool | None = None) -> widgets.VBox:
    """Toggle the sliding window and change its size; see which keys each block query sees.

    The block starts right after ``context_len`` context positions. Causality inside the
    block follows vLLM's rule (``_dflash_layer_causal``): a sliding layer is causal (query j
    sees block keys 0..j, and its window is the last ``w`` positions), a full-attention layer is
    not (the whole block; a window on a non-causal layer is symmetric, |q − k| < w). The
    "causal" checkbox plays ``is_causal`` / ``dflash_config.causal``: it starts at vLLM's
    default for the layer type and follows the sliding switch until it is set by hand.
    ``causal`` (True/False) pins it instead and greys the checkbox out (a drafter whose
    causality is fixed). Each change recomputes ``block_attention.dflash_attention_mask`` and redraws
    ``viz.visibility_mask_figure``. The returned box exposes ``.sliding``, ``.window``,
    ``.causal``, ``.figure`` and ``.summary``.
    """
    sliding = widgets.Checkbox(value=True, description="sliding window", indent=False,
                               layout=widgets.Layout(width="auto"))
    size = widgets.IntSlider(value=window, min=1, max=context_len + block_size, description="size", style=WIDE)
    is_causal = widgets.Checkbox(value=sliding.value if causal is None else causal, indent=False,
                                 description="causal inside the block (vLLM: sliding layers are)",
                                 disabled=causal is not None, layout=widgets.Layout(width="auto"))
    summary = widgets.HTML()
    ctx_pos = torch.arange(context_len)
    q_pos = torch.arange(context_len, context_len + block_size)
    state = {"by_hand": causal is not None}  # once set by hand (or pinned), the checkbox stops following

    def figure(on: bool, w: int, c: bool):
        mask = dflash_attention_mask(q_pos[None], ctx_pos, block_size, w if on else None, causal=c)[0]  # (Q, N+Q)
        seen = mask[:, :context_len].sum(-1).tolist()
        inside = "causal: query j sees block keys 0..j" if c else "not causal: every query sees the whole block"
        why = ("vLLM's default for this layer type" if c == on else "set against the layer type's default, as "
               "is_causal / dflash_config.causal can")
        summary.value = (f"{inside} ({why}). Context keys seen per block query: " + ", ".join(map(str, seen))
                         + (f" (window {w}{', symmetric' if not c else ''})" if on else " (full attention)"))
        label = (f"sliding window {w}" if on else "full attention (no window)") + (", causal" if c else ", not causal")
        return viz.visibility_mask_figure(mask, query_positions=q_pos, key_positions=torch.cat([ctx_pos, q_pos]),
                                          context_len=context_len, title=f"Which keys each block query sees: {label}")

    fig = figure_widget(figure(sliding.value, size.value, is_causal.value))

    def redraw(*_):
        _redraw_figure_widget(fig, figure(sliding.value, size.value, is_causal.value))

    def on_sliding(change):
        if not state["by_hand"] and is_causal.value != change["new"]:
            state["following"] = True
            is_causal.value = change["new"]  # vLLM's default follows the layer type (its observer redraws)
            state["following"] = False
        else:
            redraw()

    def on_causal(_):
        if not state.get("following"):
            state["by_hand"] = True
        redraw()

    def resize(_):
        if sliding.value:
            redraw()
        else:
            sliding.value = True  # moving the window switches it on (the checkbox observer redraws)

    sliding.observe(on_sliding, names="value")
    is_causal.observe(on_causal, names="value")
    size.observe(resize, names="value")
    box = widgets.VBox([widgets.HBox([sliding, size], layout=widgets.Layout(flex_flow="row wrap")), is_causal,
                        summary, fig])
    box.sliding, box.window, box.causal, box.figure, box.summary = sliding, size, is_causal, fig, summary
    return box
