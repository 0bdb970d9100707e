"""The speed model (``measure.speed_model``) on the committed records, and its figure.

No expected numbers: the formula's behaviour (monotone in tau and in each time, exact on a
hand-made step), every card row predicted, ratios consistent with their parts.
"""

from __future__ import annotations

import copy
import json

import pytest

from dflash_lab.measure.speed_model import (
    SPEC_DECODE, XS2_STEPS, lab_pair_table, poolside_table, predicted_speedup, step_costs,
)
from dflash_lab.poolside_cards import CARDS


def test_formula_behaves():
    assert predicted_speedup(1.0, 2.0, 2.0, 0.0) == pytest.approx(1.0)  # one token a step at the same cost: no gain
    assert predicted_speedup(4.0, 1.0, 1.0, 0.0) == pytest.approx(4.0)  # free verification: tau
    base = predicted_speedup(3.0, 1.0, 2.0, 0.5)
    assert predicted_speedup(3.5, 1.0, 2.0, 0.5) > base  # more accepted, faster
    assert predicted_speedup(3.0, 1.0, 2.5, 0.5) < base < predicted_speedup(3.0, 1.2, 2.0, 0.5)
    assert predicted_speedup(3.0, 1.0, 2.0, 0.7) < base
    with pytest.raises(ValueError):
        predicted_speedup(3.0, 1.0, 0.0, 0.0)


def test_cards_are_complete():
    for card in CARDS:
        assert card["url"].startswith("https://huggingface.co/poolside/") and card["num_speculative_tokens"] == 15
        assert all(r["tau"] > 1 and r["speedup"] > 0 for r in card["rows"])
    s21 = [c for c in CARDS if c["target_params_b"] > 100]
    assert {c["quantization"] for c in s21} == {"INT4", "FP8", "NVFP4"}
    assert all({r["concurrency"] for r in c["rows"]} == {1, 4, 8, 16} and len(c["rows"]) == 20 for c in s21)


def test_poolside_table_from_the_committed_steps():
    steps = json.loads(XS2_STEPS.read_text())
    rows = poolside_table(steps)
    wanted = sum(1 for c in CARDS for r in c["rows"] if r["concurrency"] in (None, 1, 16))
    assert len(rows) == wanted
    for kind in ("measured", "floor"):
        t1, tb, td = step_costs(steps, 16)[kind]
        for r in rows:
            assert r[f"predicted_{kind}"] == pytest.approx(r["tau"] * t1 / (tb + td), abs=1e-3)
            assert r[f"ratio_{kind}"] == pytest.approx(r[f"predicted_{kind}"] / r["published"], abs=2e-3)
    assert all(("not measured" in r["costs_from"]) == ("Laguna-S-2.1" in r["card"]) for r in rows)
    # a faster target step (the floor) predicts less gain when the block costs grow faster than the token's
    m, f = step_costs(steps, 16)["measured"], step_costs(steps, 16)["floor"]
    assert (f[0] / (f[1] + f[2]) < m[0] / (m[1] + m[2])) == all(r["predicted_floor"] < r["predicted_measured"]
                                                              for r in rows)


def test_lab_pair_table_from_the_committed_records():
    spec = json.loads(SPEC_DECODE.read_text())
    rows = lab_pair_table(spec)
    assert {r["batch"] for r in rows} >= {1, 8, 32}
    for r in rows:
        assert r["predicted"] == pytest.approx(r["tau"] * r["T_target_only_step_ms"] / r["T_dflash_step_ms"], abs=1e-3)
        assert r["ratio"] == pytest.approx(r["predicted"] / r["measured"], abs=2e-3)
    # slower DFlash steps in the record predict less
    slower = copy.deepcopy(spec)
    for rec in slower["records"]:
        if rec["method"] == "dflash":
            rec["ms_per_batch_step"] *= 2
    assert all(a["predicted"] > b["predicted"] for a, b in zip(rows, lab_pair_table(slower)))


def test_figure_has_every_row_and_the_diagonal():
    from dflash_lab.viz.speed_model import predicted_vs_published_figure

    rows, lab = poolside_table(), lab_pair_table()
    fig = predicted_vs_published_figure(rows, lab)
    points = sum(len(t.x) for t in fig.data if t.mode == "markers")
    assert points == len(rows) + len(lab)
    diagonal = [t for t in fig.data if t.mode == "lines"][0]
    assert list(diagonal.x) == list(diagonal.y)
    floor = predicted_vs_published_figure(rows, costs="floor")
    ys = sorted(v for t in floor.data if t.mode == "markers" for v in t.y)
    assert ys == sorted(r["predicted_floor"] for r in rows)
