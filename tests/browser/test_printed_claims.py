"""Every committed chapter passes printed_claims, and the check catches what it is for (no browser needed).

The browser test runs each chapter and holds its printouts to the committed ones (nbval's rules), so what
holds of the committed printouts holds of the run.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from printed_claims import printed_problems

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def stream(text: str) -> list[dict]:
    return [{"output_type": "stream", "name": "stdout", "text": text}]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_chapter_prints_a_bare_tau_a_nan_or_a_pipe_table(path):
    cells = [c.outputs for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    assert printed_problems(cells) == []


def test_a_tau_without_its_setting_is_caught_and_one_with_it_passes():
    assert printed_problems([stream("whole run: tau 3.09\n")])
    assert printed_problems([stream("τ 5.02 on 48 held-out prompts\n")])  # no budget, no block
    assert printed_problems([stream("τ 5.02 (48 held-out prompts, 64 new tokens, block 16)\n")]) == []
    assert printed_problems([stream("no number here: τ is tokens per step\n")]) == []


def test_a_raw_nan_is_caught_but_not_inside_a_word():
    assert printed_problems([stream("conditional c_i: [0.48, 0.31, nan]\n")])
    assert printed_problems([stream("finance nano\n")]) == []


def test_a_pipe_table_is_caught_when_printed_and_passes_when_rendered():
    table = "| a | b |\n|---|---|\n| 1 | 2 |\n"
    assert printed_problems([stream(table)])
    rendered = [{"output_type": "display_data", "data": {"text/markdown": table, "text/plain": "<Markdown>"}}]
    assert printed_problems([rendered]) == []
    assert printed_problems([stream("x | y\n")]) == []  # a pipe in running text is not a table
