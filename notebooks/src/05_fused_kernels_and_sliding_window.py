# %% [markdown]
# # Chapter 5 · Fused kernels and the sliding window
#
# **Question.** What do the fused kernel and the sliding window change?
#
# ## In plain words
#
# Chapter 2 showed what the [drafter](GLOSSARY.md#drafter) precomputes before every
# draft: a key and a value for each of its layers at each position the target has
# already accepted, the [context K/V](GLOSSARY.md#context-kv). This chapter asks how
# fast that can be done, and what happens if the drafter looks at less of it.
#
# * **A kernel** is one function the GPU runs over a whole tensor. It reads its
#   inputs from the GPU's memory and writes its result back there. For small
#   per-element steps (scale a row, rotate pairs of numbers) that round trip takes far
#   longer than the arithmetic itself.
# * **Fused** means several such steps done by *one* kernel: the data is read once,
#   every step happens while it sits in the chip's fast registers, and the result is
#   written once. The arithmetic is the same; the trips to memory are fewer. See
#   [fused kernel](GLOSSARY.md#fused-kernel).
# * **Folded** is a bit of algebra done once, before any token arrives. Each drafter
#   layer normalises its input (RMSNorm: divide a row by its size, multiply by a
#   learned weight per channel) and then multiplies by its K/V weight matrix.
#   Multiplying the learned weight into the matrix ahead of time ("folding" it in)
#   leaves a normalisation that is the same for every layer, so it runs once instead of
#   once per layer, and all layers' matrices can be stacked into one big matrix
#   product. See [folded path](GLOSSARY.md#folded-path).
# * **The [sliding window](GLOSSARY.md#sliding-window)** lets each query of the draft
#   [block](GLOSSARY.md#draft-block) look only at the nearest keys. That is less
#   attention work, and it costs accepted tokens whenever a hidden key held something
#   the drafter needed. The cache itself stays full.
#
# Fusing and folding should change only the time, not the numbers (up to rounding);
# the window changes what the drafter sees, on purpose. The chapter times the three
# paths on the machine it runs on (a CPU or a GPU) and sets them beside a committed run
# on an H200 at a real drafter's size. The fused kernel runs only on a CUDA GPU with
# Triton; elsewhere its switch says so and stays off.
#
# **In engineering terms**, these are two knobs of the drafter that change *cost* but
# should not change *what it computes* — or, for the window, change it on purpose:
#
# 1. **The fused context-K/V kernel.** Every token the target accepts becomes
#    drafter context: for every drafter layer, its K (after K-norm and RoPE) and V.
#    This precompute runs at every step and sits outside the CUDA graph of the
#    query path, so its cost is paid in full. The lab has three ways to compute it
#    (`reference`, `batched`, `folded`); on a GPU the folded one ends in **one
#    Triton kernel**. Same numbers, different speed — we check both.
# 2. **The sliding window.** A sliding-window drafter lets a block query see only
#    keys within `window` positions (and, by vLLM's rule, a sliding layer is also
#    [causal](GLOSSARY.md#causal) inside the block: `_dflash_layer_causal`, vLLM 0.33 `qwen3_dflash.py:62-73`). vLLM keeps the
#    drafter's K/V cache *full* anyway (DFlash writes the verifier's context at
#    absolute slots); the window is a compute-time limit. So it can be switched at
#    inference time — and we can measure what it costs in acceptance.

# %%
import copy
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the lab reaches the network

import torch
from IPython.display import Markdown, display
from tqdm.auto import tqdm

from dflash_lab import viz
from dflash_lab import context_kv_kernel as kernels
from dflash_lab.assets import default_device, heldout_prompts, load_default_pair, record_note
from dflash_lab.context_kv import context_kv_agreement
from dflash_lab.drafter import with_window
from dflash_lab.repro import rounded
from dflash_lab.runtime import REPO_ROOT, seed_everything
from dflash_lab.spec_decode import generate_on_prompts
from dflash_lab.target import target_forward
from dflash_lab.measure import context_kv as bench_context_kv, decoding as bench_fast_decode
from dflash_lab.measure.decoding import records_of
from dflash_lab.measure.repetition import setting_line
from dflash_lab.measure.timing import XS2
from dflash_lab.viz.kernels import context_kv_live_figure
from dflash_lab.widgets import fused_kernel_explorer, window_acceptance_explorer

seed_everything(0)
device = torch.device(default_device())
target, drafter, tokenizer = load_default_pair(device=device)
cfg = drafter.config
print("device:", device.type)
print(f"drafter: {cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads x head_dim {cfg.head_dim}, "
      f"rotary dim {cfg.rotary_dim}, layer type {cfg.layer_type}, window from its config: {cfg.window}, "
      f"causal inside the block: {cfg.is_causal}")

