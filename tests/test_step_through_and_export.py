"""The step-through (chapters 1 and 3), data out (stats to CSV/JSON, figures to files), your own
prompts, chapter 1's config explorer on Poolside's presets, and reports that say what they are."""

from __future__ import annotations

import json
import re

import plotly.graph_objects as go
import pytest
import torch

from dflash_lab import viz
from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.export import export_stats, flatten_stats
from dflash_lab.spec_decode import SpecDecodeStats, speculative_generate
from dflash_lab.target import build_target, tiny_laguna_config
from dflash_lab.user_prompts import PROMPTS_ENV, load_prompt_file, prompts_from_env


@pytest.fixture(scope="module")
def pair():
    target = build_target(tiny_laguna_config(vocab_size=128), seed=0).eval()
    cfg = DFlashDrafterConfig.from_dict({
        "hidden_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "intermediate_size": 256, "layer_types": ["full_attention"], "draft_vocab_size": 128,
        "dflash_config": {"target_layer_ids": [1, 4], "mask_token_id": 3, "block_size": 6}})
    torch.manual_seed(0)
    return target, DFlashLagunaDrafter(cfg).eval()


def decode(ids):
    return f"<{ids[0]}>"


# ---------------------------------------------------------------------------
# What each step records, and the step-through drawn from it
# ---------------------------------------------------------------------------


def test_steps_record_the_block_and_the_targets_choices(pair):
    target, drafter = pair
    r = speculative_generate(target, drafter, list(range(5, 17)), max_new_tokens=20, block_size=6)
    for step in r.steps[1:]:
        t = step.position - 1
        assert step.block_ids == [r.output_ids[0, t].item()] + [3] * len(step.draft_ids)  # [x_t, MASK x K]
        assert len(step.target_argmax) == len(step.draft_ids) + 1
        n = step.num_accepted
        assert step.draft_ids[:n] == step.target_argmax[:n]  # greedy: accepted = agreed with the target
        assert n == len(step.draft_ids) or step.draft_ids[n] != step.target_argmax[n]
        assert step.token_ids[-1] == step.target_argmax[n]  # the correction / bonus is the target's choice
    assert viz.step_verdicts(r.steps[1]).count("rejected") <= 1


def test_step_through_highlights_what_each_step_did(pair):
    target, drafter = pair
    r = speculative_generate(target, drafter, list(range(5, 17)), max_new_tokens=20, block_size=6)
    for i, step in enumerate(r.steps[1:], 1):
        page = viz.step_through_html(r, i, decode)
        kinds = re.findall(r'data-kind="(\w+)"', page)
        n, k = step.num_accepted, len(step.draft_ids)
        # guess row + emitted row + the story line each show the accepted drafts
        assert kinds.count("accepted") == 3 * min(n, len(step.token_ids))
        assert kinds.count("rejected") == (1 if n < k else 0)
        # after a rejection: the discarded guesses (k-n-1); the target's choices read after it are not shown
        assert kinds.count("unchecked") == (k - n - 1 if n < k else 0)
        choices = re.search(r'<th class="row">target\'s choice</th>(.*?)</tr>', page).group(1)
        cells = re.findall(r"<td>(.*?)</td>", choices)[1:]  # j = 1 .. k+1
        assert len(cells) == k + 1 and all(">—</span>" in c for c in cells[n + 1:])  # never checked: no choice shown
        assert all('data-kind="' in c and "—" not in c for c in cells[:n + 1])  # the checked ones, and the correction
        assert f"kept <b>{n}</b>" in page and f'data-step="{i}"' in page
    with pytest.raises(ValueError, match="step_index"):
        viz.step_through_html(r, len(r.steps), decode)


