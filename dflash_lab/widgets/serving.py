"""Chapter 8: straggler_explorer — pick a method, concurrency and prompt set of a serving record; see its static
batches wait for their slowest request, and what continuous batching saves."""

from __future__ import annotations

import ipywidgets as widgets

from dflash_lab.viz.serving import straggler_figure
from dflash_lab.widgets.common import WIDE, WIDE_BUTTONS, _redraw_figure_widget, figure_widget


def straggler_explorer(records, *, block_size: int = 16) -> widgets.VBox:
    """Over the serving ``records`` (``measure.serving``): each (method, concurrency, prompt set) draws the static
    run's requests against their batches (``viz.straggler_figure``) and says how many batch steps each batching
    ran, the floor (every row busy to the end) and both speed-ups over target-only.

    The returned box exposes ``.method``, ``.concurrency``, ``.prompt_set``, ``.figure`` and ``.summary``.
    """
    static = [r for r in records if r.get("batching") == "static" and r["method"] != "target_only"
              and r["block_size"] == block_size and r.get("request_steps")]
    if not static:
        raise ValueError(f"the record holds no static runs at block {block_size} with each request's steps")
    pick = lambda options, preferred: preferred if preferred in options else options[0]  # noqa: E731
    methods = sorted({r["method"] for r in static})
    method = widgets.ToggleButtons(options=methods, value=pick(methods, "dflash"), description="method",
                                   style=WIDE_BUTTONS)
    sizes = sorted({r["batch"] for r in static})
    concurrency = widgets.SelectionSlider(options=sizes, value=pick(sizes, 32), description="concurrency",
                                          continuous_update=False, style=WIDE)
    sets = sorted({r.get("prompt_set", "heldout") for r in static})
    prompt_set = widgets.ToggleButtons(options=sets, value=pick(sets, "heldout"), description="prompts",
                                       style=WIDE_BUTTONS)
    summary = widgets.HTML()

    def run(m, batching):
        return next((r for r in records if r["method"] == m and r["batch"] == concurrency.value
                     and r.get("batching") == batching and r.get("prompt_set", "heldout") == prompt_set.value
                     and r["block_size"] == (1 if m == "target_only" else block_size) and r.get("schedule") is None),
                    None)

    def draw():
        s, c = run(method.value, "static"), run(method.value, "continuous")
        if s is None:
            summary.value = "no static run of this method at this concurrency and prompt set in the record"
            return straggler_figure([], concurrency.value)
        steps = s["request_steps"]
        floor = -(-sum(steps) // concurrency.value)
        parts = [f"static: {s['batch_steps']} batch steps", f"every row busy to the end: {floor}"]
        if c is not None:
            parts.insert(1, f"continuous: {c['batch_steps']}")
        for r, name in ((s, "static"), (c, "continuous")):
            base = run("target_only", name)
            if r is not None and base is not None:
                parts.append(f"{name} {r['tokens_per_s'] / base['tokens_per_s']:.2f}x target-only")
        summary.value = " · ".join(parts)
        return straggler_figure(steps, concurrency.value, title=f"{method.value}, block {block_size}, static "
                                f"batches of {concurrency.value} ({prompt_set.value} prompts)")

    fig = figure_widget(draw())

    def redraw(_change=None):
        _redraw_figure_widget(fig, draw())

    for control in (method, concurrency, prompt_set):
        control.observe(redraw, names="value")
    box = widgets.VBox([widgets.HBox([method, prompt_set]), concurrency, summary, fig])
    box.method, box.concurrency, box.prompt_set, box.figure, box.summary = method, concurrency, prompt_set, fig, summary
    return box
