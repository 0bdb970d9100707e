"""Every notebook, the way a person uses it: JupyterLab in a real browser.

For each notebook: open it, Run > Run All Cells, and wait for the kernel. Then

1. no cell has an error output, and every cell printed what the committed notebook holds, by
   nbval's rules (`nbval_outputs.py`): this Run All is the chapter's one execution in CI; and no
   printout holds a τ without its setting, a raw nan or a markdown pipe table (`printed_claims.py`);
2. every plotly figure rendered: an SVG whose data traces have drawn geometry,
   both for figures shown with fig.show() and for FigureWidgets (the kernel
   says how many FigureWidgets each widget output holds, and that many must
   be on the page);
3. every widget view rendered (no "Loading widget..." or error placeholder);
4. the widgets react: each control (dropdown, checkbox, toggle, radio, slider)
   is flipped in turn, and each must change something on the page - and at
   least one must change a figure's data or layout. A widget callback that
   raises (JupyterLab would only show it in its log console) fails the test;
5. what is drawn can be read: no plotly table header cell is empty (plotly's
   Table can leave cells blank on first draw), plotly's toolbar sits on no
   colour bar, legend or title, no point's text label is cut at its plot's
   edge, and no widget label is cut off (text overflow), before and after the
   flips;
6. a step-through widget (chapters 1 and 3) moves to the next step when its
   slider moves, and the tokens it highlights change.

Screenshots of the whole notebook, after running and after flipping, go to
test-output/screenshots/. The last test runs the same checks on a notebook
that is broken on purpose and asserts that they report each breakage.

Knobs: DFLASH_LAB_BROWSER_RUN_TIMEOUT (seconds for Run All, default 900) and
DFLASH_LAB_BROWSER_FLIP_TIMEOUT (seconds for one control's redraw, default 120).
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from nbval_outputs import output_differences
from printed_claims import printed_problems

pytestmark = pytest.mark.browser

# Wall-clock limits, in seconds; a 2-core CPU runs the real (small) models.
RUN_ALL_TIMEOUT = float(os.environ.get("DFLASH_LAB_BROWSER_RUN_TIMEOUT", 900))
RENDER_TIMEOUT = 60
FLIP_TIMEOUT = float(os.environ.get("DFLASH_LAB_BROWSER_FLIP_TIMEOUT", 120))
MAX_FLIPS = 8

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

# ---------------------------------------------------------------------------
# JavaScript run in the page. Each snippet is a function of the notebook's path
# (relative to the server root) and finds that notebook's panel first.
# ---------------------------------------------------------------------------

PANEL = """
const app = window.jupyterapp;
const panel = app && Array.from(app.shell.widgets('main'))
    .find(w => w.context && w.context.path === path);
