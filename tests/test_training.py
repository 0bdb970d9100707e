"""The training recipe: corpus split, tokenizer, DFlash block/label construction, a few steps that learn."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from dflash_lab import corpus, train
from dflash_lab.assets import HELDOUT_PROMPTS, DEFAULT_TARGET, heldout_prompts
from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.runtime import load_tokenizer
from dflash_lab.spec_decode import SpecDecodeStats
from dflash_lab.target import build_target, target_forward, tiny_laguna_config

VOCAB = 256


@pytest.fixture(autouse=True)
def _one_thread():
    """Micro models run fastest single-threaded (and do not fight a busy CI box for cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def micro_target(seed: int = 0):
    """A 2-layer Laguna (sliding + full, dense then MoE) small enough for CPU unit tests."""
    cfg = tiny_laguna_config(
        VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
        mlp_layer_types=["dense", "sparse"], num_experts=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    )
    return train.freeze(build_target(cfg, seed=seed))


def micro_drafter_config(target, **kw):
    cfg = train.DrafterTrainConfig(num_layers=1, intermediate_size=128, num_aux_layers=2, block_size=4,
                                   anchors_per_seq=4, batch_size=4, **kw)
    return cfg, train.make_drafter_config(target.config, cfg)


# --- corpus ------------------------------------------------------------------------


def test_split_depends_only_on_the_relative_path():
    paths = [f"pkg{i}/mod{j}.py" for i in range(20) for j in range(50)]
    first = [corpus.split_of(p) for p in paths]
    assert first == [corpus.split_of(p) for p in paths]
    share = {name: first.count(name) / len(first) for name in corpus.SPLITS}
    assert 0.07 < share["heldout"] < 0.13 and 0.07 < share["distill"] < 0.13 and 0.74 < share["train"] < 0.86
    # The same relative path lands in the same split wherever the stdlib lives.
    assert corpus.SourceFile("json/decoder.py", "x").split == corpus.split_of("json/decoder.py")


def test_gather_skips_site_packages_and_bad_utf8_and_split_is_a_partition(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "site-packages").mkdir()
    for i in range(30):
        (tmp_path / "pkg" / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "site-packages" / "third.py").write_text("y = 1\n")
    (tmp_path / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    files = corpus.gather(tmp_path)
    names = [f.relpath for f in files]
    assert names == sorted(names) and "site-packages/third.py" not in names and "bad.py" not in names
    parts = corpus.by_split(files)
    assert sorted(f.relpath for part in parts.values() for f in part) == names
    assert all(f.split == name for name, part in parts.items() for f in part)


def test_shipped_heldout_prompts_come_from_heldout_files_only():
    prompts = heldout_prompts()
    assert len(prompts) >= 40
    assert {corpus.split_of(p["source"]) for p in prompts} == {"heldout"}
    assert all(len(p["text"]) >= 200 and not p["text"].endswith("\n") for p in prompts)
    assert json.loads(HELDOUT_PROMPTS.read_text())["prompts"] == prompts


def test_files_containing_a_heldout_prompt_are_dropped():
    prompts = [{"text": "def held_out_function(a, b):\n    return a + b"}]
    files = [corpus.SourceFile("a.py", "import os\n" + prompts[0]["text"] + "\n"), corpus.SourceFile("b.py", "x = 1\n")]
    assert [f.relpath for f in corpus.drop_files_containing(files, prompts)] == ["b.py"]


# --- tokenizer ------------------------------------------------------------------


def test_shipped_tokenizer_has_the_specials_and_round_trips_code():
    tok = load_tokenizer(DEFAULT_TARGET)
    assert len(tok) == 4096
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.mask_token_id) == (0, 1, 2, 3)
    code = 'class Café:\n\tdef f(self, x=1_000):\n        return f"{x!r}"  # ünïcode ✓\n\n'
    ids = tok.encode(code, add_special_tokens=False)
    assert tok.decode(ids) == code
    assert train.MASK_ID not in ids and train.EOS_ID not in ids


def test_a_trained_tokenizer_puts_the_specials_first():
    tok = train.train_tokenizer(["def f(x):\n    return x\n" * 50, "import os\nprint(os.sep)\n" * 50], vocab_size=300)
    assert [tok.token_to_id(t) for t in train.SPECIAL_TOKENS] == [0, 1, 2, 3]
    text = "def g(y):\n    return os.sep\n"
    assert tok.decode(tok.encode(text).ids) == text


# --- DFlash blocks and labels ----------------------------------------------------------


def test_block_is_the_anchor_token_then_masks_at_consecutive_positions():
    ids = torch.arange(100, 140).view(2, 20)
    anchors = torch.tensor([[3, 10], [0, 15]])
    block, pos = train.block_inputs(ids, anchors, block_size=4, mask_token_id=3)
    assert block.tolist() == [[103, 3, 3, 3, 110, 3, 3, 3], [120, 3, 3, 3, 135, 3, 3, 3]]
    assert pos.tolist() == [[3, 4, 5, 6, 10, 11, 12, 13], [0, 1, 2, 3, 15, 16, 17, 18]]


def test_block_position_j_learns_the_target_prediction_made_at_anchor_plus_j_minus_1():
    target = micro_target()
    ids = torch.randint(4, VOCAB, (2, 24))
    anchors = torch.tensor([[2, 9], [5, 20]])
    bs = 4
    _, labels = train.target_soft_labels(target, ids, anchors, [0, 1], bs)
    labels = labels.argmax(-1)  # (B, A, bs-1)
    full = target(input_ids=ids).logits.argmax(-1)  # prediction made at each position
    for b in range(2):
        for a in range(2):
            for j in range(1, bs):
                assert labels[b, a, j - 1] == full[b, anchors[b, a] + j - 1]


def test_anchor_sampling_stays_inside_the_continuation_window():
    gen = torch.Generator().manual_seed(0)
    a = train.sample_anchors(64, lo=10, hi=30, num=8, gen=gen)
    assert a.shape == (64, 8) and a.min() >= 10 and a.max() <= 30
    assert (a[:, 1:] > a[:, :-1]).all()  # sorted and distinct


def test_drafter_context_excludes_positions_at_or_after_the_anchor():
    target = micro_target()
    _, dcfg = micro_drafter_config(target)
    drafter = DFlashLagunaDrafter(dcfg).eval()
    ids = torch.randint(4, VOCAB, (1, 24))
    anchors = torch.tensor([[6, 12]])
    aux = target_forward(target, ids, dcfg.target_layer_ids, use_cache=False).aux_hidden
    with torch.no_grad():
        base = train.draft_logits_for(target, drafter, ids, anchors, aux, 4)
        later = aux.clone()
        later[:, 12:] += torch.randn_like(later[:, 12:])  # features of positions >= the second anchor
        moved = train.draft_logits_for(target, drafter, ids, anchors, later, 4)
        torch.testing.assert_close(moved[:, 0], base[:, 0])  # the first block never sees them...
        torch.testing.assert_close(moved[:, 1], base[:, 1])  # ...nor the second (context < 12 only)
        earlier = aux.clone()
        earlier[:, 11] += 1.0  # the last position before the second anchor
        moved = train.draft_logits_for(target, drafter, ids, anchors, earlier, 4)
        torch.testing.assert_close(moved[:, 0], base[:, 0])
        assert not torch.allclose(moved[:, 1], base[:, 1])


def test_a_short_block_inside_a_long_layout_drafts_like_a_real_short_block():
    target = micro_target()
    _, dcfg = micro_drafter_config(target)  # block size 4
    drafter = DFlashLagunaDrafter(dcfg).eval()
    ids = torch.randint(4, VOCAB, (1, 24))
    anchors = torch.tensor([[6, 12]])
    aux = target_forward(target, ids, dcfg.target_layer_ids, use_cache=False).aux_hidden
    with torch.no_grad():
        mixed = train.draft_logits_for(target, drafter, ids, anchors, aux, 4, lengths=torch.tensor([[2, 4]]))
        short = train.draft_logits_for(target, drafter, ids, anchors[:, :1], aux, 2)
        full = train.draft_logits_for(target, drafter, ids, anchors[:, 1:], aux, 4)
    torch.testing.assert_close(mixed[0, 0, :2], short[0, 0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(mixed[0, 1], full[0, 0], atol=1e-5, rtol=1e-4)


def test_position_weights_decay_from_one():
    w = train.position_weights(16, gamma=7.0)
    assert w.shape == (15,) and w[0] == 1 and (w[1:] < w[:-1]).all()
    torch.testing.assert_close(w[7], torch.tensor(np.exp(-1.0), dtype=torch.float32))


def test_degenerate_continuations_are_flagged():
    good = torch.arange(40)[None]
    bad = torch.tensor([[5, 6, 7] * 13 + [5]])
    assert train.is_degenerate(torch.cat([good, bad]), min_distinct=8).tolist() == [False, True]


# --- replaying greedy speculative decoding ------------------------------------------------


def test_replay_counts_drafts_with_the_decoders_stats():
    prompt_len, k = 2, 3
    greedy = torch.arange(20)  # the target's greedy sequence: prompt [0, 1], then 2, 3, ...
    drafts = torch.stack([greedy[prompt_len + a + 1: prompt_len + a + 1 + k] for a in range(12)])
    drafts[0, 2] = -1  # block at 2: accept 2 drafts, bonus -> next block at 5
    drafts[3, 0] = -1  # block at 5: accept 0, bonus -> next block at 6
    # block at 6 accepts all 3 -> next at 10 ; block at 10 accepts 3 -> generated 12 tokens >= 10: stop
    r = train.replay_greedy_decoding(greedy, drafts, prompt_len, max_new_tokens=10)  # counted by observe_draft
    assert (r.num_drafts, r.num_accepted_tokens, r.num_accepted_tokens_per_pos) == (4, 8, [3, 3, 2])
    assert r.acceptance_lengths == [3, 1, 4, 4] and r.num_draft_tokens == 4 * k


# --- a few steps learn --------------------------------------------------------------------


def test_a_few_target_steps_reduce_the_loss():
    rng = np.random.default_rng(0)
    pattern = rng.integers(4, VOCAB, 50).astype(np.uint16)
    streams = {"train": np.tile(pattern, 40), "heldout": np.tile(pattern, 4), "distill": np.tile(pattern, 4)}
    cfg = train.TargetTrainConfig(epochs=1, batch_size=8, seq_len=32, lr=3e-3, warmup=2, eval_every=4,
                                  eval_windows=4, log_every=1)
    overrides = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=32, layer_types=["sliding_attention", "full_attention"],
                     sliding_window=16, mlp_layer_types=["dense", "sparse"], num_experts=4,
                     moe_intermediate_size=32, shared_expert_intermediate_size=64)
    model, log = train.train_target(VOCAB, streams, cfg, torch.device("cpu"), config_overrides=overrides)
    losses = [c[1] for c in log["loss_curve"]]
    assert log["steps"] == len(streams["train"]) // (8 * 32)
    assert losses[-1] < losses[0] - 1.0
    assert log["final"]["heldout_loss"] < np.log(VOCAB) - 1.0


def test_a_few_drafter_steps_reduce_the_loss():
    target = micro_target()
    with torch.no_grad():
        target.lm_head.weight.mul_(40)  # a peaked target: its soft labels carry something to learn
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, VOCAB, (8, 12), generator=gen)
    seqs = train.greedy_generate(target, prompts, 16)  # self-distilled: the target's own continuations
    cfg, _ = micro_drafter_config(target, steps=40, lr=3e-3, warmup=5, log_every=1, short_block_share=0.5)
    drafter, log = train.train_drafter(target, {12: seqs.numpy().astype(np.uint16)}, cfg, continuation=16)
    losses = [c[1] for c in log["loss_curve"]]
    assert losses[-1] < losses[0] - 0.5
    assert isinstance(drafter.config, DFlashDrafterConfig) and drafter.config.block_size == 4


def test_the_schedule_ends_at_its_floor_so_one_schedule_can_span_two_sittings():
    target = micro_target()
    seqs = train.greedy_generate(target, torch.randint(4, VOCAB, (4, 12), generator=torch.Generator().manual_seed(1)), 16)
    lrs = {}
    for floor in (0.05, 0.4):
        cfg, _ = micro_drafter_config(target, steps=12, lr=1e-3, warmup=2, lr_floor=floor, log_every=1)
        _, log = train.train_drafter(target, {12: seqs.numpy().astype(np.uint16)}, cfg, continuation=16)
        lrs[floor] = [c[2] for c in log["loss_curve"]]
    # the last step runs 9/10 of the way down the cosine: 2 % of the span above the floor
    assert 0.4e-3 < lrs[0.4][-1] < 0.42e-3 and 0.05e-3 < lrs[0.05][-1] < 0.08e-3
    assert max(lrs[0.4]) == pytest.approx(1e-3) and all(a >= b for a, b in zip(lrs[0.4][2:], lrs[0.4][3:]))


def test_a_floor_outside_zero_to_one_is_refused_before_anything_loads():
    from dflash_lab.train.cli import main

    with pytest.raises(ValueError, match=r"DrafterTrainConfig.lr_floor must be in \[0, 1\] \(a fraction of lr\), got 1.5"):
        main(["drafter", "--lr-floor", "1.5", "--target", "/nonexistent"])


def test_training_logs_of_the_shipped_pair_plot():
    from dflash_lab.assets import DEFAULT_DRAFTER
    from dflash_lab.viz import plot_training_log

    target_fig = plot_training_log(DEFAULT_TARGET)
    assert "held-out loss" in target_fig.layout.title.text and len(target_fig.data[0].x) > 5
    drafter_fig = plot_training_log(DEFAULT_DRAFTER)
    names = [t.name for t in drafter_fig.data]
    assert "held-out acceptance (block 16)" in names and "τ" in drafter_fig.layout.title.text


# --- the paper's and Poolside's drafter shapes -------------------------------------------


@pytest.mark.parametrize("preset, layer_type, window, causal", [
    ("paper", "full_attention", None, False),
    ("poolside", "sliding_attention", 64, True),
])
def test_attention_presets_make_drafters_vllm_reads_back_the_same(preset, layer_type, window, causal):
    target = micro_target()
    cfg = train.DrafterTrainConfig(num_layers=2, **train.ATTENTION_PRESETS[preset])
    dcfg = train.make_drafter_config(target.config, cfg)
    written = dcfg.to_dict()
    assert written["layer_types"] == [layer_type] * 2 and written.get("sliding_window") == window
    back = DFlashDrafterConfig.from_dict(written)
    assert back == dcfg and back.is_causal is causal and back.window == window
    # Poolside's configs spell causality out, as Laguna-S-2.1-DFlash does; the paper's leave vLLM's rule.
    assert written["dflash_config"].get("causal") == (True if preset == "poolside" else None)


@pytest.mark.parametrize("kw, error", [
    (dict(layer_type="sliding_attention"), "needs `sliding_window`"),
    (dict(layer_type="full_attention", sliding_window=64), "only applies to sliding_attention"),
    (dict(layer_type="linear_attention"), "`layer_type` must be one of"),
    (dict(layer_type="full_attention", causal="yes"), "`causal` must be True, False or None"),
])
def test_attention_options_vllm_cannot_serve_are_refused(kw, error):
    with pytest.raises((ValueError, TypeError), match=error):
        train.make_drafter_config(micro_target().config, train.DrafterTrainConfig(**kw))


def _cli_config(*argv):
    from dflash_lab.train.cli import build_parser, train_config_from_args

    return train_config_from_args(build_parser().parse_args(["drafter", *argv]))


def test_cli_attention_preset_and_overrides():
    def parsed(*argv):
        cfg = _cli_config(*argv)
        return cfg.layer_type, cfg.sliding_window, cfg.causal

    assert parsed() == ("full_attention", None, None)
    assert parsed("--attention", "poolside") == ("sliding_attention", 64, True)
    assert parsed("--attention", "poolside", "--sliding-window", "32", "--causal", "auto") == ("sliding_attention", 32, None)
    assert parsed("--attention", "paper", "--causal", "true") == ("full_attention", None, True)
    assert parsed("--attention", "poolside", "--layer-type", "full_attention") == ("full_attention", None, True)
    with pytest.raises(ValueError, match="needs `sliding_window`"):
        parsed("--layer-type", "sliding_attention")


@pytest.mark.parametrize("argv, options", [
    ((), {}),
    (("--attention", "poolside", "--layers", "2", "--steps", "50", "--warmup", "5"),
     dict(attention="poolside", num_layers=2, steps=50, warmup=5)),
    (("--attention", "poolside", "--layer-type", "full_attention", "--causal", "auto"),
     dict(attention="poolside", layer_type="full_attention", causal=None)),
    (("--layer-type", "sliding_attention", "--sliding-window", "16", "--block-size", "8", "--seed", "3"),
     dict(layer_type="sliding_attention", sliding_window=16, block_size=8, seed=3)),
])
def test_the_cli_and_a_notebook_run_merge_presets_in_one_place_with_the_same_defaults(argv, options):
    """DrafterTrainConfig.from_preset is the one merge: the command line and train.live build the same config from
    the same choices, and with no choice both are the dataclass's defaults (3 layers, block 16, warm-up 200)."""
    from dflash_lab.train.live import drafter_train_config

    options = dict(options)
    steps, attention = options.pop("steps", train.DrafterTrainConfig.steps), options.pop("attention", "paper")
    live = drafter_train_config(steps=steps, attention=attention, **options)
    assert _cli_config(*argv) == live == train.DrafterTrainConfig.from_preset(attention, steps=steps, **options)
    if not argv:
        assert live == train.DrafterTrainConfig() and (live.num_layers, live.block_size, live.warmup) == (3, 16, 200)


def test_the_paper_preset_is_the_dataclass_default_and_presets_are_refused_by_name():
    assert train.DrafterTrainConfig.from_preset("paper") == train.DrafterTrainConfig()
    assert train.DrafterTrainConfig.from_preset("poolside").sliding_window == 64
    with pytest.raises(ValueError, match="attention preset 'eagle' is unknown"):
        train.DrafterTrainConfig.from_preset("eagle")
    with pytest.raises(TypeError, match=r"has no field \['layers'\]"):
        train.DrafterTrainConfig.from_preset("paper", layers=3)


BAD_TRAIN_FIELDS = [
    ("num_layers", 0, ValueError, "num_layers must be >= 1"), ("num_layers", True, TypeError, "must be an integer"),
    ("intermediate_size", 64.0, TypeError, "intermediate_size must be an integer"),
    ("layer_type", "linear_attention", ValueError, "`layer_type` must be one of"),
    ("sliding_window", 64, ValueError, "only applies to sliding_attention"),
    ("causal", "yes", TypeError, "`causal` must be True, False or None"),
    ("num_aux_layers", 0, ValueError, "num_aux_layers must be >= 1"),
    ("block_size", 1, ValueError, "block_size must be >= 2"),
    ("anchors_per_seq", 0, ValueError, "anchors_per_seq must be >= 1"),
    ("batch_size", "8", TypeError, "batch_size must be an integer"),
    ("steps", 0, ValueError, "steps must be >= 1"), ("warmup", -1, ValueError, "warmup must be >= 0"),
    ("lr", 0.0, ValueError, r"lr must be > 0"), ("lr", float("nan"), TypeError, "lr must be a finite number"),
    ("lr_floor", -0.1, ValueError, r"lr_floor must be in \[0, 1\]"),
    ("weight_decay", -0.01, ValueError, "weight_decay must be >= 0"),
    ("grad_clip", 0, ValueError, "grad_clip must be > 0"), ("gamma", None, TypeError, "gamma must be a finite number"),
    ("short_block_share", 1.5, ValueError, r"short_block_share must be in \[0, 1\]"),
    ("cache_target_features", 1, TypeError, "cache_target_features must be True or False"),
    ("train_only", "fc", TypeError, "train_only must be a tuple"),
    ("log_every", 0, ValueError, "log_every must be >= 1"), ("seed", -1, ValueError, "seed must be >= 0"),
]


@pytest.mark.parametrize("field, value, error, message", BAD_TRAIN_FIELDS, ids=[f"{f}={v!r}" for f, v, *_ in BAD_TRAIN_FIELDS])
def test_every_training_config_field_is_checked_and_named(field, value, error, message):
    with pytest.raises(error, match=message):
        train.DrafterTrainConfig(**{field: value})


def test_the_bad_field_cases_cover_every_field_and_mixed_ones_are_checked_together():
    from dataclasses import fields

    assert {f for f, *_ in BAD_TRAIN_FIELDS} == {f.name for f in fields(train.DrafterTrainConfig)}
    with pytest.raises(ValueError, match="short_block_share 0.3 needs block_size >= 3"):
        train.DrafterTrainConfig(block_size=2, short_block_share=0.3)
    assert train.DrafterTrainConfig(train_only=["fc"]).train_only == ("fc",)


def test_the_attention_options_are_checked_once_per_config(monkeypatch):
    from dflash_lab.train import drafter_config

    calls = []
    real = drafter_config.check_attention
    monkeypatch.setattr(drafter_config, "check_attention", lambda *a: calls.append(a) or real(*a))
    cfg = _cli_config("--attention", "poolside", "--layers", "1")
    train.make_drafter_config(micro_target().config, cfg)
    assert calls == [("sliding_attention", 64, True)]


def test_the_default_depth_is_the_shipped_drafters():
    from dflash_lab.assets import DRAFTERS

    depths = {json.loads((path / "config.json").read_text())["num_hidden_layers"] for path in DRAFTERS.values()
              if path.is_dir()}
    assert depths == {train.DrafterTrainConfig.num_layers}


def test_a_causal_drafter_drafts_a_short_block_exactly_like_the_front_of_a_long_one():
    """Causal inside the block: slot j never sees slots after it, so one trained layout serves every block size
    (the non-causal paper drafter needs short-block training for that)."""
    target = micro_target()
    cfg = train.DrafterTrainConfig(num_layers=1, intermediate_size=128, num_aux_layers=2, block_size=4,
                                   layer_type="sliding_attention", sliding_window=8, causal=True)
    drafter = DFlashLagunaDrafter(train.make_drafter_config(target.config, cfg)).eval()
    paper = DFlashLagunaDrafter(train.make_drafter_config(target.config, train.DrafterTrainConfig(
        num_layers=1, intermediate_size=128, num_aux_layers=2, block_size=4))).eval()
    ids = torch.randint(4, VOCAB, (1, 24))
    anchors = torch.tensor([[10]])
    aux = target_forward(target, ids, drafter.config.target_layer_ids, use_cache=False).aux_hidden
    with torch.no_grad():
        long, short = (train.draft_logits_for(target, drafter, ids, anchors, aux, bs) for bs in (4, 2))
        torch.testing.assert_close(short[0, 0], long[0, 0, :2], atol=1e-5, rtol=1e-4)
        long, short = (train.draft_logits_for(target, paper, ids, anchors, aux, bs) for bs in (4, 2))
        assert not torch.allclose(short[0, 0, 1], long[0, 0, 1], atol=1e-5)  # non-causal: later masks matter


def test_the_feature_cache_gives_the_targets_own_soft_labels():
    target = micro_target()
    ids = torch.randint(4, VOCAB, (6, 20))
    anchors = torch.tensor([[3, 9]] * 3)
    rows = torch.tensor([1, 4, 5])
    aux, labels = train.target_soft_labels(target, ids[rows], anchors, [0, 1], 4)
    cache = train.TargetFeatureCache(target, ids, [0, 1], batch_size=4)
    c_aux, c_labels = cache.soft_labels(target, rows, anchors, 4)
    torch.testing.assert_close(c_aux, aux)
    torch.testing.assert_close(c_labels, labels)


# --- acceptance while training ------------------------------------------------------------


def test_the_probe_counts_what_the_evaluation_counts():
    target = micro_target()
    with torch.no_grad():
        target.lm_head.weight.mul_(40)
    _, dcfg = micro_drafter_config(target)
    drafter = DFlashLagunaDrafter(dcfg).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in (12, 12, 15)]
    probe = train.AcceptanceProbe(target, prompts, max_new_tokens=10, max_block_size=4)

    class Tok:  # evaluate_acceptance tokenizes text; hand it the ids instead
        def encode(self, text, add_special_tokens=False):
            return prompts[int(text)]

    ev = train.evaluate_acceptance(target, drafter, Tok(), [{"text": str(i)} for i in range(3)], block_sizes=(4,),
                                   max_new_tokens=10)[4]
    stats = probe(drafter)
    assert stats.num_drafts == ev.stats.num_drafts
    assert stats.num_accepted_tokens_per_pos == ev.stats.num_accepted_tokens_per_pos
    back = SpecDecodeStats.from_dict(ev.record())  # what a training log holds reads back as the same counters
    assert (back.num_drafts, back.num_draft_tokens, back.num_accepted_tokens, back.num_accepted_tokens_per_pos) == \
        (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_accepted_tokens_per_pos)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["paper", "poolside"])
