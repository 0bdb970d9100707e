"""Notebooks are reproducible: fixed seeds, deterministic kernels, and rounded printouts.

nbval compares the text a notebook printed when it was saved with the text it
prints now; a float printed to all its digits differs in the last one from run
to run (thread counts, kernel choice), so stored text outputs may carry at most
``MAX_DECIMALS`` decimals (print through ``dflash_lab.repro.rounded``), and no
object addresses or temporary paths.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_lab.repro import rounded
from dflash_lab.runtime import seed_everything

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted((REPO / "notebooks" / "src").glob("*.py"))
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
MAX_DECIMALS = 4
LONG_FLOAT = re.compile(r"(?<![\w.])-?\d+\.\d{%d,}(?:e[-+]?\d+)?" % (MAX_DECIMALS + 1))
# text that changes from run to run whatever the seed: object addresses and temporary paths
UNSTABLE = re.compile(r"\bat 0x[0-9a-fA-F]{6,}|/tmp/\S+|/var/folders/\S+")
# nbval does not compare these cells' outputs
IGNORED = re.compile(r"#\s*NBVAL_(IGNORE_OUTPUT|SKIP|RAISES_EXCEPTION)")
IGNORED_TAGS = {"nbval-ignore-output", "nbval-skip", "raises-exception"}


def by_name(paths):
    return [pytest.param(p, id=p.name) for p in paths] or [pytest.param(None, marks=pytest.mark.skip(reason="no notebooks yet"))]


@pytest.mark.parametrize("source", by_name(SOURCES))
def test_notebook_source_seeds_and_asks_for_deterministic_kernels(source):
    text = source.read_text()
    assert "seed_everything(" in text or "torch.manual_seed(" in text, f"{source.name} sets no torch seed"
    assert "seed_everything(" in text or "use_deterministic_algorithms(" in text, (
        f"{source.name} does not ask for deterministic algorithms (call dflash_lab.runtime.seed_everything)"
    )


def unstable_text_in_outputs(nb: dict) -> list[str]:
    """'cell N: 0.123456' for every over-precise float, address or temporary path in compared text outputs."""
    found = []
    for i, cell in enumerate(nb.get("cells", [])):
        src = "".join(cell.get("source", ""))
        if cell.get("cell_type") != "code" or IGNORED.search(src) or IGNORED_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            continue
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] if out.get("output_type") == "stream" else [out.get("data", {}).get("text/plain", "")]
            for text in texts:
                text = "".join(text) if isinstance(text, list) else text
                found += [f"cell {i}: {m}" for m in LONG_FLOAT.findall(text) + UNSTABLE.findall(text)]
    return found


@pytest.mark.parametrize("notebook", by_name(NOTEBOOKS))
def test_stored_text_outputs_are_stable(notebook):
    problems = unstable_text_in_outputs(json.loads(notebook.read_text()))
    assert not problems, (f"{notebook.name} stores text that changes between runs (floats with more than "
                          f"{MAX_DECIMALS} decimals, addresses, temporary paths):\n" + "\n".join(problems[:20]))


def test_the_check_catches_long_floats_addresses_and_temporary_paths():
    nb = {"cells": [
        {"cell_type": "code", "source": "print(x)", "metadata": {}, "outputs": [{"output_type": "stream", "text": "rate 0.8125 1.234567 v0.33.0\n"}]},
        {"cell_type": "code", "source": "x", "metadata": {}, "outputs": [{"output_type": "execute_result", "data": {"text/plain": ["3.0000001e-05"]}}]},
        {"cell_type": "code", "source": "# NBVAL_IGNORE_OUTPUT\nt", "metadata": {}, "outputs": [{"output_type": "stream", "text": "0.1234567"}]},
        {"cell_type": "code", "source": "m", "metadata": {}, "outputs": [{"output_type": "stream", "text": "<M object at 0x7f3a2b1c> /tmp/tmpab12/x"}]},
    ]}
    assert unstable_text_in_outputs(nb) == [
        "cell 0: 1.234567", "cell 1: 3.0000001e-05", "cell 3: at 0x7f3a2b1c", "cell 3: /tmp/tmpab12/x"]


@pytest.fixture
def restore_determinism():
    state = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(state[0], warn_only=state[1])


def test_seed_everything_repeats_every_generator(restore_determinism):
    draws = []
    for _ in range(2):
        seed_everything(7)
        draws.append((random.random(), float(np.random.rand()), torch.rand(3).tolist()))
    assert draws[0] == draws[1]
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    with pytest.raises(ValueError, match="seed must be a non-negative integer"):
        seed_everything(-1)


def test_rounded_rounds_floats_in_nested_data_and_tensors():
    data = {"rate": [0.123456, 1 / 3], "n": 3, "t": torch.tensor([0.5, 2 / 3]), "neg": -0.00001, "name": "x"}
    assert rounded(data) == {"rate": [0.1235, 0.3333], "n": 3, "t": [0.5, 0.6667], "neg": 0.0, "name": "x"}
    assert rounded((1.23456, True), 2) == (1.23, True)
    assert repr(rounded([np.float64(0.123456)])) == "[0.1235]"
