"""Chapter 7: verification_explorer — pick a verification rule, temperature and block size; watch acceptance."""

from __future__ import annotations

import ipywidgets as widgets

from dflash_lab.spec_decode.sampling import REJECTION_SAMPLE_METHODS
from dflash_lab.measure.verification import default_synthetic_rates, run_cell
from dflash_lab.viz.verification import verification_rates_figure
from dflash_lab.widgets.common import WIDE, WIDE_BUTTONS, _redraw_figure_widget, figure_widget


def verification_explorer(target, drafter, prompts, *, temperatures=(0.0, 0.7, 1.0), block_sizes=(4, 8, 16),
                          max_new_tokens: int = 16, seed: int = 0) -> widgets.VBox:
    """Each new (rule, temperature, block size) runs ``bench_verification.run_cell`` on ``prompts`` for both
    draft-sampling modes (one at T = 0) and redraws ``viz.verification_rates_figure``; results are kept.

    The returned box exposes ``.method``, ``.temperature``, ``.block_size``, ``.figure``, ``.summary``
    and ``.rows()`` (the rows on show).
    """
    largest = drafter.config.block_size
    sizes = [b for b in block_sizes if b <= largest]
    method = widgets.ToggleButtons(options=list(REJECTION_SAMPLE_METHODS), value="standard", description="rule",
                                   style=WIDE_BUTTONS)
    temperature = widgets.SelectionSlider(options=list(temperatures), value=temperatures[-1],
                                          description="temperature", continuous_update=False, style=WIDE)
    block = widgets.SelectionSlider(options=sizes, value=8 if 8 in sizes else sizes[0], description="block size",
                                    continuous_update=False, style=WIDE)
    summary = widgets.HTML()
    cache: dict = {}

    def rows():
        key = (method.value, float(temperature.value), int(block.value))
        if key not in cache:
            modes = ("greedy",) if key[1] == 0 else ("greedy", "probabilistic")
            cache[key] = [run_cell(target, drafter, prompts, method=key[0], draft_mode=mode, temperature=key[1],
                                   block_size=key[2], max_new_tokens=max_new_tokens, seed=seed,
                                   synthetic_rates=default_synthetic_rates(key[2])) for mode in modes]
        return cache[key]

    def draw():
        shown = rows()
        title = f"{method.value} verification · T = {temperature.value:g} · block {block.value}"
        summary.value = " · ".join(f"{r['draft_sample_method']} drafts: τ {r['tau']:.2f}, "
                                   f"{r['tokens_per_target_forward']:.2f} tokens / target forward" for r in shown)
        return verification_rates_figure(shown, title=title)

    fig = figure_widget(draw())
    state = {"bars": len(fig.data)}

    def redraw(_change=None):
        new = draw()
        if len(new.data) == state["bars"]:
            _redraw_figure_widget(fig, new)
        else:
            with fig.batch_update():
                fig.data = []
                for trace in new.data:
                    fig.add_trace(trace)
                fig.layout.update(new.layout.to_plotly_json(), overwrite=True)
            state["bars"] = len(new.data)

    for control in (method, temperature, block):
        control.observe(redraw, names="value")
    box = widgets.VBox([method, widgets.HBox([temperature, block]), summary, fig])
    box.method, box.temperature, box.block_size, box.figure, box.summary, box.rows = (
        method, temperature, block, fig, summary, rows)
    return box
