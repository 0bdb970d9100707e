"""Chapter 5 measures on the machine it runs on: the live context-K/V timing, the fused
control where the kernel cannot run, and the figures those numbers are drawn in."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_lab.measure import context_kv as bench_context_kv
from dflash_lab.runtime import REPO_ROOT
from dflash_lab import context_kv_kernel as kernels
from dflash_lab.viz.kernels import context_kv_live_figure
from dflash_lab.viz.speed import METHOD_LABELS, speedup_vs_tau_figure

CPU = torch.device("cpu")


def committed_context_kv():
    return json.loads((REPO_ROOT / "benchmarks" / "context_kv.json").read_text())


@pytest.fixture
def live(make_drafter):
    drafter = make_drafter(layers=2)
    threads = torch.get_num_threads()
    records = bench_context_kv.time_context_kv_live(drafter, contexts=[32, 8], device=CPU, rounds=2, budget_s=0.01)
    assert torch.get_num_threads() == threads, "timing on one thread must give torch its thread count back"
    return drafter, records


def test_live_timing_times_every_path_this_machine_runs(live):
    drafter, records = live
    paths = {r["path"] for r in records}
    assert paths == {"reference", "batched", "folded", "gemm_floor"}  # no fused kernel on a CPU
    assert sorted({r["context"] for r in records}) == [8, 32]
    for r in records:
        assert r["ms"] > 0 and r["agrees"], r
        assert r["layers"] == len(drafter.layers) and r["hidden"] == drafter.config.hidden_size
        assert r["dtype"] == "float32"
        assert r["device"].startswith("CPU") and r["device"].endswith("1 thread)"), r["device"]
    ms = {(r["path"], r["context"]): r["ms"] for r in records}
    ratio = bench_context_kv.speedup(records, "folded", "reference", 32)
    assert ratio == pytest.approx(ms["reference", 32] / ms["folded", 32])
    assert bench_context_kv.speedup(records, "folded_triton", "reference", 32) is None


def test_live_timing_insisting_on_the_fused_kernel_says_why_not_on_a_cpu(make_drafter):
    if kernels.interpreting():
        pytest.skip("Triton's interpreter runs the kernel on CPU tensors")
    with pytest.raises(RuntimeError, match="cannot run"):
        bench_context_kv.time_context_kv_live(make_drafter(layers=1), contexts=[8], device=CPU, fused=True, rounds=1)


def test_live_figure_shows_both_runs_with_their_devices(live):
    _, records = live
    committed = committed_context_kv()
    fig = context_kv_live_figure(records, committed, committed_layers=5)
    title = fig.layout.title.text.replace("<br>", " ")
    assert f"measured now on {records[0]['device']}" in title and committed[0]["device"] in title
    notes = [a.text for a in fig.layout.annotations]
    assert notes[0].startswith(f"measured now · {records[0]['device']}")
    assert notes[1].startswith(f"committed run · {committed[0]['device']}")
    left = {t.name for t in fig.data if t.xaxis == "x"}
    assert {"reference (per-layer loop)", "batched (vLLM's structure, eager)", "folded (torch)"} <= left
    assert fig.layout.yaxis.title.text == fig.layout.yaxis2.title.text == "ms (log scale)"  # one unit
    shown = [t.name for t in fig.data if t.showlegend is not False]
    assert len(shown) == len(set(shown)), "each path once in the legend"
    with pytest.raises(ValueError):
        context_kv_live_figure([], committed)


def test_speedup_figure_one_colour_per_batch_and_one_unit_per_axis():
    speed = json.loads((REPO_ROOT / "benchmarks" / "spec_decode.json").read_text())
    fig = speedup_vs_tau_figure(speed["records"])
    per_batch = [t for t in fig.data if t.name.startswith("speedup, batch")]
    batches = sorted({r["batch"] for r in speed["records"] if r["cuda_graphs"]})
    assert [t.name for t in per_batch] == [f"speedup, batch {b}" for b in batches]
    colours = [t.marker.color for t in per_batch]
    assert all(isinstance(c, str) for c in colours) and len(set(colours)) == len(colours), colours
    assert {t.xaxis for t in per_batch} == {"x2"}
    tau = [t for t in fig.data if t.name.startswith("τ")]
    assert len(tau) == 1 and tau[0].xaxis == "x"
    left, right = fig.layout.yaxis.title.text, fig.layout.yaxis2.title.text
    assert "τ" in left and "greedy" not in left
    assert "plain greedy" in right and "τ" not in right


def test_speedup_figure_draws_one_prompt_set_against_its_own_baseline():
    from dflash_lab.measure.decoding import records_of

    speed = json.loads((REPO_ROOT / "benchmarks" / "spec_decode.json").read_text())
    for prompt_set, words in (("heldout", "held-out"), ("docstring", "docstring-first")):
        rows = [r for r in records_of(speed["records"], prompt_set) if r["cuda_graphs"] and r["batch"] == 1]
        if not rows:
            continue
        fig = speedup_vs_tau_figure(speed["records"], prompt_set=prompt_set)
        assert words in fig.layout.title.text
        base = next(r["tokens_per_s"] for r in rows if r["method"] == "target_only")
        bar = next(t for t in fig.data if t.name == "speedup, batch 1")
        by_tick = dict(zip(bar.x, bar.y))
        for r in rows:
            if r["method"] != "target_only":
                tick = next(x for x in bar.x if x.endswith(f"block {r['block_size']}") and
                            x.startswith(METHOD_LABELS[r["method"]].split(" (")[0]) and
                            (("Poolside" in x) == (r["method"] == "dflash_poolside")))
                assert abs(by_tick[tick] - r["tokens_per_s"] / base) < 1e-9, (prompt_set, r["method"], r["block_size"])
    with pytest.raises(ValueError, match="prompt_set"):
        speedup_vs_tau_figure(speed["records"], prompt_set="other")


def test_fused_control_on_a_cpu_says_it_needs_a_gpu_and_does_not_pretend(make_drafter):
    from dflash_lab.widgets import fused_kernel_explorer
    from dflash_lab.widgets.kernels import FUSED_NEEDS

    drafter = make_drafter(layers=2)
    context = torch.randn(24, drafter.config.hidden_size)
    box = fused_kernel_explorer(drafter, context, torch.arange(24), committed_context_kv())
    assert not box.runnable
    assert box.fused.disabled and box.fused.value is False
    assert "GPU" in FUSED_NEEDS and "Triton" in FUSED_NEEDS
    said = [box.fused.description, box.note.value, box.parity.value]  # what a reader sees: said once, in the note
    assert FUSED_NEEDS in box.note.value and sum(text.count(FUSED_NEEDS) for text in said) == 1
    assert box.fused.layout.margin  # the label does not run into the dtype buttons beside it
    assert list(box.timing) == ["folded in torch"] and box.timing["folded in torch"] > 0
    box.path.value = "reference"  # another path is measured here, the fused control stays off and disabled
    assert list(box.timing) == ["reference"] and box.timing["reference"] > 0
    assert box.fused.disabled and box.fused.value is False
    assert "agree" in box.parity.value