# %% [markdown]
# ## 1 · A real context
#
# The drafter's context is the target's own hidden features: run the target on a
# held-out prompt, keep the outputs of the layers the drafter reads, and combine
# them (`combine_hidden_states`). That gives `N` context rows of width `H`.

# %%
prompt_texts = [p["text"] for p in heldout_prompts()]
encode = lambda text, n: tokenizer(text, return_tensors="pt")["input_ids"][:, -n:].to(device)  # noqa: E731
ids = encode(prompt_texts[0], 256)
with torch.no_grad():
    features = target_forward(target, ids, cfg.target_layer_ids, use_cache=False)
    context = drafter.combine_hidden_states(features.aux_hidden[0]).float()  # (N, H)
positions = torch.arange(context.shape[0], device=device)
print("context:", tuple(context.shape), "positions", int(positions[0]), "..", int(positions[-1]))

# %% [markdown]
# ## 2 · Three paths, one answer
#
# - **reference** — a loop over layers: input RMSNorm, K/V projection, K-norm, RoPE.
# - **batched** — vLLM 0.33's structure: stack every layer's weights, normalise the
#   context once *per layer* (L copies), one batched GEMM, one batched K-norm, RoPE.
# - **folded** — `RMSNorm(x)·w_l` followed by `W_l` is `x̂ @ (W_l·w_l)ᵀ`: fold each
#   layer's norm weight into its K/V rows once, normalise the context **once**, run
#   **one** GEMM `[N, H] × [H, L·2·nkv·hd]` for every layer's K and V.
#
# The folded path's algebra, as code, in float32 on the drafter in use (biases, where a config has them, add
# after either product and are left out here):

# %%
d32, x = copy.deepcopy(drafter).float(), context.float()  # x: the context state (N, H)
x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)  # RMSNorm without its weight: one per x
per_layer, folded_rows = [], []
for layer in d32.layers:
    attn, w = layer.self_attn, layer.input_layernorm.weight  # w: this layer's RMSNorm weight (H,)
    W = attn.qkv_proj.weight[attn.q_size:]  # this layer's K and V rows (2*nkv*hd, H)
    per_layer.append((x_hat * w) @ W.T)  # what each layer does: scale by w, then project; L products
    folded_rows.append(W * w)  # the fold, done once before any token: w multiplied into W's columns
one_gemm = x_hat @ torch.cat(folded_rows).T  # ONE product for every layer's K and V: (N, L*2*nkv*hd)
gap = (torch.cat(per_layer, dim=1) - one_gemm).abs().max().item()
print(f"{len(per_layer)} products of ({x.shape[0]}, {x.shape[1]}) x ({x.shape[1]}, {W.shape[0]}) vs one of "
      f"({x.shape[0]}, {x.shape[1]}) x ({x.shape[1]}, {one_gemm.shape[1]}): equal to float32 rounding: {gap < 1e-4}")

# %% [markdown]
# K-norm and RoPE then run on the K columns of that one product, as in every path. The three paths must agree:
# to float32 rounding in float32, within bf16 rounding in bf16.

# %%
variants = [("batched", "batched", None), ("folded", "folded", False)]
if kernels.fused_available(context):
    variants.append(("folded + Triton", "folded", True))
paths_agree = {}  # (dtype, path) -> within tolerance of the reference, kept for the answer
for dtype_name in ("float32", "bfloat16"):
    model = copy.deepcopy(drafter).to(getattr(torch, dtype_name))
    ctx = context.to(getattr(torch, dtype_name))
    with torch.no_grad():
        ref = model.precompute_context_kv(ctx, positions, path="reference")
        for name, path, fused in variants:
            out = model.precompute_context_kv(ctx, positions, path=path, fused=fused)
            paths_agree[dtype_name, name] = context_kv_agreement(out, ref)["ok"]
            print(f"{dtype_name:9s} {name:16s} agrees with the reference: {paths_agree[dtype_name, name]}")

# %% [markdown]
# ## 3 · The fused kernel
#
# On a GPU the folded path is three launches: the context's `1/rms` per row (one
# read of `[N, H]`), the GEMM on the **raw** context (RMSNorm is a per-row scale,
# and a per-row scale commutes with a matrix product), and **one Triton kernel**
# that reads the GEMM output once and writes K and V once:
#
# ```
# GEMM output (N, L, 2, nkv, hd)  ──►  × 1/rms(x)          (the input RMSNorm, moved here)
#                                      K: RMSNorm per head, × k_norm weight
#                                      K: RoPE on the first rotary_dim channels
#                                      K, V  ──►  (L, N, nkv, hd) each
# ```
#
# The numerics are Laguna's: normalise in float32, cast to the input dtype, multiply
# by the weight; RoPE in the input dtype with cos/sin computed in float32 from the
# positions. In torch the same epilogue is several passes over the largest tensor
# of the step (norm, RoPE, the permute copy).
#
# Whether it runs is decided per call: `precompute_context_kv(..., fused=None)` (the
# default) runs it where `kernels.fused_available` says it can — not on a CPU, not
# without Triton, not when `DFLASH_LAB_FUSED=0`; `fused=False` never runs it, and
# `fused=True` insists on it.