def test_step_through_widget_moves_and_draws_the_drafters_mask(pair):
    from dflash_lab.widgets import step_through

    target, drafter = pair
    r = speculative_generate(target, drafter, list(range(5, 17)), max_new_tokens=12, block_size=6)
    box = step_through(r, decode, drafter=drafter, start=1)
    first = box.view.value
    assert "not causal: every query sees the whole block" in first
    box.step.value = 2
    assert box.view.value != first and 'data-step="2"' in box.view.value
    assert box.play.max == box.step.max == len(r.steps) - 1


# ---------------------------------------------------------------------------
# Data out
# ---------------------------------------------------------------------------


def some_stats(accepted=(0, 2, 1), k=3) -> SpecDecodeStats:
    s = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * k)
    for n in accepted:
        s.observe_draft(k, n)
    return s


def test_stats_round_trip_through_json_and_write_csv(tmp_path):
    s = some_stats()
    again = SpecDecodeStats.from_dict(json.loads(s.to_json(tmp_path / "s.json")))
    assert again == s and json.loads((tmp_path / "s.json").read_text())["mean_acceptance_length"] == 2.0
    header, row = s.to_csv().splitlines()
    values = dict(zip(header.split(","), row.split(",")))
    assert values["num_drafts"] == "3" and values["accepted_through_pos_1"] == "2" and values["rate_pos_3"] == "0.0"


def test_export_stats_writes_nested_dicts_as_rows_or_json(tmp_path):
    nested = {"DFlash": {16: some_stats(), 4: some_stats((1,), 1)}, "prompt lookup": some_stats((0, 0))}
    assert [name for name, _ in flatten_stats(nested)] == ["DFlash / 16", "DFlash / 4", "prompt lookup"]
    lines = export_stats(nested, tmp_path / "all.csv").read_text().splitlines()
    assert len(lines) == 4 and lines[0].startswith("name,num_drafts") and lines[2].startswith("DFlash / 4,1,")
    data = json.loads(export_stats(nested, tmp_path / "all.json").read_text())
    assert data["DFlash"]["16"]["num_accepted_tokens_per_pos"] == [2, 1, 0]
    for bad, match in (("all.txt", r"\.csv or \.json"),):
        with pytest.raises(ValueError, match=match):
            export_stats(nested, tmp_path / bad)
    with pytest.raises(TypeError, match="'x'"):
        export_stats({"x": 3}, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists() and not (tmp_path / "all.txt").exists()  # nothing half-written


def test_save_figure_by_suffix(tmp_path, monkeypatch):
    fig = go.Figure(go.Bar(y=[1, 2]), layout_title_text="saved")
    html_path = viz.save_figure(go.FigureWidget(fig), tmp_path / "f.html")
    page = html_path.read_text()
    assert "saved" in page and not re.search(r"<script[^>]*src=", page)  # plotly.js inlined: opens offline
    assert json.loads(viz.save_figure(fig, tmp_path / "f.json").read_text())["layout"]["title"]["text"] == "saved"
    with pytest.raises(ValueError, match=r"\.html, \.json, \.svg"):
        viz.save_figure(fig, tmp_path / "f.gif")
    import builtins

    real_import = builtins.__import__

    def no_kaleido(name, *args, **kwargs):
        if name == "kaleido":
            raise ImportError("no kaleido")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kaleido)
    with pytest.warns(UserWarning, match=r"SVG is drawn by kaleido, an optional package that is not installed here, "
                                         r"so f\.html was written instead of f\.svg"):
        written = viz.save_figure(fig, tmp_path / "f.svg")
    assert written == tmp_path / "f.html"


# ---------------------------------------------------------------------------
# Your own prompts
# ---------------------------------------------------------------------------


