"""Chapters 1 and 3: step through a real generation, draft -> verify -> accept, one step at a time."""

from __future__ import annotations

import ipywidgets as widgets
import torch

from dflash_lab import viz
from dflash_lab.block_attention import dflash_attention_mask
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.widgets.common import WIDE


def _block_mask(drafter, step):
    """The drafter's attention mask for this step's block, (Q, N+Q), as its config makes it."""
    cfg = drafter.config
    q = len(step.block_ids)
    t = step.position - 1
    ctx = torch.arange(t)
    positions = torch.arange(t, t + q)[None]
    return dflash_attention_mask(positions, ctx, q, cfg.window, causal=cfg.is_causal)[0]


def step_through(result, tokenizer=None, *, drafter=None, title: str | None = None, start: int | None = None,
                 interval_ms: int = 1500) -> widgets.VBox:
    """A step slider and a play button over ``result.steps`` (a ``SpecDecodeResult``).

    Each step redraws ``viz.step_through_html``: the block the drafter read, its guess
    per position, the target's choice, the verdict, the emitted tokens and the target
    forwards saved; with a DFlash ``drafter``, its attention inside the block (causal or
    not, and its window, resolved from its config as vLLM does). The returned box exposes
    ``.step``, ``.play`` and ``.view``. ``start``: the step shown first (default: the first
    step where some drafts were kept and one was rejected).
    """
    last = len(result.steps) - 1
    if last < 0:
        raise ValueError("result has no steps: generate at least one token")
    why = ""
    if start is None:  # the first step that shows everything: some drafts kept, then a rejection
        start = next((i for i, s in enumerate(result.steps) if 0 < s.num_accepted < len(s.draft_ids)), None)
        why = ", the first that keeps some drafts and then rejects one" if start is not None else ""
        start = min(1, last) if start is None else start
    step = widgets.IntSlider(value=min(max(start, 0), last), min=0, max=last, description="step",
                             continuous_update=True, style=WIDE, layout=widgets.Layout(width="420px"))
    play = widgets.Play(value=step.value, min=0, max=last, interval=interval_ms, description="play",
                        show_repeat=False)
    widgets.jslink((play, "value"), (step, "value"))
    view = widgets.HTML(layout=widgets.Layout(width="100%"))
    dflash = isinstance(drafter, DFlashLagunaDrafter)

    def draw(*_):
        s = result.steps[step.value]
        mask = _block_mask(drafter, s) if dflash and s.block_ids else None
        view.value = viz.step_through_html(
            result, step.value, tokenizer, mask=mask, causal=drafter.config.is_causal if dflash else None,
            window=drafter.config.window if dflash else None, title=title)

    step.observe(draw, names="value")
    draw()
    hint = widgets.HTML(f'<span style="font-size:12px">Step 0 is the prefill; shown first: step {step.value}{why}. '
                        "Press ▶ to play the steps in order, or drag the slider.</span>")
    box = widgets.VBox([widgets.HBox([play, step, hint], layout=widgets.Layout(flex_flow="row wrap",
                                                                                align_items="center")), view])
    box.add_class("dflash-step-through")
    box.step, box.play, box.view = step, play, view
    return box
