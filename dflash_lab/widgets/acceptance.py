"""Chapter 3: per-position acceptance as block size, temperature, prompts and drafter change."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from dflash_lab import viz
from dflash_lab.spec_decode import generate_on_prompts
from dflash_lab.widgets.common import _redraw_figure_widget


def acceptance_explorer(target, drafter, prompt_sets: dict, *, tokenizer=None, max_new_tokens: int = 32,
                        temperatures=(0.0, 0.25, 0.5, 0.75, 1.0), block_size: int = 8, seed: int = 0) -> widgets.VBox:
    """Pick the block size, temperature, prompt set and drafter; watch acceptance change.

    ``prompt_sets`` maps a name to a list of prompts (token-id lists or tensors).
    Each new combination runs ``spec_decode.generate_on_prompts`` once (results
    are kept, so going back is instant) and redraws
    ``viz.per_position_acceptance_figure`` and ``viz.acceptance_length_histogram``;
    with a ``tokenizer``, the first prompt's output is shown with
    ``viz.acceptance_tokens_html``. The returned box exposes ``.block_size``,
    ``.temperature``, ``.prompt_set``, ``.method``, ``.figures``, ``.summary``,
    ``.tokens`` and ``.results`` (the cache, keyed by those four settings).
    """
    largest = drafter.config.block_size
    block = widgets.IntSlider(value=min(block_size, largest), min=2, max=largest, description="block size",
                              continuous_update=False)
    temperature = widgets.SelectionSlider(options=list(temperatures), value=temperatures[0], description="temperature",
                                          continuous_update=False)
    prompt_set = widgets.Dropdown(options=list(prompt_sets), description="prompts")
    method = widgets.ToggleButtons(options=["DFlash", "prompt lookup"], description="drafter")
    summary, tokens = widgets.HTML(), widgets.HTML()
    results = {}

    def run():
        key = (method.value, block.value, temperature.value, prompt_set.value)
        if key not in results:
            summary.value = "<i>generating…</i>"
            results[key] = generate_on_prompts(
                target, drafter if method.value == "DFlash" else "ngram", prompt_sets[prompt_set.value],
                max_new_tokens=max_new_tokens, block_size=block.value, temperature=temperature.value, seed=seed,
                progress=False)
        return results[key]

    def describe(stats, outputs):
        tau = f"<b>{stats.mean_acceptance_length:.2f}</b> over {stats.num_drafts} drafts" if stats.num_drafts else "— (no drafts)"
        summary.value = (
            f"<b>{method.value}</b>, block {block.value}, temperature {temperature.value}, "
            f"{len(outputs)} prompts × {max_new_tokens} tokens: mean acceptance length {tau} · "
            f"{stats.target_forwards_per_token:.2f} target forwards per token")
        if tokenizer is not None and outputs:
            tokens.value = viz.acceptance_tokens_html(outputs[0], tokenizer)

    stats, outputs = run()
    per_position = go.FigureWidget(viz.per_position_acceptance_figure(stats))
    lengths = go.FigureWidget(viz.acceptance_length_histogram(stats))
    describe(stats, outputs)

    def redraw(*_):
        stats, outputs = run()
        _redraw_figure_widget(per_position, viz.per_position_acceptance_figure(stats))
        _redraw_figure_widget(lengths, viz.acceptance_length_histogram(stats))
        describe(stats, outputs)

    for control in (block, temperature, prompt_set, method):
        control.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox([block, temperature]), widgets.HBox([prompt_set, method]), summary,
                        per_position, lengths, tokens])
    box.block_size, box.temperature, box.prompt_set, box.method = block, temperature, prompt_set, method
    box.figures, box.summary, box.tokens, box.results = (per_position, lengths), summary, tokens, results
    return box
