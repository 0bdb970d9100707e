"""The per-batch speculation schedule: vLLM 0.33's rules (pinned against its own functions), the recommender, the CLI.

vLLM's ``validate_and_normalize_dynamic_sd_schedule`` and ``build_dynamic_sd_schedule_lookup`` run next to the
lab's on the same inputs; the recommended schedule goes through vLLM's ``SpeculativeConfig``.
"""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace
from typing import Annotated

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest  # noqa: E402

from dflash_lab.runtime import DEFAULT_DRAFTER, REPO_ROOT  # noqa: E402
from dflash_lab.measure.decoding import BATCHINGS, measurements_from_record, records_of  # noqa: E402
from dflash_lab.spec_decode.schedule import (  # noqa: E402
    Measurement, SpeculationSchedule, recommend_schedule, schedule_lookup, speculative_config_json, validate_schedule,
)
from dflash_lab.tools.recommend_schedule import main  # noqa: E402

RECORD = REPO_ROOT / "benchmarks" / "spec_decode.json"


@pytest.fixture(scope="module")
def vllm_dynamic():
    return pytest.importorskip("vllm.v1.spec_decode.dynamic.utils", reason="vLLM is not importable")


def raised(fn, *args):
    """(exception type, message) that fn(*args) raises, or ("returned", value)."""
    try:
        return "returned", fn(*args)
    except Exception as e:  # noqa: BLE001 - the point is to compare whatever both raise
        return type(e), str(e)


BAD_SCHEDULES = {
    "none": None,
    "not a list": ((1, 4, 3),),
    "a dict": {"1": 3},
    "empty": [],
    "entry of two": [(1, 4)],
    "entry of four": [(1, 4, 3, 0)],
    "entry a string": ["143"],
    "zero start": [(0, 4, 3)],
    "negative end": [(1, -4, 3)],
    "start after end": [(1, 4, 3), (9, 5, 2)],
    "negative K": [(1, 4, -1)],
    "overlapping": [(1, 4, 3), (4, 8, 2)],
    "overlapping once sorted": [(5, 9, 2), (1, 6, 3)],
    "same start twice": [(1, 1, 3), (1, 5, 2)],
    "first range not at 1": [(2, 4, 3)],
    "a word": [("one", 4, 3)],
    "a None item": [(1, None, 3)],
    "a fractional string": [("1.5", 4, 3)],
    "NaN": [(1, float("nan"), 3)],
    "infinity": [(1, float("inf"), 3)],
    "float truncated to zero": [(0.9, 4, 3)],
}

VALID_SCHEDULES = {
    "one range": [(1, 4, 3)],
    "lists as entries": [[1, 4, 3], [5, 8, 0]],
    "unsorted": [(9, 16, 1), (1, 4, 3), (5, 8, 2)],
    "with gaps": [(1, 2, 7), (8, 8, 3), (32, 64, 0)],
    "strings of ints": [("1", "4", "3"), (" 5", "8 ", "2")],
    "floats truncated": [(1.0, 4.9, 3.7), (5, 8.2, 2)],
    "bools as ints": [(True, 4, False)],
    "K above any cap": [(1, 3, 40), (4, 1000, 2)],
}


@pytest.mark.parametrize("name", BAD_SCHEDULES)
def test_bad_schedules_raise_vllms_error_with_vllms_message(vllm_dynamic, name):
    raw = BAD_SCHEDULES[name]
    theirs = raised(vllm_dynamic.validate_and_normalize_dynamic_sd_schedule, raw)
    ours = raised(validate_schedule, raw)
    assert theirs[0] != "returned", f"vLLM accepts {raw!r}: the case belongs in VALID_SCHEDULES"
    assert ours == theirs


@pytest.mark.parametrize("name", VALID_SCHEDULES)
def test_valid_schedules_normalise_as_vllm_does(vllm_dynamic, name):
    raw = VALID_SCHEDULES[name]
    expected = vllm_dynamic.validate_and_normalize_dynamic_sd_schedule(raw)
    assert validate_schedule(raw) == expected
    assert all(type(x) is int for entry in validate_schedule(raw) for x in entry)


