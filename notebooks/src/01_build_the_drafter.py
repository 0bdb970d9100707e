# %% [markdown]
# # Chapter 1 · Build the drafter
#
# **Question.** What is a Laguna DFlash drafter made of, and how does vLLM validate
# and load it?
#
# DFlash drafts a whole block of tokens in **one** forward pass of a small drafter.
# The drafter owns no embedding and no `lm_head`: it borrows both from the Laguna
# target. What it owns is a handful of Laguna-flavoured decoder layers, plus a
# small adapter (`aux_hidden_norms`, `fc`, `hidden_norm`) that turns the outputs of a
# few target layers into the drafter's *context*.
#
# This chapter walks the drafter the way vLLM 0.33's `DFlashLagunaForCausalLM` sees
# it: its `config.json` and the rules vLLM enforces on it, the module, the checkpoint
# layout, and one draft block with the shape of every tensor on the way.

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the lab reaches the network

import copy
import tempfile
from pathlib import Path

import torch

from dflash_lab import viz
from dflash_lab.assets import default_device
from dflash_lab.checkpoint import CheckpointError, load_drafter, save_drafter
from dflash_lab.config import DFlashDrafterConfig
from dflash_lab.drafter import DFlashLagunaDrafter
from dflash_lab.runtime import seed_everything
from dflash_lab.target import build_target, target_forward, target_layer_ids_spread, tiny_laguna_config
from dflash_lab.widgets import drafter_config_explorer

_ = seed_everything(0)  # (it returns a seeded generator; this chapter does not need one)

# %% [markdown]
# ## 1 · The config
#
# A drafter checkpoint is a directory with a `config.json` in Hugging Face style.
# Next to the usual Laguna attention fields it carries three DFlash-specific things:
#
# - `layer_types`: one entry per drafter layer, all `full_attention` or all
#   `sliding_attention`;
# - `dflash_config`: which **target** layers feed the drafter (`target_layer_ids`),
#   the token that fills the block after its first position (`mask_token_id`), and
#   the block size it was trained for;
# - `draft_vocab_size`: must equal the target's vocabulary, because the drafter
#   uses the target's `lm_head`.
#
# Our target is the small Laguna of this lab: 6 layers, hidden size 256, a 4096-token
# vocabulary. The drafter reads three of its layers, spread over its depth.

# %%
target_config = tiny_laguna_config()
layer_ids = target_layer_ids_spread(target_config.num_hidden_layers, 3)
config_dict = {
    "architectures": ["DFlashLagunaForCausalLM"],
    "model_type": "laguna",
    "hidden_size": 256,  # = the target's: embeddings and lm_head are shared
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,
    "layer_types": ["full_attention", "full_attention"],
    "draft_vocab_size": 4096,
    "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": 3, "block_size": 8},
    "target_layer_count": target_config.num_hidden_layers,  # vLLM reads it off the target
}
cfg = DFlashDrafterConfig.from_dict(config_dict)
print("target layers read:", cfg.target_layer_ids)
print(f"layer type: {cfg.layer_type}, RoPE on {cfg.rotary_dim} of {cfg.head_dim} channels "
      f"(theta {cfg.rope['rope_theta']:g}), gate per head: {cfg.gate_per_head}, window: {cfg.window}")

# %% [markdown]
# The defaults come from Laguna: a full-attention layer rotates half of each head
# (`partial_rotary_factor` 0.5) with a long-context theta, a sliding layer rotates all
# of it. `gating=True` means one softplus gate per head, as in transformers'
# `LagunaConfig`.
#
# ## 2 · What vLLM refuses, on purpose
#
# vLLM's `laguna_dflash.py` rejects five kinds of broken config. `from_dict`
# enforces the same rules, and every error names the key. Each broken config below
# is caught and its message printed.

# %%
def broken(**edits):
    d = copy.deepcopy(config_dict)
    for key, value in edits.items():
        if value is None:
            d.pop(key)
        else:
            d[key] = value
    return d


