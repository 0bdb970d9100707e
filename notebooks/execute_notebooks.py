"""Run built notebooks in place and keep only the outputs nbval compares.

After ``build_notebooks.py`` has turned a source into ``notebooks/NN_name.ipynb``,
this script executes it (cwd = notebooks/, the kernel of the current Python) and
then removes what would only bloat the diff: the outputs of cells marked
``# NBVAL_IGNORE_OUTPUT`` (figures, widgets, timing-dependent text), the
per-cell execution timestamps and the saved widget state. The small,
deterministic printouts stay, for ``pytest --nbval`` to check.

    python notebooks/execute_notebooks.py 04      # chapters whose name starts with 04
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
IGNORE_MARK = "NBVAL_IGNORE_OUTPUT"


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code" and IGNORE_MARK in cell.source:
            cell.outputs = []
    nb.metadata.pop("widgets", None)
    return nb


def execute(path: Path, timeout: int = 900) -> None:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(strip(nb), path)


def main(argv: list[str]) -> None:
    prefixes = argv or [""]
    for path in sorted(HERE.glob("*.ipynb")):
        if any(path.stem.startswith(p) for p in prefixes):
            execute(path)
            print("executed", path.relative_to(HERE.parent))


if __name__ == "__main__":
    main(sys.argv[1:])