@pytest.mark.parametrize("name", list(VALID_SCHEDULES) + ["start after end", "first range not at 1", "none"])
@pytest.mark.parametrize("max_batch", [1, 3, 8, 70])
@pytest.mark.parametrize("cap", [1, 3, 16])
def test_the_lookup_is_vllms_dense_table(vllm_dynamic, name, max_batch, cap):
    raw = VALID_SCHEDULES.get(name, BAD_SCHEDULES.get(name))
    theirs = raised(vllm_dynamic.build_dynamic_sd_schedule_lookup, raw, max_batch, cap)
    assert raised(schedule_lookup, raw, max_batch, cap) == theirs


@pytest.mark.parametrize("max_batch,cap", [(0, 3), (-2, 3), (8, 0), (8, -1)])
def test_the_lookup_refuses_what_vllm_refuses(vllm_dynamic, max_batch, cap):
    with pytest.raises(ValueError):
        vllm_dynamic.build_dynamic_sd_schedule_lookup([(1, 4, 3)], max_batch, cap)
    with pytest.raises(ValueError, match="max_batch|num_speculative_tokens"):
        schedule_lookup([(1, 4, 3)], max_batch, cap)


def test_the_decoder_schedule_reads_the_table_and_refuses_batches_outside_it():
    raw = [(1, 2, 15), (5, 8, 3), (20, 20, 0)]
    sched = SpeculationSchedule.from_config(raw, 24, 7)
    assert [sched.k_for_batch(b) for b in range(1, 25)] == schedule_lookup(raw, 24, 7)[1:]
    assert sched.k_for_batch(1) == 7 and sched.k_for_batch(4) == 7  # capped, and carried over the gap
    assert sched.k_for_batch(19) == 3 and sched.k_for_batch(24) == 0  # carried over the gap and the tail
    assert sched.ks == [0, 3, 7]
    for bad in (0, 25, 2.0, True):
        with pytest.raises(ValueError, match="batch must be an integer in 1..24"):
            sched.k_for_batch(bad)
    with pytest.raises(ValueError, match="must start at 1"):
        SpeculationSchedule.from_config([(2, 4, 3)], 8, 3)


# ---------------------------------------------------------------------------
# The recommender, on tables whose answer follows from the model by hand
# ---------------------------------------------------------------------------

TAU = {0: 1.0, 3: 2.6, 7: 3.4, 15: 3.9}  # mean acceptance length per K (K = 0: target-only)


def step_ms(batch: int, k: int) -> float:
    """A synthetic step: the target's verify cost grows with batch * (K + 1) tokens, the drafter's with K."""
    return 1.0 + 0.004 * batch * (k + 1) + (0.08 * k ** 0.5 if k else 0.0)


def synthetic(batches, *, with_tokens_per_s: bool):
    out = []
    for b in batches:
        for k, tau in TAU.items():
            tps = 1e3 * b * tau / step_ms(b, k) if with_tokens_per_s else None
            out.append(Measurement(b, k, step_ms(b, k), None if k == 0 else tau, tps))
    return out


def best_k_by_hand(b: int) -> int:
    ratio = {k: TAU[k] * step_ms(b, 0) / step_ms(b, k) for k in TAU}  # tau x t_target / t_step
    return max(ratio, key=lambda k: (ratio[k], -k))


def test_the_recommender_picks_the_largest_k_where_it_wins_and_k0_where_drafting_loses():
    batches = [1, 8, 64, 512]
    rec = recommend_schedule(synthetic(batches, with_tokens_per_s=False))
    assert rec.basis == "model"
    by_hand = {b: best_k_by_hand(b) for b in batches}
    assert {c.batch: c.k for c in rec.choices} == by_hand
    # the table is built so both ends happen: the largest K wins at batch 1, nothing beats target-only at 512
    assert by_hand[1] == max(TAU) and by_hand[512] == 0
    assert all(TAU[k] * step_ms(512, 0) / step_ms(512, k) < 1 for k in TAU if k)
    for c in rec.choices:
        assert c.speedup == pytest.approx(TAU[c.k] * step_ms(c.batch, 0) / step_ms(c.batch, c.k))
        assert c.speedup >= 1.0  # never below target-only


