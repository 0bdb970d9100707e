# %% [markdown]
# # Chapter 6 · Train the drafter
#
# **Question.** How does a drafter learn its target?
#
# A [DFlash](GLOSSARY.md#dflash) [drafter](GLOSSARY.md#drafter) never sees a label
# written by a person. It learns from the [target](GLOSSARY.md#target) itself: the
# target continues real prefixes greedily
# (*[self-distillation](GLOSSARY.md#self-distillation)*), and the drafter is trained to
# draft those continuations a whole [block](GLOSSARY.md#draft-block) at a time, from the
# target's hidden features of the tokens before the block. This chapter runs the recipe
# of `python -m dflash_lab.train drafter` in one sitting, on the shipped target:
#
# 1. fresh self-distillation data: the target's greedy continuations of code it never trained on;
# 2. the DFlash objective: blocks `[x_p, MASK, …]` (MASK is the
#    [mask token](GLOSSARY.md#mask-token)) at random anchors, each position pulled
#    towards the target's distribution there, with weights that fall along the block;
# 3. training, with held-out acceptance measured every few steps and drawn as it moves;
# 4. the trained drafter saved in vLLM's layout, loaded back, and measured as chapter 3 does.
#
# On a GPU the run takes a few minutes and trains a drafter from nothing; on a CPU the same
# cells run a miniature of about a minute and a half, which starts from a drafter that can
# already write code but cannot read this target (§1 says why), and learns to read it.

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the lab reaches the network

import json
import tempfile
import time
from pathlib import Path

import plotly.graph_objects as go
import torch
from IPython.display import display

from dflash_lab import train, viz
from dflash_lab.assets import default_device, heldout_prompts, is_shipped_pair, load_default_pair, pair_drafters, record_note
from dflash_lab.checkpoint import load_drafter, save_drafter
from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.measure.drafters import window_drops
from dflash_lab.measure.repetition import setting_line
from dflash_lab.repro import rounded
from dflash_lab.runtime import BENCHMARKS_DIR, seed_everything
from dflash_lab.spec_decode import SpecDecodeStats, generate_on_prompts
from dflash_lab.target import target_forward
from dflash_lab.train.evaluate import AcceptanceProbe
from dflash_lab.train.distill import is_degenerate
from dflash_lab.train.live import READER, distill_small, drafter_train_config, train_live, with_fresh_reader
from dflash_lab.widgets import drafter_training_explorer

_ = seed_everything(0)  # (it returns a seeded generator; this chapter does not need one)
chapter_start = time.perf_counter()

# %% [markdown]
# ## 1 · The target, and how big a run
#
# The shipped target is loaded as in every chapter (float32 arithmetic on a CPU). A GPU
# gets a run of a few minutes; a CPU a miniature with the same code path. On a CPU the
# matrices here are small, so one thread is fastest (and fair to a busy machine).

# %%
# NBVAL_IGNORE_OUTPUT
device = default_device()
target, shipped_drafter, tokenizer = load_default_pair(device=device, dtype=torch.float32)
DRAFTER_NAME = "the shipped drafter" if is_shipped_pair() else "your drafter"  # the one $DFLASH_LAB_DRAFTER names
ON_GPU = device.type == "cuda"
if not ON_GPU:
    torch.set_num_threads(1)
print("device:", device)

# %%
shipped_shape = dict(layers=shipped_drafter.config.num_hidden_layers, intermediate=shipped_drafter.config.intermediate_size)
RUN = (dict(sequences=20_000, gen_batch=4096, prefix=96, continuation=80, prompts=16, new_tokens=64, block_size=16,
            layers=3, intermediate=768, warm_start=False, steps=1500, eval_every=100, batch_size=128, anchors=32,
            lr=2e-3, gamma=7.0)
       if ON_GPU else
       dict(sequences=512, gen_batch=640, prefix=64, continuation=40, prompts=8, new_tokens=32, block_size=8,
            **shipped_shape, warm_start=True, steps=160, eval_every=40, batch_size=8, anchors=8, lr=5e-3, gamma=1.0))
TAU_FLOOR = 1.6  # the held-out τ the CPU run must reach (the last cell of §5 checks it)
print("CPU miniature:" if not ON_GPU else "GPU run:", RUN)

