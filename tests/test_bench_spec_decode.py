"""`bench spec-decode` on two prompt sets: one table and one goal line per set, computed from that set's
records, and records written before ``prompt_set`` existed read as held-out ones. Synthetic records only
(no model is loaded, nothing is timed)."""

from __future__ import annotations

import copy

from dflash_lab.measure.decoding import prompt_set_of, records_of, speedups
from dflash_lab.tools.bench import build_parser
from dflash_lab.tools.bench_spec_decode import gap_lines, goal_check, goals, kept_records, spec_decode_markdown

PAIR = {"target": "abc", "paper": {"weights": "def", "num_hidden_layers": 3}}


def record(prompt_set, method, block, tokens_per_s, tau=None, *, batch=1, graphs=True):
    r = {"method": method, "block_size": block, "batch": batch, "cuda_graphs": graphs, "tokens_per_s": tokens_per_s,
         "mean_acceptance_length": tau, "device": "NVIDIA H200", "dtype": "bfloat16", "moe": "grouped",
         "measured": "2026-12-02 10:00 UTC"}
    if prompt_set is not None:  # None: a record from before the field existed
        r["prompt_set"] = prompt_set
    return r


def set_records(prompt_set, base, dflash16, lookup8, lookup16, tau16):
    """One prompt set at batch 1, graphs on: target-only, DFlash b16, the Poolside drafter b16, prompt lookup b8/b16."""
    return [record(prompt_set, "target_only", 1, base),
            record(prompt_set, "dflash", 16, dflash16, tau16),
            record(prompt_set, "dflash_poolside", 16, dflash16 * 0.9, tau16 - 0.3),
            record(prompt_set, "prompt_lookup", 8, lookup8, 5.0),
            record(prompt_set, "prompt_lookup", 16, lookup16, 7.0)]


PHASES = {"dflash": {"block_size": 16, "steps": 100, "draft_ms_per_step": 0.3, "verify_ms_per_step": 0.8,
                     "append_ms_per_step": 0.03, "accept_ms_per_step": 0.05},
          "target_only": {"block_size": 1, "steps": 400, "draft_ms_per_step": 0.03, "verify_ms_per_step": 0.6,
                          "append_ms_per_step": 0.001, "accept_ms_per_step": 0.04}}


def result_of(records, **extra):
    return {"n_prompts": 32, "max_new_tokens": 96, "records": records, "pair": PAIR, "phases": PHASES,
            "goal": goal_check(records, 16), "command": "python -m dflash_lab.tools.bench spec-decode",
            "prompt_sets": {"heldout": {"n_prompts": 32, "max_new_tokens": 96},
                            "docstring": {"n_prompts": 32, "max_new_tokens": 96}}, **extra}


def both_sets():
    # held-out: DFlash 2000 / 1000 = 2.00x, best lookup 2100 (block 8): lookup ahead
    # docstring: DFlash 2400 / 800 = 3.00x, best lookup 1500 (block 16): DFlash ahead
    return set_records("heldout", 1000.0, 2000.0, 2100.0, 1900.0, 4.0) + \
        set_records("docstring", 800.0, 2400.0, 1200.0, 1500.0, 3.0)


def goal_line(md: str, name: str) -> str:
    return next(line for line in md.splitlines() if line.startswith(f"- {name} prompts: DFlash / target-only"))


def test_markdown_has_one_table_per_prompt_set_held_out_first():
    md = spec_decode_markdown(result_of(both_sets()))
    heads = [i for i, line in enumerate(md.splitlines()) if line.startswith("| method | block | batch 1")]
    assert len(heads) == 2, md
    held, doc = md.index("### Held-out prompts"), md.index("### Docstring-first prompts")
    phases = md.index("### Where a step's time goes (held-out prompts")
    assert held < doc < phases
    held_table, doc_table = md[held:doc], md[doc:phases]
    assert "| target_only | 1 | 1000 |" in held_table and "| target_only | 1 | 800 |" in doc_table
    assert "| dflash | 16 | 2000 (2.00x), tau 4.00 |" in held_table  # x target-only of its own set
    assert "| dflash | 16 | 2400 (3.00x), tau 3.00 |" in doc_table
    assert "32 held-out prompts (`checkpoints/heldout_prompts.json`" in held_table
    assert "32 docstring-first prompts (`checkpoints/docstring_prompts.json`" in doc_table
    assert md.count("### Where a step's time goes") == 1  # the phases: held-out only


