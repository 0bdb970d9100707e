"""Chapter 5: the fused context-K/V kernel, and acceptance under the drafter's sliding window."""

from __future__ import annotations

import ipywidgets as widgets

from dflash_lab import viz
from dflash_lab.spec_decode.fast import context_kv_kernel as kernels
from dflash_lab.context_kv import CONTEXT_KV_PATHS
from dflash_lab.drafter import with_window
from dflash_lab.spec_decode import generate_on_prompts
from dflash_lab.widgets.common import (
    CONTEXT_KV_DTYPES,
    WIDE,
    WIDE_BUTTONS,
    _agreement_html,
    _measure_context_kv,
    _redraw_figure_widget,
    figure_widget,
)
from dflash_lab.widgets.context_kv import sliding_window_explorer


def fused_kernel_explorer(drafter, context, positions, records, *, layers: int = 5) -> widgets.VBox:
    """Pick a context-K/V path and flip the fused Triton epilogue; see parity and what it costs.

    Each change re-runs ``drafter.precompute_context_kv`` on ``context`` with
    ``fused=`` passed explicitly (the kernel runs only where it can: CUDA with
    Triton; no process-wide switch changes), judges it against the reference path
    with ``context_kv.context_kv_agreement`` (the rule chapter 2 uses), says what
    actually ran here, and highlights the chosen path in
    ``viz.context_kv_timing_figure`` of ``records`` (timings from a GPU: live, or
    benchmarks/context_kv.json). The returned box exposes ``.path``, ``.fused``,
    ``.dtype``, ``.layers``, ``.parity`` and ``.figure``.
    """
    depths = sorted({r["layers"] for r in records})
    path = widgets.ToggleButtons(options=list(CONTEXT_KV_PATHS), value="folded", description="path", style=WIDE_BUTTONS)
    fused = widgets.Checkbox(value=kernels.fused_enabled(), description="fused Triton epilogue (folded path)",
                             indent=False, layout=widgets.Layout(width="auto"))
    dtype = widgets.ToggleButtons(options=list(CONTEXT_KV_DTYPES), value="float32", description="dtype", style=WIDE_BUTTONS)
    depth = widgets.Dropdown(options=depths, value=layers if layers in depths else depths[-1],
                             description="timings for L", style=WIDE, layout=widgets.Layout(width="auto"))
    parity = widgets.HTML()
    runnable = kernels.triton is not None and context.is_cuda
    copies = {}

    def measure():
        run_fused = path.value == "folded" and fused.value and runnable  # where it cannot run: torch ops
        out, ref, agree, ms = _measure_context_kv(copies, drafter, context, positions, path.value, dtype.value,
                                                  fused=run_fused)
        ran = path.value
        if path.value == "folded":
            ran = "folded + fused Triton epilogue" if run_fused else "folded in torch"
            if fused.value and not runnable:
                ran += " (the kernel needs a CUDA GPU; on one, this choice runs it)"
        parity.value = (f"ran here: <b>{ran}</b> on {context.device.type}, {dtype.value}, N = {context.shape[0]}: "
                        f"{_agreement_html(agree)} against the reference · {ms:.1f} ms")

    def figure():
        chosen = "folded_triton" if path.value == "folded" and fused.value else path.value
        return viz.context_kv_timing_figure(records, layers=depth.value, highlight=chosen)

    measure()
    fig = figure_widget(figure())

    def redraw(*_):
        measure()
        _redraw_figure_widget(fig, figure())

    for control in (path, fused, dtype, depth):
        control.observe(redraw, names="value")
    note = widgets.HTML("" if runnable else "<i>No CUDA GPU here: the fused kernel cannot run, the switch only "
                        "changes which bar is highlighted (the timings come from a GPU run).</i>")
    wrap = widgets.Layout(flex_flow="row wrap")
    box = widgets.VBox([widgets.HBox([path, depth], layout=wrap), widgets.HBox([fused, dtype], layout=wrap), note,
                        parity, fig])
    box.path, box.fused, box.dtype, box.layers, box.parity, box.figure = path, fused, dtype, depth, parity, fig
    return box


def window_acceptance_explorer(target, drafter, prompts, *, block_size: int = 8, max_new_tokens: int = 24,
                               window: int = 16, results: dict | None = None, max_window: int = 128,
                               context_len: int = 24) -> widgets.VBox:
    """Turn the drafter's sliding window on/off and size it; see the mask and the acceptance it gives.

    The mask part is ``sliding_window_explorer``; each window also runs
    ``spec_decode.generate_on_prompts`` with ``drafter.with_window`` on
    ``prompts`` (``results``, window -> SpecDecodeStats with None for full
    attention, seeds the cache) and draws ``viz.compare_acceptance_figure``
    against full attention. The returned box exposes ``.sliding``, ``.window``,
    ``.mask``, ``.figure``, ``.summary`` and ``.results``.
    """
    # The mask drawn is the one the run uses: with_window changes the window only, so causality
    # stays the drafter's own (pinned; a non-causal layer's window is symmetric).
    mask = sliding_window_explorer(context_len=context_len, block_size=block_size, window=window,
                                   causal=drafter.config.is_causal)
    mask.window.max, mask.window.continuous_update = max_window, False
    results = {} if results is None else results
    summary = widgets.HTML()

    def stats_for(w):
        if w not in results:
            summary.value = "<i>generating…</i>"
            results[w], _ = generate_on_prompts(target, with_window(drafter, w), prompts, max_new_tokens=max_new_tokens,
                                                block_size=block_size, progress=False)
        return results[w]

    def figure():
        w = mask.window.value if mask.sliding.value else None
        full, now = stats_for(None), stats_for(w)
        label = f"window {w}" if w is not None else "window off (= full)"
        summary.value = (f"{len(prompts)} prompts × {max_new_tokens} tokens, block {block_size}: mean acceptance length "
                         f"<b>{now.mean_acceptance_length:.3f}</b> with {label}, {full.mean_acceptance_length:.3f} "
                         "with full attention")
        return viz.compare_acceptance_figure({"full attention": full, label: now},
                                             title=f"Acceptance: full attention vs {label}")

    fig = figure_widget(figure())

    def redraw(*_):
        _redraw_figure_widget(fig, figure())

    mask.sliding.observe(redraw, names="value")
    mask.window.observe(redraw, names="value")
    box = widgets.VBox([mask, summary, fig])
    box.sliding, box.window, box.mask, box.figure, box.summary, box.results = (
        mask.sliding, mask.window, mask, fig, summary, results)
    return box