@pytest.mark.parametrize("switch", ["log_midpoint", "next_measured"])
def test_the_ranges_switch_between_measured_sizes_as_documented(vllm_dynamic, switch):
    batches, max_batch = [1, 8, 64, 512], 600
    rec = recommend_schedule(synthetic(batches, with_tokens_per_s=True), max_batch=max_batch, switch=switch)
    assert rec.basis == "measured"

    def owner(b):  # the measured size whose K batch b should take, by the rule's definition
        if switch == "next_measured":
            return max([s for s in batches if s <= b])
        return min(batches, key=lambda s: (abs(math.log(b) - math.log(s)), s))  # nearest in log; tie: smaller

    expected = [best_k_by_hand(owner(b)) for b in range(1, max_batch + 1)]
    assert vllm_dynamic.build_dynamic_sd_schedule_lookup(rec.schedule, max_batch, max(TAU))[1:] == expected
    assert rec.schedule[-1][1] == max_batch and all(a[2] != b[2] for a, b in zip(rec.schedule, rec.schedule[1:]))


def test_the_recommender_refuses_tables_it_cannot_rank():
    good = synthetic([1, 8], with_tokens_per_s=False)
    with pytest.raises(ValueError, match="no target-only"):
        recommend_schedule([m for m in good if not (m.batch == 8 and m.k == 0)])
    with pytest.raises(ValueError, match="two measurements of batch 1, K 3"):
        recommend_schedule(good + [Measurement(1, 3, 2.0, 2.0)])
    with pytest.raises(ValueError, match="needs tokens_per_s"):
        recommend_schedule(good, basis="measured")
    with pytest.raises(ValueError, match="switch must be one of"):
        recommend_schedule(good, switch="linear")
    with pytest.raises(ValueError, match=r"tau must be in \[1, K \+ 1\] = \[1, 4\]"):
        Measurement(1, 3, 1.0, 4.5)
    with pytest.raises(ValueError, match="step_ms must be a finite number > 0"):
        Measurement(1, 3, 0.0, 2.0)
    with pytest.raises(ValueError, match="needs step_ms"):
        Measurement(1, 3, None, 2.0).modelled_tokens_per_s()


# ---------------------------------------------------------------------------
# The record shipped in benchmarks/, and what vLLM makes of the JSON
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def record():
    return json.loads(RECORD.read_text())


def test_prompt_lookup_is_never_below_target_only_on_the_record(record):
    rows = measurements_from_record(record, "prompt_lookup")
    rec = recommend_schedule(rows)
    tps = {(m.batch, m.k): m.tokens_per_s for m in rows}
    for c in rec.choices:
        loses = max(v for (b, k), v in tps.items() if b == c.batch) == tps[(c.batch, 0)]
        assert (c.k == 0) == loses, f"batch {c.batch}"
        assert c.speedup >= 1.0
    lookup = schedule_lookup(rec.schedule, rec.choices[-1].batch, rec.num_speculative_tokens)
    assert all(lookup[c.batch] == c.k for c in rec.choices)


def spec_config_module():
    return pytest.importorskip("vllm.config", reason="vLLM is not importable")


def test_the_ngram_json_builds_vllms_speculative_config(vllm_dynamic, record):
    vc = spec_config_module()
    rec = recommend_schedule(measurements_from_record(record, "prompt_lookup"))
    for method in ("ngram_gpu", "ngram"):  # vLLM 0.33 takes both (on a GPU its V2 runner drafts both on the device)
        text = speculative_config_json(method, None, None, rec.schedule, prompt_lookup_min=2, prompt_lookup_max=5)
        sc = vc.SpeculativeConfig(**json.loads(text))  # what `vllm serve --speculative-config` builds (no target)
        assert sc.method == method and sc.num_speculative_tokens == rec.num_speculative_tokens
    assert sc.uses_dynamic_speculative_decoding()
    dense = vllm_dynamic.build_dynamic_sd_schedule_lookup(sc.num_speculative_tokens_per_batch_size, 32,
                                                          sc.num_speculative_tokens)
    assert dense == schedule_lookup(rec.schedule, 32, rec.num_speculative_tokens)
    # Model Runner V1 keeps a schedule for ngram and dflash, and drops it for methods it cannot vary K for
    for method, kept in (("ngram", True), ("dflash", True), ("suffix", False)):
        holder = SimpleNamespace(speculative_config=SimpleNamespace(
            method=method, num_speculative_tokens=15, num_speculative_tokens_per_batch_size=[(1, 2, 15)],
            uses_dynamic_speculative_decoding=lambda: True), use_v2_model_runner=False)
        vc.VllmConfig._maybe_disable_dynamic_sd_for_v1(holder)
        assert (holder.speculative_config.num_speculative_tokens_per_batch_size is not None) is kept, method