cases = {
    "no layer_types": broken(layer_types=None),
    "3 types for 2 layers": broken(layer_types=["full_attention"] * 3),
    "mixed layer types": broken(layer_types=["full_attention", "sliding_attention"]),
    "no target layers": broken(dflash_config={"target_layer_ids": [], "mask_token_id": 3}),
    "no draft_vocab_size": broken(draft_vocab_size=None),
}
for label, d in cases.items():
    try:
        DFlashDrafterConfig.from_dict(d)
    except (ValueError, NotImplementedError) as e:
        print(f"{label:21s} -> {type(e).__name__}: {e}")

# %% [markdown]
# A config that is fine on its own can still not fit a target. `validate_against_target`
# checks the pairing: the vocabulary, that every target layer id exists, the mask
# token, and that the target's hidden size is what `fc` expects.

# %%
cfg.validate_against_target(target_config)
print("pairs with the tiny Laguna target: ok")
for label, target in {
    "a 32k-vocabulary target": {"vocab_size": 32000, "num_hidden_layers": 6, "hidden_size": 256},
    "a 3-layer target": {"vocab_size": 4096, "num_hidden_layers": 3, "hidden_size": 256},
    "a 512-wide target": {"vocab_size": 4096, "num_hidden_layers": 6, "hidden_size": 512},
}.items():
    try:
        cfg.validate_against_target(target)
    except ValueError as e:
        print(f"{label}: {e}")

# %% [markdown]
# ## 3 · The module
#
# The drafter is built on the GPU when there is one (set `DFLASH_LAB_DEVICE` to
# override), else on the CPU. Its parameter names are exactly vLLM's checkpoint names,
# so its state dict *is* a vLLM drafter checkpoint.

# %%
# NBVAL_IGNORE_OUTPUT
device = default_device()  # $DFLASH_LAB_DEVICE, else cuda when there is one, else cpu
drafter = DFlashLagunaDrafter(cfg).to(device).eval()
print("device:", device)

# %%
print(drafter)

# %% [markdown]
# vLLM registers drafter layer *j* as attention layer `target_layer_count + j` (the
# target's depth, 6 here), so the drafter's KV cache never collides with the target's:

# %%
print(drafter.attention_layer_names())

# %% [markdown]
# ## 4 · Save and load, in vLLM's layout
#
# `save_drafter` writes `config.json` + `model.safetensors` into a temporary
# directory and renames it into place, so a crash never leaves half a checkpoint.
# `load_drafter` checks every name and shape before it copies anything.

# %%
workdir = Path(tempfile.mkdtemp(prefix="dflash-chapter1-"))
save_drafter(drafter, workdir / "drafter")
print(sorted(p.name for p in (workdir / "drafter").iterdir()))
reloaded = load_drafter(workdir / "drafter", device=device)
same = all(torch.equal(a, b) for a, b in zip(drafter.state_dict().values(), reloaded.state_dict().values()))
print("config equal:", reloaded.config == drafter.config, "| every tensor equal:", same)

# %% [markdown]
# A checkpoint that does not match its config is refused with the names of what is
# wrong, and pickled weights (`.bin`) are never opened: unpickling can run code.

# %%
from safetensors.torch import load_file, save_file

bad = workdir / "bad"
save_drafter(drafter, bad)
tensors = load_file(str(bad / "model.safetensors"))
del tensors["layers.1.mlp.up_proj.weight"]
tensors["fc.weight"] = tensors["fc.weight"][:, :256].contiguous()
save_file(tensors, str(bad / "model.safetensors"))
for attempt in ("mismatch", "pickle"):
    if attempt == "pickle":
        (bad / "model.safetensors").unlink()
        (bad / "pytorch_model.bin").write_bytes(b"never unpickled")
    try:
        load_drafter(bad)
    except CheckpointError as e:
        print(str(e).replace(str(workdir), "<workdir>"), end="\n\n")

# %% [markdown]
# ## 5 · The parameters
#
# Every tensor, named as in the vLLM checkpoint. Two layers of attention and MLP make
# up most of it; `fc` maps the three concatenated target layers (3 × 256) to 256.

