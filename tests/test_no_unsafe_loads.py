"""Loading never unpickles: scan the package (and the notebook sources) for unsafe loads.

Pickles can run arbitrary code, so weights load from safetensors only. The scan
reads every module's AST and reports, as ``file:line``, any

* ``torch.load`` without ``weights_only=True``,
* ``pickle``/``dill``/``joblib`` loads and ``pandas.read_pickle``,
* ``numpy.load`` with ``allow_pickle=True``,
* ``torch.hub.load`` and ``torch.jit.load`` (code from a file or the network),
* a model's ``from_pretrained`` (``AutoModel*``, ``*For*``, ``*Model``) without
  ``use_safetensors=True``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCANNED = sorted((REPO / "dflash_lab").rglob("*.py")) + sorted((REPO / "notebooks").rglob("*.py"))

ALWAYS_UNSAFE = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads", "cPickle.load",
    "dill.load", "dill.loads", "joblib.load", "pandas.read_pickle", "torch.hub.load", "torch.jit.load",
    "numpy.lib.format.read_array",
}


def dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def keyword_is_true(call: ast.Call, name: str) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords)


def is_model_class(name: str) -> bool:
    last = name.split(".")[-1]
    return last.startswith("AutoModel") or "For" in last or last.endswith("Model")


def unsafe_loads(source: str, filename: str = "<string>") -> list[str]:
    """``file:line: what`` for every unsafe load in ``source``."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> module path ("np" -> "numpy", "load" -> "torch.load")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    aliases.update({"np": aliases.get("np", "numpy"), "pd": aliases.get("pd", "pandas")})

    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (name := dotted(node.func)) is None:
            continue
        head, _, rest = name.partition(".")
        full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        where = f"{filename}:{node.lineno}"
        if full in ALWAYS_UNSAFE:
            found.append(f"{where}: {full} can unpickle (run code); load safetensors instead")
        elif full in ("torch.load", "torch.serialization.load") and not keyword_is_true(node, "weights_only"):
            found.append(f"{where}: {full} without weights_only=True")
        elif full == "numpy.load" and any(k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                                          for k in node.keywords):
            found.append(f"{where}: numpy.load with allow_pickle")
        elif full.endswith(".from_pretrained") and is_model_class(full.rsplit(".", 1)[0]) and not keyword_is_true(node, "use_safetensors"):
            found.append(f"{where}: {full} without use_safetensors=True")
    return found


def test_the_package_never_unpickles():
    assert SCANNED, "nothing to scan"
    problems = [p for f in SCANNED for p in unsafe_loads(f.read_text(), str(f.relative_to(REPO)))]
    assert not problems, "unsafe loads:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import torch\ntorch.load('w.pt')", "x.py:2: torch.load without weights_only=True"),
        ("import torch\ntorch.load('w.pt', weights_only=False)", "x.py:2: torch.load without weights_only=True"),
        ("from torch import load as L\nL('w.pt')", "x.py:2: torch.load without weights_only=True"),
        ("import pickle\npickle.loads(b'')", "x.py:2: pickle.loads can unpickle"),
        ("from pickle import load\nload(open('f', 'rb'))", "x.py:2: pickle.load can unpickle"),
        ("import numpy as np\nnp.load('a.npy', allow_pickle=True)", "x.py:2: numpy.load with allow_pickle"),
        ("import pandas as pd\npd.read_pickle('f')", "x.py:2: pandas.read_pickle can unpickle"),
        ("from transformers import LagunaForCausalLM\nLagunaForCausalLM.from_pretrained(p)",
         "x.py:2: transformers.LagunaForCausalLM.from_pretrained without use_safetensors=True"),
        ("import transformers\ntransformers.AutoModelForCausalLM.from_pretrained(p, use_safetensors=False)",
         "x.py:2: transformers.AutoModelForCausalLM.from_pretrained without use_safetensors=True"),
    ],
)
def test_the_scan_catches_unsafe_loads(source, expected):
    assert unsafe_loads(source, "x.py")[0].startswith(expected)


def test_the_scan_passes_safe_loads():
    safe = """
import torch, numpy as np
from transformers import AutoTokenizer, LagunaConfig, LagunaForCausalLM
from dflash_lab.config import DFlashDrafterConfig
torch.load("w.pt", weights_only=True, map_location="cpu")
np.load("a.npy")
np.load("a.npy", allow_pickle=False)
LagunaForCausalLM.from_pretrained(p, use_safetensors=True)
AutoTokenizer.from_pretrained(p)
LagunaConfig.from_pretrained(p)
DFlashDrafterConfig.from_pretrained(p)
"""
    assert unsafe_loads(safe) == []