"""

JS_STATE = "(path) => {" + PANEL + """
  if (!app) return {phase: 'loading JupyterLab'};
  const dialog = document.querySelector('.jp-Dialog');
  if (dialog) return {phase: 'dialog', text: dialog.innerText};
  if (!panel) return {phase: 'opening notebook'};
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = panel.content.widgets;
  let running = 0, done = 0, code = 0, current = -1;
  const errors = [];
  cells.forEach((cell, i) => {
    if (cell.model.type !== 'code') return;
    code++;
    if (cell.model.executionState === 'running') { running++; if (current < 0) current = i; }
    else if (cell.model.executionCount !== null) done++;
    for (const out of cell.model.outputs.toJSON()) {
      if (out.output_type === 'error')
        errors.push({cell: i, ename: out.ename, evalue: out.evalue,
                     traceback: (out.traceback || []).join('\\n')});
    }
  });
  return {phase: 'open', kernel: kernel ? kernel.status : 'none', cells: cells.length,
          code, running, done, current, errors};
}"""

# Figures, widget views and their health, per output. Plotly graph divs carry
# their figure in gd.data / gd.layout; a trace counts as drawn when its element
# has a non-empty box on the page.
# Each code cell's outputs as the notebook model holds them (nbformat JSON), in order.
JS_CELL_OUTPUTS = "(path) => {" + PANEL + """
  return panel.content.widgets.filter(c => c.model.type === 'code').map(c => c.model.outputs.toJSON());
}"""

JS_OUTPUTS = "(path) => {" + PANEL + """
  const TRACES = 'g.trace, g.hm, g.contour, g.table, g.sankey, .imagelayer image, .heatmaplayer image, g.slice, '
                 + '.gl-container canvas, .parcoords canvas';
  const BAD = ['Loading widget...', 'Error displaying widget', 'Failed to load', 'Failed to create view',
               'Error rendering', 'Failed to initialize model'];
  const plots = [];
  const outputs = [];
  panel.content.widgets.forEach((cell, ci) => {
    if (cell.model.type !== 'code') return;
    const area = cell.outputArea;
    for (let oi = 0; oi < area.model.length; oi++) {
      const data = area.model.get(oi).data || {};
      const node = area.widgets[oi] ? area.widgets[oi].node : null;
      if (!node) continue;
      const view = data['application/vnd.jupyter.widget-view+json'];
      const entry = {cell: ci, output: oi, mimes: Object.keys(data),
                     model_id: view ? view.model_id : null, plots: 0, bad: null,
                     text: node.innerText.slice(0, 300)};
      for (const b of BAD) if (node.innerText.includes(b)) entry.bad = b;
      // a traceback shown inside an Output widget (a callback that raised under `with out:`)
      node.querySelectorAll('.widget-output [data-mime-type="application/vnd.jupyter.stderr"]').forEach(el => {
        if (/Traceback|\\w+Error\\b/.test(el.innerText)) entry.bad = 'traceback: ' + el.innerText.slice(-300);
      });
      node.querySelectorAll('.js-plotly-plot').forEach(gd => {
        let drawn = 0;
        gd.querySelectorAll(TRACES).forEach(el => {
          const r = el.getBoundingClientRect();
          if (r.width > 0 && r.height > 0) drawn++;
        });
        entry.plots++;
        plots.push({cell: ci, output: oi, svg: !!gd.querySelector('svg.main-svg'),
                    traces: (gd.data || []).length, drawn,
                    title: ((gd.layout || {}).title || {}).text || ''});
      });
      entry.plotly_mime = Math.max(
          node.querySelectorAll('.jp-RenderedPlotly').length,
          'application/vnd.plotly.v1+json' in data ? 1 : 0);
      outputs.push(entry);
    }
  });
  return {plots, outputs};
}"""

# What a person sees change: every figure's data+layout and the text of the
# outputs, hashed; the controls' own readouts are left out.
JS_SNAPSHOT = "(path) => {" + PANEL + """
  const hash = (s) => { let h = 2166136261; for (let i = 0; i < s.length; i++) {
      h ^= s.charCodeAt(i); h = Math.imul(h, 16777619); } return (h >>> 0).toString(16); };
  const root = panel.content.node;
  const figures = Array.from(root.querySelectorAll('.jp-OutputArea .js-plotly-plot')).map(
      gd => hash(JSON.stringify([gd.data, gd.layout])));
  const texts = Array.from(root.querySelectorAll(
      '.jp-OutputArea .jp-RenderedText, .jp-OutputArea .widget-html-content, .jp-OutputArea .jp-RenderedHTMLCommon'))
      .filter(el => !el.closest('.js-plotly-plot'))
      .map(el => hash(el.innerText));
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  return {figures, texts, kernel: kernel ? kernel.status : 'none'};
}"""

# Record what the kernel says on stderr (or as an error) while it handles a
# widget's message: a callback that raises prints its traceback there, and
# JupyterLab would only show it in the log console.
JS_LISTEN = "(path) => {" + PANEL + """
  const kernel = panel.sessionContext.session.kernel;
  if (window.__dflashKernelSaid === undefined) {
    window.__dflashKernelSaid = [];
    kernel.iopubMessage.connect((_, msg) => {
      if ((msg.parent_header || {}).msg_type !== 'comm_msg') return;
      const type = msg.header.msg_type;
      if (type === 'error') window.__dflashKernelSaid.push((msg.content.traceback || []).join('\\n'));
      else if (type === 'stream' && msg.content.name === 'stderr') window.__dflashKernelSaid.push(msg.content.text);
    });
  }
  return window.__dflashKernelSaid.length;
}"""

# The controls a person can flip, in page order; each gets a data-flip index
# so Playwright can address it.
JS_CONTROLS = "(path) => {" + PANEL + """
  const root = panel.content.node;
  root.querySelectorAll('[data-flip]').forEach(el => el.removeAttribute('data-flip'));
  const found = [];
  const add = (el, kind, widget) => {
    if (el.disabled || el.closest('.jp-OutputArea') === null) return;
    const text = (widget || el).innerText || el.getAttribute('aria-label') || '';
    found.push({el, kind, label: text.replace(/[\u200b\s]+/g, ' ').trim().slice(0, 60)});
  };
  root.querySelectorAll('.widget-dropdown select, .widget-select select').forEach(
      el => add(el, 'select', el.closest('.widget-inline-hbox') || el.parentElement));
  root.querySelectorAll('.widget-checkbox input[type=checkbox]').forEach(
      el => add(el, 'checkbox', el.closest('.widget-checkbox')));
  root.querySelectorAll('button.widget-toggle-button').forEach(el => {
    if (!el.closest('.widget-toggle-buttons')) add(el, 'toggle', null);  // not one of a ToggleButtons group
  });
  root.querySelectorAll('.widget-toggle-buttons').forEach(group => {
    const next = group.querySelector('button:not(.mod-active)');
    if (next) add(next, 'toggle-buttons', group);
  });
  root.querySelectorAll('.widget-radio-box').forEach(group => {
    const next = group.querySelector('input[type=radio]:not(:checked)');
    if (next) add(next, 'radio', group.closest('.widget-radio') || group);
  });
  root.querySelectorAll('.widget-slider .noUi-handle').forEach(el => {
    const handle = el;
    const widget = el.closest('.widget-slider');
    if (widget.querySelector('[disabled]')) return;
    const at_max = handle.getAttribute('aria-valuenow') === handle.getAttribute('aria-valuemax');
    add(handle, at_max ? 'slider-down' : 'slider-up', widget);
  });
  // in page order, as a person would meet them
  found.sort((a, b) => a.el.compareDocumentPosition(b.el) & Node.DOCUMENT_POSITION_FOLLOWING ? -1 : 1);
  return found.map((c, index) => { c.el.setAttribute('data-flip', String(index));
                                   return {index, kind: c.kind, label: c.label}; });
}"""


# What a reader cannot see although it is there: plotly table header cells drawn empty,
# plotly's toolbar over a colour bar, legend or title, and widget labels cut off by the width
# they were given (text overflow).
JS_LAYOUT = "(path) => {" + PANEL + """
  const root = panel.content.node;
  const problems = [];
  root.querySelectorAll('.jp-OutputArea .js-plotly-plot').forEach(gd => {
    const title = ((gd.layout || {}).title || {}).text || '';
    const tables = (gd.data || []).filter(t => t.type === 'table');
    if (!tables.length) return;
    const headers = Array.from(gd.querySelectorAll('.y-column .column-block#header'));
    const shown = headers.map(h => (h.textContent || '').trim());
    const wanted = tables.reduce((n, t) => n + (((t.header || {}).values) || []).length, 0);
    if (shown.length < wanted)
      problems.push(`plotly table in ${JSON.stringify(title)}: ${wanted - shown.length} of ${wanted} header cells not drawn`);
    shown.forEach((text, i) => { if (!text)
      problems.push(`plotly table in ${JSON.stringify(title)}: header cell ${i} is empty`); });
  });
  // plotly's toolbar (mode bar; drawn on hover, laid out always) must not sit on a colour bar, legend or title
  root.querySelectorAll('.jp-OutputArea .js-plotly-plot').forEach(gd => {
    const bar = gd.querySelector('.modebar');
    if (!bar) return;
    const b = bar.getBoundingClientRect();
    if (!b.width || !b.height) return;
    const title = ((gd.layout || {}).title || {}).text || '';
    gd.querySelectorAll('g.colorbar, g.legend, .g-gtitle').forEach(el => {
      const r = el.getBoundingClientRect();
      if (r.width && r.height && r.left < b.right && b.left < r.right && r.top < b.bottom && b.top < r.bottom)
        problems.push(`plotly toolbar covers the ${el.getAttribute('class').split(' ').pop()} of ${JSON.stringify(title)}`);
    });
  });
  // a point's text label (mode 'markers+text') cut at its plot's edge (cliponaxis) or at the figure's
  root.querySelectorAll('.jp-OutputArea .js-plotly-plot').forEach(gd => {
    const svg = gd.querySelector('.main-svg');
    if (!svg || !gd._fullLayout) return;
    const frame = svg.getBoundingClientRect();
    const title = ((gd.layout || {}).title || {}).text || '';
    gd.querySelectorAll('.scatterlayer .trace').forEach(tr => {
      const trace = tr.__data__ && tr.__data__[0] && tr.__data__[0].trace;
      if (!trace) return;
      const xa = gd._fullLayout[(trace.xaxis || 'x').replace('x', 'xaxis')];
      const ya = gd._fullLayout[(trace.yaxis || 'y').replace('y', 'yaxis')];
      let box = {left: frame.left, right: frame.right, top: frame.top, bottom: frame.bottom};
      if (trace.cliponaxis !== false && xa && ya)
        box = {left: frame.left + xa._offset, right: frame.left + xa._offset + xa._length,
               top: frame.top + ya._offset, bottom: frame.top + ya._offset + ya._length};
      tr.querySelectorAll('.textpoint text').forEach(el => {
        const r = el.getBoundingClientRect();
        if (!r.width || !el.textContent.trim()) return;
        if (r.left < box.left - 2 || r.right > box.right + 2 || r.top < box.top - 2 || r.bottom > box.bottom + 2)
          problems.push(`label ${JSON.stringify(el.textContent)} in ${JSON.stringify(title)} is cut at the plot's edge`);
      });
    });
  });
  const labels = root.querySelectorAll('.jp-OutputArea .widget-label, .jp-OutputArea .widget-label-basic, '
      + '.jp-OutputArea .widget-checkbox label, .jp-OutputArea .widget-toggle-button, .jp-OutputArea .widget-button');
  labels.forEach(el => {
    const r = el.getBoundingClientRect();
    if (r.width === 0 || !el.innerText.trim()) return;
    if (el.scrollWidth > el.clientWidth + 1)
      problems.push(`widget label ${JSON.stringify(el.innerText.trim())} is truncated (${el.clientWidth}px shown `
                    + `of ${el.scrollWidth}px)`);
  });
  return problems;
}"""

# The step-through widget: its step and the tokens it highlights (data-kind cells).
JS_STEP_THROUGH = "(path) => {" + PANEL + """
  return Array.from(panel.content.node.querySelectorAll('.dflash-step-through')).map((box, index) => {
    const view = box.querySelector('.dflash-st');
    const marked = view ? Array.from(view.querySelectorAll('[data-kind]'))
        .filter(el => ['accepted', 'rejected', 'correction', 'bonus'].includes(el.dataset.kind))
        .map(el => el.dataset.kind + ':' + el.textContent) : [];
    const handle = box.querySelector('.widget-slider .noUi-handle');
    if (handle) handle.setAttribute('data-step-through', String(index));
    return {index, step: view ? view.dataset.step : null, marked,
            value: handle ? handle.getAttribute('aria-valuenow') : null};
  });
}"""


@dataclass
class Flip:
    """One control flipped, and what it changed on the page."""

    kind: str
    label: str
    figures_changed: int = 0
    text_changed: bool = False
    seconds: float = 0.0
    tracebacks: list = field(default_factory=list)  # raised in the kernel by the control's callback

    @property
    def changed(self) -> bool:
        return self.figures_changed > 0 or self.text_changed

    def __str__(self) -> str:
        return (f"{self.kind} {self.label!r}: {self.figures_changed} figure(s) changed, "
                f"text changed: {self.text_changed}, {self.seconds:.1f}s")


@dataclass
class Notebook:
    """One notebook open in the page: drive it, and read what it shows."""

    page: object
    path: str  # relative to the server root
    screenshots: Path
    timings: dict = field(default_factory=dict)

    def state(self) -> dict:
        return self.page.evaluate(JS_STATE, self.path)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        state = {}
        while time.monotonic() < deadline:
            state = self.state()
            if state["phase"] == "dialog":
                pytest.fail(f"{self.path}: JupyterLab opened a dialog: {state['text']!r}", pytrace=False)
            if state["phase"] == "open" and state["kernel"] == "idle":
                return
            time.sleep(0.5)
        pytest.fail(f"{self.path}: notebook and kernel not ready after {timeout:.0f}s: {state}", pytrace=False)

    def run_all(self) -> dict:
        """Run > Run All Cells, through the menu; wait until the kernel is done."""
        self.page.click(".lm-MenuBar-item:has-text('Run')")
        self.page.click(".lm-Menu-item[data-command='runmenu:run-all']")
        start = time.monotonic()
        quiet_since = None
        state = {}
        while time.monotonic() - start < RUN_ALL_TIMEOUT:
            state = self.state()
            if state["phase"] == "dialog":
                pytest.fail(f"{self.path}: JupyterLab opened a dialog: {state['text']!r}", pytrace=False)
            if state["kernel"] in ("dead", "autorestarting", "restarting"):
                pytest.fail(f"{self.path}: the kernel died (out of memory?) while running cell {state['current']}",
                            pytrace=False)
            started = state["done"] > 0 or state["errors"]
            if started and state["running"] == 0 and state["kernel"] == "idle":
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 1.0:
                    break
            else:
                quiet_since = None
            time.sleep(0.5)
        else:
            pytest.fail(
                f"{self.path}: Run All did not finish within {RUN_ALL_TIMEOUT:.0f}s; "
                f"still running cell {state.get('current')}: {state}",
                pytrace=False,
            )
        self.timings["run_all"] = time.monotonic() - start
        return state

    def outputs(self) -> dict:
        return self.page.evaluate(JS_OUTPUTS, self.path)

    def snapshot(self) -> dict:
        return self.page.evaluate(JS_SNAPSHOT, self.path)

    def controls(self) -> list[dict]:
        return self.page.evaluate(JS_CONTROLS, self.path)

    def kernel_eval(self, code: str, expression: str) -> object:
        """Run `code` silently in the notebook's kernel and return `expression` (JSON)."""
        js = "async ([path, code, expr]) => {" + PANEL + """
          const kernel = panel.sessionContext.session.kernel;
          const future = kernel.requestExecute({code, silent: true, store_history: false,
                                                user_expressions: {result: expr}});
          const reply = await future.done;
          const r = reply.content.user_expressions.result;
          return r.status === 'ok' ? r.data['text/plain'] : ('ERROR ' + r.ename + ': ' + r.evalue);
        }"""
        text = self.page.evaluate(js, [self.path, code, f"__import__('json').dumps({expression})"])
        if text.startswith("ERROR"):
            raise RuntimeError(f"kernel: {text}")
        return json.loads(ast.literal_eval(text))  # the repr of a JSON string

    def screenshot(self, name: str) -> None:
        """The whole notebook in one picture: make the window as tall as the notebook."""
        height = self.page.evaluate(
            "(path) => {" + PANEL + """
              app.shell.collapseLeft();
              const inner = panel.node.querySelector('.jp-WindowedPanel-inner');
              panel.node.querySelector('.jp-WindowedPanel-outer').scrollTop = 0;
              return inner.scrollHeight + panel.content.node.getBoundingClientRect().top + 40; }""",
            self.path,
        )
        width = self.page.viewport_size["width"]
        self.page.set_viewport_size({"width": width, "height": int(min(max(height, 1000), 16000))})
        time.sleep(1.0)  # let plotly re-lay-out responsive figures
        self.page.screenshot(path=str(self.screenshots / name))
        self.page.set_viewport_size({"width": width, "height": 1000})