def test_thirty_seconds_of_cpu_training_from_scratch_beat_the_untrained_drafter(attention):
    """The whole recipe in miniature on the shipped target: fresh self-distilled data, the CLI's loop,
    held-out acceptance before and after (about 30 s on a 2-core CPU)."""
    from dflash_lab.assets import load_default_pair
    from dflash_lab.train.live import distill_small, drafter_train_config, train_live

    target, _, tokenizer = load_default_pair("cpu")
    data, stats = distill_small(target, tokenizer, num_sequences=64, continuation=32, max_files=60)
    assert stats["sequences"] >= 32
    prompts = [tokenizer.encode(p["text"], add_special_tokens=False)[-48:] for p in heldout_prompts()[:6]]
    probe = train.AcceptanceProbe(target, prompts, max_new_tokens=24, max_block_size=4)
    cfg = drafter_train_config(steps=120, warmup=12, block_size=4, num_layers=1, attention=attention,
                               intermediate_size=256, batch_size=8, anchors_per_seq=8, lr=5e-3, gamma=1.0,
                               log_every=20, cache_target_features=True)
    run = train_live(target, data, cfg, probe, eval_every=60, show_progress=False)
    assert [s for s, _ in run.evals] == [0, 60, 120]
    before, after = run.before, run.after
    assert after.mean_acceptance_length > before.mean_acceptance_length + 0.1
    assert after.per_position_acceptance_rate[0] > before.per_position_acceptance_rate[0] + 0.1
    assert run.drafter.config.is_causal is (attention == "poolside")


