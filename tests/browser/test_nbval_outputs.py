"""The browser test's output check is nbval's: what nbval passes it passes, what nbval fails it fails.

These run without a browser: they feed the check the committed outputs (as JupyterLab hands them
back) and altered ones, and compare its verdict with nbval's own comparison.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from nbval_outputs import cell_options, compare, output_differences

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def code_cells(path: Path) -> list:
    return [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def as_lab_json(outputs) -> list[dict]:
    """Outputs the way JupyterLab's model serialises them: multi-line text as a list of lines."""
    lab = []
    for o in outputs:
        o = dict(o)
        if "text" in o:
            o["text"] = o["text"].splitlines(keepends=True)
        lab.append(o)
    return lab


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_chapter_that_prints_what_it_committed_passes(path):
    executed = [as_lab_json(c.outputs) for c in code_cells(path)]
    assert output_differences(path, executed) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_changed_printout_in_a_checked_cell_fails(path):
    cells = code_cells(path)
    checked = [i for i, c in enumerate(cells)
               if cell_options(c)["check"] and not cell_options(c)["skip"] and c.execution_count is not None
               and any(o.output_type == "stream" for o in c.outputs)]
    if not checked:
        pytest.skip(f"{path.name} has no checked printout")
    i = checked[0]
    executed = [as_lab_json(c.outputs) for c in cells]
    stream = next(o for o in executed[i] if o["output_type"] == "stream")
    stream["text"] = stream["text"] + ["one line more\n"]
    problems = output_differences(path, executed)
    assert len(problems) == 1 and problems[0].startswith(f"cell {i} outputs differ"), problems
    assert "one line more" in problems[0]
    assert output_differences(path, executed[:-1])[0].endswith(f"the file has {len(cells)}")


def test_streams_are_coalesced_and_ignored_cells_accept_anything(tmp_path):
    nb = nbformat.v4.new_notebook()
    stdout = nbformat.v4.new_output("stream", name="stdout", text="a\nb\n")
    nb.cells = [nbformat.v4.new_code_cell("print('a'); print('b')", outputs=[stdout], execution_count=1),
                nbformat.v4.new_code_cell("# NBVAL_IGNORE_OUTPUT\nprint(1)", outputs=[], execution_count=2),
                nbformat.v4.new_code_cell("x = 1", outputs=[], execution_count=3)]
    path = tmp_path / "tiny.ipynb"
    nbformat.write(nb, path)
    split = [{"output_type": "stream", "name": "stdout", "text": "a\n"},
             {"output_type": "stream", "name": "stdout", "text": "50%\rb\n"}]
    anything = [{"output_type": "stream", "name": "stdout", "text": "whatever\n"}]
    assert output_differences(path, [split, anything, []]) == []
    stderr = [{"output_type": "stream", "name": "stderr", "text": "a warning\n"}]
    assert output_differences(path, [split, [], stderr])[0].startswith("cell 2 outputs differ")
    same, report = compare([nbformat.from_dict(split[0])], [stdout])
    assert not same and "b" in report
