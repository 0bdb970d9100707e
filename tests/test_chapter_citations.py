"""The vLLM source lines chapters 1, 2, 3 and 7 cite (`file.py:a-b`) exist in the installed vLLM 0.33,
and chapter 2's cite the code its text names there."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "notebooks" / "src"
CHAPTERS = ["01_build_the_drafter.py", "02_context_kv_norms.py", "03_per_position_acceptance.py",
            "07_verification_workbench.py"]
CITATION = re.compile(r"`([A-Za-z0-9_/]+\.py):(\d+(?:-\d+)?(?:, \d+(?:-\d+)?)*)`")


def vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def resolve(root: Path, cited: str) -> Path:
    """The one file of vLLM a citation names: by its path, else by its unique name."""
    path = cited.removeprefix("vllm/")
    if (root / path).is_file():
        return root / path
    found = [p for p in root.rglob(Path(path).name) if p.as_posix().endswith(path)]
    assert len(found) == 1, f"`{cited}` names {len(found)} files in vLLM: {found}"
    return found[0]


def spans(ranges: str) -> list[tuple[int, int]]:
    out = []
    for part in ranges.split(", "):
        a, _, b = part.partition("-")
        out.append((int(a), int(b or a)))
    return out


def test_every_cited_vllm_line_exists():
    root = vllm_root()
    cited = [(name, m.group(1), m.group(2)) for name in CHAPTERS
             for m in CITATION.finditer((SRC / name).read_text())]
    assert cited, "no citation found: has the pattern changed?"
    for chapter, path, ranges in cited:
        lines = resolve(root, path).read_text().splitlines()
        for a, b in spans(ranges):
            assert 1 <= a <= b <= len(lines), f"{chapter}: `{path}:{ranges}` is past the end ({len(lines)} lines)"
            assert any(line.strip() for line in lines[a - 1:b]), f"{chapter}: `{path}:{a}-{b}` holds only blank lines"


# Chapter 2's citations and the code vLLM 0.33 has there: the rejected positions' rows hidden by
# seq_lens, the grouped rms_norm of the context, and the in-place RoPE over every layer's K.
CHAPTER_2 = {
    "v1/spec_decode/dflash.py:182-187": ["seq_lens", "num_rejected_tokens"],
    "laguna_dflash.py:189-194, 212-217": ["ops.rms_norm("],
    "qwen3_dflash.py:675-682": ["ops.rotary_embedding("],
}


def test_chapter_2_cites_the_code_it_names():
    root = vllm_root()
    text = (SRC / "02_context_kv_norms.py").read_text()
    for citation, needles in CHAPTER_2.items():
        assert f"`{citation}`" in text, f"chapter 2 no longer cites `{citation}`"
        path, _, ranges = citation.partition(":")
        lines = resolve(root, path).read_text().splitlines()
        for a, b in spans(ranges):
            block = "\n".join(lines[a - 1:b])
            assert all(n in block for n in needles), f"`{path}:{a}-{b}` does not hold {needles}:\n{block}"
        if "rotary_embedding" in needles[0]:  # in place: the keys go in as the "query", key=None
            assert "None," in "\n".join(lines[spans(ranges)[0][0] - 1:spans(ranges)[0][1]])