def test_goal_line_per_set_is_computed_from_that_sets_records():
    records = both_sets()
    md = spec_decode_markdown(result_of(records))
    assert "**Goal (batch 1, block 16, graphs on), per prompt set:**" in md
    held, doc = goal_line(md, "held-out"), goal_line(md, "docstring-first")
    assert md.index(held) < md.index(doc)
    assert "= 2.00x (goal >= 3x: NOT met)" in held and "(block 8) = 0.95x (prompt lookup ahead)" in held
    assert "= 3.00x (goal >= 3x: met)" in doc and "(block 16) = 1.60x (DFlash ahead)" in doc

    changed = copy.deepcopy(records)  # the docstring set's DFlash b16 slower: only its line moves
    next(r for r in changed if r["prompt_set"] == "docstring" and r["method"] == "dflash")["tokens_per_s"] = 1200.0
    md2 = spec_decode_markdown(result_of(changed))
    assert goal_line(md2, "held-out") == held
    doc2 = goal_line(md2, "docstring-first")
    assert "= 1.50x (goal >= 3x: NOT met)" in doc2 and "(block 16) = 0.80x (prompt lookup ahead)" in doc2
    assert goals(result_of(changed))["docstring"]["dflash_over_target_only"] == 1.5

    changed[0]["tokens_per_s"] = 500.0  # the held-out target-only: only the held-out line moves
    md3 = spec_decode_markdown(result_of(changed))
    assert "= 4.00x (goal >= 3x: met)" in goal_line(md3, "held-out")
    assert goal_line(md3, "docstring-first") == doc2


def test_gap_lines_use_held_out_phases_and_each_sets_own_tau():
    lines = [line for line in gap_lines(result_of(both_sets())) if line]
    assert lines[0].startswith("Why (held-out prompts;") and "tau = 4.00 tokens" in lines[0]
    assert "The measured ratio (2.00x) also counts each generation's prefill" in lines[1]  # ("" lines dropped above)  # no clock split: older run
    step_d, step_t = 0.3 + 0.8 + 0.03 + 0.05, 0.03 + 0.6 + 0.001 + 0.04
    assert lines[2].startswith("On the docstring-first prompts DFlash's tau is 3.00 (4.00 held-out)")
    assert f"= {3.0 * step_t / step_d:.2f}x; measured 3.00x." in lines[2]


def test_the_clock_per_generation_is_split_into_prefill_steps_and_host():
    # 32 generations each: DFlash 32 x 20 ms over 32 x 18 steps; target-only 32 x 60 ms over 32 x 95 steps
    records = both_sets()
    for r in records:
        if r.get("prompt_set") == "heldout" and r["method"] in ("dflash", "target_only"):
            steps = 18 if r["method"] == "dflash" else 95
            r.update(seconds=32 * (0.020 if r["method"] == "dflash" else 0.060), batch_steps=32 * steps)
    phases = copy.deepcopy(PHASES)
    phases["dflash"].update(whole_step_ms=1.0, prefill_ms_per_generation=0.5)
    phases["target_only"].update(whole_step_ms=0.6, prefill_ms_per_generation=0.4)
    line = next(x for x in gap_lines(result_of(records, phases=phases)) if x.startswith("The clock per generation"))
    assert "DFlash 20.00 ms = 18.0 steps x 1.000 ms (one graph each) + prefill 0.50 ms + 1.50 ms on the host" in line
    assert "target-only 60.00 ms = 95.0 steps x 0.600 ms (one graph each) + prefill 0.40 ms + 2.60 ms on the host" in line
    assert f"Whole-step graphs alone give {95 * 0.6 / 18:.2f}x" in line and "measured 2.00x" in line
    phases["dflash"]["whole_step_ms"] = 0.5  # the split follows the phases
    line = next(x for x in gap_lines(result_of(records, phases=phases)) if x.startswith("The clock per generation"))
    assert "+ prefill 0.50 ms + 10.50 ms on the host" in line and f"give {95 * 0.6 / 9:.2f}x" in line
    phases["target_only"]["whole_step_ms"] = 0.61  # 95 x 0.61 + 0.4 = 58.35 ms of 60: host time left, as before
    line = next(x for x in gap_lines(result_of(records, phases=phases)) if x.startswith("The clock per generation"))
    assert "+ prefill 0.40 ms + 1.65 ms on the host" in line and "left over" not in line
    phases["target_only"]["whole_step_ms"] = 0.64  # 95 x 0.64 = 60.8 ms > 60 ms
    line = next(x for x in gap_lines(result_of(records, phases=phases)) if x.startswith("The clock per generation"))
    assert "+ prefill 0.40 ms, and -1.20 ms left over: the loop's steps ran 13 us faster each" in line
    assert "-1.20 ms on the host" not in line
    phases["dflash"]["prefill_ms_per_generation"] = None  # a run that did not time the prefill alone: not split
    line = next(x for x in gap_lines(result_of(records, phases=phases)) if x.startswith("The clock per generation"))
    assert "+ 11.00 ms for the prefill and the host's work between steps" in line


