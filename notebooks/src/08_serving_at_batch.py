# %% [markdown]
# # Chapter 8 · Serving at batch
#
# **Question.** Why does DFlash's speed-up shrink as more requests run at once, and what does a
# server do about it?
#
# A DFlash step costs about the same for one sequence or for thirty-two on a GPU, and keeps τ tokens
# of each. What shrinks at batch is not the step but the number of useful rows in it. Decode a
# **static batch** — B prompts in, wait until all are done, B more — and every finished row idles
# until the batch's slowest sequence ends: the batch runs as many steps as its straggler needs.
# vLLM's scheduler does not work that way: it keeps up to `max_num_seqs` requests running and gives
# a finished request's place to the next waiting one at the next step (**continuous batching**,
# `vllm/v1/core/sched/scheduler.py`). vLLM 0.33 also lets an operator size the speculation per
# running batch, `num_speculative_tokens_per_batch_size` (`vllm/config/speculative.py`,
# `vllm/v1/spec_decode/dynamic/utils.py`): fewer drafts where the verify step turns compute-bound.
#
# The lab's fast path does both (`spec_decode.fast.serving.serve`): a decoder row is a request's
# place; a finished row is read back and refilled with the next prompt (its own prefill, its caches
# and context K/V overwritten, the other rows untouched), and the graphed step goes on at the same
# shape. This chapter measures the straggler effect live, then reads the committed GPU record.

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the lab reaches the network

import json

import torch

from dflash_lab import viz, widgets
from dflash_lab.assets import default_device, heldout_prompts, load_default_pair, record_note
from dflash_lab.measure.decoding import measurements_from_record
from dflash_lab.measure.serving import best_blocks, request_stream, time_split
from dflash_lab.runtime import BENCHMARKS_DIR, REPO_ROOT, device_name, drafter_path, seed_everything
from dflash_lab.spec_decode.fast.decoder import FastDecoder
from dflash_lab.spec_decode.fast.serving import serve
from dflash_lab.spec_decode.schedule import format_recommendation, recommend_schedule, speculative_config_json

seed_everything(0)
device = default_device()
target, drafter, tokenizer = load_default_pair(device, dtype=torch.float32)
CONCURRENCY, REQUESTS, NEW_TOKENS, BLOCK = 4, 12, 24, 8
prompts = [torch.tensor(tokenizer(p["text"])["input_ids"][-48:]) for p in heldout_prompts()[:REQUESTS]]
stream = request_stream(prompts, REQUESTS)
graphs = device.type == "cuda"
print(f"device {device_name(device)}; {REQUESTS} held-out requests of {len(prompts[0])} tokens, "
      f"{NEW_TOKENS} new tokens each, {CONCURRENCY} at a time; DFlash block {BLOCK}; CUDA graphs {graphs}")

# %% [markdown]
# ## 1. The straggler effect, live
#
# The same stream of requests served twice by the same decoder: statically (a new batch only when
# the last one is done) and continuously (a finished row takes the next request). Both are greedy and
# lossless: every request's tokens are target-only's.

# %%
runs = {}
for method, proposer, block in (("target_only", None, 1), ("dflash", drafter, BLOCK)):
    dec = FastDecoder(target, proposer, batch=CONCURRENCY, block_size=block,
                      capacity=max(len(p) for p in prompts) + NEW_TOKENS, cuda_graphs=graphs)
    serve(dec, stream, max_new_tokens=2)  # warm-up: every prefill shape once
    for batching in ("static", "continuous"):
        runs[method, batching] = serve(dec, stream, max_new_tokens=NEW_TOKENS, policy=batching)
reference = [r.result.new_token_ids for r in runs["target_only", "static"].requests]
for (method, batching), run in runs.items():
    same = sum(r.result.new_token_ids == ref for r, ref in zip(run.requests, reference))
    steps = run.steps_per_request()
    print(f"{method:11s} {batching:10s}: {run.steps:4d} batch steps, a request needs {sum(steps) / len(steps):5.1f} "
          f"on average; the same tokens as target-only: {same}/{len(reference)}")

# %%
live_steps = runs["dflash", "static"].steps_per_request()
viz.straggler_figure(live_steps, CONCURRENCY,
                     title=f"Live, DFlash block {BLOCK}: each static batch of {CONCURRENCY} waits for its slowest")

# %% [markdown]
# Every dot below its bar is a row idling. Target-only requests all need the same number of steps
# (one token each), so a static batch wastes nothing there; DFlash requests finish after τ-dependent
# numbers of steps, and the slowest sets the pace. Continuous batching runs the DFlash stream in
# fewer batch steps:

# %%
dflash_static, dflash_cont = runs["dflash", "static"].steps, runs["dflash", "continuous"].steps
print(f"DFlash batch steps: static {dflash_static}, continuous {dflash_cont} "
      f"({dflash_static / dflash_cont:.2f}x fewer); the lower bound, every row busy to the end: "
      f"{-(-sum(live_steps) // CONCURRENCY)}")

