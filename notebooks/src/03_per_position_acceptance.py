# %% [markdown]
# # Chapter 3 · Per-position acceptance
#
# **Question.** How far into the block does the drafter stay right?
#
# One DFlash step drafts a whole block in one drafter forward: the block is the
# last real token `x_t` followed by `B − 1` mask tokens, and the drafter fills in
# `d_1 … d_{B−1}`. The target then checks all of them in **one** forward and keeps
# the longest prefix it agrees with, plus one token of its own (the *bonus* when it
# kept everything, the *correction* otherwise). So the step yields
# `1 + accepted` tokens, and the question is how long that accepted prefix tends to be.
#
# vLLM counts exactly this, and so does the lab (same definitions):
#
# - `num_drafts`, `num_draft_tokens`, `num_accepted_tokens`;
# - `num_accepted_tokens_per_pos[i]`: drafts whose first `i+1` drafted tokens were
#   **all** accepted; the per-position acceptance rate is that over `num_drafts`;
# - mean acceptance length `τ = 1 + accepted / drafts` (the bonus token included).
#
# This chapter runs real speculative decoding on held-out Python with the shipped
# tiny Laguna target and its DFlash drafter, draws those counters, compares DFlash
# with prompt-lookup drafting (vLLM's `ngram` method), and reads the same counters
# from a vLLM server's `/metrics` page.

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the lab reaches the network

import torch
from IPython.display import HTML
from tqdm.auto import tqdm

from dflash_lab import viz
from dflash_lab.assets import default_device, heldout_prompts, load_default_pair
from dflash_lab.metrics import stats_from_prometheus_text
from dflash_lab.repro import rounded
from dflash_lab.runtime import REPO_ROOT, seed_everything
from dflash_lab.spec_decode import generate_on_prompts, speculative_generate
from dflash_lab.widgets import acceptance_explorer

_ = seed_everything(0)  # (it returns a seeded generator; this chapter does not need one)

# %% [markdown]
# The shipped pair: the tiny Laguna code target and its DFlash drafter, loaded on the
# lab's device (CUDA when there is one; `DFLASH_LAB_DEVICE` overrides it, and
# `DFLASH_LAB_TARGET` / `DFLASH_LAB_DRAFTER` point at other checkpoints).

# %%
# NBVAL_IGNORE_OUTPUT
device = default_device()
target, drafter, tokenizer = load_default_pair(device=device)
print("device:", device)

# %%
cfg = drafter.config
print(f"drafter: {cfg.num_hidden_layers} layers, trained for blocks of up to {cfg.block_size}, "
      f"reads target layers {cfg.target_layer_ids}")

# %% [markdown]
# ## 1 · Held-out prompts
#
# The prompts are cut from standard-library files that neither model trained on.
# Each keeps its last 64 tokens, and each run generates 32 more: small enough for a
# laptop CPU, long enough for a dozen drafts per prompt.

# %%
PROMPT_TOKENS, MAX_NEW = 64, 32


def encode(text: str) -> list[int]:
    return tokenizer(text)["input_ids"][-PROMPT_TOKENS:]


heldout = heldout_prompts()
prompts = [encode(p["text"]) for p in heldout[:8]]
print(len(heldout), "held-out prompts; using", len(prompts), "of", PROMPT_TOKENS, "tokens each")
print("from:", [p["source"] for p in heldout[:8]])

# %% [markdown]
# ## 2 · One step, by hand
#
# `speculative_generate` records every step: the drafts it proposed, how many the
# target kept, and what it emitted. The first step is the prefill (no draft: the
# target reads the prompt and says the first token). Each later step proposes
# `B − 1 = 7` tokens here.

# %%
one = speculative_generate(target, drafter, prompts[0], max_new_tokens=16, block_size=8)
show = lambda ids: "".join(tokenizer.decode([t]) for t in ids)  # noqa: E731
for step in one.steps[:5]:
    print(f"position {step.position:3d}  drafted {show(step.draft_ids)!r:42}  kept {step.num_accepted}  "
          f"emitted {show(step.token_ids)!r}")

# %% [markdown]
# Greedy speculative decoding is *lossless*: the output is token for token what the
# target alone would have written (the unit tests check this against
# `target.generate` for several block sizes, in float32). On a GPU the pair runs in
# bfloat16, where a near-tie between two tokens can flip with the order of
# computation, so an occasional `False` there is rounding, not a bug.

# %%
plain = target.generate(one.output_ids[:, :one.prompt_length], max_new_tokens=16, do_sample=False,
                        eos_token_id=None, pad_token_id=0)
