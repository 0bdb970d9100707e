"""Chapter 6: train a drafter with the settings you pick, and watch it learn."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from dflash_lab import viz
from dflash_lab.train.live import drafter_train_config, train_live

ATTENTION_CHOICES = {  # label -> ATTENTION_PRESETS name
    "full, non-causal (paper)": "paper",
    "sliding 64, causal (Poolside)": "poolside",
}


def drafter_training_explorer(target, data: dict, probe, *, steps: int = 200, max_steps: int | None = None,
                              eval_every: int = 50, block_size: int = 8, num_layers: int = 2,
                              train_kwargs: dict | None = None, start_from=None,
                              start_label: str = "the run above") -> widgets.VBox:
    """Pick block size, drafter depth, attention and steps; press *train*; the figure moves as it learns.

    ``data`` is self-distillation data ({P: (n, P + continuation)}), ``probe`` an
    ``AcceptanceProbe`` of the same target (its ``max_block_size`` caps the block
    sizes offered). Each press runs ``train.live.train_live`` (the CLI's
    ``train_drafter`` with held-out acceptance every ``eval_every`` steps) and moves
    ``viz.live_training_figure``. The box exposes the controls, ``.figure``,
    ``.summary``, ``.runs`` (every finished run, newest last) and ``.train()``
    (what the button does). ``start_from``: a finished ``LiveRun`` drawn until the
    first press (so the figure never opens empty), named ``start_label``.
    """
    blocks = [b for b in (4, 8, 16) if b <= probe.max_block_size]
    block = widgets.Dropdown(options=blocks, value=block_size if block_size in blocks else blocks[-1],
                             description="block size")
    depth = widgets.IntSlider(value=num_layers, min=1, max=4, description="layers", continuous_update=False)
    attention = widgets.ToggleButtons(options=list(ATTENTION_CHOICES), description="attention",
                                      style={"button_width": "auto"})  # the labels are long: never cut them
    n_steps = widgets.IntSlider(value=steps, min=eval_every, max=max_steps or 4 * steps, step=eval_every,
                                description="steps", continuous_update=False)
    button = widgets.Button(description="train", button_style="primary", icon="play")
    summary = widgets.HTML("<i>press train</i>")
    figure = go.FigureWidget(viz.live_training_figure(label="drafter", total_steps=steps))
    if start_from is not None:
        figure.layout.xaxis.range = figure.layout.xaxis2.range = [0, start_from.config.steps]
        viz.update_live_training_figure(figure, start_from.log.get("loss_curve", []), start_from.evals,
                                        label=start_label)
        summary.value = f"<i>drawn: {start_label}; press train to run the settings above</i>"
    runs = []

    def train(*_):
        label = f"{depth.value} layer{'s' * (depth.value != 1)}, {attention.value}, block {block.value}"
        settings = {"warmup": max(1, n_steps.value // 10), **(train_kwargs or {})}  # a short run warms up briefly
        cfg = drafter_train_config(steps=n_steps.value, block_size=block.value, num_layers=depth.value,
                                   attention=ATTENTION_CHOICES[attention.value], **settings)
        figure.layout.xaxis.range = figure.layout.xaxis2.range = [0, cfg.steps]
        button.disabled, summary.value = True, f"<i>training {label}…</i>"
        try:
            run = train_live(target, data, cfg, probe, eval_every=eval_every,
                             on_update=lambda r: viz.update_live_training_figure(figure, r.log.get("loss_curve", []),
                                                                                 r.evals, label=label))
        finally:
            button.disabled = False
        runs.append(run)
        summary.value = (f"<b>{label}</b>: held-out τ {run.before.mean_acceptance_length:.2f} before → "
                         f"<b>{run.after.mean_acceptance_length:.2f}</b> after {run.log['steps']} steps "
                         f"({run.log['train_seconds']:.0f} s)")
        return run

    def pending(*_):
        # What the next press will train, and the axes it will fill: every control shows at once.
        with figure.batch_update():
            figure.layout.xaxis.range = figure.layout.xaxis2.range = [0, n_steps.value]
            figure.layout.xaxis3.range = [0.5, block.value - 0.5]
        summary.value = (f"<i>next run: {depth.value} layer{'s' * (depth.value != 1)}, {attention.value}, "
                         f"block {block.value}, "
                         f"{n_steps.value} steps; press train</i>")

    for control in (block, depth, attention, n_steps):
        control.observe(pending, names="value")
    button.on_click(train)
    box = widgets.VBox([widgets.HBox([block, depth, n_steps]), widgets.HBox([attention, button]), summary, figure])
    box.block_size, box.layers, box.attention, box.steps, box.button = block, depth, attention, n_steps, button
    box.figure, box.summary, box.runs, box.train = figure, summary, runs, train
    return box