# %%
print("fused kernel available here:", kernels.fused_available(context))
L, N, nkv, hd = 5, 32768, 8, 128  # Laguna-XS.2-sized drafter, a 32k context
gemm_flop = 2 * N * 2048 * L * 2 * nkv * hd
print(f"at L={L}, N={N}: GEMM {gemm_flop / 1e12:.2f} TFLOP; "
      f"epilogue moves {kernels.epilogue_bytes(N, L, nkv, hd, torch.bfloat16) / 1e9:.2f} GB (GEMM output read once, K and V written once)")

# %% [markdown]
# ## 4 · What it costs, measured here
#
# First on this machine, now: the three paths on the shipped drafter itself (its own
# shapes and dtype) at a few context lengths, next to the folded path's GEMM alone, the
# one product every path must do. Each is timed with `measure.timing.time_ms` (median
# after warm-up: CUDA events on a GPU, a host clock on a CPU, where torch runs on one
# thread so that other work on a small shared CPU moves the numbers less), in three
# interleaved rounds, keeping each path's fastest. On a GPU with Triton the fused kernel
# is timed too. About ten seconds on a 2-core CPU.

# %%
# NBVAL_IGNORE_OUTPUT
LIVE_CONTEXTS = [128, 512, 2048]
started = time.perf_counter()
live = bench_context_kv.time_context_kv_live(drafter, contexts=LIVE_CONTEXTS, device=device)
live_s = time.perf_counter() - started
live_paths = list(dict.fromkeys(r["path"] for r in live))
print(f"timed now on {live[0]['device']}, {live[0]['dtype']}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size} "
      f"({live_s:.1f} s); every path agrees with the reference: {all(r['agrees'] for r in live)}")
print("N       " + "".join(f"{p:>15s}" for p in live_paths))
for n in LIVE_CONTEXTS:
    print(f"{n:<8d}" + "".join(f"{bench_context_kv.lookup_ms(live, p, cfg.num_hidden_layers, n):12.3f} ms" for p in live_paths))

# %% [markdown]
# Beside it, the committed run: every path at Laguna-XS.2's drafter shapes, in bf16, in
# one process with CUDA events, `benchmarks/context_kv.json`
# (`python -m dflash_lab.tools.bench context-kv`). On a GPU the next cell measures that
# run again now (a minute, `torch.compile` included) for the explorer below.

# %%
# NBVAL_IGNORE_OUTPUT
committed = json.loads((REPO_ROOT / "benchmarks" / "context_kv.json").read_text())
if device.type == "cuda":
    records, _ = bench_context_kv.run_context_kv(layers=[5], contexts=[1024, 8192, 32768], device=device,
                                                 dtype=torch.bfloat16, compiled=True,
                                                 fused=kernels.fused_available(context), progress=lambda s: None)
else:
    records = committed
print("XS.2-shaped timings from:", records[0]["device"], "(live)" if records is not committed else "(committed run)")

# %%
xs2_shapes = (f"Laguna-XS.2 shapes: hidden {XS2['hidden_size']}, {XS2['num_key_value_heads']} KV heads × "
              f"{XS2['head_dim']}, bfloat16")
context_kv_live_figure(live, committed, committed_layers=5, live_what="the drafter in use", committed_what=xs2_shapes)

# %%
# NBVAL_IGNORE_OUTPUT
def times(a_ms, b_ms):
    """'2.3× faster' / '1.4× slower': how the path that took b_ms compares with the one that took a_ms."""
    r = a_ms / b_ms
    return f"{r:.1f}× faster" if r >= 1 else f"{1 / r:.1f}× slower"