def test_load_default_pair_names_its_drafters():
    from dflash_lab.assets import DRAFTERS, load_default_pair

    with pytest.raises(ValueError, match="`drafter` must be one of"):
        load_default_pair("cpu", drafter="eagle")
    if not DRAFTERS["poolside"].is_dir():
        pytest.skip("the poolside drafter is not shipped in this checkout")
    _, drafter, _ = load_default_pair("cpu", drafter="poolside")
    assert drafter.config.is_sliding and drafter.config.is_causal and drafter.config.window == 64


def test_the_training_explorer_trains_and_moves_its_figure():
    from dflash_lab.widgets import drafter_training_explorer

    target = micro_target()
    with torch.no_grad():
        target.lm_head.weight.mul_(40)
    gen = torch.Generator().manual_seed(0)
    seqs = train.greedy_generate(target, torch.randint(4, VOCAB, (8, 12), generator=gen), 16)
    probe = train.AcceptanceProbe(target, [torch.randint(4, VOCAB, (10,), generator=gen).tolist()], max_new_tokens=8,
                                  max_block_size=4)
    box = drafter_training_explorer(target, {12: seqs.numpy().astype(np.uint16)}, probe, steps=20, eval_every=10,
                                    block_size=4, num_layers=1,
                                    train_kwargs=dict(intermediate_size=64, num_aux_layers=2, batch_size=4,
                                                      anchors_per_seq=4, log_every=10))
    assert box.block_size.options == (4,)
    assert len(box.figure.data[1].x) == 0  # nothing trained yet, nothing drawn
    box.steps.value = 30  # every control shows what the next press will do
    assert list(box.figure.layout.xaxis.range) == [0, 30] and "30 steps" in box.summary.value
    box.steps.value = 20
    box.attention.value = "sliding 64, causal (Poolside)"
    run = box.train()
    assert [s for s, _ in run.evals] == [0, 10, 20] and run.drafter.config.is_causal
    assert list(box.figure.data[1].x) == [0, 10, 20] and len(box.figure.data[0].x) == 2
    assert "held-out τ" in box.summary.value
    # Opened on a finished run, the figure shows it before any press.
    again = drafter_training_explorer(target, {12: seqs.numpy().astype(np.uint16)}, probe, steps=20, eval_every=10,
                                      block_size=4, start_from=run, start_label="the earlier run")
    assert list(again.figure.data[1].x) == [0, 10, 20] and "the earlier run" in again.summary.value