# %% [markdown]
# On a CPU every step is slow and host work is a small share, so the live timings say little about
# a server; the committed record does.
#
# ## 2. The committed record: static against continuous, up to 64 requests at once
#
# `python -m dflash_lab.tools.bench serve --refill-at c/4` on a GPU: 128 requests (the prompt set
# cycled), 96 new tokens each, every request arriving at once (`vllm bench serve --request-rate inf
# --max-concurrency B`), graphs on, bf16; target-only, both shipped drafters and prompt lookup at blocks
# 4, 8 and 16, each method at its best block. Continuous batching there refills once a quarter of the
# rows are free (`--refill-at c/4`): a refill is its own prefill forward, and one shared by several
# requests costs about what one costs (the refill-threshold sweep is
# `benchmarks/spec_decode_serving_refill.json`).

# %%
record = json.loads((BENCHMARKS_DIR / "spec_decode_serving.json").read_text())
note = record_note(record)
print(f"device {record['device']}; {record['command']}" + (f"\nwhose numbers: {note}" if note else ""))
records, phases = record["records"], record.get("phases", {})
viz.serving_speedup_figure(records, phases=phases, title=f"Speed-up against concurrency ({record['device']})")

# %% [markdown]
# The bars marked "step bound" are τ × target-only's step / the drafter's step at that batch, from
# each phase timed as its own graph: what the method would reach if every row were busy every step
# and prefill were free.


# %%
def best(method, batch, batching, prompt_set="heldout"):
    rows = [r for r in records if r["method"] == method and r["batch"] == batch and r["batching"] == batching
            and r["prompt_set"] == prompt_set and r.get("schedule") is None]
    return max(rows, key=lambda r: r["tokens_per_s"]) if rows else None


def speedup(method, batch, batching, prompt_set="heldout"):
    r, base = best(method, batch, batching, prompt_set), best("target_only", batch, batching, prompt_set)
    return r["tokens_per_s"] / base["tokens_per_s"] if r and base else float("nan")


for c in sorted({r["batch"] for r in records}):
    step = phases.get(str(c), {})
    static = f"{speedup('dflash', c, 'static'):.2f}x static" if c > 1 else "static alike at 1"
    line = (f"concurrency {c:>2}: DFlash {speedup('dflash', c, 'continuous'):.2f}x continuous, {static}; "
            f"prompt lookup {speedup('prompt_lookup', c, 'continuous'):.2f}x continuous")
    if "dflash" in step:
        line += (f"; step {step['dflash']['whole_step_ms']:.3f} ms vs target-only "
                 f"{step['target_only']['whole_step_ms']:.3f} ms")
    print(line)

# %% [markdown]
# Where does a served run's time go? A continuous run's wall time is its batch steps (their count
# times the whole step's graphed time, from the phases) plus everything else: the refills (each its
# own prefill) and the host reading the rows' state and deciding the next burst of steps.
# `measure.serving.time_split` does that arithmetic on a record; here on the latest continuous run
# (`benchmarks/spec_decode_serving_continuous.json` where it is committed, else the record above).

# %%
split_path = BENCHMARKS_DIR / "spec_decode_serving_continuous.json"
split_record = json.loads(split_path.read_text()) if split_path.exists() else record
split_note = record_note(split_record)
print(f"device {split_record['device']}; {split_record['command']}" + (f"\nwhose numbers: {split_note}" if split_note
                                                                       else ""))
split = time_split(split_record)
for r in split:
    print(f"concurrency {r['batch']:>2} {r['method']:<16} block {r['block_size']:>2}: {r['seconds']:.3f} s, "
          f"{r['in_steps_s']:.3f} in batch steps, {r['outside_s']:.3f} outside "
          f"({r['outside_ms_per_request']:.2f} ms a request); rows busy {r['occupancy']:.0%}")
share = {(r["method"], r["batch"]): r["outside_s"] / r["seconds"] for r in split}
for c in sorted({r["batch"] for r in split if r["batch"] > 1}):
    if ("dflash", c) in share and ("target_only", c) in share:
        print(f"outside the batch steps at concurrency {c}: DFlash {share['dflash', c]:.0%} of its run, "
              f"target-only {share['target_only', c]:.0%}")
viz.serving_time_figure(split, title=f"Where a served run's time goes ({split_record['device']})")

# %% [markdown]
# The time outside the steps is per request (a refill, a result read back) and per burst (a read of
# the rows' state, a decision). DFlash finishes a request in about a sixth of target-only's steps, so
# the same per-request cost is a six times larger share of its run. vLLM hides such costs with
# asynchronous scheduling and by preparing the next step's inputs while the current one runs.