# %%
rows = [(name, tuple(t.shape), t.numel()) for name, t in drafter.state_dict().items()]
print(f"{len(rows)} tensors, {sum(r[2] for r in rows):,} parameters")
print("no embed_tokens / lm_head:", not any("embed_tokens" in r[0] or "lm_head" in r[0] for r in rows))

# %%
# NBVAL_IGNORE_OUTPUT
viz.parameter_table_figure(rows, title="Laguna DFlash drafter: tensors in vLLM's checkpoint layout")

# %% [markdown]
# Change the config and watch what vLLM would say and which tensors change. Depth adds
# whole layers; sliding layers have exactly the tensors of full ones (the window and
# RoPE are settings, not weights); a per-channel gate makes `g_proj` 64 times wider;
# mixed layer types are refused.

# %%
# NBVAL_IGNORE_OUTPUT
drafter_config_explorer(config_dict)

# %% [markdown]
# ## 6 · One draft block, step by step
#
# Random weights are enough to see the data path. A random tiny Laguna target
# processes a 12-token prompt; the drafter then drafts one block of 8.
#
# **Step 1: target features.** The target runs once and we keep the outputs of
# layers 1, 2 and 4, concatenated along the hidden dimension.

# %%
target = build_target(target_config, seed=0).to(device)
prompt = torch.randint(4, 4096, (1, 12), generator=torch.Generator().manual_seed(0)).to(device)
with torch.no_grad():
    out = target_forward(target, prompt, cfg.target_layer_ids)
print("prompt      ", tuple(prompt.shape), "            (batch, T)")
print("aux hidden  ", tuple(out.aux_hidden.shape), "       (batch, T, 3 target layers x 256)")

# %% [markdown]
# **Step 2: context.** `combine_hidden_states` normalises each target layer's slice,
# concatenates, projects with `fc` and normalises again: one 256-wide state per
# position. **Step 3: context K/V.** Every drafter layer's K and V of those states,
# computed once (chapter 2 looks inside).

# %%
with torch.no_grad():
    context = drafter.combine_hidden_states(out.aux_hidden[0])
    positions = torch.arange(context.shape[0], device=device)
    k, v = drafter.precompute_context_kv(context, positions)
print("context     ", tuple(context.shape), "           (T, hidden)")
print("context K, V", tuple(k.shape), tuple(v.shape), "(layers, T, KV heads, head dim)")

# %% [markdown]
# **Step 4: the block.** The last token the target produced, then 7 mask tokens,
# embedded with the **target's** table at positions 12..19. **Step 5: one drafter
# forward**: queries are the 8 block positions, keys are the 12 context positions
# plus the block itself, with no causal mask inside the block. **Step 6: the target's
# `lm_head`** turns the drafter's output into logits; positions 1..7 are the draft.

# %%
last_token = out.logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
block_ids = torch.cat([last_token, torch.full((1, cfg.block_size - 1), cfg.mask_token_id, device=device)], dim=1)
block_positions = torch.arange(12, 12 + cfg.block_size, device=device)[None]
with torch.no_grad():
    noise = target.get_input_embeddings()(block_ids)
    hidden = drafter(noise, block_positions, k, v, positions)
    logits = target.lm_head(hidden)
draft = logits[0, 1:].argmax(-1)
print("block ids   ", tuple(block_ids.shape), "            (batch, block)")
print("embeddings  ", tuple(noise.shape), "       (batch, block, hidden)")
print("drafter out ", tuple(hidden.shape))
print("logits      ", tuple(logits.shape), "      (batch, block, vocab)")
print("draft       ", tuple(draft.shape), "               block - 1 proposed tokens")

# %%
# NBVAL_IGNORE_OUTPUT
print("block:", block_ids[0].tolist())
print("draft:", draft.tolist(), "(random weights: not meaningful yet; chapter 3 uses the trained pair)")

# %% [markdown]
# **Where next.** Chapter 2 opens up step 3, the context K/V: what the three
# implementations compute and what the sliding window hides. Chapter 3 runs the
# draft → verify → accept loop with the trained pair.