# The kernel side of the figure count: how many FigureWidgets (and plotly
# figures captured by Output widgets) each displayed widget holds.
CENSUS_CODE = """
def __dflash_lab_figure_census(model_ids):
    from ipywidgets.widgets.widget import _instances
    try:
        from plotly.basewidget import BaseFigureWidget
    except ImportError:
        BaseFigureWidget = type(None)
    def count(widget, seen):
        if widget is None or id(widget) in seen:
            return 0
        seen.add(id(widget))
        n = isinstance(widget, BaseFigureWidget)
        for out in getattr(widget, "outputs", None) or ():
            n += isinstance(out, dict) and "application/vnd.plotly.v1+json" in out.get("data", {})
        for child in getattr(widget, "children", None) or ():
            n += count(child, seen)
        return int(n)
    return {m: count(_instances.get(m), set()) for m in model_ids}
"""


def render_problems(nb: Notebook) -> tuple[list[str], dict]:
    """What is wrong with the figures and widget views now on the page ([] when all is well)."""
    found = nb.outputs()
    problems = []
    for plot in found["plots"]:
        where = f"cell {plot['cell']} output {plot['output']} figure {plot['title']!r}"
        if not plot["svg"]:
            problems.append(f"{where}: no SVG")
        elif plot["traces"] == 0:
            problems.append(f"{where}: the figure has no data traces")
        elif plot["drawn"] == 0:
            problems.append(f"{where}: {plot['traces']} trace(s) but nothing drawn")
    model_ids = [o["model_id"] for o in found["outputs"] if o["model_id"]]
    census = nb.kernel_eval(CENSUS_CODE, f"__dflash_lab_figure_census({model_ids!r})") if model_ids else {}
    for out in found["outputs"]:
        where = f"cell {out['cell']} output {out['output']}"
        if out["bad"]:
            problems.append(f"{where}: widget shows {out['bad']!r}: {out['text']!r}")
        expected = out["plotly_mime"] + (census.get(out["model_id"]) or 0)
        if out["plots"] < expected:
            problems.append(f"{where}: {expected} figure(s) expected, {out['plots']} rendered")
    return problems, found