print("same tokens as target.generate:", torch.equal(plain, one.output_ids))

# %% [markdown]
# ## 3 · How far into the block? DFlash, block 16, greedy
#
# All 8 prompts, merged into one set of counters.

# %%
# NBVAL_IGNORE_OUTPUT
dflash = {}  # block size -> SpecDecodeStats
dflash[16], dflash_runs = generate_on_prompts(target, drafter, prompts, max_new_tokens=MAX_NEW, block_size=16,
                                              desc="DFlash, block 16")

# %%
print(rounded(dflash[16].summary(), 3))

# %% [markdown]
# The bars are vLLM's per-position rate: the share of drafts whose first `i` drafted
# tokens were all right. They can only fall. The orange line is the *conditional*
# rate, "right at `i` given right up to `i − 1`": where it stays high the drafter is
# consistent once it is on track; where it drops, the block is too long for it.

# %%
viz.per_position_acceptance_figure(dflash[16])

# %% [markdown]
# The same counters give the distribution of acceptance lengths (drafts with exactly
# `n` accepted = `per_pos[n−1] − per_pos[n]`), so this histogram can be drawn for a
# vLLM server too.

# %%
viz.acceptance_length_histogram(dflash[16])

# %% [markdown]
# ## 4 · Every token, coloured by where it came from
#
# Green tokens were drafted and kept; blue ones are the target's own (the bonus, or
# the correction after a rejection); a red, struck-through token is the draft the
# target rejected at that spot (hover for the rest of the discarded block). The
# prompt's tail leads in grey.

# %%
HTML(viz.acceptance_tokens_html(dflash_runs[0], tokenizer, prompt_tail=24))

# %% [markdown]
# ## 5 · A baseline: prompt lookup
#
# Prompt lookup (vLLM's `ngram` method) drafts without a model: find the longest
# recent n-gram that also occurred earlier in the sequence and copy what followed it.
# It runs in the same loop, with the same verification and counters. A step where it
# finds no match is not a draft (vLLM does not count it either): the target simply
# decodes one token, so compare *target forwards per token* too.

# %%
# NBVAL_IGNORE_OUTPUT
lookup = {}
lookup[16], lookup_runs = generate_on_prompts(target, "ngram", prompts, max_new_tokens=MAX_NEW, block_size=16,
                                              desc="prompt lookup, block 16")

# %%
for name, stats in {"DFlash": dflash[16], "prompt lookup": lookup[16]}.items():
    print(f"{name:14s} drafts {stats.num_drafts:3d}  tau {stats.mean_acceptance_length:.3f}  "
          f"target forwards per token {stats.target_forwards_per_token:.3f}")

# %%
viz.compare_acceptance_figure({"DFlash": dflash[16], "prompt lookup": lookup[16]},
                              title="DFlash vs prompt lookup, block 16, greedy")

# %% [markdown]
# ## 6 · Block size
#
# A longer block offers more tokens per verification but each extra position is
# harder to get right. vLLM calls `B − 1` `num_speculative_tokens`. Compare position 1
# across block sizes too: in DFlash the whole block is drafted at once, so the mask
# tokens after a position are part of its input, and a block shorter or longer than
# the ones the drafter trained on can change even its first guess.

# %%
# NBVAL_IGNORE_OUTPUT
for block in tqdm([4, 8], desc="block sizes"):
    dflash[block], _ = generate_on_prompts(target, drafter, prompts, max_new_tokens=MAX_NEW, block_size=block,
                                           progress=False)
    lookup[block], _ = generate_on_prompts(target, "ngram", prompts, max_new_tokens=MAX_NEW, block_size=block,
                                           progress=False)

# %%
for name, by_block in {"DFlash": dflash, "prompt lookup": lookup}.items():
    for block in sorted(by_block):
        s = by_block[block]
        print(f"{name:14s} block {block:2d}: tau {s.mean_acceptance_length:.3f}, per position",
              rounded(s.per_position_acceptance_rate[:8], 3))

# %%
viz.acceptance_vs_block_size_figure({"DFlash": dflash, "prompt lookup": lookup})

# %% [markdown]
# ## 7 · Temperature
#
# With sampling, a draft is kept with probability `min(1, p/q)` (target `p`, drafter
# `q`) and a rejection draws from the leftover `(p − q)+`: the output is still
# distributed exactly as the target's own samples. Hotter sampling spreads `p`, and
# acceptance usually falls. Runs are seeded, so the numbers repeat.

