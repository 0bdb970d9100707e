"""Chapter 4: vLLM's KV-cache groups for a model, a drafter method and a cache layout."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from dflash_lab.kv_cache import layout as kv_layout, presets as kv_presets
from dflash_lab.kv_cache import groups as kv  # vLLM itself is imported lazily (kv_specs.vllm_api)
from dflash_lab import viz

# Who flags the drafter's group (kv_cache_groups' rules): #55390's rules as the seed's tests state
# them, the same rules behind vLLM 0.33's block-drop gate, or vLLM 0.33's engine without #55390.
FLAGGERS = {
    "seed": "#55390 as the seed states it (every EAGLE method)",
    "seed-gated": "#55390 behind 0.33's gate (only with the block drop)",
    "vllm-0.33": "vLLM 0.33 engine, no #55390",
}

_WIDE = {"description_width": "initial"}  # labels never truncated


def kv_groups_explorer(*, kv_budget_bytes: int = 1 << 30) -> widgets.VBox:
    """Pick a model, a drafter method, a cache layout and who flags the draft group; see vLLM's groups.

    Every change re-runs vLLM's grouping and the chosen annotation and redraws, in place,
    the layout diagram and the memory figure for ``kv_budget_bytes``. A control that does
    not apply to the chosen model is greyed out and unticked, so what is shown is always
    what was run; the line under the controls says why.
    """
    preset = widgets.Dropdown(options=[(p["label"], name) for name, p in kv_presets.PRESETS.items()],
                              description="model", style=_WIDE)
    method = widgets.Dropdown(options=[*((m, m) for m in kv.EAGLE_METHODS), ("none (no drafter)", None)],
                              description="method", style=_WIDE)
    layout = widgets.Dropdown(options=[("general (LBHNC)", "LBHNC"), ("packed (BLHNC)", "BLHNC")],
                              description="layout", style=_WIDE)
    flagger = widgets.Dropdown(options=[(label, key) for key, label in FLAGGERS.items()],
                               description="draft group flagged by", style=_WIDE,
                               layout=widgets.Layout(width="auto"))
    sliding = widgets.Checkbox(description="toy drafter: sliding-window layers", value=False, indent=False,
                               layout=widgets.Layout(width="auto"))
    marked = widgets.Checkbox(description="MTP layers marked is_draft (as 0.33's runner does)", value=False,
                              indent=False, layout=widgets.Layout(width="auto"))
    hybrid_off = widgets.Checkbox(description="hybrid manager disabled", value=False, indent=False,
                                  layout=widgets.Layout(width="auto"))
    status = widgets.HTML()
    layout_fig, memory_fig = go.FigureWidget(), go.FigureWidget()
    memory_table = widgets.HTML()  # an HTML table: plotly's Table can leave header cells blank in a widget
    can_disable: dict[str, bool] = {}  # preset -> whether vLLM 0.33 can disable its hybrid manager
    syncing = {"on": False}  # set while controls are being made consistent: no redraw per change

    def show(widget, fig):
        # Assigning a layout reaches the browser as a relayout, which keeps whatever the new
        # layout leaves out: clear the old draft-group shading first, or a stale one stays drawn.
        if widget.layout.shapes:
            widget.layout.shapes = ()
        with widget.batch_update():
            widget.data = ()
            widget.add_traces(fig.data)
            widget.layout = fig.layout
            widget.layout.width = 1000  # a widget's figure does not stretch to the page by itself

    def sync_controls() -> list[str]:
        """Grey out (and untick) what does not apply to the chosen model; say why."""
        p = kv_presets.PRESETS[preset.value]
        notes = []
        if preset.value not in can_disable:
            try:
                kv.vllm_kv_cache_groups(kv_presets.preset_specs(preset.value), hybrid_manager_disabled=True)
                can_disable[preset.value] = True
            except ValueError:  # vLLM 0.33 cannot promote Mamba or MLA layers to one spec type
                can_disable[preset.value] = False
        syncing["on"] = True
        try:
            for box, applies, why in [
                (hybrid_off, can_disable[preset.value], "vLLM 0.33 cannot disable the hybrid manager for this model"),
                (sliding, preset.value == "laguna_dflash", "only the toy drafter's layer types can be switched"),
                (marked, bool(p.get("mtp")), "DFlash drafter layers are always marked"),
            ]:
                box.disabled = not applies
                if not applies:
                    box.value = False
                    notes.append(why)
        finally:
            syncing["on"] = False
        return notes

    def redraw(*_):
        if syncing["on"]:
            return
        p = kv_presets.PRESETS[preset.value]
        notes = sync_controls()  # first: it may untick a control, and the specs follow the controls
        specs = kv_presets.preset_specs(preset.value, drafter_sliding=sliding.value, mark_draft=marked.value)
        title = f"{p['label']} · method={method.value} · {layout.value} ({kv.LAYOUTS.get(layout.value)})"
        title += f"<br>flagged by: {FLAGGERS[flagger.value]}"
        if hybrid_off.value:
            title += " · hybrid manager disabled"
        run = dict(layout=layout.value, hybrid_manager_disabled=hybrid_off.value)
        with kv.captured_warnings() as warned:
            groups = kv.kv_cache_groups(specs, method=method.value, model_type=p["model_type"], **run,
                                        rules=flagger.value)
        status.value = "<small>" + " · ".join(f"greyed out: {n}" for n in notes) + "</small>"
        show(layout_fig, viz.kv_group_layout_figure(kv_layout.describe_groups(groups, specs), title=title,
                                                    warning=warned[0] if warned else None))
        memory = kv_layout.group_memory(groups, layout=layout.value, kv_budget_bytes=kv_budget_bytes)
        memory_title = f"Memory per group for a {kv_budget_bytes / (1 << 30):g} GiB KV budget"
        memory_table.value = viz.kv_group_memory_table_html(memory, caption=memory_title)
        show(memory_fig, viz.kv_group_memory_figure(memory, title=memory_title + ": one pool block"))

    def on_preset(change):
        wanted = kv_presets.PRESETS[change["new"]]["method"]  # each model comes with its own drafter
        if method.value == wanted:
            redraw()
        else:
            method.value = wanted  # the method observer redraws

    method.value = kv_presets.PRESETS[preset.value]["method"]
    preset.observe(on_preset, names="value")
    for control in (method, layout, flagger, sliding, marked, hybrid_off):
        control.observe(redraw, names="value")
    redraw()
    controls = [widgets.HBox([preset, method, layout]), widgets.HBox([flagger]),
                widgets.HBox([sliding, marked, hybrid_off]), status]
    return widgets.VBox([*controls, layout_fig, memory_table, memory_fig])