L_here, N_top = cfg.num_hidden_layers, max(LIVE_CONTEXTS)
here = {p: bench_context_kv.lookup_ms(live, p, L_here, N_top) for p in live_paths}
there = {p: bench_context_kv.lookup_ms(committed, p, 5, 32768) for p in ("reference", "batched", "folded", "gemm_floor")}
display(Markdown(
    f"Here ({live[0]['device']}, N = {N_top}): `batched` is {times(here['reference'], here['batched'])} than the "
    f"reference loop and `folded` is {times(here['reference'], here['folded'])}; the GEMM alone takes "
    f"{here['gemm_floor'] / here['folded']:.0%} of the folded path's time. On the {committed[0]['device']} at "
    f"Laguna-XS.2 shapes (L = 5, N = 32768) the same two paths are {times(there['reference'], there['batched'])} "
    f"and {times(there['reference'], there['folded'])} than the loop, and the GEMM is {there['gemm_floor'] / there['folded']:.0%} "
    f"of the folded path. Either way, what separates the paths is not the product, which they share, but the "
    f"passes over memory around it (norms, RoPE, copies): how much they cost next to the GEMM depends on the "
    f"machine and on the shapes. Why `batched` can lose to the loop on a CPU: it writes L = {L_here} normalised "
    f"copies of the context ({L_here * N_top * cfg.hidden_size * 4 / 2**20:.1f} MB in float32 at N = {N_top}) before "
    f"its batched product reads them back, and a CPU gains nothing from launching fewer kernels (it launches none); "
    f"on a GPU, where each launch and each pass over memory costs, stacking the layers is what pays."
    + (f" The fused kernel here: {times(here['folded'], here['folded_triton'])} than the folded path in torch."
       if "folded_triton" in here else "")))

# %% [markdown]
# The lab's targets for the fused kernel, on the committed H200 run at L = 5, N = 32768:
# the fused path at least 4× faster than the reference, 1.5× faster than `torch.compile`
# of the batched path, and within 1.25× of the GEMM alone. Read the middle ratio for
# what it is: `batched` is vLLM's *structure* in torch ops; vLLM itself runs custom
# kernels there (a grouped `ops.rms_norm`, an in-place `ops.rotary_embedding`), so these
# are speed-ups over a torch re-implementation, not over vLLM.

# %%
for t in bench_context_kv.context_kv_targets(committed):
    print(f"{t['ratio']:34s} {t['value']:.2f}  goal {t['goal']:7s} met: {t['met']}")

# %%
epilogue_ms = kernels.epilogue_bytes(N, L, nkv, hd, torch.bfloat16) / 4e12 * 1e3  # one read + one write at 4 TB/s
display(Markdown(
    f"Why the GEMM is the floor: every path must at least multiply the context by every layer's K/V weights. The "
    f"folded path does exactly that product once; what is left above the floor is the epilogue's one read and one "
    f"write (about {epilogue_ms:.2f} ms at an H200's 4 TB/s at L = {L}, N = {N}) and the row `1/rms` pass. On the "
    f"{committed[0]['device']} the eager `batched` path is only {there['reference'] / there['batched']:.2f}× the "
    f"loop's speed at N = 32768: its elementwise passes (L copies of the normalised context, norms, RoPE, a permute "
    f"copy) cost more than its GEMM."))

# %% [markdown]
# Pick a path and flip the kernel. The line under the controls says what ran **here**,
# whether it agrees with the reference, and how long it took here (`time_ms`, on the
# context of §1). On a CUDA GPU with Triton the checkbox switches the fused
# kernel for the folded path and the line gives that path's time with and without it;
# on a CPU the checkbox is off and disabled, and says that the kernel needs a GPU. The
# chart highlights what the choice costs at Laguna-XS.2's shapes on the GPU.

# %%
# NBVAL_IGNORE_OUTPUT
fused_kernel_explorer(drafter, context, positions, records)

# %% [markdown]
# ## 5 · Measured: does DFlash make decoding faster?
#
# Speculative decoding exists to be faster, so measure it. The teaching loop
# (`speculative_generate`) is the wrong thing to time on a GPU: it runs
# transformers' forward with a growing cache, hundreds of tiny kernels launched
# one by one from Python, and on a target as small as the shipped one that is
# launch overhead, not arithmetic. The lab's fast path
# (`dflash_lab.spec_decode.fast.decoder`) computes the same thing the way a server
# does: static KV caches written in place (slot = position, so a rejected draft
# needs no crop), the MoE as grouped GEMMs, RMSNorm and head-norm + RoPE as one
# kernel each, and every decode step — draft, verify, context-K/V append,
# accept — captured as **one [CUDA graph](GLOSSARY.md#cuda-graph)** and replayed.
# Greedy output is token for token the same (float32; tests/test_fast_decode.py).
# Several prompts can share a batch, each accepting its own number of drafts per step.
#
# [τ](GLOSSARY.md#tau), the mean acceptance length, is the number of tokens one
# [target forward](GLOSSARY.md#verification) yields: the ceiling of the speedup if
# drafting were free and verifying B tokens cost as much as one. The measured speedup is
# tokens/s over plain greedy decoding through the same machinery.