def test_records_without_prompt_set_are_held_out():
    old = set_records(None, 1000.0, 2000.0, 2100.0, 1900.0, 4.0)
    assert all("prompt_set" not in r for r in old)
    assert {prompt_set_of(r) for r in old} == {"heldout"} and records_of(old, "heldout") == old
    assert records_of(old, "docstring") == []
    assert goal_check(old, 16)["dflash_over_target_only"] == 2.0 and goal_check(old, 16, "docstring") is None
    assert {s["prompt_set"] for s in speedups(old)} == {"heldout"}
    result = {k: v for k, v in result_of(old).items() if k != "prompt_sets"}  # an older JSON: no "prompt_sets"
    md = spec_decode_markdown(result)
    assert "### Held-out prompts" in md and "### Docstring-first prompts" not in md
    assert "= 2.00x (goal >= 3x: NOT met)" in goal_line(md, "held-out")
    assert "- docstring-first prompts" not in md
    # old held-out records mixed with new docstring ones: each set against its own target-only
    mixed = old + set_records("docstring", 800.0, 2400.0, 1200.0, 1500.0, 3.0)
    assert {s: g["dflash_over_target_only"] for s, g in goals(result_of(mixed)).items()} == {"heldout": 2.0, "docstring": 3.0}
    assert {(s["prompt_set"], s["speedup"]) for s in speedups(mixed) if s["method"] == "dflash"} == \
        {("heldout", 2.0), ("docstring", 3.0)}


def test_kept_records_of_a_previous_run():
    old = set_records(None, 1000.0, 2000.0, 2100.0, 1900.0, 4.0) + \
        [record(None, "target_only", 1, 90.0, graphs=False)]
    last = {"n_prompts": 32, "max_new_tokens": 96, "records": old, "pair": PAIR}  # written before prompt_set
    # re-measuring only the docstring set keeps every held-out record, tagged, with the last run's settings
    kept, settings = kept_records(last, pair=PAIR, graphs=(True, False), prompt_sets=("docstring",))
    assert len(kept) == len(old) and {r["prompt_set"] for r in kept} == {"heldout"}
    assert settings == {"heldout": {"n_prompts": 32, "max_new_tokens": 96}}
    assert all("prompt_set" not in r for r in old)  # the last run's dicts are not changed
    # re-measuring both sets with graphs on keeps the graphs-off rows only (of the held-out set, as before)
    kept, settings = kept_records(last, pair=PAIR, graphs=(True,), prompt_sets=("heldout", "docstring"))
    assert [(r["prompt_set"], r["cuda_graphs"]) for r in kept] == [("heldout", False)] and settings == {}
    # another pair: nothing kept
    assert kept_records(last, pair={"target": "other"}, graphs=(True,), prompt_sets=("docstring",)) == ([], {})
    # a new-style result keeps its own per-set settings
    new = {"records": both_sets(), "pair": PAIR, "n_prompts": 8, "max_new_tokens": 32,
           "prompt_sets": {"heldout": {"n_prompts": 8, "max_new_tokens": 32}, "docstring": {"n_prompts": 16, "max_new_tokens": 64}}}
    kept, settings = kept_records(new, pair=PAIR, graphs=(True,), prompt_sets=("heldout",))
    assert {r["prompt_set"] for r in kept} == {"docstring"} and settings == {"docstring": {"n_prompts": 16, "max_new_tokens": 64}}


def test_prompt_set_option():
    parser = build_parser()
    assert parser.parse_args(["spec-decode"]).prompt_set == "both"
    assert parser.parse_args(["spec-decode", "--prompt-set", "docstring"]).prompt_set == "docstring"


def test_the_eager_loops_records_get_their_own_table_and_older_rows_read_the_same():
    eager = [dict(record("heldout", "target_only", 1, 30.0), backend="eager", target_forwards_per_token=1.0,
                  outputs_equal_target_only="8/8", target_ms_per_forward=33.0, drafter_ms_per_step=0.05),
             dict(record("heldout", "dflash", 16, 60.0, 5.25), backend="eager", target_forwards_per_token=0.2,
                  outputs_equal_target_only="5/8", target_ms_per_forward=45.0, drafter_ms_per_step=36.0)]
    md = spec_decode_markdown(result_of(both_sets(), eager_records=eager, eager_records_carried_over=True))
    head = "## The eager teaching loop (`speculative_generate`) (carried over from an earlier run)"
    assert md.index("**Goal") < md.index(head) < md.index("Command:")
    assert "| target_only | 1 | 30.0 | 1.000 | - | 8/8 | 33.0 | 0.05 |" in md
    assert "| dflash | 16 | 60.0 | 0.200 | 5.25 | 5/8 | 45.0 | 36.0 |" in md
    static_part = spec_decode_markdown(result_of(both_sets())).split("\nCommand:")[0]
    assert md.startswith(static_part) and head not in static_part  # the static tables as without eager records
    # the same rows in the earlier format (under "shipped_pair", "dflash_b16", target-only without a block)
    older = [dict(r, method="target_only" if r["method"] == "target_only" else "dflash_b16",
                  block_size=None if r["method"] == "target_only" else 16) for r in eager]
    for r in older:
        del r["backend"], r["prompt_set"], r["batch"]
    md_older = spec_decode_markdown(result_of(both_sets(), shipped_pair=older, eager_records_carried_over=True))
    assert md_older == md