# %% [markdown]
# A drafter learns two things at once: to **read the target** (`combine_hidden_states`: a
# norm per target layer, then `fc`, which turns the target's features into the drafter's
# context) and to **draft** from what it read (the decoder layers). From nothing, both take
# far longer than a CPU minute: on a CPU the loop below, started from random numbers, gets
# little further in that time than guessing which token tends to follow which (press
# *train* in §7, which always starts from nothing, to watch it). So the two runs differ in
# where they start:
#
# * the **GPU run** trains a fresh drafter, every weight random;
# * the **CPU run** is a *warm start*: it copies the shipped drafter's decoder layers and
#   final norm, starts its reader from random numbers (`with_fresh_reader`), and trains the
#   reader alone (`train_only`; the layers stay frozen, gradients flow through them). Its
#   layers know how to draft code but are fed noise for context, so before training it
#   drafts almost nothing (its τ is measured in §5); what the run must learn is exactly how
#   to read *this* target. Training only the reader is also what fits a CPU minute: only
#   the reader's weights (their share is printed in §5) get gradients and optimiser
#   updates, so each step is cheaper, and a learning rate that would wreck the trained
#   layers is safe. (A warm start from the whole shipped drafter would teach nothing: it
#   is trained already.)
#
# `gamma` sets how fast the loss weights fall along the block (§3): the GPU run uses the
# DFlash paper's 7; the CPU miniature, which has time to learn only the first positions,
# puts its weight there.
#
# ## 2 · Fresh self-distillation data
#
# Prefixes are cut at line ends from standard-library files in the corpus's `distill`
# split: files the target never trained on, so their continuations look like what the
# target writes for the held-out prompts. The target continues each prefix greedily, with
# a KV cache, `gen_batch` prefixes at a time, until enough are kept; continuations that
# collapse into repetition are dropped (below: which, and why).

# %%
# NBVAL_IGNORE_OUTPUT
t0, c0 = time.perf_counter(), time.process_time()
data, data_stats = distill_small(target, tokenizer, num_sequences=RUN["sequences"], prefix_lengths=(RUN["prefix"],),
                                 continuation=RUN["continuation"], gen_batch=RUN["gen_batch"])
data_seconds, data_cpu = time.perf_counter() - t0, time.process_time() - c0
sequences = data[RUN["prefix"]]
print(f"{data_stats['sequences']} sequences of {sequences.shape[1]} tokens "
      f"({data_stats['dropped_degenerate']} degenerate ones dropped) in {data_seconds:.1f} s")

# %% [markdown]
# **What is dropped, and why.** A greedy decoder can fall into a loop: once the target has
# written `-192` twice, writing it again is its most likely next step, and the continuation
# becomes `-192-192-192…`. Such a continuation says nothing about how the target continues
# code, yet every anchor in it yields a block, and all those blocks are the same few tokens:
# kept, they would fill the loss with one trivial pattern and teach the drafter to repeat.
# The rule (`distill.is_degenerate`, the CLI's `--min-distinct`) is blunt and cheap: a
# continuation with fewer than `min_distinct` distinct tokens is dropped. This run's numbers:

# %%
# NBVAL_IGNORE_OUTPUT
P, C = RUN["prefix"], RUN["continuation"]
min_distinct = data_stats["config"]["min_distinct"]
continued = data_stats["sequences"] + data_stats["dropped_degenerate"]
distinct = [len(set(row[P:].tolist())) for row in sequences]  # distinct tokens in each kept continuation
print(f"the target continued {continued} prefixes ({data_stats['batches']} batch(es) of up to {RUN['gen_batch']}) by "
      f"{C} tokens; {data_stats['dropped_degenerate']} ({data_stats['dropped_degenerate'] / continued:.0%}) used "
      f"fewer than {min_distinct} distinct tokens and were dropped, {data_stats['sequences']} kept")
print(f"the kept continuations use {min(distinct)} to {max(distinct)} distinct tokens of {C} "
      f"(median {sorted(distinct)[len(distinct) // 2]})")
loop = torch.tensor([tokenizer.encode("-192" * 20, add_special_tokens=False)[:C]])
print(f"'-192-192-…' as {loop.shape[1]} tokens: {len(set(loop[0].tolist()))} distinct, dropped: "
      f"{bool(is_degenerate(loop, min_distinct))}")
fewest = min(range(len(distinct)), key=distinct.__getitem__)
text = repr(tokenizer.decode(sequences[fewest, P:].tolist()))
print(f"the kept continuation with the fewest ({distinct[fewest]}):", text if len(text) <= 110 else text[:110] + "…")