# %%
# NBVAL_IGNORE_OUTPUT
speed = json.loads((REPO_ROOT / "benchmarks" / "spec_decode.json").read_text())
speed_records, phases = records_of(speed["records"], "heldout"), speed["phases"]  # the held-out set (the other below)
docstring_records = records_of(speed["records"], "docstring")
if device.type == "cuda":  # a quick live run: batch 1, block 16, 8 prompts x 64 tokens (~half a minute)
    live_prompts = [tokenizer(p["text"], return_tensors="pt")["input_ids"][0, -256:].to(device)
                    for p in heldout_prompts()[:8]]
    speed_records = bench_fast_decode.measure_fast_decoding(target, {"paper": drafter}, live_prompts, batches=[1],
                                                            block_sizes=[16], graphs=(True,), max_new_tokens=64,
                                                            progress=lambda s: None)
    phases = bench_fast_decode.phase_breakdown(target, {"paper": drafter}, live_prompts, block_size=16, max_new_tokens=64)
print("speed from:", speed_records[0]["device"], "(live)" if device.type == "cuda" else "(committed run)")
SPEED_OWNER = None if device.type == "cuda" else record_note(speed)  # whose numbers the committed run holds
if SPEED_OWNER:
    print(f"whose numbers: {SPEED_OWNER}; its tau and speed-ups are that pair's")

# %%
base = {(r["batch"], r["cuda_graphs"]): r["tokens_per_s"] for r in speed_records if r["method"] == "target_only"}
print(setting_line(f"{speed['n_prompts']} held-out prompts (last 256 tokens)", speed["max_new_tokens"], "4 / 8 / 16",
                   "longer generations in bf16 on a GPU (the target's continuations differ from CPU float32's)"))
for r in speed_records:
    if r["cuda_graphs"] and r["batch"] == 1:
        tau = f"tau {r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else "tau -   "
        print(f"{r['method']:14s} block {r['block_size']:>2}: {r['tokens_per_s']:7.0f} tok/s  "
              f"{r['tokens_per_s'] / base[(1, True)]:.2f}x plain greedy  {tau}")

# %%
viz.speedup_vs_tau_figure(speed_records)

# %%
# NBVAL_IGNORE_OUTPUT
if docstring_records and device.type != "cuda":  # the committed run's second prompt set: the same methods
    plain = {r["batch"]: r["tokens_per_s"] for r in docstring_records if r["method"] == "target_only" and r["cuda_graphs"]}
    ds = speed.get("prompt_sets", {}).get("docstring", {})
    print(f"setting: {ds.get('n_prompts', '?')} docstring-first prompts, {ds.get('max_new_tokens', '?')} new tokens "
          "each, batch 1, graphs on (the committed run)")
    for r in docstring_records:
        if r["cuda_graphs"] and r["batch"] == 1 and r["block_size"] == 16:
            print(f"docstring-first prompts, {r['method']:15s} block 16: {r['tokens_per_s'] / plain[1]:.2f}x plain greedy, "
                  f"tau {r['mean_acceptance_length']:.2f}")

# %%
ph = phases
step_ms = {m: sum(ph[m][f"{k}_ms_per_step"] for k in ("draft", "verify", "append", "accept")) for m in ph}
verify_ratio = ph["dflash"]["verify_ms_per_step"] / ph["target_only"]["verify_ms_per_step"]
drafting_ms = step_ms["dflash"] - ph["dflash"]["verify_ms_per_step"]
b16 = {r["batch"]: r["tokens_per_s"] / base[(r["batch"], True)] for r in speed_records
       if r["method"] == "dflash" and r["block_size"] == 16 and r["cuda_graphs"]}
tau16 = next(r["mean_acceptance_length"] for r in speed_records if r["method"] == "dflash" and r["block_size"] == 16
             and r["batch"] == 1 and r["cuda_graphs"])
batches = sorted(b16)
trend = ("" if len(batches) == 1 else ", and it shrinks as the batch grows"
         if all(b16[a] > b16[b] for a, b in zip(batches, batches[1:])) else ", and it changes with the batch")
display(Markdown(
    f"On the {speed_records[0]['device']}, DFlash at block 16 reaches "
    + ", ".join(f"{b16[b]:.2f}× at batch {b}" for b in batches)
    + f", against τ {tau16:.2f} at batch 1: the speedup stays {'well ' if b16[batches[0]] < 0.75 * tau16 else ''}"
    f"under τ{trend}. Both have the same cause on a model this small: every kernel is latency-bound, so a "
    f"step costs about the same whatever it computes. Verifying {ph['dflash']['block_size']} tokens costs "
    f"{verify_ratio:.2f}× one token's forward ({ph['dflash']['verify_ms_per_step']:.3f} vs "
    f"{ph['target_only']['verify_ms_per_step']:.3f} ms) — that part works for DFlash — but the drafter step is not "
    f"free: the drafter's layers, the lm_head, the context-K/V append and the acceptance add {drafting_ms:.3f} ms, "
    f"{drafting_ms / step_ms['target_only']:.0%} of a plain decoding step ({step_ms['target_only']:.3f} ms)."
    + (f" At batch {batches[-1]} the target's own forward is already shared by {batches[-1]} sequences, and drafting "
       "adds work that plain decoding does not do." if batches[-1] > 1 else "")
    + " [Prompt lookup](GLOSSARY.md#prompt-lookup) has no drafter forward, but "
    "its drafts come from the host, so every step waits for a read-back."))