def test_the_dflash_json_passes_speculative_config_field_validation(vllm_dynamic, record):
    """Each key is a SpeculativeConfig field and each value passes that field's pydantic type and constraints
    (building the whole config needs the target's ModelConfig: the slow test below)."""
    from pydantic import TypeAdapter

    vc = spec_config_module()
    rec = recommend_schedule(measurements_from_record(record, "dflash"))
    config = json.loads(speculative_config_json("dflash", str(DEFAULT_DRAFTER), None, rec.schedule))
    fields = vc.SpeculativeConfig.__pydantic_fields__
    def adapter(key):
        field = fields[key]
        return TypeAdapter(Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation)

    for key, value in config.items():
        adapter(key).validate_python(value)
    with pytest.raises(ValueError, match="fractional part"):  # the field check is real: pydantic refuses 2.5
        adapter("num_speculative_tokens_per_batch_size").validate_python([(1, 2.5, 3)])
    assert vllm_dynamic.validate_and_normalize_dynamic_sd_schedule(config["num_speculative_tokens_per_batch_size"]) \
        == rec.schedule
    assert config["num_speculative_tokens"] == max(k for _, _, k in rec.schedule)


@pytest.mark.slow
def test_the_dflash_json_builds_vllms_speculative_config_against_the_shipped_target(record):
    vc = spec_config_module()
    from dflash_lab.runtime import DEFAULT_TARGET

    rec = recommend_schedule(measurements_from_record(record, "dflash"))
    text = speculative_config_json("dflash", str(DEFAULT_DRAFTER), None, rec.schedule)
    target = vc.ModelConfig(model=str(DEFAULT_TARGET), tokenizer=str(DEFAULT_TARGET), dtype="float32",
                            max_model_len=512)
    sc = vc.SpeculativeConfig(**json.loads(text), target_model_config=target,
                              target_parallel_config=vc.ParallelConfig())
    assert sc.method == "dflash" and list(sc.num_speculative_tokens_per_batch_size) == rec.schedule


@pytest.mark.parametrize("args,match", [
    (("dflash", "d", 7, [(1, 2, 15), (3, 8, 7)]), "must be the schedule's largest K"),
    (("dflash", "d", None, [(1, 8, 0)]), "never speculate"),
    (("dflash", None, None, [(1, 8, 3)]), "needs model"),
    (("ngram", "d", None, [(1, 8, 3)]), "model must be None"),
    (("eagle", "d", None, [(1, 8, 3)]), "method must be 'dflash', 'ngram' or 'ngram_gpu'"),
    (("dflash", "d", None, [(2, 8, 3)]), "must start at 1"),
])
def test_the_json_writer_refuses_configs_vllm_would_misread(args, match):
    with pytest.raises(ValueError, match=match):
        speculative_config_json(*args)
    with pytest.raises(ValueError, match="prompt_lookup_min=6 must be <= prompt_lookup_max=2"):
        speculative_config_json("ngram", None, None, [(1, 8, 3)], prompt_lookup_min=6, prompt_lookup_max=2)


def test_the_command_prints_the_table_the_json_and_where_the_record_was_measured(record, capsys):
    main(["--record", str(RECORD), "--method", "prompt_lookup"])
    out = capsys.readouterr().out
    text = out.split("--speculative-config '", 1)[1].split("'", 1)[0]
    rec = recommend_schedule(measurements_from_record(record, "prompt_lookup"))
    config = json.loads(text)
    assert config["method"] == "ngram"
    assert [tuple(r) for r in config["num_speculative_tokens_per_batch_size"]] == rec.schedule
    for r in record["records"]:
        assert r["device"] in out and r["measured"] in out  # both runs of the record are named
    for start, end, k in rec.schedule:
        assert any(line.split()[:2] == [f"{start}-{end}", str(k)] for line in out.splitlines())


SERVING_RECORD = REPO_ROOT / "benchmarks" / "spec_decode_serving_continuous.json"