# %% [markdown]
# One of them: the end of the real prefix, then what the target wrote.

# %%
# NBVAL_IGNORE_OUTPUT
example = sequences[0].tolist()
print(tokenizer.decode(example[RUN["prefix"] - 24:RUN["prefix"]]) + "⟦" + tokenizer.decode(example[RUN["prefix"]:]) + "⟧")

# %% [markdown]
# ## 3 · The objective, on one block
#
# Every sequence yields many blocks. At an anchor `p` in the continuation the block is
# `[x_p, MASK × (B−1)]` at positions `p … p+B−1`; the drafter's context is the target's
# features of positions `< p`; block position `j ≥ 1` is trained towards the target's
# distribution at position `p+j−1` (its prediction of token `p+j`), with weight
# `exp(−(j−1)/γ)`: a draft token only counts if every token before it was accepted.
# These are the functions the CLI's loop calls.

# %%
ids = torch.as_tensor(sequences[:1].astype("int64"))
anchors = torch.tensor([[RUN["prefix"] + 5]])
B = RUN["block_size"]
block, positions = train.block_inputs(ids, anchors, B, tokenizer.mask_token_id)
print("block tokens:   ", ["MASK" if t == tokenizer.mask_token_id else "x_p" for t in block[0].tolist()])
print("block positions:", positions[0].tolist())
print("label positions:", train.label_positions(anchors, B)[0, 0].tolist(), "(the target's prediction made there)")
print("loss weights:   ", rounded(train.position_weights(B, gamma=RUN["gamma"]).tolist(), 2), f"(gamma {RUN['gamma']})")

# %% [markdown]
# **The loss on this block, written out.** The target reads the sequence up to the block's
# last label position; its features of positions `< p` are the drafter's context, and its
# logits at `p … p+B−2` are the soft labels. The drafter drafts the block in one forward (as in
# chapter 3's loop), and each block position gets a cross-entropy to the target's
# distribution: `−Σ_v p_target(v) log q_drafter(v)`. The loss is their weighted mean.

# %%
ids, anchors = ids.to(device), anchors.to(device)
p, layers = int(anchors[0, 0]), shipped_drafter.config.target_layer_ids
with torch.no_grad():
    seen = target_forward(target, ids[:, :p + B - 1], layers, use_cache=False)  # positions 0 .. p+B-2
target_logits = seen.logits[0, p:p + B - 1]  # (B-1, V): the target's predictions AT p .. p+B-2
weights = train.position_weights(B, gamma=RUN["gamma"], device=device)  # (B-1,)


@torch.no_grad()
def block_loss(drafter):
    """(per-position cross-entropy (B-1,), weighted loss) of ``drafter`` on this one block."""
    k, v = drafter.precompute_context_kv(drafter.combine_hidden_states(seen.aux_hidden[0, :p]),
                                         torch.arange(p, device=device))  # context: positions < p
    block_ids = torch.tensor([[int(ids[0, p])] + [drafter.config.mask_token_id] * (B - 1)], device=device)
    hidden = drafter(target.get_input_embeddings()(block_ids), torch.arange(p, p + B, device=device)[None],
                     k, v, torch.arange(p, device=device))  # (1, B, H)
    draft_logits = target.lm_head(hidden[0, 1:])  # (B-1, V): block position j guesses token p+j
    ce = -(target_logits.softmax(-1) * draft_logits.log_softmax(-1)).sum(-1)  # (B-1,)
    return ce, float((ce * weights).sum() / weights.sum())

# %% [markdown]
# The shipped drafter against an untrained one of the same shape, and each checked against the
# package's objective (`draft_logits_for` drafts every block of a batch in one forward,
# `dflash_loss` weighs the cross-entropies), which the training loop below calls:

# %%
torch.manual_seed(0)
untrained = DFlashLagunaDrafter(shipped_drafter.config).to(device).eval()  # same shape, random weights
aux, labels = train.target_soft_labels(target, ids, anchors, layers, B)  # (1, T, .), (1, 1, B-1, V)
ces = {}  # drafter -> per-position cross-entropy on this block
for name, d in {"loaded": shipped_drafter, "untrained": untrained}.items():
    ces[name], loss = block_loss(d)
    with torch.no_grad():
        package, _ = train.dflash_loss(train.draft_logits_for(target, d, ids, anchors, aux, B)[:, :, 1:], labels, weights)
    print(f"{name:17s} cross-entropy per position {rounded(ces[name].tolist(), 2)} -> loss {loss:.3f}; "
          f"dflash_loss {float(package):.3f}; same: {abs(loss - float(package)) < 1e-4 * max(1.0, loss)}")