def test_a_fresh_reader_keeps_the_layers_and_training_only_the_reader_moves_only_the_reader():
    from dflash_lab.train.live import READER, train_live, with_fresh_reader

    target = micro_target()
    cfg, dcfg = micro_drafter_config(target, steps=4, log_every=2, cache_target_features=True, train_only=READER)
    torch.manual_seed(1)
    source = DFlashLagunaDrafter(replace(dcfg, block_size=8)).eval()
    before = {k: v.clone() for k, v in source.state_dict().items()}
    warm = with_fresh_reader(source, block_size=4, seed=3)
    assert warm.config.block_size == 4 and source.config.block_size == 8
    for k, v in warm.state_dict().items():
        same = torch.equal(v, before[k])
        if k.startswith(READER):
            assert same == (v.dim() < 2), k  # norms start at one in both; fc is new random numbers
        else:
            assert same, k  # decoder layers and the final norm are the source's
    gen = torch.Generator().manual_seed(0)
    seqs = train.greedy_generate(target, torch.randint(4, VOCAB, (8, 12), generator=gen), 16)
    probe = train.AcceptanceProbe(target, [torch.randint(4, VOCAB, (10,), generator=gen).tolist()], max_new_tokens=8,
                                  max_block_size=4)
    run = train_live(target, {12: seqs.numpy().astype(np.uint16)}, cfg, probe, eval_every=2, show_progress=False,
                     init=warm)
    assert all(torch.equal(v, warm.state_dict()[k]) for k, v in run.initial.state_dict().items())  # untrained copy
    for k, v in run.drafter.state_dict().items():  # train_only: the reader moved, nothing else did
        assert torch.equal(v, warm.state_dict()[k]) != k.startswith(READER), k
    assert all(torch.equal(v, before[k]) for k, v in source.state_dict().items())  # the source is untouched
    assert "fresh reader" in run.log["initialised_from"]
    assert run.log["trained_parameters"] == sum(p.numel() for n, p in warm.named_parameters() if n.startswith(READER))
    with pytest.raises(ValueError, match="name no parameter"):
        train.drafter_training.trainable_parameters(warm, ("decoder",))


