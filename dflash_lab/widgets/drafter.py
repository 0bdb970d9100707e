"""Chapter 1: edit a drafter config (or load a real Poolside one) and see vLLM's verdict, layer by layer."""

from __future__ import annotations

import copy
import html

import ipywidgets as widgets
import torch

from dflash_lab import viz
from dflash_lab.config import DFlashDrafterConfig, rope_resolution_table
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.presets import DRAFTER_PRESETS
from dflash_lab.widgets.common import WIDE, _redraw_figure_widget, figure_widget

PRESET_LABELS = {
    "laguna-s-2.1-dflash": "Laguna-S-2.1-DFlash (Poolside's config.json, verbatim)",
    "laguna-xs-2.1-dflash (shape)": "Laguna-XS-2.1-DFlash (its published shape)",
}
CAUSAL_KEY = {"absent": None, "true": True, "false": False}  # dflash_config.causal


def causality_rule(d: dict, cfg: DFlashDrafterConfig) -> str:
    """Which of vLLM's `_dflash_layer_causal` rules decided (first match wins; vLLM 0.33, qwen3_dflash.py:62-73)."""
    if d.get("is_causal") is not None:
        return f"is_causal = {str(d['is_causal']).lower()}"
    if (d.get("dflash_config") or {}).get("causal") is not None:
        return f"dflash_config.causal = {str(d['dflash_config']['causal']).lower()}"
    return f"layer type {cfg.layer_type}: " + ("sliding → causal" if cfg.is_sliding else "full → not causal")


def resolved_layers(d: dict, cfg: DFlashDrafterConfig, names: list[str]) -> list[dict]:
    """One row per drafter layer: its vLLM name, type, resolved causality and why, window, RoPE."""
    return [{"name": name, "layer_type": cfg.layer_types[j], "causal": cfg.is_causal, "rule": causality_rule(d, cfg),
             "window": cfg.window, "rope_theta": float(cfg.rope.get("rope_theta", 10000.0)),
             "rotary": f"{cfg.rotary_dim} of {cfg.head_dim}"} for j, name in enumerate(names)]