# %% [markdown]
# Where one batch-1 step's time goes, each phase captured as its own graph:

# %%
taus = {"dflash": next(r["mean_acceptance_length"] for r in speed_records if r["method"] == "dflash"
                       and r["block_size"] == phases["dflash"]["block_size"] and r["batch"] == 1 and r["cuda_graphs"])}
viz.step_time_figure(phases, taus=taus)

# %% [markdown]
# ### Laguna-XS.2 measured at its true shape, and Poolside's speed-ups predicted
#
# At 8.8 M parameters every kernel waits on latency; Laguna-XS.2 is 40 layers of MoE experts.
# `benchmarks/xs2_steps.json` (`python -m dflash_lab.tools.bench_xs2_steps`) measures it on an
# H200: all 40 layers with its real pattern (one full-attention layer in four, a dense first layer,
# 256 experts top-8), random bf16 weights, the graphed static path, each step beside the bytes it
# must read (its *floor*: only the experts its tokens are routed to). A speed model turns a mean
# acceptance length τ into a speed-up:
#
# $$\text{speed-up} = \tau \cdot \frac{T_\text{target}(1)}{T_\text{target}(B) + T_\text{drafter}(B)}, \qquad B = 16$$
#
# It is checked against Poolside's model cards (`dflash_lab/poolside_cards.py`: τ and the speed-up
# per benchmark at 15 speculative tokens) and against the shipped pair's committed records, where
# τ and the speed-up are both measured. It leaves out tensor parallelism (the S-2.1 cards run on 2
# GPUs), quantization (INT4/FP8/NVFP4), the engine's own per-step work and concurrency; S-2.1 was
# not measured (118 B parameters do not fit on one H200), so its rows reuse XS.2's cost ratio.
# Random weights route to fewer distinct experts than a trained router would (the record says how
# many), so the 16-token step is, if anything, cheaper here than on Laguna itself.
#
# On the static path each layer's attention is one Triton kernel (`spec_decode.fast.attention`):
# which cache slots a query sees is computed from its position (causal, the sliding window, a draft
# tree's ancestors) instead of read from a mask over every slot, only those slots are read, and
# Laguna's softplus gate is applied on the way out. vLLM gets the same from its attention backends
# (FlashAttention with a window; the gate is Laguna's own). A decode token's products are one-row
# GEMVs (`spec_decode.fast.gemv`): the routed experts read only their 8 chosen experts, one program per
# (expert, column tile), and the dense projections beat cuBLAS at one row. The record prints what
# the attention kernel saves against the masks + SDPA route. In the committed run the router runs
# inside the routed experts' gate/up launch, the attention's splits are merged by the last of them,
# each kernel starts while the previous one drains (programmatic dependent launch,
# `spec_decode.fast.pdl`, with the same steps timed without it), and the one-row kernel runs at the
# tiles swept on that card (`gemv.CARD_TILES`, `benchmarks/gemv_tiles_h200.md`). An H100 run of the
# same code (`benchmarks/xs2_steps_h100.json`) is printed beside it: there the loop that loads the next
# weight chunk before it multiplies the current one won the sweep (`benchmarks/gemv_tiles_h100.md`).

# %%
import statistics  # noqa: E402

from dflash_lab.measure.speed_model import XS2_STEPS, lab_pair_table, poolside_table  # noqa: E402
from dflash_lab.viz.speed_model import predicted_vs_published_figure  # noqa: E402

xs2 = json.loads(XS2_STEPS.read_text())
at = f" at commit {xs2['code']}" if xs2.get("code") else ""
print(f"measured on {xs2.get('device', '?')}{at} (committed run; the shapes are Laguna-XS.2's, not the pair loaded here)")
for kind in ("target", "drafter"):
    for t in xs2[kind]:
        print(f"{kind:>7}, {t['block']:>2} tokens: {t['ms']:6.2f} ms measured, floor {t['floor_ms']:.2f} ms at 4.8 TB/s "
              f"({t['over_floor']:.1f}x the floor at the {xs2['copy_bandwidth_Bps'] / 1e12:.2f} TB/s copy bandwidth)")
