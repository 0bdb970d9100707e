"""Chapter 3: per-position acceptance as block size, temperature, draft sampling, prompts and drafter change."""

from __future__ import annotations

import ipywidgets as widgets

from dflash_lab import viz
from dflash_lab.measure.repetition import REPETITIVE_AT, repeated_ngram_share
from dflash_lab.spec_decode import generate_on_prompts
from dflash_lab.widgets.common import WIDE, WIDE_BUTTONS, _redraw_figure_widget, figure_widget

YOUR_TEXT = "your text (box below)"
DRAFT_SAMPLING = {"greedy": "greedy drafts (vLLM's default)", "probabilistic": "probabilistic drafts"}


def repetition_note(outputs) -> str:
    """How many of these continuations are the target repeating itself (``measure.repetition``): τ on a looping
    continuation measures copying, not drafting."""
    shares = [repeated_ngram_share(r.output_ids[0, r.prompt_length:]) for r in outputs]
    if not shares:
        return ""
    looping = sum(x >= REPETITIVE_AT for x in shares)
    if len(shares) == 1:
        return (f" · its continuation repeats {shares[0]:.0%} of its 4-grams"
                + (": <b>repetitive</b>, so this τ is mostly copying" if looping else ""))
    return f" · {looping} of {len(shares)} continuations repetitive (≥ {REPETITIVE_AT:.0%} of their 4-grams repeated)"


