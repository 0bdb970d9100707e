"""Issue 34: τ beside how much of it is the target repeating itself; figures and exits that say what happened."""

from __future__ import annotations

import json

import pytest

from dflash_lab.assets import docstring_prompts, heldout_prompts, nonrepetitive_prompts, pair_fingerprint
from dflash_lab.measure.repetition import (
    REPETITIVE_AT, describe, repeated_ngram_share, select_non_repetitive, setting_line, tau_by_repetition,
)
from dflash_lab.runtime import BENCHMARKS_DIR
from dflash_lab.vllm_engine.process import is_exit_noise
from dflash_lab.viz import step_time_figure


def test_a_looping_continuation_scores_high_and_fresh_text_zero():
    assert repeated_ngram_share([7, 8, 9] * 10) > 0.85  # "_bg_bg_bg": every 4-gram after the first three repeats
    assert repeated_ngram_share(list(range(64))) == 0.0
    assert repeated_ngram_share([1, 2, 3]) == 0.0  # no 4-gram at all
    # 1 2 3 4 | 1 2 3 4 5: of its six 4-grams, one (1 2 3 4) is seen before
    assert repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4, 5]) == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match="`n`"):
        repeated_ngram_share([1, 2], n=0)


def test_tau_is_pooled_as_vllm_pools_it_on_each_side_of_the_threshold():
    counts = [[10, 50], [10, 10], [5, 5]]  # drafts, accepted tokens
    split = tau_by_repetition(counts, [0.9, 0.0, 0.1])
    assert split["num_repetitive"] == 1 and split["share_repetitive"] == pytest.approx(1 / 3)
    assert split["tau_repetitive"] == pytest.approx(1 + 50 / 10)
    assert split["tau_non_repetitive"] == pytest.approx(1 + 15 / 15)
    assert split["tau"] == pytest.approx(1 + 65 / 25)
    assert tau_by_repetition(counts, [0.0] * 3)["tau_repetitive"] is None  # no repetitive prompt: no τ, not 1.0
    assert "1 of 3 continuations repetitive" in describe(split)
    with pytest.raises(ValueError, match="same prompts"):
        tau_by_repetition(counts, [0.1, 0.2])


def test_the_non_repetitive_selection_keeps_only_prompts_under_the_threshold_and_renumbers():
    prompts = [{"id": i, "text": f"p{i}"} for i in range(5)]
    kept = select_non_repetitive(prompts, [0.5, 0.1, REPETITIVE_AT, 0.0, 0.2], n=2)
    assert [p["text"] for p in kept] == ["p1", "p3"] and [p["id"] for p in kept] == [0, 1]
    assert all(p["repeated_4gram_share"] < REPETITIVE_AT for p in kept)


def test_the_committed_non_repetitive_set_is_held_out_and_under_the_threshold():
    chosen = nonrepetitive_prompts()
    assert len(chosen) >= 16
    assert all(p["repeated_4gram_share"] < REPETITIVE_AT for p in chosen)
    others = [p["text"] for p in heldout_prompts() + docstring_prompts()]
    assert not any(p["text"][:120] in o or o[:120] in p["text"] for p in chosen for o in others)


def test_the_repetition_record_is_this_pairs_and_agrees_with_its_own_counts():
    record = json.loads((BENCHMARKS_DIR / "repetition.json").read_text())
    assert record["pair"] == pair_fingerprint()
    chosen = record["sets"]["non-repetitive"]
    assert chosen["num_prompts"] == len(nonrepetitive_prompts())
    for entry in record["sets"].values():
        for by_block in list(entry["drafters"].values()) + [entry["prompt_lookup"]]:
            for split in by_block.values():
                again = tau_by_repetition(split["per_prompt_drafts_accepted"], entry["shares"], record["threshold"])
                assert again["tau_non_repetitive"] == pytest.approx(split["tau_non_repetitive"])
                assert again["num_repetitive"] == sum(s >= record["threshold"] for s in entry["shares"])


def test_every_drafter_s_draft_phase_is_drawn_as_drafting_and_prompt_lookup_s_is_not():
    phase = {"block_size": 16, "draft_ms_per_step": 0.25, "verify_ms_per_step": 0.75, "append_ms_per_step": 0.03,
             "accept_ms_per_step": 0.05}
    fig = step_time_figure({m: dict(phase) for m in ("dflash", "dflash_poolside", "prompt_lookup", "target_only")})
    drafter_bar = next(t for t in fig.data if t.name.startswith("drafter"))
    accept_bar = next(t for t in fig.data if t.name.startswith("sampling"))
    assert list(drafter_bar.x) == [0.25, 0.25, 0.0, 0.0]
    assert list(accept_bar.x) == pytest.approx([0.05, 0.05, 0.30, 0.30])


