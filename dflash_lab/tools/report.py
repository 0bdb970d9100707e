"""Headless reports: run every notebook and write one self-contained HTML page each.

    python -m dflash_lab.tools.report --out reports notebooks      # what `make report` runs

Each notebook runs top to bottom in a fresh kernel (nbclient, working directory
= the notebook's folder, offline: HF_HUB_OFFLINE=1 and a loopback-only socket
guard in the kernel), with a tqdm line per notebook that advances cell by cell.
Then nbconvert's HTML exporter (JupyterLab's look, with ``tools.report_html``'s
template and static renderings) writes ``reports/NAME.html``:

- plotly.js is inlined once in the page head, so every figure draws offline;
  figures shown with ``fig.show()`` become plotly divs;
- the widget state is saved in the page (nbclient ``store_widget_state``) and
  every widget view is drawn from it as a static snapshot of its final state:
  sliders, dropdowns and toggles at their values, progress bars, HTML, and each
  plotly ``FigureWidget`` with the figure the kernel last held. (The 5 MB
  JavaScript bundle each FigureWidget carries is left out of the saved state.)
  A view with controls says that it is a static snapshot of their last state.
  Nothing is fetched from the network: nbconvert's MathJax and Mermaid loaders
  (CDN scripts) are left out; the chapters write no LaTeX.

``reports/index.html`` links the pages. A notebook that fails prints the
failing cell's traceback, gets no page (a stale one is removed), and makes the
exit status 1. Every file is written to a temporary name and renamed, so no
half-written report is ever left behind. Each notebook's slowest cell is
printed, and cells that ran longer than ``--slow-cell`` seconds without
showing a progress bar are listed as warnings.

Two things JupyterLab would draw differently from what a reader needs are mended: a
widget the kernel closed (a tqdm bar with ``leave=False``) is not drawn from its last,
stale state, and stderr lines known to be harmless notices (``KNOWN_STDERR_NOISE``: vLLM
0.33 and torch on a CPU-only machine) are left out, counted in the log; every other stderr
line stays, in JupyterLab's red box.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
from tqdm.auto import tqdm

from ..repro import OFFLINE_ENV, write_ipython_startup
from ..runtime import atomic_file
from .report_html import ANSI, GLOSSARY, drop_known_stderr_noise, glossary_page, to_html

# ---------------------------------------------------------------------------
# Running a notebook
# ---------------------------------------------------------------------------

# Run in the kernel after the last cell (then dropped from the notebook): the
# figure every FigureWidget holds now, by widget model id. Its saved widget
# state only has the figure it was built with; later edits travel as messages.
FIGURE_DUMP_CELL = """\
def __dflash_lab_figures():
    try:
        import plotly.io as pio
        from ipywidgets.widgets.widget import _instances
        from plotly.basewidget import BaseFigureWidget
    except ImportError:
        return {}
    return {model_id: __import__("json").loads(pio.to_json(w, validate=False))
            for model_id, w in list(_instances.items()) if isinstance(w, BaseFigureWidget)}