def test_a_record_of_both_batchings_gives_the_continuous_rows_unless_told(capsys):
    """A serving record holds every (batch, K) twice, static and continuous, and rows run under a schedule:
    the schedule is read from the continuous rows by default (as a server batches), the static ones on request,
    never from scheduled rows; the command says which rows it read."""
    record = json.loads(SERVING_RECORD.read_text())
    by = {b: [r for r in record["records"] if r["batching"] == b and r["method"] in ("dflash", "target_only")
              and records_of([r], "heldout")] for b in BATCHINGS}
    assert all(by.values())
    for batching in (None, "continuous", "static"):
        rows = measurements_from_record(record, "dflash", batching=batching)
        want = by[batching or "continuous"]
        assert sorted((m.batch, m.k, m.tokens_per_s) for m in rows) == sorted(
            (r["batch"], r["block_size"] - 1, r["tokens_per_s"]) for r in want)
    scheduled = dict(by["continuous"][-1], schedule=[[1, 64, 3]], tokens_per_s=1e9)
    assert measurements_from_record({"records": [*record["records"], scheduled]}, "dflash") == \
        measurements_from_record(record, "dflash")
    with pytest.raises(ValueError, match="batching must be one of"):
        measurements_from_record(record, "dflash", batching="dynamic")
    with pytest.raises(ValueError, match="no 'static' rows"):
        measurements_from_record({"records": by["continuous"]}, "dflash", batching="static")
    for batching in ("continuous", "static"):
        main(["--record", str(SERVING_RECORD), "--method", "dflash", "--batching", batching])
        out = capsys.readouterr().out
        assert f"{batching} batching" in out.splitlines()[0]
        rec = recommend_schedule(measurements_from_record(record, "dflash", batching=batching))
        text = out.split("--speculative-config '", 1)[1].split("'", 1)[0]
        assert [tuple(r) for r in json.loads(text)["num_speculative_tokens_per_batch_size"]] == rec.schedule


def test_schedules_come_from_the_first_record_that_holds_each_method():
    """``bench serve --schedule-from A B``: a method takes its schedule from the first record holding it (the
    device drafter's from the record that measured it), and none where every record says K = 0 wins."""
    from dflash_lab.tools.bench_serving import schedules_from

    ngram = SERVING_RECORD.with_name("spec_decode_serving_ngram_gpu.json")
    first, second = (json.loads(p.read_text()) for p in (SERVING_RECORD, ngram))
    methods = ["dflash", "prompt_lookup", "prompt_lookup_gpu"]
    got = schedules_from([SERVING_RECORD, ngram], "heldout", methods, 64)
    assert got == schedules_from(str(SERVING_RECORD), "heldout", methods, 64) | \
        schedules_from([ngram], "heldout", ["prompt_lookup_gpu"], 64)
    for method, record in (("dflash", first), ("prompt_lookup_gpu", second)):
        rec = recommend_schedule(measurements_from_record(record, method, prompt_set="heldout"), max_batch=64)
        assert got[method] == SpeculationSchedule.from_config(rec.schedule, 64, rec.num_speculative_tokens)
    assert "prompt_lookup" not in got  # K = 0 at every batch on the H200 record: nothing to serve under it
    assert schedules_from(None, "heldout", methods, 64) is None


def test_scheduled_runs_are_reported_beside_the_unscheduled_ones():
    """A run served under a schedule is its own row in the serving tables ("<method> (scheduled)"), never taken
    as the method's best block, and the tables name each schedule."""
    from dflash_lab.measure.serving import best_blocks
    from dflash_lab.tools.bench_serving import serving_markdown

    record = json.loads(SERVING_RECORD.with_name("spec_decode_serving_schedule.json").read_text())
    best = best_blocks(record["records"])
    schedules = {r["method"]: r["schedule"] for r in record["records"] if r.get("schedule")}
    assert schedules  # the record served some schedules
    for (_, method, _), r in best.items():
        assert bool(r.get("schedule")) == method.endswith(" (scheduled)")
    md = serving_markdown(record)
    for method, schedule in schedules.items():
        assert f"{method} `{json.dumps(schedule)}`" in md
        for c in {r["batch"] for r in record["records"]}:
            row = best["heldout", f"{method} (scheduled)", c]
            assert f"| {c} | continuous | {method} (scheduled) | {row['block_size']} | {row['tokens_per_s']:.0f} |" in md
    from dflash_lab.viz.serving import serving_speedup_figure

    fig = serving_speedup_figure(record["records"])
    base = {r["batch"]: r["tokens_per_s"] for r in record["records"] if r["method"] == "target_only"}
    for method in schedules:
        trace = next(t for t in fig.data if t.name == f"{method}, scheduled")
        assert trace.line.dash == "dashdot"
        assert list(trace.y) == [best["heldout", f"{method} (scheduled)", c]["tokens_per_s"] / base[c]
                                 for c in trace.x]