def test_the_tau_axis_starts_near_the_data():
    from dflash_lab.viz.training_live import tau_axis_range

    assert tau_axis_range([1.0, 1.21]) == [1.0, 1.5]  # never below 1, the least a step yields
    assert tau_axis_range([1.03, 1.78]) == [1.0, 1.9]
    assert tau_axis_range([2.4, 3.1]) == [2.3, 3.2]  # a run that starts high starts its axis there
    assert tau_axis_range([]) == [1.0, 1.5]


# --- the larger corpus: installed packages, licences, held-out split by path ----------------


def fake_site_packages(root, packages: dict) -> None:
    """{name: (licence metadata lines, {relpath: text})} as installed distributions under root."""
    for name, (licence, files) in packages.items():
        info = root / f"{name}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{licence}\n")
        (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files))
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)


def test_only_permissive_licences_are_taken_and_each_is_recorded(tmp_path):
    from dflash_lab.train import code_corpus

    code = "def f(x):\n    return x + 1\n"
    fake_site_packages(tmp_path, {
        "mitpkg": ("License-Expression: MIT", {"mitpkg/a.py": code, "mitpkg/b_pb2.py": code}),
        "bsdpkg": ("Classifier: License :: OSI Approved :: BSD License", {"bsdpkg/x.py": "y = 2\n"}),
        "gplpkg": ("License: GPL-3.0-or-later", {"gplpkg/g.py": code}),
        "mplpkg": ("License-Expression: MPL-2.0 AND MIT", {"mplpkg/m.py": code}),
        "anonpkg": ("", {"anonpkg/n.py": code}),
    })
    taken, left_out = code_corpus.package_sources(tmp_path)
    assert {p.name: (p.licence, [f.relpath for f in p.files]) for p in taken} == {
        "bsdpkg": ("BSD License", ["bsdpkg/x.py"]), "mitpkg": ("MIT", ["mitpkg/a.py"])}  # protobuf stubs skipped
    assert {e["name"]: e["why"] for e in left_out} == {
        "gplpkg": "licence not permissive", "mplpkg": "licence not permissive", "anonpkg": "no licence stated"}


