"""The drafter comparison's statistics and its second prompt set (docstring-first prompts)."""

from __future__ import annotations

import ast
import sys
import textwrap

import numpy as np
import pytest

from dflash_lab import corpus
from dflash_lab.assets import heldout_prompts
from dflash_lab.measure.drafters import bootstrap_index, bootstrap_tau, paired_difference, tau_of
from dflash_lab.runtime import DOCSTRING_PROMPTS


def test_tau_pools_counts_over_prompts_as_vllms_counters_do():
    counts = [[10, 30], [2, 0], [4, 4]]  # drafts, accepted tokens per prompt
    assert tau_of(np.array(counts)) == pytest.approx(1 + 34 / 16)  # not the mean of per-prompt taus
    assert np.isnan(tau_of(np.zeros((3, 2))))


def test_bootstrap_interval_brackets_tau_and_narrows_with_more_prompts():
    rng = np.random.default_rng(1)
    few = np.column_stack([np.full(8, 20), rng.integers(20, 80, 8)])
    many = np.tile(few, (16, 1))
    a, b = bootstrap_tau(few), bootstrap_tau(many)
    assert a["low"] < a["tau"] < a["high"] and b["low"] < b["tau"] < b["high"]
    assert a["tau"] == pytest.approx(b["tau"])
    assert (b["high"] - b["low"]) < 0.5 * (a["high"] - a["low"])  # 16x the prompts: about a quarter as wide


def test_a_paired_difference_cancels_what_the_prompts_share():
    rng = np.random.default_rng(2)
    base = np.column_stack([np.full(24, 20), rng.integers(0, 200, 24)])  # prompts differ a lot
    better = base + np.array([0, 4])  # the same prompts, 4 more accepted tokens on each
    index = bootstrap_index(24)
    d = paired_difference(better, base, index=index)
    assert d["difference"] == pytest.approx(4 * 24 / (20 * 24))
    assert d["low"] > 0 and d["share_a_ahead"] == 1.0  # always ahead on the same prompts...
    unpaired = bootstrap_tau(better, index=index)["low"] - bootstrap_tau(base, index=bootstrap_index(24, seed=9))["high"]
    assert unpaired < 0  # ...which two separate intervals cannot show: they overlap
    same = paired_difference(base, base, index=index)
    assert same["difference"] == same["low"] == same["high"] == 0.0
    swapped = paired_difference(base, better, index=index)
    assert swapped["low"] == pytest.approx(-d["high"]) and swapped["high"] == pytest.approx(-d["low"])


@pytest.mark.parametrize("a, b, error", [([[1, 2, 3]], [[1, 2, 3]], "drafts, accepted"), ([], [], "non-empty"),
                                         ([[1, 1]], [[1, 1], [2, 2]], "same prompts")])
def test_bad_counts_are_refused_by_name(a, b, error):
    with pytest.raises(ValueError, match=error):
        paired_difference(a, b)


def _function_body_is_the_docstring(text: str) -> bool:
    tree = ast.parse(textwrap.dedent(text))
    node = tree.body[-1]
    while isinstance(node, ast.ClassDef):  # a method's prompt may carry its class line
        node = node.body[-1]
    return (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and len(node.body) == 1
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str))


def test_the_docstring_prompts_stop_after_a_docstring_and_never_overlap_the_heldout_set():
    prompts, heldout = heldout_prompts(DOCSTRING_PROMPTS), heldout_prompts()
    assert len(prompts) == 48
    assert all(corpus.split_of(p["source"]) == "heldout" for p in prompts)
    assert all(_function_body_is_the_docstring(p["text"]) for p in prompts)
    lines = {(q["source"], q["first_line"] + i) for q in heldout for i in range(q["text"].count("\n") + 1)}
    for p in prompts:
        assert not any((p["source"], p["first_line"] + i) in lines for i in range(p["text"].count("\n") + 1)), p["id"]


def test_the_docstring_prompts_are_recut_exactly_from_this_interpreters_stdlib():
    doc_python = __import__("json").loads(DOCSTRING_PROMPTS.read_text())["python"]
    if doc_python != ".".join(map(str, sys.version_info[:3])):  # patch releases edit stdlib files too
        pytest.skip(f"the set was cut from Python {doc_python}'s standard library")
    recut = corpus.cut_docstring_prompts(corpus.gather(), avoid=heldout_prompts())
    assert [p["text"] for p in recut] == [p["text"] for p in heldout_prompts(DOCSTRING_PROMPTS)]


def test_the_window_study_pairs_each_drafters_drop_and_their_difference():
    from dflash_lab.measure.drafters import window_drops

    rng = np.random.default_rng(3)
    def counts(extra):
        return np.column_stack([np.full(30, 20), rng.integers(40, 60, 30) + extra]).tolist()
    runs = {"a: full prompts": counts(0), "a: last 64 tokens": counts(0), "b: full prompts": counts(0),
            "b: last 64 tokens": counts(10)}  # b accepts 10 more tokens per prompt on the cut prompts
    study = {"cut_tokens": 64, "num_prompts": 30,
             "runs": {k: {"per_prompt_drafts_accepted": v} for k, v in runs.items()}}
    d = window_drops(study)
    a, b = (tau_of(np.array(runs[f"{x}: full prompts"])) - tau_of(np.array(runs[f"{x}: last 64 tokens"])) for x in "ab")
    assert d["a: full - last 64 tokens"]["difference"] == pytest.approx(a)
    assert d["b's drop - a's drop"]["difference"] == pytest.approx(b - a)
    assert d["b's drop - a's drop"]["high"] < 0  # b drops by ~0.5 more: resolved
