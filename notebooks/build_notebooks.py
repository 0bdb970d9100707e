"""Build the notebooks from their plain-Python sources.

Each chapter is written as ``notebooks/src/NN_name.py`` with ``# %%`` (code) and
``# %% [markdown]`` (prose) cell markers, so a review reads as a code diff. This
script turns each source into ``notebooks/NN_name.ipynb`` with the kernelspec
set and no outputs:

    python notebooks/build_notebooks.py            # all chapters
    python notebooks/build_notebooks.py 03         # chapters whose name starts with 03
    python notebooks/build_notebooks.py --execute  # ... then run them, keeping small printouts
    python notebooks/build_notebooks.py --keep-outputs  # new sources, the committed printouts kept

``--keep-outputs`` is for edits that cannot change what a cell prints (an import
line, a comment): each rebuilt code cell keeps the outputs and tags of the
committed cell with the same id; `pytest --nbval` then checks they still hold.

With ``--execute`` each built notebook runs top to bottom (nbclient, cwd =
notebooks/, offline) and keeps only what nbval should compare: stdout and
plain-text results of a few KB. Figures, widgets, HTML, images and stderr are
dropped, and a cell that lost any output is tagged ``nbval-ignore-output`` (its
printouts stay for the reader, nbval no longer compares them). Cells whose
source says ``# NBVAL_IGNORE_OUTPUT`` or ``# NBVAL_SKIP`` keep no output at all.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
TEXT_MIMES = {"text/plain", "text/markdown", "text/latex"}
MAX_OUTPUT_CHARS = 4000  # one kept printout; longer ones are not "small"
MAX_NOTEBOOK_BYTES = 200_000  # a committed notebook stays diff-sized
# Printouts that usually differ from run to run: addresses, durations, rates, dates.
UNSTABLE = re.compile(r"0x[0-9a-f]{6,}|\d\s?(ms|µs|us|s|sec|seconds)\b|it/s|\d{4}-\d\d-\d\d[ T]\d\d:")


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


def build(src: Path, *, keep_outputs: bool = False) -> Path:
    out = HERE / f"{src.stem}.ipynb"
    old = {c.get("id"): c for c in nbformat.read(out, as_version=4).cells} if keep_outputs and out.exists() else {}
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = KERNELSPEC
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = split_cells(src.read_text())
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{src.stem[:2]}-{i:03d}"  # stable ids keep diffs small
        prev = old.get(cell["id"])
        if cell.cell_type == "code" and prev is not None and prev.cell_type == "code":
            cell.outputs = prev.outputs
            cell.execution_count = prev.get("execution_count")  # nbval rejects outputs of an unrun cell
            if prev.metadata.get("tags"):
                cell.metadata["tags"] = prev.metadata["tags"]
    nbformat.write(nb, out)
    return out


def nbval_markers(cell) -> set[str]:
    """The nbval comment markers (# NBVAL_...) in a cell's source."""
    return {line.strip().lstrip("#").strip() for line in cell.source.splitlines() if line.strip().startswith("#")}


def is_small_text(output) -> bool:
    if output.output_type == "stream":
        return output.name == "stdout" and len(output.text) <= MAX_OUTPUT_CHARS
    if output.output_type in ("execute_result", "display_data"):
        data = output.get("data", {})
        return set(data) <= TEXT_MIMES and sum(len(str(v)) for v in data.values()) <= MAX_OUTPUT_CHARS
    return output.output_type == "error"  # only in cells that are expected to raise


def keep_small_outputs(nb, name: str) -> nbformat.NotebookNode:
    """Strip an executed notebook down to the printouts nbval checks (see the module doc)."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        markers = nbval_markers(cell)
        tags = set(cell.metadata.pop("tags", []))
        if "NBVAL_RAISES_EXCEPTION" in markers:
            tags.discard("raises-exception")  # set only for nbclient; nbval reads the comment
        kept = [] if markers & {"NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP"} else [o for o in cell.outputs if is_small_text(o)]
        if len(kept) < len(cell.outputs) and not markers & {"NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP"}:
            tags.add("nbval-ignore-output")  # nbval would see outputs the file no longer has
        for o in kept if "nbval-ignore-output" not in tags else []:
            unstable = UNSTABLE.search(o.get("text") or "".join(map(str, o.get("data", {}).values())))
            if unstable:
                print(f"warning: {name} cell {i} prints {unstable.group(0)!r}, which may differ between "
                      "runs; mark the cell # NBVAL_IGNORE_OUTPUT if it does", file=sys.stderr)
                break
        cell.outputs = kept
        if tags:
            cell.metadata["tags"] = sorted(tags)
    nb.metadata.pop("widgets", None)
    nb.metadata["language_info"] = {"name": "python"}  # not the kernel's full version string
    return nb


def execute(path: Path) -> None:
    """Run a built notebook in place; keep only its small printouts."""
    from dflash_lab.tools.report import NotebookFailed, execute_notebook, write_atomic

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # nbclient lets a cell raise only when it is tagged so
        if cell.cell_type == "code" and "NBVAL_RAISES_EXCEPTION" in nbval_markers(cell):
            cell.metadata.setdefault("tags", []).append("raises-exception")
    try:
        nb, _ = execute_notebook(path, nb=nb, store_widget_state=False, record_timing=False)
    except NotebookFailed as exc:
        raise SystemExit(f"FAILED {exc}") from None
    text = nbformat.writes(keep_small_outputs(nb, path.name)) + "\n"
    if len(text.encode()) > MAX_NOTEBOOK_BYTES:
        sizes = sorted(((len(json.dumps(c)), i) for i, c in enumerate(nb.cells)), reverse=True)[:3]
        raise SystemExit(f"{path.name}: {len(text.encode()) // 1000} KB with outputs, over the "
                         f"{MAX_NOTEBOOK_BYTES // 1000} KB limit; largest cells: "
                         + ", ".join(f"cell {i} ({n // 1000} KB)" for n, i in sizes))
    write_atomic(path, text)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="Build notebooks/NN_name.ipynb from notebooks/src/NN_name.py.")
    parser.add_argument("prefixes", nargs="*", default=[""], help="build the chapters whose name starts with these")
    parser.add_argument("--execute", action="store_true", help="run each built notebook and keep small printouts")
    parser.add_argument("--keep-outputs", action="store_true",
                        help="keep each code cell's committed outputs (for edits that change no printout)")
    args = parser.parse_args(argv)
    for src in sorted((HERE / "src").glob("*.py")):
        if any(src.stem.startswith(p) for p in args.prefixes or [""]):
            out = build(src, keep_outputs=args.keep_outputs)
            print("built", out.relative_to(HERE.parent))
            if args.execute:
                execute(out)
                print(f"executed {out.relative_to(HERE.parent)} ({out.stat().st_size // 1000} KB)")


if __name__ == "__main__":
    main(sys.argv[1:])
