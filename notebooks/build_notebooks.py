"""Build the notebooks from their plain-Python sources.

Each chapter is written as ``notebooks/src/NN_name.py`` with ``# %%`` (code) and
``# %% [markdown]`` (prose) cell markers, so a review reads as a code diff. This
script turns each source into ``notebooks/NN_name.ipynb`` with the kernelspec
set and no outputs:

    python notebooks/build_notebooks.py            # all chapters
    python notebooks/build_notebooks.py 03         # chapters whose name starts with 03
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def split_cells(source: str) -> list[nbformat.NotebookNode]:
    """Split a `# %%`-marked source into notebook cells."""
    cells, kind, lines = [], None, []

    def flush():
        text = "\n".join(lines).strip("\n")
        if kind is None or not text:
            return
        if kind == "markdown":
            # Markdown lines are written as comments in the source: strip the "# ".
            text = "\n".join(l[2:] if l.startswith("# ") else l.lstrip("#") for l in text.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(text))
        else:
            cells.append(nbformat.v4.new_code_cell(text))

    for line in source.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        else:
            lines.append(line)
    flush()
    return cells


def build(src: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = split_cells(src.read_text())
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{src.stem[:2]}-{i:03d}"  # stable ids keep diffs small
    out = HERE / f"{src.stem}.ipynb"
    nbformat.write(nb, out)
    return out


def main(argv: list[str]) -> None:
    prefixes = argv or [""]
    for src in sorted((HERE / "src").glob("*.py")):
        if any(src.stem.startswith(p) for p in prefixes):
            print("built", build(src).relative_to(HERE.parent))


if __name__ == "__main__":
    main(sys.argv[1:])