def test_prompt_files_in_both_formats(tmp_path, monkeypatch):
    (tmp_path / "p.txt").write_text("def f():\n\n    pass\n---\nimport os\n---\n\n")
    assert load_prompt_file(tmp_path / "p.txt") == ["def f():\n\n    pass", "import os"]
    (tmp_path / "p.json").write_text(json.dumps(["a = 1", {"text": "b = 2"}]))
    assert load_prompt_file(tmp_path / "p.json") == ["a = 1", "b = 2"]
    monkeypatch.delenv(PROMPTS_ENV, raising=False)
    assert prompts_from_env() is None
    monkeypatch.setenv(PROMPTS_ENV, str(tmp_path / "p.json"))
    assert prompts_from_env() == (str(tmp_path / "p.json"), ["a = 1", "b = 2"])
    for name, text, match in (("e.txt", "\n---\n", "holds no prompt"), ("e.json", "{}", "JSON list"),
                              ("n.json", "[1]", "item 0"), ("x.json", "[", "not valid JSON")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=match):
            load_prompt_file(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_prompt_file(tmp_path / "missing.txt")


# ---------------------------------------------------------------------------
# Chapter 1's explorer on Poolside's configs; the sliding-window mask follows vLLM's rule
# ---------------------------------------------------------------------------


def test_config_explorer_resolves_poolsides_drafter_as_vllm_does():
    from dflash_lab.presets import drafter_preset
    from dflash_lab.widgets import drafter_config_explorer

    d, target = drafter_preset("laguna-xs-2.1-dflash (shape)")
    box = drafter_config_explorer(d, target_config=target)
    box.preset.value = "laguna-s-2.1-dflash"
    assert box.layers.value == 6 and box.causal.value == "true"
    text = re.sub("<[^>]+>", " ", box.details.value)
    assert "model.layers.48.self_attn.attn" in text and "model.layers.53.self_attn.attn" in text
    assert "dflash_config.causal = true" in text and "last 512" in text
    assert "⚠ differs from the file" in box.details.value  # flat rope_theta: sliding layers served theta 10000
    assert "69 tensors, 1,114,977,792 parameters" in box.status.value
    box.causal.value = "absent"  # the layer type decides: sliding -> causal
    assert "layer type sliding_attention: sliding → causal" in box.details.value
    box.causal.value = "false"
    assert "±512 (symmetric)" in box.details.value and "not causal" in box.status.value
    box.layer_types.value = "mixed"
    assert "vLLM refuses it" in box.status.value and "mixed" not in box.details.value


def test_sliding_window_mask_is_causal_as_vllm_makes_sliding_layers():
    from dflash_lab.widgets import sliding_window_explorer

    box = sliding_window_explorer(context_len=6, block_size=4, window=3)
    z = box.figure.data[0].z  # 0 hidden, 1 context key, 2 block key
    assert box.causal.value and [list(row[6:]) for row in z] == [[2, 0, 0, 0], [2, 2, 0, 0], [2, 2, 2, 0], [0, 2, 2, 2]]
    box.sliding.value = False  # full attention: vLLM's default turns causality off too
    assert not box.causal.value and all(list(row[6:]) == [2, 2, 2, 2] for row in box.figure.data[0].z)
    pinned = sliding_window_explorer(context_len=6, block_size=4, window=2, causal=False)
    assert pinned.causal.disabled and list(pinned.figure.data[0].z[0][6:]) == [2, 2, 0, 0]  # symmetric |q-k| < 2


# ---------------------------------------------------------------------------
# Reports: controls say they are pictures; nothing from the network
# ---------------------------------------------------------------------------


def test_report_marks_controls_as_static_snapshots_and_loads_no_mathjax():
    from dflash_lab.tools import report_html

    models = {"box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_s", "IPY_MODEL_h"]}},
              "s": {"model_name": "IntSliderModel", "state": {"value": 3, "description": "step"}},
              "h": {"model_name": "HTMLModel", "state": {"value": "<b>hi</b>"}},
              "bar": {"model_name": "FloatProgressModel", "state": {"value": 1}}}
    assert report_html.has_controls("box", models) and not report_html.has_controls("bar", models)
    assert "{%- block html_head_js_mathjax -%}{%- endblock" in report_html.REPORT_TEMPLATE
    assert "{%- block html_head_js_mermaidjs -%}{%- endblock" in report_html.REPORT_TEMPLATE