def acceptance_explorer(target, drafter, prompt_sets: dict, *, tokenizer=None, encode=None, max_new_tokens: int = 32,
                        temperatures=(0.0, 0.25, 0.5, 0.75, 1.0), block_size: int = 8, seed: int = 0,
                        text: str = "") -> widgets.VBox:
    """Pick the block size, temperature, draft sampling, prompt set and drafter; watch acceptance change.

    ``prompt_sets`` maps a name to a list of prompts (token-id lists or tensors). With an
    ``encode`` function (text -> token ids; default: ``tokenizer``'s ids), a text box adds
    the prompt set "your text": type or paste any prompt and it is run like the others.
    Each new combination runs ``spec_decode.generate_on_prompts`` once (results are kept,
    so going back is instant) and redraws ``viz.per_position_acceptance_figure`` and
    ``viz.acceptance_length_histogram``; with a ``tokenizer``, the first prompt's output is
    shown with ``viz.acceptance_tokens_html``. ``draft sampling`` is vLLM's
    ``draft_sample_method``: it only matters when sampling (temperature > 0). The returned
    box exposes ``.block_size``, ``.temperature``, ``.draft_sampling``, ``.prompt_set``,
    ``.method``, ``.text``, ``.figures``, ``.summary``, ``.tokens``, ``.results`` and
    ``.stats()`` (the SpecDecodeStats on show, e.g. for ``dflash_lab.export.export_stats``).
    """
    if encode is None and tokenizer is not None and callable(tokenizer) and hasattr(tokenizer, "decode"):
        encode = lambda s: tokenizer(s)["input_ids"][-64:]  # noqa: E731  (the chapter's last-64-token rule)
    largest = drafter.config.block_size
    block = widgets.IntSlider(value=min(block_size, largest), min=2, max=largest, description="block size",
                              continuous_update=False, style=WIDE)
    temperature = widgets.SelectionSlider(options=list(temperatures), value=temperatures[0], description="temperature",
                                          continuous_update=False, style=WIDE)
    draft_sampling = widgets.ToggleButtons(options=[(label, key) for key, label in DRAFT_SAMPLING.items()],
                                           value="greedy", description="draft sampling", style=WIDE_BUTTONS)
    names = list(prompt_sets) + ([YOUR_TEXT] if encode is not None else [])
    prompt_set = widgets.Dropdown(options=names, description="prompts", style=WIDE,
                                  layout=widgets.Layout(width="auto"))
    method = widgets.ToggleButtons(options=["DFlash", "prompt lookup"], description="drafter", style=WIDE_BUTTONS)
    box_text = widgets.Textarea(value=text, placeholder="Type or paste a prompt, then pick “your text” above",
                                description="your text", continuous_update=False, style=WIDE,
                                layout=widgets.Layout(width="100%", height="90px"))
    summary, tokens = widgets.HTML(), widgets.HTML()
    results = {}

    def prompts_now():
        if prompt_set.value == YOUR_TEXT:
            ids = encode(box_text.value) if box_text.value.strip() else []
            return [ids] if ids else []
        return prompt_sets[prompt_set.value]

    def key():
        text_key = box_text.value if prompt_set.value == YOUR_TEXT else None
        return method.value, block.value, temperature.value, draft_sampling.value, prompt_set.value, text_key

    def run():
        k = key()
        if k not in results:
            prompts = prompts_now()
            if not prompts:
                return None
            summary.value = "<i>generating…</i>"
            results[k] = generate_on_prompts(
                target, drafter if method.value == "DFlash" else "ngram", prompts, max_new_tokens=max_new_tokens,
                block_size=block.value, temperature=temperature.value, seed=seed,
                draft_sample_method=draft_sampling.value, progress=False)
        return results[k]

    def describe(stats, outputs):
        tau = (f"<b>{stats.mean_acceptance_length:.2f}</b> over {stats.num_drafts} drafts" if stats.num_drafts
               else "— (no drafts)")
        if temperature.value == 0:
            sampling = "greedy decoding (drafts are the argmax either way)"
        elif method.value == "prompt lookup":
            sampling = "prompt lookup's drafts are fixed tokens (q one-hot) either way"
        else:
            sampling = DRAFT_SAMPLING[draft_sampling.value]
        summary.value = (
            f"<b>{method.value}</b>, block {block.value}, temperature {temperature.value}, {sampling}; "
            f"{len(outputs)} prompt{'s' if len(outputs) != 1 else ''} × {max_new_tokens} tokens: "
            f"mean acceptance length τ {tau} · {stats.target_forwards_per_token:.2f} target forwards per token"
            + repetition_note(outputs))
        if tokenizer is not None and outputs:
            tokens.value = viz.acceptance_tokens_html(outputs[0], tokenizer)

    def figures_for(stats):
        color = viz.method_color(method.value)
        return (viz.per_position_acceptance_figure(stats, color=color),
                viz.acceptance_length_histogram(stats))

    first = run()
    if first is None:
        raise ValueError("prompt_sets: the first prompt set is empty")
    stats, outputs = first
    per_position, lengths = (figure_widget(f) for f in figures_for(stats))
    describe(stats, outputs)
    shown = {"stats": stats}

    def redraw(*_):
        got = run()
        if got is None:
            summary.value = "<i>the text box is empty: type a prompt to run it</i>"
            return
        stats, outputs = got
        shown["stats"] = stats
        for widget, fig in zip((per_position, lengths), figures_for(stats)):
            _redraw_figure_widget(widget, fig)
        describe(stats, outputs)

    def on_text(_):
        if prompt_set.value == YOUR_TEXT:
            redraw()

    for control in (block, temperature, draft_sampling, prompt_set, method):
        control.observe(redraw, names="value")
    box_text.observe(on_text, names="value")
    rows = [widgets.HBox([block, temperature], layout=widgets.Layout(flex_flow="row wrap")),
            widgets.HBox([draft_sampling], layout=widgets.Layout(flex_flow="row wrap")),
            widgets.HBox([prompt_set, method], layout=widgets.Layout(flex_flow="row wrap"))]
    if encode is not None:
        rows.append(box_text)
    note = widgets.HTML("<small>vLLM runs <code>draft_sample_method=\"greedy\"</code> unless told otherwise: "
                        "the drafter's argmax is the draft, and the accept test treats q as one-hot.</small>")
    box = widgets.VBox([*rows, note, summary, per_position, lengths, tokens])
    box.block_size, box.temperature, box.draft_sampling = block, temperature, draft_sampling
    box.prompt_set, box.method, box.text = prompt_set, method, box_text
    box.figures, box.summary, box.tokens, box.results = (per_position, lengths), summary, tokens, results
    box.stats = lambda: shown["stats"]
    return box