def test_a_copy_of_a_heldout_file_never_trains_and_prompt_lines_are_kept_out(tmp_path):
    from dflash_lab.train import code_corpus

    held_path = next(p for p in (f"m{i}.py" for i in range(200)) if corpus.split_of(p) == "heldout")
    train_path = next(p for p in (f"pkg/m{i}.py" for i in range(200)) if corpus.split_of(p) == "train")
    text = "def held(a, b):\n    total = a + b\n    return total * 2\n"
    files = [corpus.SourceFile(train_path, text), corpus.SourceFile(held_path, text)]
    assert [f.relpath for f in code_corpus.deduplicate(files)] == [held_path]
    prompt = {"text": "class Thing:\n    def method_one(self):\n        return self.value_one + 1\n"}
    vendored = corpus.SourceFile(train_path, "import os\n\n" + prompt["text"].replace("    ", "\t") + "\nx = 1\n")
    other = corpus.SourceFile("pkg/other.py", "x = 1\n")
    assert code_corpus.drop_prompt_overlap([vendored, other], [prompt]) == [other]

    pack = tmp_path / "c.jsonl.xz"
    code_corpus.save_corpus_pack([other, files[1]], ["somepkg", code_corpus.STDLIB_PACKAGE], {"packages": []}, pack)
    back, packages = code_corpus.load_corpus_pack(pack)
    assert back == [other, files[1]] and packages == ["somepkg", code_corpus.STDLIB_PACKAGE]
    assert code_corpus.manifest_path(pack).is_file() and code_corpus.is_corpus_pack(pack)