# %% [markdown]
# What does a step cost? On a GPU a small model's step costs its number of kernels more than its bytes:
# each launch takes a few microseconds however little it reads, inside a CUDA graph too.
# `measure.launches.phase_launches` counts them per phase on the pair loaded here, on this device. On a
# CPU the lab's Triton kernels do not run (they need CUDA, or Triton's interpreter), so it counts the
# torch ops that the kernels replace on a GPU. On an H100 the same count gives 40 / 83 / 8 / 1 kernels a
# DFlash step of block 16 with the shipped pair (`README.md`, "Laguna-XS.2 at its true shape").

# %%
from dflash_lab.measure.launches import phase_launches  # noqa: E402

for method, proposer, block in (("target_only", None, 1), ("dflash", drafter, BLOCK)):
    dec = FastDecoder(target, proposer, batch=1, block_size=block, capacity=len(prompts[0]) + NEW_TOKENS,
                      cuda_graphs=False)
    counted = phase_launches(dec, prompts[:1], max_new_tokens=NEW_TOKENS)
    lab = sum(sum(c.triton.values()) for c in counted.values())
    print(f"{method:11s} one step on {device_name(device)}: "
          + ", ".join(f"{name} {c.total}" for name, c in counted.items())
          + f" = {sum(c.total for c in counted.values())} kernels ({lab} of them the lab's Triton kernels); "
          f"host syncs inside the step: {sum(sum(c.syncs.values()) for c in counted.values())}")

# %%
rec32 = best("dflash", 32, "static")
viz.straggler_figure(rec32["request_steps"], 32,
                     title=f"The record, DFlash block {rec32['block_size']}, static batches of 32")

# %% [markdown]
# Pick a method, a concurrency and a prompt set: the explorer redraws that static run's batches and
# says how many batch steps each batching ran against the floor.

# %%
widgets.straggler_explorer(records)

# %% [markdown]
# ## 3. Which speculation per batch: vLLM 0.33's schedule
#
# From the continuous rows, `spec_decode.schedule.recommend_schedule` picks at each measured
# concurrency the K (drafts per step, block − 1; K = 0 is a plain target step) with the most tokens
# per second, and writes the `num_speculative_tokens_per_batch_size` ranges vLLM 0.33 validates with
# its own rules (the lab's `validate_schedule` is pinned against them in `tests/test_schedule.py`):

# %%
continuous = {"records": [r for r in records if r["batching"] == "continuous" and r.get("schedule") is None]}
schedules = {}
for method in ("dflash", "prompt_lookup"):
    rec = recommend_schedule(measurements_from_record(continuous, method), max_batch=64)
    schedules[method] = rec
    print(f"{method}:\n{format_recommendation(rec)}\n")
drafter_dir = drafter_path().resolve()
shown = drafter_dir.relative_to(REPO_ROOT) if drafter_dir.is_relative_to(REPO_ROOT) else drafter_dir
print("vllm serve TARGET --max-num-seqs 64 --speculative-config '"
      + speculative_config_json("dflash", str(shown), None, schedules["dflash"].schedule) + "'")
lookup = schedules["prompt_lookup"]
if lookup.num_speculative_tokens:
    print("vllm serve TARGET --max-num-seqs 64 --speculative-config '"
          + speculative_config_json("ngram", None, None, lookup.schedule, prompt_lookup_min=2, prompt_lookup_max=5)
          + "'")

# %% [markdown]
# Prompt lookup's schedule stops speculating where it loses (K = 0): with it a server never runs
# prompt lookup below target-only, by not running it. DFlash keeps its longest block at every
# measured concurrency on this record.
#
# The prompt lookup in these records drafts on the host and reads every row back each step, as the
# V1 model runner (and the CPU engine) does. On a GPU vLLM 0.33 runs the V2 model runner, which drafts
# `method="ngram"` on the device (`NgramGPUSpeculator`: the longest n-gram's rightmost match, always K
# drafts). The lab's `drafter="ngram_gpu"` is that rule inside the fast path's graphed step
# (`benchmarks/spec_decode_serving_ngram_gpu.md`, an H100: 1.28x target-only at 8 where the host's
# rule gives 0.83x, still below target-only from 32 on).
#
# Served under the schedules: `bench serve --schedule-from` runs each method at its block and again
# under the schedule recommended from the records, in one run (`benchmarks/spec_decode_serving_schedule.json`).
# A drafter scheduled to K = 0 still appends its context K/V every step, as vLLM 0.33's DFlash speculator
# does ("to keep the drafter in sync", `v1/worker/gpu/spec_decode/dflash/speculator.py:546-553`), so its
# K = 0 step costs more than target-only's.