print(f"{DRAFTER_NAME}'s cross-entropy is lower at every block position:",
      bool((ces["loaded"] < ces["untrained"]).all()))

# %% [markdown]
# Training lowers this number *on average over many blocks* at random anchors. Each point of
# §5's loss curve is one small batch, so on a CPU's short run the curve is noisy and its last
# points can sit above an earlier dip (the chapter's run below may end that way); held-out τ,
# drawn beside it, is what says whether the drafter got better. The first positions weigh most,
# so they improve first: §5 shows it in the acceptance they lead to.

# %% [markdown]
# ## 4 · A held-out yardstick, cheap enough to use while training
#
# Held-out prompts (standard-library files that neither model trained on) keep their
# last 64 tokens. The target's greedy continuation of each, and its features, are
# computed once (`AcceptanceProbe`); a measurement then runs only the drafter and
# replays greedy [speculative decoding](GLOSSARY.md#speculative-decoding) over its
# drafts, counted with vLLM's counters. Every τ of §5 and §6 is on this yardstick (printed below);
# the shipped drafters' τ in §8 come from their training logs, on another one (more prompts,
# longer continuations; §8 prints it), so the two are not to be compared.

# %%
# NBVAL_IGNORE_OUTPUT
prompt_ids = [tokenizer.encode(p["text"], add_special_tokens=False)[-64:] for p in heldout_prompts()[:RUN["prompts"]]]
t0 = time.perf_counter()
probe = AcceptanceProbe(target, prompt_ids, max_new_tokens=RUN["new_tokens"], max_block_size=RUN["block_size"])
YARDSTICK = f"{len(prompt_ids)} held-out prompts, {RUN['new_tokens']} new tokens, block {RUN['block_size']}, greedy"
print(f"{YARDSTICK}: the target's continuations in {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# ## 5 · Train, and watch it learn
#
# `train_live` calls the CLI's `train_drafter` (same objective, same optimiser and
# schedule) with a callback that measures the probe every few steps and moves the
# figure: the loss on the left, held-out [τ](GLOSSARY.md#tau) in the middle, and on the
# right the [per-position acceptance](GLOSSARY.md#per-position-acceptance) of the latest
# measurement next to the drafter's before training (dotted). The full-attention,
# non-[causal](GLOSSARY.md#causal) drafter of the DFlash paper is trained here; §7
# trains the other kind.
#
# The target is frozen, so its features of the training sequences are computed once, before
# the first step (`cache_target_features`), and every step runs only the drafter. The run
# starts from the drafter §1 chose: on a CPU the shipped drafter's frozen layers with a fresh
# reader, which alone is trained.

# %%
# NBVAL_IGNORE_OUTPUT
cfg = drafter_train_config(steps=RUN["steps"], warmup=RUN["steps"] // 10, block_size=RUN["block_size"],
                           num_layers=RUN["layers"], attention="paper", batch_size=RUN["batch_size"],
                           anchors_per_seq=RUN["anchors"], lr=RUN["lr"], intermediate_size=RUN["intermediate"],
                           gamma=RUN["gamma"], log_every=20, cache_target_features=True)
start = with_fresh_reader(shipped_drafter, block_size=RUN["block_size"]) if RUN["warm_start"] else None
if start is not None:
    cfg.train_only = READER  # the layers stay as the shipped drafter has them; only the reader learns
STARTED_FROM = (f"{DRAFTER_NAME}'s {RUN['layers']} decoder layers and final norm (frozen), its reader "
                f"({', '.join(READER)}) random and the only part trained" if start is not None else "random weights")
print("the run starts from", STARTED_FROM)
figure = go.FigureWidget(viz.live_training_figure(label="paper drafter", total_steps=cfg.steps))
display(figure)

# %%
# NBVAL_IGNORE_OUTPUT
moves = []  # every redraw, so the record shows the figure moved


def redraw(run):
    viz.update_live_training_figure(figure, run.log.get("loss_curve", []), run.evals, label="paper drafter")
    moves.append(len(run.evals))


t0, c0 = time.perf_counter(), time.process_time()
run = train_live(target, data, cfg, probe, eval_every=RUN["eval_every"], on_update=redraw, init=start)
train_seconds, train_cpu = time.perf_counter() - t0, time.process_time() - c0
print(f"{run.log['steps']} steps in {train_seconds:.0f} s; the figure was redrawn {len(moves)} times")
print(f"trained: {run.log['trained_parameters']:,} of the drafter's {run.log['num_parameters']:,} parameters "
      f"({run.log['trained_parameters'] / run.log['num_parameters']:.0%})")

# %% [markdown]
# The measurements behind the middle panel:

# %%
# NBVAL_IGNORE_OUTPUT
print("held-out yardstick:", YARDSTICK)
for step, stats in run.evals:
    print(f"step {step:5d}: τ {stats.mean_acceptance_length:.3f}, per position",
          rounded(stats.per_position_acceptance_rate[:6], 2))

# %%
before, after = run.before.mean_acceptance_length, run.after.mean_acceptance_length
print("held-out acceptance after training beats before:", after > before)
print("the figure moved while training:", len(moves) > 2 and len(run.evals) > 2)
if is_shipped_pair():  # the floor is measured on the shipped pair; another pair's target sets its own
    print(f"held-out τ after training reaches {TAU_FLOOR}:", after >= TAU_FLOOR)
    assert after >= TAU_FLOOR, f"the live run reached held-out τ {after:.3f} < {TAU_FLOOR} ({YARDSTICK})"
else:
    print(f"held-out τ after training: {after:.3f} (the floor {TAU_FLOOR} is the shipped pair's and is not checked on "
          "your pair: how much a drafter learns in this budget depends on the target it reads)")

# %% [markdown]
# ## 6 · Save it as vLLM loads it, and measure it as chapter 3 does
#
# `save_drafter` writes `config.json` and `model.safetensors` in vLLM 0.33's
# `DFlashLagunaForCausalLM` layout (bf16 weights, no embedding, no `lm_head`). Loading
# it back checks every tensor name and shape. Then real greedy speculative decoding
# (`generate_on_prompts`, chapter 3's measurement) runs on the held-out prompts with the
# drafter before and after training.

# %%
out_dir = Path(tempfile.mkdtemp(prefix="ch06-")) / "my-dflash-drafter"
save_drafter(run.drafter, out_dir, dtype=torch.bfloat16)
saved = json.loads((out_dir / "config.json").read_text())
print(sorted(p.name for p in out_dir.iterdir()))
print({k: saved[k] for k in ("architectures", "layer_types", "num_hidden_layers", "dflash_config")})
trained = load_drafter(out_dir, device=device, dtype=torch.float32)

# %%
# NBVAL_IGNORE_OUTPUT
measured = {}
for name, drafter in {"before training": run.initial, "after training": trained}.items():
    measured[name], _ = generate_on_prompts(target, drafter, prompt_ids, max_new_tokens=RUN["new_tokens"],
                                            block_size=RUN["block_size"], progress=False)
    s = measured[name]
    print(f"{name:16s} τ {s.mean_acceptance_length:.3f} over {s.num_drafts} drafts ({YARDSTICK}), per position",
          rounded(s.per_position_acceptance_rate[:6], 2))

# %%
print("speculative decoding accepts more after training:",
      measured["after training"].mean_acceptance_length > measured["before training"].mean_acceptance_length)
gap = abs(measured["after training"].mean_acceptance_length - run.after.mean_acceptance_length)
print("the probe and the decoder agree on the trained drafter (τ within 0.05):", gap < 0.05)

# %%
viz.compare_acceptance_figure(measured, title=f"Chapter 3's measurement, block {RUN['block_size']}: before vs after")

# %% [markdown]
# ## 7 · Explore: depth, block size, attention, steps
#
# Press *train* to run the same loop with other settings, always from random weights (no
# warm start), so on a CPU it shows how slowly a drafter starts from nothing. *Attention* switches between
# the DFlash paper's drafter (full attention, every block position sees the whole block)
# and Poolside's (a [sliding window](GLOSSARY.md#sliding-window) of 64 and causal inside
# the block, as vLLM serves Laguna-S-2.1-DFlash). A window of 64 matters here because
# the prompts and continuations run to a few hundred tokens, as 512 does for Poolside's
# long contexts.

# %%
# NBVAL_IGNORE_OUTPUT
# Every press starts from random weights: on a CPU a small drafter, at the learning rate a fresh one needs.
EXPLORE = (dict(layers=RUN["layers"], intermediate=RUN["intermediate"], lr=RUN["lr"]) if ON_GPU else
           dict(layers=1, intermediate=512, lr=5e-3))
explorer = drafter_training_explorer(
    target, data, probe, steps=RUN["steps"], eval_every=RUN["eval_every"], block_size=RUN["block_size"],
    num_layers=EXPLORE["layers"], train_kwargs=dict(batch_size=RUN["batch_size"], anchors_per_seq=RUN["anchors"],
                                                    lr=EXPLORE["lr"], intermediate_size=EXPLORE["intermediate"],
                                                    gamma=RUN["gamma"], log_every=20, cache_target_features=True),
    start_from=run, start_label="the paper drafter trained above")
explorer

# %% [markdown]
# ## 8 · Paper or Poolside? The two shipped drafters
#
# The lab ships two drafters for its target, trained on the same self-distilled data
# for the same GPU time (side by side on one H200, `scripts/train_pair_h200.sh`): the
# paper's (`load_default_pair()`, full attention, non-causal) and Poolside's
# (`load_default_pair(drafter="poolside")`, sliding window 64, causal). Their training
# logs hold chapter 3's measurement on the held-out prompts (CPU, float32,
# `python -m dflash_lab.train evaluate --update-log`; how many prompts and tokens is printed below).

# %%
shipped, settings = {}, set()
for name, path in pair_drafters().items():
    log = viz.read_training_log(path) if (path / "training_log.json").is_file() else {}
    evals = {int(k.removeprefix("block_")): ev for k, ev in (log.get("final") or {}).items() if k.startswith("block_")}
    if evals:
        shipped[name] = {bs: SpecDecodeStats.from_dict(ev) for bs, ev in sorted(evals.items())}
        settings |= {(ev.get("num_prompts"), ev.get("max_new_tokens")) for ev in evals.values()}
settings = sorted(settings)
SHIPPED_YARDSTICK = (f"{settings[0][0]} held-out prompts, {settings[0][1]} new tokens, CPU float32"
                     if len(settings) == 1 else "the held-out prompts, CPU float32")
print(f"{DRAFTER_NAME.removesuffix('drafter')}drafters' yardstick:", SHIPPED_YARDSTICK if shipped else
      "none: their training logs hold no evaluation yet (python -m dflash_lab.train evaluate --update-log)")
for name, by_block in shipped.items():
    dcfg = DFlashDrafterConfig.from_pretrained(pair_drafters()[name])
    print(f"{name:8s} ({dcfg.layer_type}, window {dcfg.window}, causal {dcfg.is_causal}):",
          ", ".join(f"block {bs} τ {s.mean_acceptance_length:.2f}" for bs, s in by_block.items()))

# %%
if shipped:
    viz.drafter_comparison_figure(shipped, title=f"{DRAFTER_NAME.capitalize()}s: {SHIPPED_YARDSTICK}").show()

# %%
if len(shipped) == 2:
    for bs in sorted(set(shipped["paper"]) & set(shipped["poolside"])):
        a, b = (shipped[n][bs].mean_acceptance_length for n in ("paper", "poolside"))
        print(f"block {bs:2d} ({SHIPPED_YARDSTICK}): the {'paper' if a >= b else 'poolside'} drafter accepts more, "
              f"τ {max(a, b):.2f} vs {min(a, b):.2f} ({abs(a - b) / min(a, b):.0%})")

# %% [markdown]
# One prompt set and one number per drafter make an anecdote: prompts differ far more than
# drafters do, and a different set of prompts can reverse a small lead. The result below is
# `benchmarks/drafters.json` (`python -m dflash_lab.tools.bench drafters`, about 9 minutes on
# a CPU): both drafters on the 48 held-out prompts and on a second set of another style,
# 48 **docstring-first** prompts (`checkpoints/docstring_prompts.json`: a function's signature
# and docstring, so the continuation is a function body the prompt does not contain), each
# with a 95 % bootstrap interval over prompts. The difference is **paired**: both drafters
# are resampled on the same prompts, so how easy a prompt is cancels out, and the interval
# of the difference is much narrower than the two intervals side by side suggest.

# %%
comparison = json.loads((BENCHMARKS_DIR / "drafters.json").read_text())
if record_note(comparison):
    print("whose numbers: benchmarks/drafters.json is", record_note(comparison))
for set_name, entry in comparison["sets"].items():
    print(f"{set_name} ({entry['num_prompts']} prompts, {comparison['max_new_tokens']} new tokens):")
    for bs, d in entry["differences"]["paper - poolside"].items():
        a, b = (entry["drafters"][n][bs] for n in ("paper", "poolside"))
        verdict = ("the paper's drafter ahead" if d["low"] > 0 else "Poolside's ahead" if d["high"] < 0
                   else "no difference resolved")
        print(f"  block {bs:>2}: paper τ {a['tau']:.2f} [{a['low']:.2f}, {a['high']:.2f}], poolside τ {b['tau']:.2f} "
              f"[{b['low']:.2f}, {b['high']:.2f}]; paired difference {d['difference']:+.2f} "
              f"[{d['low']:+.2f}, {d['high']:+.2f}]: {verdict}")

# %% [markdown]
# ### How much of τ is the target repeating itself
#
# This small target often loops at greedy decoding, and a looping continuation is easy to draft: the drafter,
# like prompt lookup, only has to copy. So each set's τ is split by a stated n-gram measure
# (`dflash_lab.measure.repetition`): a continuation is **repetitive** when at least a quarter of its token
# 4-grams already occurred earlier in it. The third set, **non-repetitive** (`checkpoints/nonrepetitive_prompts.json`),
# holds held-out prompts whose continuation the shipped target does not loop on: its τ is the drafter
# predicting new text (`python -m dflash_lab.tools.bench repetition`, `benchmarks/repetition.json`).

# %%
repetition = json.loads((BENCHMARKS_DIR / "repetition.json").read_text())
if record_note(repetition):
    print("whose numbers: benchmarks/repetition.json is", record_note(repetition))


def tau_cell(x):
    return "-" if x is None else f"{x:.2f}"


rep_rows = []
for set_name, entry in repetition["sets"].items():
    for name, by_block in [*entry["drafters"].items(), ("prompt lookup", entry["prompt_lookup"])]:
        r = by_block["16"]
        rep_rows.append([set_name, name, tau_cell(r["tau"]), f"{r['num_repetitive']} of {r['num_prompts']}",
                         tau_cell(r["tau_repetitive"]), tau_cell(r["tau_non_repetitive"])])
viz.answer_table(["prompts", "proposer", "τ", "repetitive", "τ repetitive", "τ non-repetitive"], rep_rows,
                 caption=f"Block 16, {repetition['max_new_tokens']} new tokens, greedy, CPU float32; repetitive: at "
                         f"least {repetition['threshold']:.0%} of a continuation's {repetition['ngram']}-grams repeated")

# %% [markdown]
# A sliding drafter sees only its window of the target's features, while the target (two
# full-attention layers) reads the whole prompt. Does that cost it on long prompts? The
# window study (`benchmarks/drafter_window.json`, `bench drafters --window-study`) runs both
# drafters on the held-out prompts whole and cut to their last 64 tokens, and the sliding one
# once more with its window removed. Cutting a prompt changes the task as well (the target
# sees less and continues differently), so the fair question is whether the sliding drafter
# *drops more* than the full-attention one, on the same prompts.

# %%
study = json.loads((BENCHMARKS_DIR / "drafter_window.json").read_text())
if record_note(study):
    print("whose numbers: benchmarks/drafter_window.json is", record_note(study))
drops = window_drops(study)
print(setting_line(f"{study['num_prompts']} held-out prompts", study["max_new_tokens"], study["block_size"],
                   "the same prompts, whole and cut; the rows differ by drafter and window"))
for name, r in study["runs"].items():
    print(f"{name:44s} τ {r['tau']:.2f} [{r['low']:.2f}, {r['high']:.2f}]")
extra = drops["poolside's drop - paper's drop"]
unwindowed = next(r for n, r in study["runs"].items() if "removed" in n)
resolved = extra["high"] < 0 or extra["low"] > 0
print(f"the sliding drafter's drop on whole prompts, beyond the paper drafter's: {extra['difference']:+.2f} "
      f"[{extra['low']:+.2f}, {extra['high']:+.2f}] ({'resolved' if resolved else 'within noise'})")
print(f"the sliding drafter with its window removed: τ {unwindowed['tau']:.2f} — it drafts from the 64 tokens it "
      "was trained to see; training and serving apply the same window rule (drafter.visible_keys)")
cut_name = f"last {study['cut_tokens']} tokens"
gain = {d: drops[f"{d}: full - {cut_name}"]["difference"] for d in ("paper", "poolside")}
if resolved and extra["difference"] < 0:
    print(f"so it is the model, not a defect: the full-attention drafter gains {gain['paper']:+.2f} from the whole "
          f"prompt, the sliding one {gain['poolside']:+.2f}. On whole prompts the target conditions on tokens beyond "
          f"the {study['cut_tokens']} the sliding drafter sees (its full-attention layers read them); cutting the "
          "prompt takes them from the target as well, and the sliding drafter's disadvantage shrinks")

# %% [markdown]
# ## Where the time went
#
# Wall times of this run (they vary by machine, so nbval ignores this cell), and the CPU
# time this process spent on the live part: on a machine shared with other work the wall
# time grows, the CPU time does not (on a CPU the run uses one thread).

# %%
# NBVAL_IGNORE_OUTPUT
print(f"device {device}: data {data_seconds:.0f} s, training {train_seconds:.0f} s "
      f"({run.log['steps'] / max(train_seconds, 1e-9):.1f} steps/s), whole chapter so far "
      f"{time.perf_counter() - chapter_start:.0f} s")
print(f"the live part (data + training): {data_seconds + train_seconds:.0f} s wall, "
      f"{data_cpu + train_cpu:.0f} s of CPU time")

# %% [markdown]
# ## Answer
#
# How does a drafter learn its target? From the target's own greedy continuations,
# through the target's features: the printout below puts this run's numbers into the
# answer.

# %%
# NBVAL_IGNORE_OUTPUT
first, last = run.evals[0][1], run.evals[-1][1]
rows = [
    ["training data: the target's greedy continuations (loops dropped)",
     f"{data_stats['sequences']} ({data_stats['dropped_degenerate']} dropped: fewer than {min_distinct} distinct tokens)"],
    ["drafter trained", f"{run.drafter.config.num_hidden_layers} layer(s), {run.log['trained_parameters'] / 1e6:.2f} of "
                        f"{run.log['num_parameters'] / 1e6:.1f} M parameters, {run.log['steps']} steps"],
    [f"held-out τ ({YARDSTICK}): before → after", f"{first.mean_acceptance_length:.2f} → {last.mean_acceptance_length:.2f}"],
    ["position 1 accepted: before → after", f"{first.per_position_acceptance_rate[0]:.0%} → "
                                            f"{last.per_position_acceptance_rate[0]:.0%}"],
    ["the saved checkpoint, real speculative decoding (the probe)",
     f"τ {measured['after training'].mean_acceptance_length:.2f} ({last.mean_acceptance_length:.2f})"],
]
if len(shipped) == 2 and all(16 in shipped[n] for n in ("paper", "poolside")) and record_note(comparison) is None:
    lead = comparison["sets"]["held-out"]["differences"]["paper - poolside"]["16"]
    held, fresh = (repetition["sets"][k]["drafters"]["paper"]["16"] for k in ("held-out", "non-repetitive"))
    rows += [
        [f"shipped drafters, block 16 ({SHIPPED_YARDSTICK}): paper vs Poolside-style",
         f"τ {shipped['paper'][16].mean_acceptance_length:.2f} vs {shipped['poolside'][16].mean_acceptance_length:.2f}; "
         f"paired lead {lead['difference']:+.2f} [{lead['low']:+.2f}, {lead['high']:+.2f}]"],
        [f"the paper's drafter on the {held['num_repetitive']} repetitive / {held['num_prompts'] - held['num_repetitive']} "
         "other held-out continuations; on the non-repetitive set",
         f"τ {held['tau_repetitive']:.2f} / {held['tau_non_repetitive']:.2f}; {fresh['tau']:.2f}"],
    ]
viz.answer_table(["what", "value"], rows, caption="Chapter 6's answer: this run, then the shipped drafters' records")

# %% [markdown]
# It distils: the drafter learns to match the target's distribution at every position of a block from the target's
# features of the tokens before it, and it learns the near positions first (each later position needs every
# earlier one right, so the loss weights fall along the block). How it attends matters too, and so does what it is
# asked to continue: where the target loops, copying is easy and τ is high; the non-repetitive set is the honest
# yardstick.