def layout_problems(nb: Notebook) -> list[str]:
    """Empty plotly table header cells and truncated widget labels now on the page."""
    return nb.page.evaluate(JS_LAYOUT, nb.path)


def check_step_throughs(nb: Notebook) -> int:
    """Move every step-through's slider one step; the highlighted tokens must change. Returns how many."""
    boxes = nb.page.evaluate(JS_STEP_THROUGH, nb.path)
    for box in boxes:
        assert box["marked"], f"{nb.path}: step-through {box['index']} highlights no token at step {box['step']}"
        handle = nb.page.locator(f"[data-step-through='{box['index']}']")
        handle.scroll_into_view_if_needed()
        handle.focus()
        nb.page.keyboard.press("ArrowRight")
        deadline = time.monotonic() + FLIP_TIMEOUT
        now = box
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = nb.page.evaluate(JS_STEP_THROUGH, nb.path)[box["index"]]
            if now["step"] != box["step"]:
                break
        assert now["step"] == str(int(box["step"]) + 1), (
            f"{nb.path}: moving step-through {box['index']}'s slider did not move it to the next step: {box} -> {now}")
        assert now["marked"] != box["marked"], (
            f"{nb.path}: step-through {box['index']}: the highlighted tokens did not change from step {box['step']} "
            f"to {now['step']}: {now['marked']}")
        print(f"{nb.path}: step-through {box['index']}: step {box['step']} -> {now['step']}, highlighted "
              f"{box['marked'][:4]} -> {now['marked'][:4]}")
    return len(boxes)