def test_a_tau_setting_line_names_prompts_budget_block_and_the_headline():
    line = setting_line("8 held-out prompts", 32, 16, "fewer prompts")
    assert all(w in line for w in ("8 held-out prompts", "32 new tokens", "block 16", "fewer prompts", "headline"))


def test_nanobinds_exit_report_is_noise_and_vllms_log_is_not():
    assert is_exit_noise("nanobind: leaked 27 instances!")
    assert is_exit_noise(" - leaked instance 0x7f00 of type \"xgrammar.GrammarMatcher\"")
    assert not is_exit_noise("INFO 12-04 api_server.py: Shutting down")


def test_the_readme_counts_the_shims_fixes():
    import ast
    import re

    from dflash_lab.runtime import REPO_ROOT

    tree = ast.parse((REPO_ROOT / "vllm_cpu_shim" / "src" / "vllm_cpu_shim" / "fixes.py").read_text())
    (fixes,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "FIXES" for t in node.targets)]
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}
    said = re.findall(r"(\w+) vLLM CPU defects", (REPO_ROOT / "README.md").read_text())
    assert said and all(w.lower() == words[len(fixes.elts)] for w in said), said


def test_the_readme_tau_table_carries_the_repetition_split_of_the_committed_record():
    from dflash_lab.runtime import REPO_ROOT

    record = json.loads((BENCHMARKS_DIR / "repetition.json").read_text())
    readme = (REPO_ROOT / "README.md").read_text()
    header = next(line for line in readme.splitlines() if line.startswith("| drafter | attention in the block"))
    assert "repetitive" in header and "non-repetitive set" in header
    for name, module in (("paper", "`laguna-tiny-code-dflash`"), ("poolside", "`laguna-tiny-code-dflash-poolside`")):
        row = next(line for line in readme.splitlines() if line.startswith(f"| {module} "))
        held = record["sets"]["held-out"]["drafters"][name]["16"]
        fresh = record["sets"]["non-repetitive"]["drafters"][name]["16"]
        assert f"{held['tau_repetitive']:.2f} / {held['tau_non_repetitive']:.2f}" in row, row
        assert f"**{fresh['tau']:.2f}**" in row, row
    held = record["sets"]["held-out"]["drafters"]["paper"]["16"]
    assert f"{held['num_repetitive']} repetitive / {held['num_prompts'] - held['num_repetitive']} other" in header


def test_the_explorer_says_when_a_continuation_is_the_target_looping():
    from types import SimpleNamespace

    import torch

    from dflash_lab.widgets.acceptance import repetition_note

    def run(continuation):
        return SimpleNamespace(output_ids=torch.tensor([[1, 2, 3] + continuation]), prompt_length=3)

    looping, fresh = run([5, 6, 7] * 8), run(list(range(10, 34)))
    assert "repetitive" in repetition_note([looping]) and "repetitive" not in repetition_note([fresh])
    assert "1 of 2 continuations repetitive" in repetition_note([looping, fresh])
    assert repetition_note([]) == ""


def test_the_drafter_comparison_carries_the_repetition_split_when_the_pairs_match():
    from dflash_lab.tools.bench_drafters import drafters_markdown

    result = json.loads((BENCHMARKS_DIR / "drafters.json").read_text())
    record = json.loads((BENCHMARKS_DIR / "repetition.json").read_text())
    held = record["sets"]["held-out"]["drafters"]["paper"]["16"]
    line = (f"{held['num_repetitive']} of {held['num_prompts']} continuations repetitive; τ at block 16 on those / on "
            f"the others: paper {held['tau_repetitive']:.2f} / {held['tau_non_repetitive']:.2f}")
    assert line in drafters_markdown(result, BENCHMARKS_DIR) and line in (BENCHMARKS_DIR / "drafters.md").read_text()
    other = dict(result, pair={"target": "another pair"})
    assert "Repetition" not in drafters_markdown(other, BENCHMARKS_DIR)  # never another pair's split


def test_the_conversion_table_keeps_a_conditional_bar_inside_its_cell():
    from dflash_lab.spec_decode.acceptance import CONVERSIONS, conversion_table_markdown

    rows = conversion_table_markdown().splitlines()
    # every row splits into as many cells as the header once escaped bars are left alone
    cells = [len([c for c in row.replace("\\|", "¦").split("|")[1:-1]]) for row in rows]
    assert set(cells) == {len(CONVERSIONS[0])}
    assert any("P(i kept \\| 0..i-1 kept)" in row for row in rows)