# %%
# NBVAL_IGNORE_OUTPUT
dflash_t, lookup_t = {0.0: dflash[8]}, {0.0: lookup[8]}
for temperature in tqdm([0.5, 1.0], desc="temperatures"):
    dflash_t[temperature], _ = generate_on_prompts(target, drafter, prompts, max_new_tokens=MAX_NEW, block_size=8,
                                                   temperature=temperature, seed=0, progress=False)
    lookup_t[temperature], _ = generate_on_prompts(target, "ngram", prompts, max_new_tokens=MAX_NEW, block_size=8,
                                                   temperature=temperature, seed=0, progress=False)

# %%
print("block 8, tau by temperature:")
print("  DFlash       ", rounded({t: s.mean_acceptance_length for t, s in dflash_t.items()}, 3))
print("  prompt lookup", rounded({t: s.mean_acceptance_length for t, s in lookup_t.items()}, 3))

# %%
viz.acceptance_vs_temperature_figure({"DFlash": dflash_t, "prompt lookup": lookup_t},
                                     title="Mean acceptance length vs temperature (block 8)")

# %% [markdown]
# ## 8 · Explore
#
# Move the block size and the temperature, switch the prompt set or the drafter. The
# third prompt set is deliberately repetitive code, the case prompt lookup is made for.

# %%
# NBVAL_IGNORE_OUTPUT
table = "".join(f'    "E{name}": {i},\n' for i, name in enumerate(
    ["PERM", "NOENT", "SRCH", "INTR", "IO", "NXIO", "2BIG", "NOEXEC", "BADF", "CHILD", "AGAIN", "NOMEM"], 1))
repetitive = encode("ERRORS = {\n" + table + "}\n\nNAMES = {\n" + table[:120])
explorer = acceptance_explorer(
    target, drafter, {"held-out 1-4": prompts[:4], "held-out 5-8": prompts[4:], "repetitive code": [repetitive]},
    tokenizer=tokenizer, max_new_tokens=24, temperatures=(0.0, 0.5, 1.0), block_size=8)
explorer

# %% [markdown]
# ## 9 · The same figures from a vLLM server
#
# A vLLM server with speculative decoding exports these counters on `/metrics`
# (`curl http://localhost:8000/metrics > metrics.txt`), one series per engine;
# `LLM.get_metrics()` gives the same numbers in Python.
# `stats_from_prometheus_text` reads either into the lab's `SpecDecodeStats`, so
# every figure above draws a production run as well.
#
# The file below is an **example** page in vLLM 0.33's exact format, written by
# `notebooks/data/make_vllm_metrics_example.py`: a DFlash drafter with
# `num_speculative_tokens = 15` on two data-parallel engines. Its numbers are
# illustrative, not measured. Counters are cumulative since the server started:
# subtract a scrape taken before your run (`after − before`) to isolate it.

# %%
metrics_text = (REPO_ROOT / "notebooks" / "data" / "vllm_metrics_example.txt").read_text()
print([line for line in metrics_text.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")])
served = stats_from_prometheus_text(metrics_text)  # both engines, summed
engine0 = stats_from_prometheus_text(metrics_text, engine=0)  # or select by label
print("all engines:", rounded(served.summary(), 3))
print("engine 0 tau:", round(engine0.mean_acceptance_length, 3))

# %%
viz.per_position_acceptance_figure(served, title=f"vLLM /metrics (example): τ = {served.mean_acceptance_length:.2f}")

# %%
viz.compare_acceptance_figure({"vLLM example, block 16": served, "lab DFlash, block 16": dflash[16]},
                              title="A served drafter next to the lab's")

# %% [markdown]
# ## 10 · Where the time goes
#
# Besides the counters, the lab's stats keep the wall time of drafter and target
# forwards and the number of target forwards per generated token (1.0 for plain
# decoding). Timings vary from machine to machine, so nbval ignores this cell.

# %%
# NBVAL_IGNORE_OUTPUT
for name, stats in {"DFlash b16": dflash[16], "DFlash b4": dflash[4], "prompt lookup b16": lookup[16]}.items():
    print(f"{name:18s} target {stats.target_time_s:6.2f} s, drafter {stats.drafter_time_s:5.2f} s, "
          f"{stats.target_forwards_per_token:.3f} target forwards per token")

# %% [markdown]
# ## What to try
#
# - Longer generations or more prompts: do the per-position curves settle?
# - `top_p` / `top_k` together with temperature in `speculative_generate`.
# - Point `stats_from_prometheus_text` at your own server's `/metrics`, before and
#   after a benchmark, and subtract.