def test_prefixes_come_from_the_named_streams_in_their_shares():
    target = micro_target()

    class Tok:  # token 10 starts a line
        def __len__(self):
            return VOCAB

        def decode(self, ids):
            return "\n" if ids == [10] else "x"

    a = np.tile(np.array([10, 20, 21, 22], dtype=np.uint16), 50)  # only tokens 10, 20-22
    b = np.tile(np.array([10, 30, 31, 32], dtype=np.uint16), 50)  # only tokens 10, 30-32
    cfg = train.DistillConfig(prefix_lengths=(8,), continuation=4, num_sequences=8, gen_batch=8, min_distinct=1,
                              sources={"a": 0.75, "b": 0.25})
    data, stats = train.build_distill_data(target, Tok(), {"a": a, "b": b}, cfg, show_progress=False)
    prefixes = data[8][:, :8]
    from_a = [bool(set(p.tolist()) <= {10, 20, 21, 22}) for p in prefixes]
    assert from_a == [True] * 6 + [False] * 2 and stats["config"]["sources"] == {"a": 0.75, "b": 0.25}
    with pytest.raises(ValueError, match=r"prefix sources \['c'\] are not corpus streams"):
        train.build_distill_data(target, Tok(), {"a": a}, train.DistillConfig(sources={"c": 1.0}), show_progress=False)