def wait_rendered(nb: Notebook, timeout: float = RENDER_TIMEOUT) -> tuple[list[str], dict]:
    """Poll until everything is drawn; after `timeout`, return what still is not."""
    deadline = time.monotonic() + timeout
    while True:
        problems, found = render_problems(nb)
        if not problems or time.monotonic() > deadline:
            return problems, found
        time.sleep(1.0)


def flip(nb: Notebook, control: dict) -> Flip:
    """Flip one control and wait until the page settles; report what changed."""
    page, result = nb.page, Flip(control["kind"], control["label"])
    before = nb.snapshot()
    said = page.evaluate(JS_LISTEN, nb.path)
    target = page.locator(f"[data-flip='{control['index']}']")
    target.scroll_into_view_if_needed()
    start = time.monotonic()
    if control["kind"] == "select":
        options = target.evaluate("el => Array.from(el.options).map(o => o.value)")
        current = target.evaluate("el => el.selectedIndex")
        target.select_option(options[(current + 1) % len(options)])
    elif control["kind"].startswith("slider"):
        target.focus()
        page.keyboard.press("ArrowRight" if control["kind"] == "slider-up" else "ArrowLeft")
    else:
        target.click()
    # Settled: the page changed and then stayed the same for 1.5 s with the kernel
    # idle, or nothing changed by the time the kernel has been idle for 3 s.
    last, stable_since, idle_since = before, None, None
    while time.monotonic() - start < FLIP_TIMEOUT:
        time.sleep(0.25)
        now = nb.snapshot()
        idle = now["kernel"] == "idle"
        idle_since = (idle_since or time.monotonic()) if idle else None
        if now != last:
            last, stable_since = now, time.monotonic()
        changed = now["figures"] != before["figures"] or now["texts"] != before["texts"]
        if changed and idle and time.monotonic() - stable_since > 1.5:
            break
        if not changed and idle_since and time.monotonic() - idle_since > 3.0:
            break
    result.seconds = time.monotonic() - start
    result.figures_changed = sum(a != b for a, b in zip(before["figures"], last["figures"])) + abs(
        len(before["figures"]) - len(last["figures"])
    )
    result.text_changed = before["texts"] != last["texts"]
    stderr = "".join(page.evaluate("(n) => window.__dflashKernelSaid.slice(n)", said))
    result.tracebacks = [ANSI.sub("", stderr)] if re.search(r"Traceback|\w+Error\b", stderr) else []
    return result


def open_and_run(nb: Notebook, server) -> dict:
    nb.page.goto(f"{server.url}/lab/tree/{nb.path}?token={server.token}&reset")
    nb.wait_ready()
    return nb.run_all()


# ---------------------------------------------------------------------------
# What one chapter must show, beyond what every chapter must: run after Run All,
# before the controls are flipped, and again after them (flipped=True).
# ---------------------------------------------------------------------------

# Chapter 5's live figure and fused control, as the page holds them.
JS_CHAPTER_5 = "(path) => {" + PANEL + """
  const root = panel.content.node;
  const plots = Array.from(root.querySelectorAll('.jp-OutputArea .js-plotly-plot')).map(gd => {
    const title = (((gd.layout || {}).title || {}).text || '').replace(/<br>/g, ' ');
    const notes = ((gd.layout || {}).annotations || []).map(a => (a.text || '').replace(/<br>/g, ' '));
    const bars = (gd.data || []).filter(t => (t.xaxis || 'x') === 'x' && (t.y || []).some(y => y !== null)).length;
    let drawn = 0;
    gd.querySelectorAll('g.trace').forEach(el => { const r = el.getBoundingClientRect(); if (r.width && r.height) drawn++; });
    return {title, notes, bars, drawn};
  });
  const fused = Array.from(root.querySelectorAll('.jp-OutputArea .widget-checkbox'))
      .filter(el => /fused/i.test(el.innerText))
      .map(el => ({label: el.innerText.replace(/\s+/g, ' ').trim(),
                   disabled: !!(el.querySelector('input[type=checkbox]') || {}).disabled,
                   checked: !!(el.querySelector('input[type=checkbox]') || {}).checked,
                   box: (el.closest('.widget-vbox') || el.parentElement).innerText.replace(/\s+/g, ' ')}));
  return {plots, fused};
}"""