def drafter_config_explorer(config: dict, *, target_config=None) -> widgets.VBox:
    """Pick a config (this chapter's, or a real Poolside one), change its depth, layer types, gate and
    causality key; see vLLM's verdict, each layer as vLLM resolves it, RoPE, and the tensors.

    Each change runs ``DFlashDrafterConfig.from_dict`` (vLLM's rules) on the edited dict and
    ``validate_against_target`` against the matching target (``target_config`` for ``config``;
    the preset's own target for a preset). A config vLLM would refuse shows its error; a valid
    one is built on the meta device (shapes only, at full size) and redraws the tables and
    ``viz.parameter_bars_figure``. The returned box exposes ``.preset``, ``.layers``,
    ``.layer_types``, ``.gating``, ``.causal``, ``.figure``, ``.status``, ``.details``.
    """
    sources = {"tiny": (config, target_config)}
    sources.update({name: DRAFTER_PRESETS[name] for name in PRESET_LABELS})
    preset = widgets.Dropdown(options=[("this chapter's tiny drafter", "tiny")]
                              + [(v, k) for k, v in PRESET_LABELS.items()],
                              description="config", style=WIDE, layout=widgets.Layout(width="auto"))
    layers = widgets.IntSlider(min=1, max=8, description="layers", style=WIDE)
    layer_types = widgets.Dropdown(description="layer types", style=WIDE, layout=widgets.Layout(width="auto"), options=[
        ("all full_attention", "full_attention"), ("all sliding_attention", "sliding_attention"),
        ("mixed (vLLM refuses)", "mixed")])
    gating = widgets.Dropdown(description="gate", style=WIDE, layout=widgets.Layout(width="auto"), options=[
        ("one per head ('per-head')", "per-head"), ("one per channel ('per-element')", "per-element"),
        ("none (false)", False)])
    causal = widgets.Dropdown(description="dflash_config.causal", style=WIDE, layout=widgets.Layout(width="auto"),
                              options=[("absent: the layer type decides", "absent"), ("true", "true"),
                                       ("false", "false")])
    status, details, tensors = widgets.HTML(), widgets.HTML(), widgets.HTML()
    syncing = {"on": False}

    def load_controls():
        """Set the controls to the chosen config's own values (one redraw, after)."""
        d = sources[preset.value][0]
        syncing["on"] = True
        try:
            layers.value = d["num_hidden_layers"]
            kinds = set(d.get("layer_types") or ["full_attention"])
            layer_types.value = kinds.pop() if len(kinds) == 1 else "mixed"
            gate = d.get("gating", True)
            gating.value = "per-head" if gate is True else gate
            flag = (d.get("dflash_config") or {}).get("causal")
            causal.value = "absent" if flag is None else str(flag).lower()
        finally:
            syncing["on"] = False

    def edited() -> dict:
        d = copy.deepcopy(sources[preset.value][0])
        n = d["num_hidden_layers"] = layers.value
        kinds = ["full_attention", "sliding_attention"]
        d["layer_types"] = [kinds[j % 2] for j in range(n)] if layer_types.value == "mixed" else [layer_types.value] * n
        d["gating"] = gating.value
        if layer_types.value != "full_attention":
            d.setdefault("sliding_window", 64)
        dflash = d.setdefault("dflash_config", {})
        if CAUSAL_KEY[causal.value] is None:
            dflash.pop("causal", None)
        else:
            dflash["causal"] = CAUSAL_KEY[causal.value]
        return d

    def asked(d: dict) -> str:
        """The edited settings the verdict is about, in config.json's words."""
        kinds = sorted(set(d["layer_types"]))
        flag = (d.get("dflash_config") or {}).get("causal")
        return (f"<small>asked about: num_hidden_layers {d['num_hidden_layers']}, layer_types "
                f"{' + '.join(kinds)}, gating {d['gating']!r}, dflash_config.causal "
                f"{'absent' if flag is None else str(flag).lower()}</small><br>")

    def figure():
        d, target = edited(), sources[preset.value][1]
        try:
            cfg = DFlashDrafterConfig.from_dict(d)
        except (ValueError, NotImplementedError) as exc:
            status.value = asked(d) + f"<b>vLLM refuses it</b>: {type(exc).__name__}: {html.escape(str(exc))}"
            details.value = tensors.value = ""
            return None
        try:
            if target is not None:
                cfg.validate_against_target(target)
            pairing = "pairs with its target ✓" if target is not None else "no target given"
        except ValueError as exc:
            pairing = f"does not pair with its target: {html.escape(str(exc))}"
        with torch.device("meta"):  # shapes only, no memory: real sizes even for S-2.1
            drafter = DFlashLagunaDrafter(cfg)
        rows = [(name, tuple(t.shape), t.numel()) for name, t in drafter.state_dict().items()]
        names = drafter.attention_layer_names()
        status.value = (asked(d) + f"<b>vLLM's rules: valid</b> · {pairing} · {len(rows)} tensors, "
                        f"{sum(r[2] for r in rows):,} parameters · every block query "
                        + ("sees block keys up to its own position (causal)" if cfg.is_causal
                           else "sees the whole block (not causal)"))
        details.value = (viz.layer_table_html(resolved_layers(d, cfg, names))
                         + '<div style="font-size:12px;margin-top:4px">RoPE as vLLM loads the file '
                         "(transformers' LagunaConfig, then each layer's pick, laguna.py:365-400):</div>"
                         + viz.rope_table_html(rope_resolution_table(d)))
        tensors.value = viz.parameter_table_html(rows)
        return viz.parameter_bars_figure(rows, title=f"{cfg.num_hidden_layers} × {cfg.layer_type}, gating="
                                                     f"{cfg.gating!r}: {sum(r[2] for r in rows):,} parameters")

    load_controls()
    fig = figure_widget(figure())

    shown = {"title": fig.layout.title.text}

    def redraw(*_):
        if syncing["on"]:
            return
        new = figure()
        if new is not None:
            _redraw_figure_widget(fig, new)
            shown["title"] = fig.layout.title.text
        else:  # a refused config leaves the last valid picture, and says so
            fig.layout.title.text = f"Last valid config, not the refused one above: {shown['title']}"

    def on_preset(_):
        load_controls()
        redraw()

    preset.observe(on_preset, names="value")
    for control in (layers, layer_types, gating, causal):
        control.observe(redraw, names="value")
    wrap = widgets.Layout(flex_flow="row wrap")
    box = widgets.VBox([widgets.HBox([preset], layout=wrap), widgets.HBox([layers, layer_types, gating], layout=wrap),
                        widgets.HBox([causal], layout=wrap), status, details, fig, tensors])
    box.preset, box.layers, box.layer_types, box.gating, box.causal = preset, layers, layer_types, gating, causal
    box.figure, box.status, box.details = fig, status, details
    return box
