"""A `make report` page opened in Chromium with the network cut off: every figure draws, every widget shows."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

pytestmark = pytest.mark.browser

CELLS = [
    "# Report page check",
    "from tqdm.auto import tqdm\n"
    "import ipywidgets as widgets, plotly.graph_objects as go\n"
    "for _ in tqdm(range(3), desc='steps'):\n"
    "    pass",
    "out = widgets.Output()\n"
    "with out:\n"
    "    go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]), layout_title_text='inside an Output widget').show()\n"
    "path = widgets.Dropdown(options=['reference', 'batched', 'folded'], value='folded', description='path')\n"
    "widgets.VBox([path, out])",
    "fw = go.FigureWidget(go.Bar(y=[2, 1]), layout_title_text='FigureWidget')\n"
    "fw.data[0].y = [5, 6, 7]\n"
    "fw",
    "go.Figure(go.Scatter(y=[1, 3, 2]), layout_title_text='shown').show()",
]

# Per figure: its title, how many traces it holds and how many trace elements have a box on the page.
JS_FIGURES = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(gd => ({
  title: ((gd.layout || {}).title || {}).text || '',
  traces: (gd.data || []).length,
  drawn: Array.from(gd.querySelectorAll('g.trace, g.hm, .heatmaplayer image, .imagelayer image'))
              .filter(el => { const r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; }).length,
  bars: Array.from(gd.querySelectorAll('g.trace.bars g.point')).length,
}))"""


def test_report_page_draws_figures_and_widgets_offline(tmp_path, browser, screenshots):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    nb.cells = [nbformat.v4.new_markdown_cell(c) if c.startswith("#") else nbformat.v4.new_code_cell(c)
                for c in CELLS]
    (tmp_path / "nbs").mkdir()
    nbformat.write(nb, tmp_path / "nbs" / "page_check.ipynb")
    run = subprocess.run([sys.executable, "-m", "dflash_lab.tools.report", "--out", "reports", "nbs"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr

    context = browser.new_context(viewport={"width": 1200, "height": 900})
    requested = []
    context.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                  else (requested.append(route.request.url), route.abort()))
    page = context.new_page()
    page_errors = []
    page.on("pageerror", lambda exc: page_errors.append(str(exc)))
    try:
        page.goto((tmp_path / "reports" / "page_check.html").as_uri())
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 3", timeout=30_000)
        figures = {f["title"]: f for f in page.evaluate(JS_FIGURES)}
        page.screenshot(path=str(screenshots / "report.page_check.png"), full_page=True)
        selected = page.evaluate("() => Array.from(document.querySelectorAll('.dflash-widget-snapshot select'))"
                                 ".map(s => s.options[s.selectedIndex].text)")
        progress = page.evaluate("() => Array.from(document.querySelectorAll('.dflash-widget-snapshot progress'))"
                                 ".map(p => p.value / p.max)")
        notes = page.evaluate("() => Array.from(document.querySelectorAll('.dflash-w-snapshot-note'))"
                              ".filter(n => n.innerText.includes('Static snapshot')).length")
        index = page.goto((tmp_path / "reports" / "index.html").as_uri())
        assert index.ok and "page_check.html" in page.content()
    finally:
        context.close()

    assert set(figures) == {"inside an Output widget", "FigureWidget", "shown"}, figures
    assert all(f["traces"] == 1 and f["drawn"] >= 1 for f in figures.values()), figures
    assert figures["FigureWidget"]["bars"] == 3  # the figure the kernel held last, not the one it was built with
    assert selected == ["folded"] and progress == [1.0]
    assert not page_errors, page_errors
    assert not requested, f"the page reached for the network: {requested}"
    assert notes == 1, f"the widget view with a dropdown must say it is a static snapshot, found {notes} notes"
