"""Chapter 5: the fused context-K/V kernel, and acceptance under the drafter's sliding window."""

from __future__ import annotations

import ipywidgets as widgets
import torch

from dflash_lab import viz
from dflash_lab import context_kv_kernel as kernels
from dflash_lab.context_kv import CONTEXT_KV_PATHS
from dflash_lab.drafter import with_window
from dflash_lab.measure import context_kv as bench_context_kv
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


FUSED_NEEDS = "needs a CUDA GPU with Triton"  # what the fused control says where the kernel cannot run


def fused_kernel_explorer(drafter, context, positions, records, *, layers: int = 5) -> widgets.VBox:
    """Pick a context-K/V path and flip the fused Triton epilogue; see parity, the time it takes here, and
    what it costs at Laguna-XS.2's shapes.

    Each change re-runs ``drafter.precompute_context_kv`` on ``context`` with
    ``fused=`` passed explicitly (no process-wide switch changes), judges it against
    the reference path with ``context_kv.context_kv_agreement`` (the rule chapter 2
    uses), times it here with ``measure.context_kv.time_context_kv_path``
    (``time_ms``; one thread on a CPU) and says what actually ran. The fused kernel
    runs only on a CUDA GPU with Triton: there the checkbox (folded path) switches
    it, and the line gives the folded path's time with the kernel and without; elsewhere
    the checkbox is off, disabled, and says that it needs one. The figure,
    ``viz.context_kv_timing_figure`` of ``records`` (a GPU's: live, or
    benchmarks/context_kv.json), highlights the chosen path. The returned box exposes
    ``.path``, ``.fused``, ``.dtype``, ``.layers``, ``.parity``, ``.timing`` (the last
    measured milliseconds, by what ran), ``.runnable`` and ``.figure``.
    """
    depths = sorted({r["layers"] for r in records})
    runnable = kernels.triton is not None and context.is_cuda
    path = widgets.ToggleButtons(options=list(CONTEXT_KV_PATHS), value="folded", description="path", style=WIDE_BUTTONS)
    if runnable:
        fused = widgets.Checkbox(value=kernels.fused_enabled(), description="fused Triton epilogue (folded path)",
                                 indent=False, layout=widgets.Layout(width="auto", margin="0 24px 0 0"))
    else:
        fused = widgets.Checkbox(value=False, disabled=True, description="fused Triton epilogue (folded path)",
                                 indent=False, layout=widgets.Layout(width="auto", margin="0 24px 0 0"),
                                 tooltip=f"The fused kernel {FUSED_NEEDS}; this machine runs {context.device.type} "
                                         f"tensors{'' if kernels.triton is not None else ' and has no Triton'}.")
    dtype = widgets.ToggleButtons(options=list(CONTEXT_KV_DTYPES), value="float32", description="dtype",
                                  style=WIDE_BUTTONS)
    depth = widgets.Dropdown(options=depths, value=layers if layers in depths else depths[-1],
                             description="timings for L", style=WIDE, layout=widgets.Layout(width="auto"))
    parity = widgets.HTML()
    timing = {}
    copies = {}

    def time_here(run_path, run_fused):
        model, ctx = copies[dtype.value], context.to(getattr(torch, dtype.value))
        return bench_context_kv.time_context_kv_path(model, ctx, positions, run_path, fused=run_fused)

    def measure():
        fused.disabled = not runnable or path.value != "folded"  # the kernel is the folded path's epilogue
        run_fused = path.value == "folded" and fused.value and runnable
        _, _, agree, _ = _measure_context_kv(copies, drafter, context, positions, path.value, dtype.value,
                                             fused=run_fused)
        ran = path.value
        if path.value == "folded":
            ran = "folded + fused Triton epilogue" if run_fused else "folded in torch"
        ms = time_here(path.value, run_fused)
        timing.clear()
        timing[ran] = ms
        line = (f"ran here: <b>{ran}</b> on {context.device.type}, {dtype.value}, N = {context.shape[0]}: "
                f"{_agreement_html(agree)} against the reference · median <b>{ms:.3f} ms</b> "
                f"({bench_context_kv.live_device_name(context.device)})")
        if path.value == "folded" and runnable:  # the toggle's effect, both sides measured now
            other = time_here("folded", not run_fused)
            timing["folded in torch" if run_fused else "folded + fused Triton epilogue"] = other
            with_k, without = (ms, other) if run_fused else (other, ms)
            line += (f"<br>folded path here: {with_k:.3f} ms with the fused kernel, {without:.3f} ms without "
                     f"({without / with_k:.2f}×)")
        parity.value = line

    def figure():
        chosen = "folded_triton" if path.value == "folded" and fused.value and runnable else path.value
        return viz.context_kv_timing_figure(records, layers=depth.value, highlight=chosen)

    measure()
    fig = figure_widget(figure())

    def redraw(*_):
        measure()
        _redraw_figure_widget(fig, figure())

    for control in (path, fused, dtype, depth):
        control.observe(redraw, names="value")
    note = widgets.HTML("" if runnable else (
        f"<i>The fused kernel {FUSED_NEEDS}; this machine runs {context.device.type} tensors"
        f"{'' if kernels.triton is not None else ' and has no Triton'}, so its checkbox is off and disabled. "
        "The paths above are timed here; the chart's fused bars come from the GPU run.</i>"))
    wrap = widgets.Layout(flex_flow="row wrap")
    box = widgets.VBox([widgets.HBox([path, depth], layout=wrap), widgets.HBox([fused, dtype], layout=wrap), note,
                        parity, fig])
    box.path, box.fused, box.dtype, box.layers, box.parity, box.figure = path, fused, dtype, depth, parity, fig
    box.timing, box.runnable, box.note = timing, runnable, note
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
        summary.value = (f"{len(prompts)} prompts × {max_new_tokens} tokens, block {block_size}: "
                         f"mean acceptance length "
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