fused = {t["block"]: t["ms"] for t in xs2["target"]}
for o in xs2.get("target_sdpa_attention", []):  # the static path's attention kernel against masks + SDPA
    print(f"attention kernel ({xs2['device']}, same run): target {o['block']:>2} tokens {fused[o['block']]:.2f} ms, "
          f"with masks + SDPA {o['ms']:.2f} ms")
other_run = XS2_STEPS.with_name("xs2_steps_h100.json")  # the same code on another card
if other_run.exists():
    a = json.loads(other_run.read_text())
    at = f" at commit {a['code']}" if a.get("code") else ""
    print(f"the same steps on {a['device']}{at}, every static-path kernel on: "
          + ", ".join(f"{t['block']} token(s) {t['ms']:.2f} ms ({t['over_floor']:.2f}x its floor there)"
                      for t in a["target"])
          + "; drafter " + ", ".join(f"{t['block']}: {t['ms']:.2f} ms" for t in a["drafter"]))
    for o in a.get("target_without_pdl", []):
        print(f"  without programmatic dependent launch: {o['block']} token(s) {o['ms']:.2f} ms")
    other = poolside_table(a)
    print(f"Poolside's cards predicted from that run: median ratio predicted / published "
          f"{statistics.median(r['ratio_measured'] for r in other):.2f} (from the H200 record below: "
          f"{statistics.median(r['ratio_measured'] for r in poolside_table(xs2)):.2f})")
cards, lab = poolside_table(xs2), lab_pair_table()
held = speed.get("prompt_sets", {}).get("heldout", {})
print("setting: each card's tau is Poolside's, on that benchmark's prompts at 15 speculative tokens (block 16); the "
      f"shipped pair's rows are the committed H200 run's {held.get('n_prompts', '?')} held-out prompts, "
      f"{held.get('max_new_tokens', '?')} new tokens each")
for r in cards:
    c = "-" if r["concurrency"] is None else r["concurrency"]
    print(f"{r['card'].split('/')[-1]:<26} {r['benchmark']:<9} c={c:<2} tau {r['tau']:.2f}: published {r['published']:.2f}x, "
          f"predicted {r['predicted_measured']:.2f}x (ratio {r['ratio_measured']:.2f}), at the floors "
          f"{r['predicted_floor']:.2f}x (ratio {r['ratio_floor']:.2f})")
for r in lab:
    print(f"shipped pair, batch {r['batch']:>2}, block {r['block']:>2}: tau {r['tau']:.2f}, measured {r['measured']:.2f}x, "
          f"predicted {r['predicted']:.2f}x (ratio {r['ratio']:.2f})")

# %%
# NBVAL_IGNORE_OUTPUT
predicted_vs_published_figure(cards, lab)

# %% [markdown]
# Points on the dashed line are predicted exactly. The shipped pair at batch 1 lies close to it; at
# batch 8 and 32 the model overestimates, because the sequences of a static batch accept different
# lengths and the batch runs until its slowest one ends. The card rows add what the model leaves out
# (parallelism, quantization, the engine, concurrency) on top of Laguna-XS.2's random-weight routing.

# %% [markdown]
# ## 6 · The sliding window: which keys a block query sees
#
# A block of `B` tokens starts right after the context. Each block query sees the
# context before the block. Inside the block vLLM's rule applies: a `sliding_attention`
# layer is **causal** (a query sees block keys at or before itself) unless the config
# says `causal: false`; a `full_attention` layer is not. With a window `w`, a causal
# query only sees keys less than `w` positions back (vLLM's window `(w, 0)`); a
# non-causal query sees |q − k| < w in both directions (vLLM symmetrises the window,
# `_maybe_symmetrize_window`). Here a context of 24 tokens, a block of 8, window 8,
# causal as Poolside's sliding drafters are: the first query (the real token) sees
# the last 7 context keys and itself, each later query one context key fewer and one
# block key more; the last sees no context at all — only its own block up to itself.

# %% [markdown]
# Chapter 2 draws this mask and lets you move the window and flip causality (its explorer, with the count of keys
# each query sees); §7's explorer below draws it once more, beside the acceptance each window gives.

# %% [markdown]
# ## 7 · What the window costs in acceptance
#
# The window only limits what the drafter *looks at*: weights, RoPE and the K/V store
# are untouched, so `with_window(drafter, w)` keeps the weights and cuts attention at
# `w` — here symmetric, because the shipped drafter is full attention and so
# non-causal. This is a lab experiment, not a config vLLM would serve: in vLLM, making
# a layer `sliding_attention` also makes it causal and gives it the sliding entry of
# `rope_parameters` (`model_executor/models/laguna.py:365-373`). Greedy speculative
# decoding on held-out prompts with the shipped pair, for several windows and for full
# attention.