# %%
served = json.loads((BENCHMARKS_DIR / "spec_decode_serving_schedule.json").read_text())
served_note = record_note(served)
print(f"device {served['device']}; {served['command']}" + (f"\nwhose numbers: {served_note}" if served_note else ""))
served_best = best_blocks(served["records"])  # a scheduled run is its own "<method> (scheduled)"
for (s, method, c), r in sorted(served_best.items()):
    if r.get("schedule"):
        base = served_best[s, "target_only", c]["tokens_per_s"]
        print(f"{r['method']:<17} concurrency {c:>2}: scheduled {r['tokens_per_s'] / base:.2f}x target-only, "
              f"at its block {served_best[s, r['method'], c]['tokens_per_s'] / base:.2f}x; schedule {r['schedule']}")
viz.serving_speedup_figure(served["records"], title=f"Served under the recommended schedules ({served['device']})")

# %% [markdown]
# ## Refills carried by the steps
#
# Each refill above is a forward of its own: one row's prompt through the target and the drafter's
# context K/V, on this small pair about as dear as a whole step. vLLM 0.33 runs no such pass. Its
# scheduler puts a new request's prompt tokens into the same batch as the running requests' decode
# tokens (chunked prefill, `v1/core/sched/scheduler.py`). The lab's version keeps the step's shape
# (rows × W): a refilled row verifies its prompt's next W tokens in place of [x_t, drafts], so the
# step's own verify and append write the prompt's K/V, and the chunk holding the prompt's last token
# gives the first token (`spec_decode.fast.chunked_fill`; `serve(refill="chunked")`). A refill then
# launches nothing, and the row gives up ceil(T / W) of its steps. With a schedule's K = 0 the chunk
# is one token, so a 256-token prompt takes 256 steps.
#
# The record below (`bench serve --refill both`) serves each method both ways in one run.

# %%
chunked = json.loads((BENCHMARKS_DIR / "spec_decode_serving_chunked.json").read_text())
chunked_note = record_note(chunked)
print(f"device {chunked['device']}; {chunked['command']}"
      + (f"\nwhose numbers: {chunked_note}" if chunked_note else ""))
chunked_best = best_blocks(chunked["records"])  # a chunked run is its own "<method> (chunked)"
for (s, label, c), r in sorted(chunked_best.items()):
    if label == f"{r['method']} (chunked)":
        base, own = chunked_best[s, "target_only", c], chunked_best[s, r["method"], c]
        print(f"{r['method']:<17} concurrency {c:>2}: refills in the steps "
              f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x target-only ({r['batch_steps']} steps), "
              "each its own prefill "
              f"{own['tokens_per_s'] / base['tokens_per_s']:.2f}x ({own['batch_steps']} steps)")
viz.serving_speedup_figure(chunked["records"],
                           title=f"Refills as prefills or carried by the steps ({chunked['device']})")

# %% [markdown]
# On the committed record (an H100, the shipped pair, 256-token prompts, block 16) carrying the refills
# loses at 8 and 32 and ties at 64. A 256-token prompt is 16 chunks, so each refill costs its row 16
# steps: at 8 rows that is two whole steps of the batch per refill, at 32 half a step, against a
# one-row prefill of about one step. The refill's forward is cheap on a GPU because it is one graph.
# In that run a chunked step also launched about 25 small kernels of chunk bookkeeping; the accept
# kernel now does it in its one launch, not yet re-timed. Prompt lookup under its schedule drafts
# nothing (K = 0) from 17 running requests, so its chunk is one token and a refill takes 256 steps.
# vLLM sizes a prefill chunk by a token budget per step (`max_num_batched_tokens`), not by the
# speculation width, so its chunks are far wider than 16 tokens. In bf16, 108 of 128 chunked requests
# at 8 equal target-only's (128/128 with prefills): the prompt's K/V is computed in another order.

# %% [markdown]
# ## Answer

# %%
rows = [
    ["live: DFlash batch steps, static vs continuous", f"{dflash_static} vs {dflash_cont}",
     f"this run ({device_name(device)}, {REQUESTS} requests, {CONCURRENCY} at a time)"],
]
for c in (8, 32, 64):
    rows.append([f"DFlash × target-only at concurrency {c}: continuous / static",
                 f"{speedup('dflash', c, 'continuous'):.2f}x / {speedup('dflash', c, 'static'):.2f}x",
                 f"record ({record['device']})" + (f", {note}" if note else "")])
rows.append(["prompt lookup's schedule (batch ranges, K)", str(schedules["prompt_lookup"].schedule),
             "recommended from the record"])
viz.answer_table(["what", "value", "from"], rows, caption="Chapter 8's answer")

# %% [markdown]
# In words: DFlash's speed-up shrinks at batch mostly because a static batch runs until its slowest
# sequence ends; serving the same requests continuously, as vLLM's scheduler does, recovers most of
# the steps. What remains is the step itself (the bound) and the prefill each new request brings.
