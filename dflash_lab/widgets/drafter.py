"""Chapter 1: edit a drafter config and see vLLM's verdict and the drafter's tensors."""

from __future__ import annotations

import copy
import html

import ipywidgets as widgets
import plotly.graph_objects as go
import torch

from dflash_lab import viz
from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.widgets.common import _redraw_figure_widget


def drafter_config_explorer(config: dict) -> widgets.VBox:
    """Change a drafter config's depth, layer types and gate; see vLLM's verdict and the tensors.

    Each change runs ``DFlashDrafterConfig.from_dict`` on the edited dict. A
    config vLLM would refuse shows its error; a valid one builds the drafter on
    the meta device (no memory) and redraws ``viz.parameter_table_figure``. The
    returned box exposes ``.layers``, ``.layer_types``, ``.gating``, ``.figure``
    and ``.status``.
    """
    layers = widgets.IntSlider(value=config["num_hidden_layers"], min=1, max=6, description="layers")
    layer_types = widgets.Dropdown(description="layer types", value="full_attention", options=[
        ("all full_attention", "full_attention"), ("all sliding_attention", "sliding_attention"),
        ("mixed (vLLM refuses)", "mixed")])
    gating = widgets.Dropdown(description="gate", value=True, options=[
        ("one per head (True)", True), ("one per channel (per-element)", "per-element"), ("none (False)", False)])
    status = widgets.HTML()

    def edited() -> dict:
        d = copy.deepcopy(config)
        n = d["num_hidden_layers"] = layers.value
        kinds = ["full_attention", "sliding_attention"]
        d["layer_types"] = [kinds[j % 2] for j in range(n)] if layer_types.value == "mixed" else [layer_types.value] * n
        d["gating"] = gating.value
        if layer_types.value != "full_attention":
            d.setdefault("sliding_window", 64)
        return d

    def figure():
        try:
            cfg = DFlashDrafterConfig.from_dict(edited())
        except (ValueError, NotImplementedError) as exc:
            status.value = f"<b>refused</b>: {type(exc).__name__}: {html.escape(str(exc))}"
            return None
        with torch.device("meta"):  # shapes only, no memory
            drafter = DFlashLagunaDrafter(cfg)
        rows = [(name, tuple(t.shape), t.numel()) for name, t in drafter.state_dict().items()]
        names = drafter.attention_layer_names()
        status.value = (f"<b>valid</b>: RoPE on {cfg.rotary_dim} of {cfg.head_dim} channels, window {cfg.window}; "
                        f"attention layers {names[0]} … {names[-1]}")
        return viz.parameter_table_figure(
            rows, title=f"{cfg.num_hidden_layers} × {cfg.layer_type}, gating={cfg.gating!r}: "
                        f"{sum(r[2] for r in rows):,} parameters")

    fig = go.FigureWidget(figure())

    def redraw(*_):
        new = figure()
        if new is not None:  # a refused config leaves the last valid picture
            _redraw_figure_widget(fig, new)

    for control in (layers, layer_types, gating):
        control.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox([layers, layer_types, gating]), status, fig])
    box.layers, box.layer_types, box.gating, box.figure, box.status = layers, layer_types, gating, fig, status
    return box
