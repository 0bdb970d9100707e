"""Controls for the lab: ipywidgets wired to the figure functions in viz.py.

Widgets hold no logic of their own: each control re-runs a package function
and hands the result to a viz function. One section per chapter.
"""

from __future__ import annotations

import ipywidgets as widgets


# ---------------------------------------------------------------------------
# Chapter 1-2: the drafter and its context K/V
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Chapter 3: per-position acceptance
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Chapter 4: hybrid KV-cache groups
# ---------------------------------------------------------------------------


def kv_groups_explorer(*, kv_budget_bytes: int = 1 << 30) -> widgets.VBox:
    """Pick a model, a drafter method and a cache layout; see vLLM's groups and the flagged one.

    Every change re-runs ``kv_groups.kv_cache_groups`` (vLLM's grouping + the draft-group
    rules) and redraws the layout diagram and the memory table for ``kv_budget_bytes``.
    """
    from IPython.display import display

    from dflash_lab import kv_groups as kv
    from dflash_lab import viz

    preset = widgets.Dropdown(options=[(p["label"], name) for name, p in kv.PRESETS.items()], description="model")
    method = widgets.Dropdown(options=[*kv.EAGLE_METHODS, ("none (no drafter)", None)], description="method")
    sliding = widgets.Checkbox(description="drafter sliding window", value=False)
    layout = widgets.ToggleButtons(options=[("general (LBHNC)", "LBHNC"), ("packed (BLHNC)", "BLHNC")])
    hybrid_off = widgets.Checkbox(description="hybrid manager disabled", value=False)
    out = widgets.Output()

    def redraw(*_):
        p = kv.PRESETS[preset.value]
        specs = kv.preset_specs(preset.value, drafter_sliding=sliding.value)
        with out:
            out.clear_output(wait=True)
            try:
                with kv.captured_warnings() as warned:
                    groups = kv.kv_cache_groups(specs, method=method.value, model_type=p["model_type"],
                                                layout=layout.value, hybrid_manager_disabled=hybrid_off.value)
            except ValueError as exc:
                print(exc)
                return
            title = f"{p['label']} · method={method.value} · {layout.value} ({kv.LAYOUTS.get(layout.value)})"
            if preset.value == "laguna_dflash":  # only the DFlash drafter has its own layer_types
                window = "sliding" if sliding.value else "full"
                title += f"<br>drafter layers: {window} attention; their KV cache: full attention either way"
            else:
                title += "<br>drafter sliding window: n/a (an MTP block reuses a target layer)"
            display(viz.kv_group_layout_figure(kv.describe_groups(groups, specs), title=title,
                                               warning=warned[0] if warned else None))
            display(viz.kv_group_memory_table(kv.group_memory(groups, layout=layout.value, kv_budget_bytes=kv_budget_bytes),
                                              title=f"Memory per group for a {kv_budget_bytes / (1 << 30):g} GiB KV budget"))

    def on_preset(change):
        wanted = kv.PRESETS[change["new"]]["method"]  # each model comes with its own drafter
        if method.value == wanted:
            redraw()
        else:
            method.value = wanted  # the method observer redraws

    method.value = kv.PRESETS[preset.value]["method"]
    preset.observe(on_preset, names="value")
    for control in (method, sliding, layout, hybrid_off):
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([preset, method]), widgets.HBox([layout, sliding, hybrid_off]), out])


# ---------------------------------------------------------------------------
# Chapter 5: fused kernels and the sliding window
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Training logs
# ---------------------------------------------------------------------------