def check_chapter_5(nb: Notebook, *, flipped: bool = False) -> None:
    """Chapter 5 measures on the machine it runs on, and its fused control does not pretend.

    The kernel says which device timed the live run and whether the fused kernel can run
    there. Then the page must hold the live timing figure (titled with that device, its
    left panel "measured now" with at least the three paths drawn, its right panel the
    committed run), and the fused control: on a machine without a CUDA GPU with Triton,
    an unchecked, disabled checkbox that says it needs one, with a line saying it was not
    run; where the kernel runs, an enabled checkbox and the folded path's time with the
    kernel and without (before the flips: a flip may leave another path chosen).
    """
    here = nb.kernel_eval("", "{'device': live[0]['device'], 'paths': sorted({r['path'] for r in live}), "
                              "'runnable': kernels.triton is not None and context.is_cuda}")
    assert {"reference", "batched", "folded"} <= set(here["paths"]), f"{nb.path}: live timing lacks a path: {here}"
    page = nb.page.evaluate(JS_CHAPTER_5, nb.path)
    live = [p for p in page["plots"] if f"measured now on {here['device']}" in p["title"]]
    assert live, (f"{nb.path}: no figure titled 'measured now on {here['device']}' (the live context-K/V timing); "
                  f"figures: {[p['title'] for p in page['plots']]}")
    fig = live[0]
    assert fig["drawn"] > 0 and fig["bars"] >= 3, f"{nb.path}: the live timing figure draws too little: {fig}"
    assert any(n.startswith(f"measured now · {here['device']}") for n in fig["notes"]), fig["notes"]
    assert any(n.startswith("committed run · ") for n in fig["notes"]), fig["notes"]
    assert page["fused"], f"{nb.path}: no fused-kernel checkbox on the page"
    for control in page["fused"]:
        if here["runnable"] and not flipped:
            assert "with the fused kernel" in control["box"], f"{nb.path}: the fused toggle shows no measured time: {control}"
        elif not here["runnable"]:
            assert control["disabled"] and not control["checked"], (
                f"{nb.path}: the fused kernel cannot run on {here['device']}, but its checkbox is live: {control}")
            assert control["box"].count("needs a CUDA GPU with Triton") == 1, (
                f"{nb.path}: the fused control should say once that it needs a GPU: {control['box']!r}")
    print(f"{nb.path}: live timing figure on {here['device']} ({fig['bars']} paths drawn); fused control: "
          f"{[c['label'] + (' (disabled)' if c['disabled'] else '') for c in page['fused']]}")


# Chapter 4's figures in page order, and the explorer's model dropdown.
JS_CHAPTER_4 = "(path) => {" + PANEL + """
  const root = panel.content.node;
  const titles = Array.from(root.querySelectorAll('.jp-OutputArea .js-plotly-plot')).map(
      gd => (((gd.layout || {}).title || {}).text || '').replace(/<br>/g, ' ').replace(/<[^>]+>/g, '')
                .replace(/(\\S)- /g, '$1-'));  // a title as read: lines joined, markup and hyphen breaks gone
  const models = Array.from(root.querySelectorAll('.jp-OutputArea .widget-dropdown')).filter(
      el => /^\\s*model/.test(el.innerText)).map(el => {
        const select = el.querySelector('select');
        const text = (o) => o.text.replace(/\\u00a0/g, ' ');  // ipywidgets writes option spaces as no-break spaces
        return {options: Array.from(select.options).map(text),
                selected: select.selectedIndex >= 0 ? text(select.options[select.selectedIndex]) : null};
      });
  return {titles, models};
}"""


def check_chapter_4(nb: Notebook, *, flipped: bool = False) -> None:
    """Chapter 4 opens on the shipped pair: its grouping is the first figure on the page, its title
    says in how many groups the drafter is (the kernel's count, from vLLM's grouping of the
    checkpoints), the split case is drawn with vLLM V1's refusal, and the explorer offers the
    shipped pair (selected before the flips) and the split case as presets."""
    here = nb.kernel_eval("", "{'groups': len(pair_split), 'drafter': n_drafter, 'split': SPLIT_DEPTH, "
                              "'refusal': split_refusal, 'split_target': SPLIT_TARGET, "
                              "'shipped': kv_presets.PRESETS['shipped_pair']['label'], "
                              "'split_label': kv_presets.PRESETS['shipped_target_4_layer_drafter']['label']}")
    page = nb.page.evaluate(JS_CHAPTER_4, nb.path)
    assert page["titles"], f"{nb.path}: no figure on the page"
    first = page["titles"][0]
    groups = f"{here['groups']} group{'s' if here['groups'] > 1 else ''}"
    assert first.startswith("The shipped pair") and f"the drafter's {here['drafter']} layers in {groups}" in first, (
        f"{nb.path}: the first figure is not the shipped pair's grouping ({groups}): {first!r}")
    target = here["split_target"][0].upper() + here["split_target"][1:]  # "The same target": the loaded one
    split = [t for t in page["titles"] if t.startswith(f"{target} + a {here['split']}-layer drafter")]
    assert split and here["refusal"] in split[0], (
        f"{nb.path}: the split case is not drawn with vLLM's refusal {here['refusal']!r}: {page['titles'][:6]}")
    assert page["models"], f"{nb.path}: no 'model' dropdown (the KV-group explorer)"
    for model in page["models"]:
        assert here["shipped"] in model["options"] and here["split_label"] in model["options"], (
            f"{nb.path}: the explorer lacks the shipped-pair presets: {model['options']}")
        if not flipped:
            assert model["selected"] == here["shipped"], f"{nb.path}: the explorer opens on {model['selected']!r}"
    print(f"{nb.path}: first figure {first!r}; split case {split[0]!r}; explorer presets "
          f"{page['models'][0]['options'][:2]}")