def test_a_widened_drafter_drafts_exactly_what_it_was_widened_from():
    target = micro_target()
    dcfg = replace(micro_drafter_config(target)[1], num_hidden_layers=2, layer_types=["full_attention"] * 2)
    drafter = DFlashLagunaDrafter(dcfg).eval()
    for p in drafter.parameters():  # trained-looking weights: down-projections nowhere near zero
        p.data.normal_(0, 0.2)
    ids = torch.randint(4, VOCAB, (2, 24))
    anchors = torch.tensor([[6, 12], [8, 15]])
    aux = target_forward(target, ids, dcfg.target_layer_ids, use_cache=False).aux_hidden
    wide = train.reshape_drafter(drafter, intermediate_size=192).eval()
    assert wide.config.intermediate_size == 192 and wide.layers[0].mlp.down_proj.weight.shape == (64, 192)
    assert wide.layers[0].mlp.gate_proj.weight[128:].abs().sum() > 0  # new units are live, not dead
    with torch.no_grad():
        base = train.draft_logits_for(target, drafter, ids, anchors, aux, 4)
        torch.testing.assert_close(train.draft_logits_for(target, wide, ids, anchors, aux, 4), base)
        shallow = train.reshape_drafter(drafter, num_layers=1).eval()
        assert shallow.config.num_hidden_layers == 1 and len(shallow.layers) == 1
        assert shallow.config.layer_types == dcfg.layer_types[:1]
        for name, value in shallow.state_dict().items():  # the bottom of the stack and the shared parts, kept
            torch.testing.assert_close(value, drafter.state_dict()[name])
        assert not torch.allclose(train.draft_logits_for(target, shallow, ids, anchors, aux, 4), base)


@pytest.mark.parametrize("kw, error", [({"num_layers": 3}, "num_layers must be 1..2"),
                                       ({"num_layers": 0}, "num_layers must be 1..2"),
                                       ({"intermediate_size": 64}, "narrower than the initial drafter's 128")])
def test_reshaping_refuses_to_deepen_or_narrow(kw, error):
    dcfg = replace(micro_drafter_config(micro_target())[1], num_hidden_layers=2, layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError, match=error):
        train.reshape_drafter(DFlashLagunaDrafter(dcfg), **kw)
