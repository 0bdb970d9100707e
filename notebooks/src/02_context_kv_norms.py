# %% [markdown]
# # Chapter 2 · The context K/V
#
# **Question.** What [context K/V](GLOSSARY.md#context-kv) does the
# [drafter](GLOSSARY.md#drafter) precompute from the [target's](GLOSSARY.md#target)
# features, and do the three ways of computing it agree?
#
# Before a [block](GLOSSARY.md#draft-block) is drafted, every drafter layer needs keys
# and values for every context position: the positions the target has already processed.
# [DFlash](GLOSSARY.md#dflash) computes them once from the target's hidden features and
# then extends them after each step. vLLM projects context K/V for **every
# [verified](GLOSSARY.md#verification) position** of a step, rejected drafts included:
# those rows sit in their cache slots, hidden from attention by `seq_lens`, and are
# overwritten by the next step (`v1/spec_decode/dflash.py:182-187`). The lab
# appends only the accepted positions: the same K/V wherever attention can look, at a
# smaller cost. For drafter layer *l* and context state *x*:
#
# K = RoPE(K-norm(W_K · RMSNorm_l(x))),  V = W_V · RMSNorm_l(x)
#
# The lab computes this three ways, side by side in `dflash_lab/context_kv.py`:
#
# | path | what it does |
# |---|---|
# | `reference` | a loop over layers: the readable definition |
# | `batched` | vLLM 0.33's *structure* in plain torch ops: stacked weights, one batched RMSNorm of L copies of the context, one batched GEMM, one batched K-norm, RoPE on all layers at once |
# | [`folded`](GLOSSARY.md#folded-path) | ours: fold each layer's RMSNorm weight into its K/V rows once, normalise the context once, ONE GEMM for every layer's K and V, then K-norm + RoPE in one pass |
#
# `batched` follows vLLM's three methods (`_build_context_kv_buffers`,
# `_project_context_kv`, `_normalize_context_k`), but vLLM runs its own kernels there:
# a grouped `ops.rms_norm` (`laguna_dflash.py:189-194, 212-217`) and an in-place
# `ops.rotary_embedding` (`qwen3_dflash.py:675-682`, in the `DFlashQwen3Model` that Laguna's
# drafter extends). So any speed-up the lab shows is over a torch re-implementation of vLLM's
# structure, not over vLLM itself.

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the lab reaches the network

import copy
import math

import torch
import torch.nn.functional as F

from dflash_lab import viz
from dflash_lab.assets import default_device, is_shipped_pair, load_default_pair
from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.context_kv import context_kv_agreement
from dflash_lab.drafter import DFlashLagunaDrafter, dflash_attention_mask
from dflash_lab.layers import apply_rope, rope_tables
from dflash_lab.spec_decode import DFlashContext
from dflash_lab.runtime import drafter_path, seed_everything, target_path
from dflash_lab.target import build_target, target_forward, target_layer_ids_spread, tiny_laguna_config
from dflash_lab.widgets import CONTEXT_KV_DTYPES, context_kv_path_explorer, sliding_window_explorer

_ = seed_everything(0)  # (it returns a seeded generator; this chapter does not need one)

# %% [markdown]
# We use the shipped trained pair (the tiny Laguna target and its DFlash drafter),
# or the pair that `DFLASH_LAB_TARGET` / `DFLASH_LAB_DRAFTER` name, when it is there. Without it the chapter still runs, on random weights, and says
# so below: the shapes, the agreement of the paths and the window are the same, only
# the pictures are less interesting.

# %%
# NBVAL_IGNORE_OUTPUT
device = default_device()  # $DFLASH_LAB_DEVICE, else cuda when there is one, else cpu
try:
    target, drafter, tokenizer = load_default_pair(device=device)
    weights = "the shipped trained pair" if is_shipped_pair() else f"your pair: {target_path()} + {drafter_path()}"
except FileNotFoundError as missing:
    if not is_shipped_pair():  # a pair you named must load: its error names what is missing
        raise
    target = build_target(tiny_laguna_config(), seed=0).to(device)
    drafter = DFlashLagunaDrafter(DFlashDrafterConfig.from_dict({
        "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "intermediate_size": 768, "layer_types": ["sliding_attention"] * 3, "sliding_window": 16,
        "draft_vocab_size": 4096, "target_layer_count": 6,
        "dflash_config": {"target_layer_ids": target_layer_ids_spread(6, 3), "mask_token_id": 3, "block_size": 8},
    })).to(device).eval()
    tokenizer = None
    weights = f"RANDOM weights: the trained pair is not available ({type(missing).__name__}: {missing})"