__import__("IPython").display.display({"application/json": __dflash_lab_figures()}, raw=True)
del __dflash_lab_figures
"""
FIGURE_DUMP_ID = "dflash-lab-figure-dump"


class _Client(NotebookClient):
    """nbclient's client, but a widget the kernel closes leaves the saved state, as its views leave JupyterLab.

    nbclient keeps every widget it has seen with its last synced state, closed or not, so a
    closed view would be drawn again from that state: a tqdm bar with ``leave=False`` (closed
    when its loop ends, without a last redraw of its text) would show frozen one step short,
    "88% 7/8". JupyterLab removes a closed widget's view; so does the report.
    """

    def handle_comm_msg(self, outs, msg, cell_index) -> None:
        super().handle_comm_msg(outs, msg, cell_index)
        if msg["msg_type"] == "comm_close":
            comm_id = msg["content"].get("comm_id")
            self.widget_state.pop(comm_id, None)
            self.widget_buffers.pop(comm_id, None)


class NotebookFailed(RuntimeError):
    """A cell raised: names the notebook and the cell, and carries the traceback."""

    def __init__(self, path: Path, cell_index: int | None, traceback: str):
        self.path, self.cell_index, self.traceback = path, cell_index, traceback
        where = f"cell {cell_index}" if cell_index is not None else "kernel"
        super().__init__(f"{path.name}: {where} failed\n{traceback}")


@contextlib.contextmanager
def kernel_environment():
    """Environment variables a kernel started inside the block inherits.

    Offline Hugging Face, plotly figures as plain mime bundles (the report
    renders them itself), and an IPython profile whose startup file installs
    the loopback-only socket guard (as the nbval kernels have).
    """
    with tempfile.TemporaryDirectory(prefix="dflash-lab-ipython-") as ipython_dir:
        write_ipython_startup(ipython_dir)
        update = {**OFFLINE_ENV, "PLOTLY_RENDERER": "plotly_mimetype", "IPYTHONDIR": ipython_dir,
                  "TOKENIZERS_PARALLELISM": "false"}
        saved = {k: os.environ.get(k) for k in update}
        os.environ.update(update)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def execute_notebook(
    path: Path,
    *,
    nb: nbformat.NotebookNode | None = None,
    timeout: float | None = 1800,
    store_widget_state: bool = True,
    record_timing: bool = True,
    dump_figures: bool = False,
    position: int = 0,
) -> tuple[nbformat.NotebookNode, dict]:
    """Run the notebook at `path` (or `nb`, read from there) in a fresh kernel; return it with outputs.

    Returns ``(nb, figures)``; ``figures`` maps each live FigureWidget's model
    id to its figure (only with ``dump_figures``). Raises NotebookFailed with
    the failing cell's traceback.
    """
    nb = nbformat.read(path, as_version=4) if nb is None else nb
    n_code = sum(c.cell_type == "code" for c in nb.cells)  # the notebook's own: the figure dump is not counted
    if dump_figures:
        nb.cells.append(nbformat.v4.new_code_cell(FIGURE_DUMP_CELL, id=FIGURE_DUMP_ID))
    bar = tqdm(total=n_code, desc=path.stem, unit="cell", position=position, leave=True, dynamic_ncols=True)
    current = {"index": None, "code": 0}

    def on_cell_start(cell, cell_index, **_):  # nbclient calls it for every cell, markdown too
        current["index"] = cell_index
        if cell.get("id") == FIGURE_DUMP_ID:
            bar.set_postfix_str("reading the figures back")
        elif cell.cell_type == "code":  # the bar counts code cells, so the postfix names the code cell it runs
            current["code"] += 1
            bar.set_postfix_str(f"code cell {current['code']} of {n_code} (notebook cell {cell_index})")

    def on_cell_executed(cell, cell_index, **_):
        if cell.get("id") != FIGURE_DUMP_ID:
            bar.update(1)

    client = _Client(
        nb,
        timeout=timeout,
        kernel_name=nb.metadata.get("kernelspec", {}).get("name", "python3"),
        resources={"metadata": {"path": str(path.parent.resolve())}},
        store_widget_state=store_widget_state,
        record_timing=record_timing,
        on_cell_start=on_cell_start,
        on_cell_executed=on_cell_executed,
    )
    try:
        with kernel_environment():
            client.execute()
    except CellExecutionError as exc:
        raise NotebookFailed(path, current["index"], ANSI.sub("", str(exc))) from None
    except (CellTimeoutError, DeadKernelError) as exc:
        raise NotebookFailed(path, current["index"], f"{type(exc).__name__}: {exc}") from None
    finally:
        bar.close()

    figures = {}
    if dump_figures:
        dump = nb.cells.pop()
        for out in dump.get("outputs", []):
            figures.update(out.get("data", {}).get("application/json", {}))
    return nb, figures


def cell_timings(nb) -> list[tuple[int, float, bool]]:
    """(cell index, seconds, showed a progress bar) for every code cell that ran (record_timing)."""
    timings = []
    for i, cell in enumerate(nb.cells):
        timing = cell.get("metadata", {}).get("execution", {})
        start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
        if cell.cell_type == "code" and start and end:
            seconds = _iso_seconds(end) - _iso_seconds(start)
            timings.append((i, seconds, any(_is_progress_bar(o) for o in cell.outputs)))
    return timings


def _iso_seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _is_progress_bar(output) -> bool:
    """tqdm's notebook bar (a widget whose text form is the bar) or its console bar (stderr)."""
    text = output.get("text", "") if output.get("output_type") == "stream" else output.get("data", {}).get(
        "text/plain", ""
    )
    return bool(re.search(r"\d+%\|", text if isinstance(text, str) else "".join(text)))


# ---------------------------------------------------------------------------
# Writing the report
# ---------------------------------------------------------------------------


def write_atomic(path: Path, text: str) -> None:
    """``text`` at ``path`` (UTF-8), through runtime.atomic_file: flushed to disk, then renamed over ``path``."""

    def write(tmp: Path) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    atomic_file(path, write)


@dataclass
class Entry:
    path: Path
    title: str
    ok: bool = False
    seconds: float = 0.0
    html_name: str = ""
    size: int = 0
    error: str = ""
    slowest: tuple = ()  # (cell index, seconds)
    slow: list = field(default_factory=list)  # (cell index, seconds) of slow cells without a progress bar


