"""nbval's output check, applied to the outputs of the browser's Run All.

CI executes each chapter once: JupyterLab runs it (the browser test needs a live
kernel for its widgets), and the printouts that cell produced are then compared
with the ones committed in the notebook by nbval's own rules - the same comment
markers and tags (``# NBVAL_IGNORE_OUTPUT``, ``# NBVAL_SKIP``,
``nbval-ignore-output``...), the same stream coalescing and the same fields left
out (metadata, execution counts, widget model ids, images) - as
``pytest --nbval notebooks/`` would apply after executing the chapter itself.
That command still works on its own; `make test` no longer runs it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import nbformat
from nbval.plugin import IPyNbCell, coalesce_streams, find_comment_markers, find_metadata_tags, nocolors

# nbval's IPyNbFile.skip_compare without --nbdime: what it never compares.
SKIP_COMPARE = ("metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
                "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg")


def cell_options(cell) -> dict:
    """nbval's options for one code cell: its tags, then its comment markers (which win)."""
    options = defaultdict(bool, find_metadata_tags(cell.metadata))
    options.update(dict(find_comment_markers(cell.source)))
    options.setdefault("check", True)
    return options


def _joined(value):
    """JupyterLab may hand a multi-line string back as a list of lines; nbformat joins them."""
    return "".join(value) if isinstance(value, list) and all(isinstance(v, str) for v in value) else value


def as_output(raw: dict) -> nbformat.NotebookNode:
    out = {k: _joined(v) for k, v in raw.items() if k != "data"}
    if "data" in raw:
        out["data"] = {mime: _joined(v) for mime, v in raw["data"].items()}
    return nbformat.from_dict(out)


def compare(executed: list, committed: list) -> tuple[bool, str]:
    """nbval's IPyNbCell.compare_outputs on two output lists: (equal, nbval's report)."""
    checker = SimpleNamespace(parent=SimpleNamespace(skip_compare=SKIP_COMPARE), colors=nocolors,
                              sanitize=lambda s: s)
    checker.format_output_compare = lambda key, committed_value, executed_value: checker.comparison_traceback.append(
        f"{key!r} committed:\n{committed_value}\n{key!r} now:\n{executed_value}")
    same = IPyNbCell.compare_outputs(checker, coalesce_streams(executed), coalesce_streams(committed))
    return same, "\n".join(checker.comparison_traceback)


def output_differences(notebook: Path, executed: list[list[dict]]) -> list[str]:
    """What nbval would fail in `notebook` given each code cell's executed outputs, in order."""
    nb = nbformat.read(notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    if len(executed) != len(code):
        return [f"{notebook.name}: {len(executed)} code cells ran, the file has {len(code)}"]
    problems = []
    for i, (cell, outputs) in enumerate(zip(code, executed)):
        options = cell_options(cell)
        if options["skip"]:
            continue
        if cell.execution_count is None:  # nbval checks no output of an unrun reference cell
            if cell.outputs:
                problems.append(f"cell {i}: unrun reference cell has outputs")
            continue
        if not options["check"]:
            continue
        same, report = compare([as_output(o) for o in outputs], [nbformat.from_dict(o) for o in cell.outputs])
        if not same:
            problems.append(f"cell {i} outputs differ from the committed ones:\n{report}")
    return problems