# %%
# NBVAL_IGNORE_OUTPUT
BLOCK, MAX_NEW, PROMPT_TOKENS = 8, 16, 64
prompts = [encode(text, PROMPT_TOKENS) for text in prompt_texts[:6]]
by_window = {}
for w in tqdm([None, 32, 8], desc="windows"):
    by_window[w], _ = generate_on_prompts(target, with_window(drafter, w), prompts, max_new_tokens=MAX_NEW,
                                          block_size=BLOCK, progress=False)

# %%
print(setting_line(f"{len(prompts)} held-out prompts (last {PROMPT_TOKENS} tokens)", MAX_NEW, BLOCK,
                   "a few short prompts and a short budget, so every window runs in seconds"))
for w, stats in by_window.items():
    print(f"{'full attention' if w is None else f'window {w}':15s} tau {rounded(stats.mean_acceptance_length, 3)}  "
          f"drafts {stats.num_drafts}")

# %%
viz.window_acceptance_figure(by_window)

# %% [markdown]
# A window hides the prompt's earlier lines from the drafter: a wide one costs
# little, a short one leaves only what can be guessed from the last few tokens, and
# acceptance drops. (This drafter was trained with full attention; one trained with
# its window would lose less.) Turn the window on and off and
# move it: the mask on top, the acceptance it gives below (each new window runs
# the prompts once; the ones above are cached).

# %%
# NBVAL_IGNORE_OUTPUT
window_acceptance_explorer(target, drafter, prompts, block_size=BLOCK, max_new_tokens=MAX_NEW, window=8,
                           results=by_window)

# %% [markdown]
# ## Answer
#
# **What do the fused kernel and the sliding window change?** The numbers this chapter
# computed:

# %%
targets = {t["ratio"]: t["value"] for t in bench_context_kv.context_kv_targets(committed, L=L, N=N)}
dflash16 = next(r for r in speed_records if r["method"] == "dflash" and r["block_size"] == 16 and r["batch"] == 1
                and r["cuda_graphs"])
full, w32, w8 = (by_window[w].mean_acceptance_length for w in (None, 32, 8))
speed_from = f"{'this run' if device.type == 'cuda' else 'committed run'}, {dflash16['device']}" + (
    f" ({SPEED_OWNER})" if SPEED_OWNER else "")
viz.answer_table(["what", "value", "from"], [
    ["every context-K/V path equals the reference (float32, bfloat16)", str(all(paths_agree.values())),
     "this run"],
    [f"τ on {len(prompts)} held-out prompts, {MAX_NEW} new tokens, block {BLOCK}: full attention / window 32 / 8",
     f"{full:.2f} / {w32:.2f} / {w8:.2f}", "this run"],
    [f"fused folded path at Laguna-XS.2 shapes (L = {L}, N = {N}) vs the reference loop / torch.compile'd batched / "
     "the GEMM alone", f"{targets['reference / folded_triton']:.1f}x faster / {targets['batched_compiled / folded_triton']:.1f}x "
     f"faster / within {targets['folded_triton / gemm_floor']:.2f}x", f"committed run, {committed[0]['device']}"],
    [f"DFlash, block 16, {speed['n_prompts']} held-out prompts, {speed['max_new_tokens']} new tokens: τ and speed-up "
     "over plain greedy", f"τ {dflash16['mean_acceptance_length']:.2f}, {dflash16['tokens_per_s'] / base[(1, True)]:.2f}x",
     speed_from],
], caption="Chapter 5's answer: what this run computed, and what only the committed GPU runs measure")

# %%
# NBVAL_IGNORE_OUTPUT
viz.answer_table(["path (the drafter in use, N = " + str(N_top) + ")", "vs the reference loop, timed now"], [
    ["batched", times(here["reference"], here["batched"])],
    ["folded (torch)", times(here["reference"], here["folded"])],
    ["folded + fused kernel", times(here["reference"], here["folded_triton"]) if "folded_triton" in here
     else "needs a CUDA GPU with Triton: not run here"],
], caption=f"Timed in this run on {live[0]['device']} (varies run to run)")

# %% [markdown]
# - The three context-K/V paths compute the same K and V; the fused kernel keeps the
#   folded path's one GEMM and replaces every other pass with one read and one write.
# - What is left above the GEMM is that one read and one write of the GEMM output
#   (only fusing the epilogue into the GEMM itself would remove it).
# - The sliding window is a compute-time limit: it changes which keys a query sees,
#   not the cache. Shrinking it below the useful context costs acceptance. In vLLM a
#   sliding drafter layer is also causal inside the block (unless its config says
#   otherwise), with a one-sided window; a non-causal layer's window is symmetric.
