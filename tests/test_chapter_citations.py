"""The vLLM source lines chapters 1, 2, 3, 7 and 9 cite (`file.py:a-b`) exist in the installed vLLM 0.33,
and chapter 2's cite the code its text names there."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "notebooks" / "src"
CHAPTERS = ["01_build_the_drafter.py", "02_context_kv_norms.py", "03_per_position_acceptance.py",
            "07_verification_workbench.py", "09_draft_trees.py"]
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


# Issue 31: the lines chapter 1 and the lab's modules cite for what vLLM reads, and the code there.
# (file in the lab, vLLM file, line ranges as cited, what those lines must hold)
REPO = SRC.parents[1]
CODE_CITATIONS = [
    ("notebooks/src/01_build_the_drafter.py", "laguna.py", "656-658", ["_maybe_add_hidden_state("]),
    ("dflash_lab/config_keys.py", "laguna.py", "656-658", ["_maybe_add_hidden_state("]),
    ("notebooks/src/01_build_the_drafter.py", "transformers_utils/config.py", "675-683",
     ["rotary_pct", "rotary_emb_fraction", "config.partial_rotary_factor = partial_rotary_factor"]),
    ("notebooks/src/01_build_the_drafter.py", "v1/worker/gpu/spec_decode/utils.py", "99-109",
     ["dflash_config", "hf_config.mask_token_id"]),
    ("notebooks/src/01_build_the_drafter.py", "config/speculative.py", "1614-1618",
     ["`num_speculative_tokens` was not provided"]),
    ("dflash_lab/spec_decode/loop.py", "config/speculative.py", "1614-1618",
     ["`num_speculative_tokens` was not provided"]),
    ("dflash_lab/spec_decode/sampling.py", "v1/spec_decode/llm_base_proposer.py", "1842-1851",
     ["logits.div_(temperature", "We only use the temperature"]),
    ("dflash_lab/spec_decode/sampling.py", "v1/worker/gpu/spec_decode/speculator.py", "460-476", ["apply_temperature=True"]),
    ("dflash_lab/spec_decode/sampling.py", "rejection_sampler_utils.py", "168-181, 909-920", ["/ temp"]),
    ("dflash_lab/spec_decode/sampling.py", "v1/spec_decode/llm_base_proposer.py", "257-260",
     ['("standard", "fly")', '"probabilistic"']),
    ("dflash_lab/spec_decode/sampling.py", "fly.py", "82-87", ['float("-inf")']),
    ("dflash_lab/spec_decode/sampling.py", "fly.py", "149-156", ["draft_prob > 0", "target_prob > 0"]),
    ("dflash_lab/spec_decode/sampling.py", "config/speculative.py", "2014-2030", ["fly_window_size"]),
]


@pytest.mark.parametrize("module, path, ranges, needles", CODE_CITATIONS,
                         ids=[f"{m.rsplit('/', 1)[-1]}->{p}:{r}" for m, p, r, _ in CODE_CITATIONS])
def test_issue_31_citations_name_the_code_they_describe(module, path, ranges, needles):
    text = (REPO / module).read_text()
    assert re.search(rf"{re.escape(path)}(``)?:{re.escape(ranges)}", text), f"{module} no longer cites {path}:{ranges}"
    lines = resolve(vllm_root(), path).read_text().splitlines()
    for a, b in spans(ranges):
        block = "\n".join(lines[a - 1:b])
        assert all(n in block for n in needles), f"`{path}:{a}-{b}` does not hold {needles}:\n{block}"