def notebook_title(path: Path) -> str:
    """The notebook's first markdown heading, else its name."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return path.stem


def index_html(entries: list[Entry]) -> str:
    rows = []
    for e in entries:
        name = html.escape(e.path.stem)
        link = f'<a href="{html.escape(e.html_name)}">{name}</a>' if e.ok else name
        status = "ok" if e.ok else f'<span class="failed">FAILED</span><pre>{html.escape(e.error[-3000:])}</pre>'
        note = "".join(f"<div>cell {i}: {s:.0f}s without a progress bar</div>" for i, s in e.slow)
        if e.slowest:
            note += f"<div>slowest: cell {e.slowest[0]}, {e.slowest[1]:.0f}s</div>"
        rows.append(
            f"<tr><td>{link}</td><td>{html.escape(e.title)}</td><td>{status}{note}</td>"
            f"<td>{e.seconds:.0f}s</td><td>{e.size / 1e6:.1f} MB</td></tr>"
        )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>dflash_lab notebooks</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 6px 12px; text-align: left; vertical-align: top; }}
.failed {{ color: #c62828; font-weight: bold; }} pre {{ font-size: 11px; max-width: 70em; overflow: auto; }}
</style></head><body>
<h1>dflash_lab notebooks</h1>
<p>Each notebook was run top to bottom on the shipped checkpoints; the pages are self-contained
(plotly.js inlined, widgets drawn from their saved state). Generated {stamp}.</p>
<table><tr><th>notebook</th><th>chapter</th><th>status</th><th>run time</th><th>page</th></tr>
{"".join(rows)}
</table></body></html>
"""


def find_notebooks(paths: list[Path]) -> list[Path]:
    found = []
    for p in paths:
        if p.is_dir():
            found.extend(sorted(q for q in p.glob("*.ipynb") if not q.name.startswith(".")))
        elif p.suffix == ".ipynb" and p.exists():
            found.append(p)
        else:
            raise FileNotFoundError(f"{p}: not a notebook or a folder of notebooks")
    return found


def build_report(notebooks: list[Path], out: Path, *, timeout: float, slow_cell: float) -> list[Entry]:
    entries = []
    for path in notebooks:
        entry = Entry(path=path, title=notebook_title(path), html_name=f"{path.stem}.html")
        target = out / entry.html_name
        start = time.monotonic()
        try:
            nb, figures = execute_notebook(path, timeout=timeout, dump_figures=True)
            timings = cell_timings(nb)
            entry.slowest = max(((i, t) for i, t, _ in timings), key=lambda it: it[1], default=())
            entry.slow = [(i, t) for i, t, progress in timings if t > slow_cell and not progress]
            noise = drop_known_stderr_noise(nb)
            if noise:
                print(f"{path.name}: left out {noise} known stderr line(s) (vLLM 0.33 and torch on this machine; "
                      "report_html.KNOWN_STDERR_NOISE)", file=sys.stderr)
            page = to_html(nb, figures, entry.title)
            write_atomic(target, page)
            entry.ok, entry.size = True, len(page.encode())
        except NotebookFailed as exc:
            entry.error = str(exc)
            target.unlink(missing_ok=True)  # no stale page for a notebook that no longer runs
            print(f"\nFAILED {exc}", file=sys.stderr)
        entry.seconds = time.monotonic() - start
        if entry.slowest:
            print(f"{path.name}: {entry.seconds:.0f}s, slowest cell {entry.slowest[0]} ({entry.slowest[1]:.0f}s)",
                  file=sys.stderr)
        for i, s in entry.slow:
            print(f"warning: {path.name} cell {i} ran {s:.0f}s without a progress bar (tqdm.auto)", file=sys.stderr)
        entries.append(entry)
        write_atomic(out / "index.html", index_html(entries))  # the index is current after each notebook
    for folder in dict.fromkeys(path.parent for path in notebooks):  # the glossary the chapters link to
        if (folder / GLOSSARY).is_file():
            write_atomic(out / "GLOSSARY.html", glossary_page((folder / GLOSSARY).read_text()))
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_lab.tools.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="notebooks, or folders of notebooks")
    parser.add_argument("--out", type=Path, default=Path("reports"), help="output folder (default: reports)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a single cell may run")
    parser.add_argument("--slow-cell", type=float, default=10,
                        help="warn about cells that run longer than this without a progress bar")
    args = parser.parse_args(argv)
    try:
        notebooks = find_notebooks(args.paths)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    if not notebooks:
        parser.error(f"no notebooks in {', '.join(map(str, args.paths))}")
    entries = build_report(notebooks, args.out, timeout=args.timeout, slow_cell=args.slow_cell)
    failed = [e for e in entries if not e.ok]
    print(f"{len(entries) - len(failed)} of {len(entries)} notebooks ran; report: {args.out / 'index.html'}")
    if failed:
        print("failed: " + ", ".join(e.path.name for e in failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