# Chapter 6's training figures (live run and explorer): title, the τ panel's axis and data.
JS_CHAPTER_6 = "(path) => {" + PANEL + """
  const root = panel.content.node;
  return Array.from(root.querySelectorAll('.jp-OutputArea .js-plotly-plot')).filter(
      gd => /mean acceptance length/.test((((gd.layout || {}).yaxis2 || {}).title || {}).text || '')).map(gd => ({
        title: (((gd.layout || {}).title || {}).text || '').replace(/<br>/g, ' '),
        range: ((gd.layout || {}).yaxis2 || {}).range || null,
        shown: gd._fullLayout && gd._fullLayout.yaxis2 ? gd._fullLayout.yaxis2.range : null,
        tau: Array.from(((gd.data || [])[1] || {}).y || [])}));
}"""


def check_chapter_6(nb: Notebook, *, flipped: bool = False) -> None:
    """Chapter 6's live run shows learning: its held-out τ after training (the kernel's) reaches the
    chapter's floor, the live figure's title says the kernel's τ before and after, and every
    training figure's τ axis starts near its data (at 1, the least τ, or above; never at 0) and
    holds all of it."""
    here = nb.kernel_eval("", "{'taus': [s.mean_acceptance_length for _, s in run.evals], 'floor': TAU_FLOOR, "
                              "'steps': [st for st, _ in run.evals]}")
    taus = here["taus"]
    assert taus[-1] >= here["floor"], f"{nb.path}: the live run reached held-out τ {taus[-1]:.3f} < {here['floor']}"
    figures = nb.page.evaluate(JS_CHAPTER_6, nb.path)
    live = [f for f in figures if f["title"].startswith("paper drafter:")]
    assert live, f"{nb.path}: no live training figure; τ figures: {[f['title'] for f in figures]}"
    said = (f"held-out τ {taus[0]:.2f} at step {here['steps'][0]} → {taus[-1]:.2f} at step {here['steps'][-1]}")
    assert said in live[0]["title"], f"{nb.path}: the live figure's title {live[0]['title']!r} does not say {said!r}"
    for fig in figures:
        drawn = [t for t in fig["tau"] if t is not None]
        if not drawn:
            continue
        lo, hi = fig["shown"] or fig["range"]
        assert 1.0 - 1e-9 <= lo <= min(drawn) and min(drawn) - lo <= 0.2 and hi >= max(drawn), (
            f"{nb.path}: the τ axis of {fig['title']!r} runs {lo}..{hi}, its data {min(drawn):.2f}..{max(drawn):.2f}")
    print(f"{nb.path}: live run τ {taus[0]:.2f} → {taus[-1]:.2f} (floor {here['floor']}); τ axes "
          f"{[f['shown'] or f['range'] for f in figures]}")


CHAPTER_CHECKS = {"04_hybrid_kv_groups": check_chapter_4, "05_fused_kernels_and_sliding_window": check_chapter_5,
                  "06_train_the_drafter": check_chapter_6}


def test_notebook_runs_renders_and_reacts(notebook, lab_server, lab_page, screenshots):
    page, rel, started = lab_page, f"notebooks/{notebook.name}", time.monotonic()
    for old in screenshots.glob(f"{notebook.stem}.*png"):  # no picture from an earlier run passes for this one
        old.unlink()
    nb = Notebook(page, rel, screenshots)
    try:
        state = open_and_run(nb, lab_server)

        # 1. no error outputs; every code cell ran
        if state["errors"]:
            err = state["errors"][0]
            pytest.fail(f"{rel}: cell {err['cell']} raised {err['ename']}: {err['evalue']}\n"
                        + ANSI.sub("", err["traceback"]), pytrace=False)
        assert state["done"] == state["code"], f"{rel}: only {state['done']} of {state['code']} code cells ran"
        printed = nb.page.evaluate(JS_CELL_OUTPUTS, nb.path)
        differ = output_differences(notebook, printed)
        assert not differ, f"{rel}: printouts differ from the committed notebook (nbval's rules):\n" + "\n".join(differ)
        claims = printed_problems(printed)  # a τ without its setting, a raw nan, a pipe table printed as text
        assert not claims, f"{rel}: printed what a reader cannot use:\n" + "\n".join(claims)

        # 2-3. figures drawn, widget views rendered
        problems, found = wait_rendered(nb)
        assert not problems, f"{rel}: not everything rendered:\n  " + "\n  ".join(problems)
        nb.screenshot(f"{notebook.stem}.png")
        hidden = layout_problems(nb)  # what is drawn, a reader must be able to read
        assert not hidden, f"{rel}: drawn but not readable:\n  " + "\n  ".join(hidden)
        chapter_check = CHAPTER_CHECKS.get(notebook.stem)
        if chapter_check:  # what this chapter must show, beyond what every chapter must
            chapter_check(nb)

        # 3b. a step-through's slider changes the highlighted tokens
        check_step_throughs(nb)

        # 4. the controls react
        controls = nb.controls()
        assert controls, f"{rel}: no widget control (dropdown, checkbox, toggle, radio, slider) found"
        flips = []
        for i in range(min(len(controls), MAX_FLIPS)):
            now = nb.controls()  # a redraw may have replaced the controls' elements
            if i >= len(now):
                break
            flips.append(flip(nb, now[i]))
            print(f"{rel}: flipped {flips[-1]}")
            assert not flips[-1].tracebacks, f"{rel}: flipping {flips[-1]} raised in the kernel:\n" + "\n".join(
                flips[-1].tracebacks)
        dead = [str(f) for f in flips if not f.changed]
        assert not dead, f"{rel}: controls that changed nothing on the page: {dead}"
        assert any(f.figures_changed for f in flips), f"{rel}: no control changed a figure: {list(map(str, flips))}"
        problems, _ = wait_rendered(nb)  # what the flips redrew is drawn too
        problems += layout_problems(nb)
        assert not problems, f"{rel}: after flipping the controls:\n  " + "\n  ".join(problems)
        if chapter_check:  # and still, after the flips
            chapter_check(nb, flipped=True)
        nb.screenshot(f"{notebook.stem}.flipped.png")
        print(f"{rel}: {len(found['plots'])} figure(s), {len(controls)} control(s); run all "
              f"{nb.timings['run_all']:.0f}s, whole test {time.monotonic() - started:.0f}s")
    except BaseException:
        try:  # a picture of the failure: the whole notebook if it is open, else the window
            nb.screenshot(f"{notebook.stem}.FAILED.png")
        except Exception:
            with contextlib.suppress(Exception):
                page.screenshot(path=str(screenshots / f"{notebook.stem}.FAILED.png"))
        raise