print("device:", device)
print("weights:", weights)
cfg = drafter.config
print(f"drafter: {cfg.num_hidden_layers} x {cfg.layer_type}, {cfg.num_key_value_heads} KV heads of {cfg.head_dim}, "
      f"reads target layers {cfg.target_layer_ids}")

# %% [markdown]
# ## 1 · From target features to context K/V
#
# 48 tokens of Python go through the target once; the outputs of the drafter's
# target layers are combined into one context state per position, and the drafter
# turns those into K and V for each of its layers.

# %%
code = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


for i in range(10):
    print(i, fibonacci(i))
'''
T = 48
if tokenizer is not None:
    token_ids = tokenizer(code * 4)["input_ids"][:T]
else:
    token_ids = torch.randint(4, cfg.draft_vocab_size, (T,), generator=torch.Generator().manual_seed(0)).tolist()
input_ids = torch.tensor([token_ids], device=device)
positions = torch.arange(T, device=device)
with torch.no_grad():
    features = target_forward(target, input_ids, cfg.target_layer_ids)
    context = drafter.combine_hidden_states(features.aux_hidden[0])  # (T, hidden)
    k, v = drafter.precompute_context_kv(context, positions, path="reference")
L, nkv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
print("tokens:", input_ids.shape[1])
print("K is (layers, positions, KV heads, head dim):", tuple(k.shape) == (L, T, nkv, hd))
print("V is (layers, positions, KV heads, head dim):", tuple(v.shape) == (L, T, nkv, hd))

# %% [markdown]
# **The reference path, written out.** `path="reference"` is the formula above as a loop over
# the drafter's layers; here it is again in the chapter, and it gives the same numbers bit for bit:

# %%
def context_kv_by_hand(context, positions):
    cos, sin = rope_tables(cfg, positions, context.dtype)  # (partial) RoPE at these absolute positions
    ks, vs = [], []
    for layer in drafter.layers:
        attn, x = layer.self_attn, layer.input_layernorm(context)  # RMSNorm_l(x): (T, H)
        bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias[attn.q_size:]
        k_raw, v_l = F.linear(x, attn.qkv_proj.weight[attn.q_size:], bias).unflatten(-1, (2, nkv, hd)).unbind(-3)
        ks.append(apply_rope(attn.k_norm(k_raw), cos, sin))  # K-norm per head, then RoPE: (T, nkv, hd)
        vs.append(v_l)  # V as projected
    return torch.stack(ks), torch.stack(vs)  # (L, T, nkv, hd) each

# %%
with torch.no_grad():
    k_hand, v_hand = context_kv_by_hand(context, positions)
print("by hand == precompute_context_kv(path='reference'):", torch.equal(k_hand, k) and torch.equal(v_hand, v))

# %% [markdown]
# **One append after an accepted step.** During decoding the context grows a step at a time.
# Say the target has read positions 0 … 39, and the next step verified `x_40` plus 7 drafts and
# kept 3 of them: positions 40 … 43 are now part of the sequence (the correction token is
# position 44, and the target reads it with the next block). The drafter's context K/V gets
# those 4 positions appended, computed from their own target features; the 40 positions
# before are not touched. `DFlashContext` is the store the lab's loop keeps (absolute slots,
# like vLLM's cache), filled here with the default (folded) path:

# %%
store = DFlashContext(drafter, T, device, context.dtype)
with torch.no_grad():
    store.append(drafter, features.aux_hidden[0, :40])  # the prefill: positions 0 .. 39
    store.append(drafter, features.aux_hidden[0, 40:44])  # one accepted step: x_40 and 3 kept drafts
k_store, v_store = store.kv()
print("context length after the append:", store.length, "| K/V shape:", tuple(k_store.shape))
print("agrees with the reference over positions 0 .. 43 at once (context_kv_agreement):",
      context_kv_agreement((k_store, v_store), (k[:, :44], v[:, :44]))["ok"])

# %% [markdown]
# ## 2 · Norms per layer and position
#
# One cell per (layer, position): the L2 norm of that position's K (all heads
# together) and of its V. K has been through K-norm, so its rows are nearly flat;
# V is the raw projection and carries whatever the context state carries.

# %%
# NBVAL_IGNORE_OUTPUT
viz.context_kv_norms_figure(k, v, positions=positions)

# %% [markdown]
# The same per KV head, for the first and the last drafter layer. Grouped-query
# attention means each KV head serves several query heads; the context store holds
# only the KV heads.

# %%
# NBVAL_IGNORE_OUTPUT
viz.context_kv_head_norms_figure(k, v, layer=0, positions=positions)

# %%
# NBVAL_IGNORE_OUTPUT
viz.context_kv_head_norms_figure(k, v, layer=L - 1, positions=positions)

# %% [markdown]
# ## 3 · What K-norm does
#
# K before K-norm is the raw projection of the normalised context (three lines
# below). K-norm rescales every head vector to unit RMS times its learned weight, so
# the size of K no longer follows the size of the context state; RoPE then only
# rotates, which keeps norms.

# %%
with torch.no_grad():
    k_before = torch.stack([
        F.linear(layer.input_layernorm(context),
                 layer.self_attn.qkv_proj.weight[layer.self_attn.q_size:][: nkv * hd]).unflatten(-1, (nkv, hd))
        for layer in drafter.layers
    ])  # (L, T, nkv, hd)
    k_normed = torch.stack([layer.self_attn.k_norm(kb) for layer, kb in zip(drafter.layers, k_before)])
tol = 1e-4 if k.dtype == torch.float32 else 2e-2
print("K before K-norm has K's shape:", k_before.shape == k.shape)
print("RoPE keeps every head's norm:", torch.allclose(k_normed.norm(dim=-1), k.norm(dim=-1), rtol=tol, atol=tol))

# %%
# NBVAL_IGNORE_OUTPUT
viz.k_norm_effect_figure(k_before, k, positions=positions)

# %% [markdown]
# ## 4 · Three paths, one answer
#
# The paths differ in the order of operations, so they agree to rounding: within
# 1e-5 (relative to the largest value) in float32. In bfloat16 the worst-case bound
# **scales with the largest |K| or |V|**: two paths that round in different orders may
# land two bfloat16 steps apart at that magnitude, and the bound allows **three** (one
# step of stated margin; at least 6e-2), and 5e-3 on average (`context_kv_tolerance`). K has unit RMS after
# K-norm, but trained K-norm weights push |K| past 4, where one step is 2⁻⁵; V is not
# normalised at all. At Laguna-XS.2 shapes the measured worst case was 0.078–0.125.
# The cell prints the bound that applied here.

# %%
drafter32 = copy.deepcopy(drafter).float()
context32 = context.float()
agreements = {}  # (dtype, path) -> context_kv_agreement's verdict, kept for the answer
for dtype_name in CONTEXT_KV_DTYPES:
    dtype = getattr(torch, dtype_name)
    model = drafter32 if dtype == torch.float32 else copy.deepcopy(drafter32).to(dtype)
    with torch.no_grad():
        ref = model.precompute_context_kv(context32.to(dtype), positions, path="reference")
        for path in ("batched", "folded"):
            out = model.precompute_context_kv(context32.to(dtype), positions, path=path)
            agree = agreements[dtype_name, path] = context_kv_agreement(out, ref)
            print(f"{dtype_name:8s} {path:7s} agrees with reference: {agree['ok']} "
                  f"(worst-case bound {agree['max_tol']:.2g} at max |K|,|V| {max(r.abs().max().item() for r in ref):.2g})")

# %% [markdown]
# Switch the path and the dtype: the left panel is that path's ‖K‖, the right panel
# its largest deviation from the reference at each (layer, position), and the line
# above says whether it is within tolerance.

# %%
# NBVAL_IGNORE_OUTPUT
context_kv_path_explorer(drafter32, context32, positions)

# %% [markdown]
# ## 5 · What the sliding window hides, and what causality hides
#
# A block of 8 starts right after 24 context positions. Every query sees the context
# before the block. Inside the block, vLLM decides per layer whether it is
# [causal](GLOSSARY.md#causal) (`_dflash_layer_causal`, first match wins): `is_causal`
# or `dflash_config.causal` if the config sets one; otherwise a layer is **causal
# exactly when it is `sliding_attention`**. A causal
# query sees the block keys at or before its own position; a non-causal one sees the
# whole block. Poolside's real drafters (Laguna-S-2.1-DFlash, XS-2.1) are sliding and
# causal; the DFlash paper's are full attention and non-causal. Why causal for sliding
# layers: vLLM's sliding-window kernels are causal windows `(w, 0)`, and a causal
# drafter can reuse them and the same cache layout as the target's sliding layers.
#
# With a [sliding window](GLOSSARY.md#sliding-window) of *w*, a causal query at position
# *p* sees only keys at positions > *p − w* (window `(w, 0)`); for a non-causal layer
# vLLM makes the window symmetric (`_maybe_symmetrize_window`: `(w, w)`, |*p* − *k*| <
# *w*). The window limits **compute**: the K/V store stays full (vLLM gives DFlash
# drafter layers a full-attention KV cache even when they slide), because the next
# block's queries sit further right and the store is written at absolute positions.

# %%
block_positions = torch.arange(24, 32)[None]
masks = {}  # (causal, window) -> which keys each block query sees, (8 queries, 24 context + 8 block keys)
for causal in (True, False):
    for window in (8, 4, None):
        mask = dflash_attention_mask(block_positions, torch.arange(24), block_size=8, window=window, causal=causal)[0]
        masks[causal, window] = mask
        print(f"{'causal    ' if causal else 'non-causal'} window {str(window):4s}: context keys seen per block query "
              f"{mask[:, :24].sum(-1).tolist()}, block keys seen {mask[:, 24:].sum(-1).tolist()}")

# %% [markdown]
# Toggle the window, move its size and switch causality: blue cells are context keys
# a query sees, orange cells block keys, grey cells hidden. With causality on (vLLM's
# default for sliding layers) the block part is a triangle; off, the window is
# symmetric.

# %%
# NBVAL_IGNORE_OUTPUT
sliding_window_explorer(context_len=24, block_size=8, window=8)

# %% [markdown]
# This drafter's own layers:

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{cfg.layer_type}, window {cfg.window}, causal inside the block: {cfg.is_causal}")

# %% [markdown]
# ## Answer
#
# **What context K/V does the drafter precompute from the target's features, and do
# the three ways of computing it agree?** The numbers this chapter computed:

# %%
def row_spread(x):  # (L, T, nkv, hd) -> mean over layers of (max - min) / mean of the per-head norm along positions
    n = x.float().norm(dim=-1).mean(dim=-1)  # (L, T)
    return ((n.max(dim=1).values - n.min(dim=1).values) / n.mean(dim=1)).mean().item()


bf16_step = 2.0 ** (math.floor(math.log2(max(r.abs().max().item() for r in (k, v)))) - 7)  # at the largest |K|,|V|
worst = {d: max((agreements[d, p] for p in ("batched", "folded")), key=lambda a: a["max_err"]) for d in CONTEXT_KV_DTYPES}
f32, b16 = worst["float32"], worst["bfloat16"]
seen = masks[True, 8][:, :24].sum(-1)
viz.answer_table(["question", "this run"], [
    ["numbers per context position", f"{L * 2 * nkv * hd:,} ({L} layers x K and V x {nkv} heads x {hd})"],
    ["spread of per-head |K| along positions", f"{row_spread(k_before):.2f} before K-norm, {row_spread(k):.2f} after "
                                               f"(V, not normalised: {row_spread(v):.2f})"],
    ["float32: worst path vs reference", (f"under {10 ** math.ceil(math.log10(f32['max_err'])):.0e}"
                                          if f32["max_err"] else "0 (identical)") + f" (bound {f32['max_tol']:.1e})"],
    ["bfloat16: worst path vs reference", f"{b16['max_err'] / bf16_step:.3g} rounding step(s) (bound "
                                          f"{b16['max_tol'] / bf16_step:.3g}: paths may land 2 apart, the rest is "
                                          f"margin; a step is {bf16_step:.3g})"],
    ["every path within its bound", str(all(a["ok"] for a in agreements.values()))],
    ["a causal window of 8: context keys a block query sees", f"{seen.max().item()} down to {seen.min().item()} of 24 "
                                                              f"(the store keeps all {k.shape[1]})"],
], caption="Chapter 2's answer, computed in this run")

# %% [markdown]
# **Where next.** Chapter 3 puts the context K/V to work: draft, verify, accept, and
# how far into the block the drafter stays right.
