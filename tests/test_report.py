"""`python -m dflash_lab.tools.report`: self-contained pages for notebooks that run, a traceback and exit 1 for one that fails."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import nbformat
import pytest

from dflash_lab.tools import report

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}

GOOD_CELLS = [
    "# A good chapter",
    "print('hello from the kernel')",
    "import plotly.graph_objects as go\ngo.Figure(go.Bar(x=['a', 'b'], y=[1, 2])).show()",
    "import ipywidgets as widgets\n"
    "fw = go.FigureWidget(go.Scatter(y=[1, 2, 3]))\n"
    "block = widgets.IntSlider(value=4, min=2, max=16, description='block size')\n"
    "fw.data[0].y = [3, 1, 2]  # an edit after the widget was built: the page must show it\n"
    "widgets.VBox([block, fw])",
    "from tqdm.auto import tqdm\n"
    "for _ in tqdm(range(8), desc='kept bar'):\n"
    "    pass\n"
    "for _ in tqdm(range(8), desc='closed bar', leave=False):  # closed at the end, its text never redrawn\n"
    "    pass",
    "import sys  # a known harmless notice (left out of the page) and a line the reader must see (kept)\n"
    "sys.stderr.write('Triton is not ' + 'installed. triton-cpu is expected on x86 CPUs.\\n')\n"
    "sys.stderr.write('a real ' + 'warning\\n')",
]
BROKEN_CELLS = [
    "# A broken chapter",
    "x = 1",
    "raise ValueError('deliberately broken for the test')",
    "print('never reached')",
]


def write_notebook(path, cells) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.cells = [
        nbformat.v4.new_markdown_cell(c) if c.startswith("#") else nbformat.v4.new_code_cell(c) for c in cells
    ]
    nbformat.write(nb, path)


def run_report(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "dflash_lab.tools.report", *map(str, args)],
        cwd=cwd, capture_output=True, text=True, timeout=600,
    )


@pytest.mark.slow
def test_report_of_a_good_notebook_is_self_contained_with_widget_state(tmp_path):
    import plotly.offline

    (tmp_path / "nbs").mkdir()
    write_notebook(tmp_path / "nbs" / "01_good.ipynb", GOOD_CELLS)

    result = run_report("--out", tmp_path / "reports", tmp_path / "nbs", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    page = (tmp_path / "reports" / "01_good.html").read_text()
    assert plotly.offline.get_plotlyjs()[:2000] in page, "plotly.js is not inlined"
    external = re.findall(r'<script[^>]*\ssrc="(https?:[^"]*)"', page)
    assert all("mathjax" in url for url in external), f"scripts from the network: {external}"
    assert "hello from the kernel" in page
    # the saved widget state: the slider's model with its value, and the FigureWidget
    m = re.search(r'<script type="application/vnd.jupyter.widget-state\+json">(.*?)</script>', page, re.S)
    assert m, "no widget state in the page"
    models = json.loads(m.group(1))["state"]
    sliders = [s["state"] for s in models.values() if s["model_name"] == "IntSliderModel"]
    assert sliders and sliders[0]["value"] == 4 and sliders[0]["description"] == "block size"
    assert any(s["model_module"] == "anywidget" for s in models.values())
    # the widget view drawn from that state, with the figure as the kernel last held it
    sliders_drawn = re.findall(r'<input[^>]*type="range"[^>]*>', page)
    assert len(sliders_drawn) == 1 and 'max="16"' in sliders_drawn[0] and 'value="4"' in sliders_drawn[0]
    assert page.count("Plotly.newPlot") == 2  # the bar chart and the FigureWidget
    assert '"y":[3,1,2]' in page.replace(" ", "")
    # tqdm bars as JupyterLab leaves them: the kept one complete, the closed one (leave=False) not drawn
    drawn = re.sub(r"<script.*?</script>", "", page, flags=re.S).replace("\u2007", " ")  # shown, not saved state
    assert "kept bar: 100%" in drawn and " 8/8 " in drawn
    assert re.search(r'<progress (max="8(\.0)?" value="8(\.0)?"|value="8(\.0)?" max="8(\.0)?")>', drawn), drawn[-3000:]
    assert "closed bar:" not in drawn, "a closed tqdm bar (leave=False) is drawn from its last, stale state"
    # stderr: the known notice left out (and counted in the log), every other line kept
    assert "a real warning" in drawn and "Triton is not installed" not in drawn
    assert "01_good.ipynb: left out 1 known stderr line(s)" in result.stderr
    # the progress line counts the notebook's code cells and names the one it runs
    code_cells = sum(not c.startswith("#") for c in GOOD_CELLS)
    assert f"{code_cells}/{code_cells}" in result.stderr and f"code cell {code_cells} of {code_cells} (notebook cell " \
        f"{len(GOOD_CELLS) - 1})" in result.stderr, result.stderr[-2000:]
    assert f"/{code_cells + 1}" not in result.stderr  # the report's own figure read-back is not counted
    index = (tmp_path / "reports" / "index.html").read_text()
    assert 'href="01_good.html"' in index and "A good chapter" in index
    assert not list((tmp_path / "reports").glob(".*.tmp")), "a temporary file was left behind"


@pytest.mark.slow
def test_report_of_a_broken_notebook_exits_nonzero_with_the_traceback(tmp_path):
    (tmp_path / "nbs").mkdir()
    write_notebook(tmp_path / "nbs" / "02_broken.ipynb", BROKEN_CELLS)
    (tmp_path / "reports").mkdir()
    stale = tmp_path / "reports" / "02_broken.html"
    stale.write_text("a page from an earlier run")

    result = run_report("--out", tmp_path / "reports", tmp_path / "nbs", cwd=tmp_path)

    assert result.returncode != 0
    assert "02_broken.ipynb: cell 2 failed" in result.stderr
    assert "ValueError: deliberately broken for the test" in result.stderr
    assert "raise ValueError" in result.stderr  # the failing cell's source, as nbclient reports it
    assert not stale.exists(), "the page of a notebook that no longer runs was kept"
    index = (tmp_path / "reports" / "index.html").read_text()
    assert "FAILED" in index and "deliberately broken" in index


def test_write_atomic_leaves_the_old_file_when_the_rename_fails(tmp_path, monkeypatch):
    target = tmp_path / "page.html"
    target.write_text("old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        report.write_atomic(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["page.html"]


def test_report_names_a_path_that_is_not_a_notebook(tmp_path):
    with pytest.raises(SystemExit):
        report.main(["--out", str(tmp_path / "r"), str(tmp_path / "missing.ipynb")])