# ---------------------------------------------------------------------------
# The checks above must fail on a broken notebook. This one breaks figures in
# every way the suite has met (empty traces, no traces, plotly.js throwing, a
# FigureWidget whose view fails), has a control wired to nothing and one whose
# callback raises; each must be reported.
# ---------------------------------------------------------------------------

BROKEN_CELLS = [
    "import plotly.graph_objects as go, ipywidgets as widgets\n"
    "from IPython.display import display",
    "go.Figure(go.Scatter(x=[], y=[]), layout_title_text='empty traces').show()",
    "go.Figure(layout_title_text='no traces').show()",
    "display({'application/vnd.plotly.v1+json': {'data': [{'type': 'scatter', 'y': [1, 2]}],\n"
    "                                            'layout': {'title': {'text': 'js throws'}},\n"
    "                                            'frames': 'not a list'}}, raw=True)",
    "class BrokenFigureWidget(go.FigureWidget):\n"
    "    _esm = 'export default { render() { throw new Error(\"deliberately broken view\"); } };'\n"
    "BrokenFigureWidget(go.Scatter(y=[1, 2, 3]))",
    "go.Figure(go.Table(header=dict(values=['', 'shape']), cells=dict(values=[['a'], ['b']])),\n"
    "          layout_title_text='blank header').show()\n"
    "widgets.IntSlider(description='a label far too long to fit in its box')",
    "ok = go.FigureWidget(go.Scatter(y=[1, 2, 3]), layout_title_text='fine')\n"
    "dead = widgets.IntSlider(value=1, min=0, max=5, description='wired to nothing')\n"
    "def explode(change):\n"
    "    raise ValueError('deliberately broken callback')\n"
    "boom = widgets.Dropdown(options=['a', 'b'], description='raises')\n"
    "boom.observe(explode, names='value')\n"
    "widgets.VBox([dead, boom, ok])",
    "go.Figure(go.Heatmap(z=[[1, 2], [3, 4]], colorbar=dict(title=dict(text='a colour bar title', side='right'))),\n"
    "          layout=dict(title_text='toolbar on the colour bar', modebar_orientation='v')).show()",
    "go.Figure(go.Scatter(x=[1, 9.9], y=[1, 2], mode='markers+text', text=['kept', 'a label past the edge'],\n"
    "                     textposition='middle right'), layout=dict(title_text='cut label', xaxis_range=[0, 10])).show()",
]


def test_the_checks_catch_broken_figures_and_dead_controls(lab_server, lab_page, screenshots):
    import nbformat

    rel = "selftest/broken_figures.ipynb"
    nbk = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    nbk.cells = [nbformat.v4.new_code_cell(src) for src in BROKEN_CELLS]
    (lab_server.root / "selftest").mkdir(exist_ok=True)
    nbformat.write(nbk, lab_server.root / rel)

    nb = Notebook(lab_page, rel, screenshots)
    state = open_and_run(nb, lab_server)
    assert not state["errors"] and state["done"] == len(BROKEN_CELLS), state
    problems, _ = wait_rendered(nb, timeout=15)
    nb.screenshot("selftest.broken_figures.png")
    print("the checks found, as they should:\n  " + "\n  ".join(problems))

    report = "\n".join(problems)
    assert "figure 'empty traces': 1 trace(s) but nothing drawn" in report
    assert "figure 'no traces': the figure has no data traces" in report
    assert "cell 3 output 0: 1 figure(s) expected, 0 rendered" in report
    assert "cell 4 output 0: 1 figure(s) expected, 0 rendered" in report
    assert "cell 6" not in report, report  # the working FigureWidget is not blamed
    hidden = "\n".join(layout_problems(nb))
    print("layout checks found:\n  " + hidden.replace("\n", "\n  "))
    assert "plotly table in \"blank header\": header cell 0 is empty" in hidden
    assert "widget label \"a label far too long to fit in its box\" is truncated" in hidden
    assert "plotly toolbar covers the colorbar of \"toolbar on the colour bar\"" in hidden
    assert "label \"a label past the edge\" in \"cut label\" is cut at the plot's edge" in hidden
    assert "label \"kept\"" not in hidden
    flips = {}
    for i in range(len(nb.controls())):
        control = nb.controls()[i]
        flips[control["label"].split()[0]] = flip(nb, control)
    print("\n".join(f"flipped {f}" for f in flips.values()))
    assert not flips["wired"].changed and not flips["wired"].tracebacks
    assert any("ValueError: deliberately broken callback" in t for t in flips["raises"].tracebacks)
