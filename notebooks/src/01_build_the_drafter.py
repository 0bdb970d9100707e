# %% [markdown]
# # Chapter 1 · Build the drafter
#
# **Question.** What is a Laguna DFlash drafter made of, and how does vLLM validate
# and load it?
#
# [DFlash](GLOSSARY.md#dflash) drafts a whole [block](GLOSSARY.md#draft-block) of tokens in
# **one** forward pass of a small [drafter](GLOSSARY.md#drafter). The drafter owns no embedding
# and no `lm_head`: it borrows both from the Laguna [target](GLOSSARY.md#target). What it owns
# is a handful of Laguna-flavoured decoder layers, plus a small adapter (`aux_hidden_norms`,
# `fc`, `hidden_norm`) that turns the outputs of a few target layers into the drafter's
# *context* ([context K/V](GLOSSARY.md#context-kv)).
#
# This chapter walks the drafter the way vLLM 0.33's `DFlashLagunaForCausalLM` sees
# it: its `config.json` and the rules vLLM enforces on it, Poolside's real drafter configs,
# the module, the checkpoint layout, and one draft block, first with the shape of every
# tensor, then step by step with the trained pair. Words in the [glossary](GLOSSARY.md) are
# linked the first time they appear.

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the lab reaches the network

import copy
import json
import tempfile
from pathlib import Path

import torch
from IPython.display import HTML

from dflash_lab import presets, viz
from dflash_lab.assets import (default_device, drafter_path, heldout_prompts, is_shipped_pair, load_default_pair,
                               target_path)
from dflash_lab.checkpoint import CheckpointError, load_drafter, save_drafter
from dflash_lab.measure.repetition import setting_line
from dflash_lab.config import DFlashDrafterConfig, config_key_table, rope_resolution_table
from dflash_lab.drafter import DFlashLagunaDrafter, dflash_attention_mask
from dflash_lab.runtime import seed_everything
from dflash_lab.spec_decode import speculative_generate
from dflash_lab.target import build_target, target_forward, target_layer_ids_spread, tiny_laguna_config
from dflash_lab.widgets import drafter_config_explorer, step_through

_ = seed_everything(0)  # (it returns a seeded generator; this chapter does not need one)

# %% [markdown]
# ## 1 · The config
#
# A drafter checkpoint is a directory with a `config.json` in Hugging Face style.
# Next to the usual Laguna attention fields it carries three DFlash-specific things:
#
# - `layer_types`: one entry per drafter layer, all `full_attention` or all
#   `sliding_attention`; the type also decides whether attention inside the draft block is
#   [causal](GLOSSARY.md#causal): vLLM makes a `sliding_attention` layer causal (block query j
#   sees block keys 0..j) and a `full_attention` layer not (every query sees the whole block),
#   unless `is_causal` or `dflash_config.causal` says otherwise;
# - `dflash_config`: which **target** layers feed the drafter (`target_layer_ids`),
#   the token that fills the block after its first position (`mask_token_id`, the
#   [mask token](GLOSSARY.md#mask-token); vLLM falls back to a top-level `mask_token_id` when
#   this one is absent, `v1/worker/gpu/spec_decode/utils.py:99-109`, and so does the lab), the
#   block size it was trained for (`block_size`), and optionally `causal`. vLLM never reads
#   `block_size` for DFlash: it drafts the `num_speculative_tokens` you pass, which it requires
#   (`config/speculative.py:1614-1618`), and runs a value above `block_size - 1` unchecked. The lab
#   reads `block_size` only as the default of `speculative_generate(..., block_size=None)`
#   (= `num_speculative_tokens + 1`) and runs a larger block as vLLM does;
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
print("causal inside the block:", cfg.is_causal, "(full_attention and no causal key: vLLM's rule says no)")

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
# ## 3 · Real drafters: Poolside's configs
#
# Poolside publishes its Laguna DFlash drafters. `dflash_lab.presets` holds the
# Laguna-S-2.1-DFlash `config.json` verbatim and a config with Laguna-XS-2.1-DFlash's published
# shape, each with a matching target config. Both are **sliding-window** drafters with
# `dflash_config.causal: true`, so vLLM runs them causal inside the block; the DFlash paper's
# drafters, and this lab's shipped one, are full attention and not causal. Each is validated
# against its target, counted at full size (built on PyTorch's `meta` device: shapes, no
# memory), and built for real with the widths and vocabulary shrunk
# (`presets.shrink_drafter_config`, which keeps layer types, causality, window, RoPE, layer ids
# and gate).

# %%
for name in presets.DRAFTER_PRESETS:
    d, target_d = presets.drafter_preset(name)
    real = DFlashDrafterConfig.from_dict(d)
    real.validate_against_target(target_d)
    with torch.device("meta"):  # full size, shapes only
        full = DFlashLagunaDrafter(real).state_dict()
    n_params = sum(t.numel() for t in full.values())
    small = DFlashLagunaDrafter(DFlashDrafterConfig.from_dict(presets.shrink_drafter_config(d)))
    print(f"{name}: pairs with a {target_d['num_hidden_layers']}-layer target; {len(full)} tensors, "
          f"{n_params / 1e9:.3f} B parameters; "
          f"{real.num_hidden_layers} x {real.layer_type}, window {real.window}, causal {real.is_causal}")
    print("   built shrunk:", sum(p.numel() for p in small.parameters()), "parameters; vLLM's layer names:",
          small.attention_layer_names()[0], "...", small.attention_layer_names()[-1])

# %% [markdown]
# Laguna-S-2.1-DFlash comes to 1.115 B parameters in 69 tensors, as a public port plan of the
# S-2.1 pair says. Its drafter layers register after the target's 48, as `model.layers.48` …
# `model.layers.53`.
#
# **RoPE: what the file says and what vLLM serves.** The S-2.1 file carries one flat
# `rope_theta: 500000` and no `rope_parameters`. vLLM reads a drafter directory through
# transformers' `LagunaConfig`, which does not move a flat `rope_theta` anywhere: both layer
# types keep Laguna's defaults (`full_attention` θ 500000 on half of each head, which happens
# to equal the file's value; `sliding_attention` θ 10000 on all of it). Each vLLM layer then
# picks its entry (`laguna.py:365-373`: its layer type's, else `full_attention`'s). These
# drafters are all sliding, so vLLM serves them with θ 10000, not the file's 500000. The lab
# follows vLLM, says which key each value came from, and flags the difference:

# %%
d_s21, _ = presets.drafter_preset("laguna-s-2.1-dflash")
for row in rope_resolution_table(d_s21):
    flag = "  <- differs from the file" if row["differs"] else ""
    print(f"{row['layer_type']:18s} theta in file {row['rope_theta_in_file']:>9g}   vLLM serves "
          f"{row['rope_theta_served']:>9g}   partial rotary {row['partial_rotary_factor']:g}{flag}")
    print(f"{'':18s} from {row['rope_from']}")
print("the S-2.1 drafter's own layers run theta", DFlashDrafterConfig.from_dict(d_s21).rope["rope_theta"])

# %% [markdown]
# **The other keys vLLM reads.** A sliding layer takes `swa_rope_parameters` instead of its
# entry when the file has it (`laguna.py:380-394`); a top-level `partial_rotary_factor` is
# added to an entry that has none (`:398-400`); `swa_attention_sink_enabled` gives sliding
# layers a learned sink per head (`:354-358, 485-488`), which the lab's drafter does not have,
# so the lab refuses it by name. For the layer ids, `eagle_aux_hidden_state_layer_ids` wins when
# non-empty (an empty list counts as absent, `eagle3_utils.py:120`), but
# `dflash_config.target_layer_ids` must be there too: `DFlashLagunaModel` reads it
# (`laguna_dflash.py:78`). vLLM also takes aux id 0 (the embedding output,
# `laguna.py:656-658`); the lab captures layer outputs only and refuses it, saying so. The
# top-level rotary factor may also be spelled `rotary_pct` or `rotary_emb_fraction`: vLLM's
# `patch_rope_parameters` reads them, in that order, after `partial_rotary_factor`
# (`transformers_utils/config.py:675-683`), and so does the lab. The S-2.1
# file with one key changed at a time, as the lab reads it (a test builds vLLM's own drafter on
# such configs and checks every θ and rotary width):

# %%
def s21_with(**changes):
    d = copy.deepcopy(d_s21)
    for key, value in changes.items():
        if key == "target_layer_ids":
            d["dflash_config"].pop("target_layer_ids")
        else:
            d[key] = value
    return d


variants = {
    "as published": s21_with(),
    "swa_rope_parameters theta 250000": s21_with(swa_rope_parameters={"rope_theta": 250000.0}),
    "partial_rotary_factor 0.5, swa entry without one": s21_with(swa_rope_parameters={"rope_theta": 10000.0},
                                                                 partial_rotary_factor=0.5),
    "swa_attention_sink_enabled true": s21_with(swa_attention_sink_enabled=True),
    "aux ids, no target_layer_ids": s21_with(target_layer_ids=None),
    "aux ids empty": s21_with(eagle_aux_hidden_state_layer_ids=[]),
    "aux ids start at 0": s21_with(eagle_aux_hidden_state_layer_ids=[0, 11, 20, 30, 39, 48]),
}
for label, d in variants.items():
    try:
        c = DFlashDrafterConfig.from_dict(d)
        print(f"{label:48s} -> theta {c.rope['rope_theta']:g}, rotary {c.rotary_dim}/{c.head_dim}, "
              f"aux ids {c.aux_hidden_state_layer_ids}")
    except (ValueError, NotImplementedError) as e:
        print(f"{label:48s} -> {type(e).__name__}: {str(e).split(': ', 1)[1][:110]}...")

# %% [markdown]
# Each key, what vLLM 0.33 does with it and what the lab does, for the published S-2.1 file
# (`config.config_key_table`):

# %%
for row in config_key_table(d_s21):
    print(f"{row['key']:34s} file: {str(row['in_file'])[:26]:26s} vLLM: {row['vllm']}\n{'':34s} lab: {row['lab']}")

# %% [markdown]
# **Asking vLLM itself.** The lab's rules are vLLM's, written out; vLLM 0.33 is installed, so
# the same questions can go to its own functions: `get_config` reads the directory (through the
# strict `LagunaConfig`), `_dflash_layer_causal` decides each layer's causality, and
# `get_eagle3_aux_layers_from_config` resolves which target hidden states feed the drafter.
# Importing vLLM takes a while on a CPU.

# %%
# NBVAL_IGNORE_OUTPUT
import logging
from types import SimpleNamespace

logging.getLogger("vllm").setLevel(logging.ERROR)  # vLLM's platform notes (no GPU here) are not this chapter's
logging.getLogger("torch").setLevel(logging.ERROR)
# vLLM is a heavy optional dependency: imported here, for this one check, not at the top.
from vllm.model_executor.models.qwen3_dflash import _dflash_layer_causal  # noqa: E402
from vllm.transformers_utils.config import get_config  # noqa: E402
from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config  # noqa: E402

# %%
def ask_vllm(d: dict) -> tuple:
    """vLLM 0.33's own reading of a drafter config.json: causality per layer, aux layer ids, theta."""
    folder = Path(tempfile.mkdtemp(prefix="dflash-chapter1-vllm-"))
    (folder / "config.json").write_text(json.dumps(d))
    hf = get_config(str(folder), trust_remote_code=False)
    causal = [_dflash_layer_causal(hf, i) for i in range(hf.num_hidden_layers)]
    aux = list(get_eagle3_aux_layers_from_config(SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))))
    own = hf.rope_parameters.get(hf.layer_types[0], hf.rope_parameters)
    return causal, aux, float(own["rope_theta"])


for name in presets.DRAFTER_PRESETS:
    d, _ = presets.drafter_preset(name)
    causal, aux, theta = ask_vllm(d)
    lab = DFlashDrafterConfig.from_dict(d)
    agree = causal == [lab.is_causal] * lab.num_hidden_layers and aux == lab.aux_hidden_state_layer_ids \
        and theta == lab.rope["rope_theta"]
    print(f"{name}: vLLM causal per layer {causal}, aux ids {aux}, theta {theta:g}; the lab agrees: {agree}")

# %% [markdown]
# ## 4 · The module
#
# The drafter is built on the GPU when there is one (set `DFLASH_LAB_DEVICE` to
# override), else on the CPU. Its parameter names are exactly vLLM's checkpoint names, and
# the `config.json` the lab writes is one vLLM 0.33 reads. That second half was not always
# true: the lab used to write `"sliding_window": null` for a full-attention drafter, and
# transformers' strict `LagunaConfig` (vLLM's way into a drafter directory) refuses a null
# window. Now an absent window is left out and both layer-id keys
# (`eagle_aux_hidden_state_layer_ids`, which vLLM reads first, and
# `dflash_config.target_layer_ids`) are written and agree, so a saved drafter *is* a vLLM
# drafter checkpoint: a CI test hands it to vLLM's `get_config` and `SpeculativeConfig`.

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
# ## 5 · Save and load, in vLLM's layout
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
written = json.loads((workdir / "drafter" / "config.json").read_text())
print("sliding_window written:", "sliding_window" in written, "| eagle_aux_hidden_state_layer_ids:",
      written["eagle_aux_hidden_state_layer_ids"], "= target_layer_ids + 1:", written["dflash_config"]["target_layer_ids"])

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
# ## 6 · The parameters
#
# Every tensor, named as in the vLLM checkpoint. Two layers of attention and MLP make
# up most of it; `fc` maps the three concatenated target layers (3 × 256) to 256.

# %%
rows = [(name, tuple(t.shape), t.numel()) for name, t in drafter.state_dict().items()]
print(f"{len(rows)} tensors, {sum(r[2] for r in rows):,} parameters")
print("no embed_tokens / lm_head:", not any("embed_tokens" in r[0] or "lm_head" in r[0] for r in rows))

# %%
# NBVAL_IGNORE_OUTPUT
HTML(viz.parameter_table_html(rows, caption="Laguna DFlash drafter: tensors in vLLM's checkpoint layout"))

# %%
# NBVAL_IGNORE_OUTPUT
viz.parameter_bars_figure(rows)

# %% [markdown]
# Change the config, or load Poolside's, and watch what vLLM would say, how it resolves each
# layer, and which tensors change. Depth adds whole layers; sliding layers have exactly the
# tensors of full ones (the window, causality and RoPE are settings, not weights) but switch
# causality on unless `dflash_config.causal` says otherwise; a per-channel gate makes `g_proj`
# 64 times wider; mixed layer types are refused. The RoPE table flags a θ that vLLM serves
# differently from the file.

# %%
# NBVAL_IGNORE_OUTPUT
drafter_config_explorer(config_dict, target_config=target_config)

# %% [markdown]
# ## 7 · One draft block, step by step
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
# plus the block itself. This drafter's layers are `full_attention`, so by vLLM's rule they are
# not causal: every block query sees every block key (a sliding drafter such as Poolside's
# would be causal, query j seeing block keys 0..j). **Step 6: the target's `lm_head`** turns
# the drafter's output into logits; positions 1..7 are the draft.

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
print("draft:", draft.tolist(), "(random weights: not meaningful yet)")

# %% [markdown]
# The mask the drafter used, drawn: left of the dotted line the 12 context keys, right of it
# the block's 8 keys; and the same block as vLLM would run it in a sliding, causal drafter
# (window 8).

# %%
# NBVAL_IGNORE_OUTPUT
ctx_pos = torch.arange(12)
for causal, window, label in ((cfg.is_causal, cfg.window, "this drafter: full attention, not causal"),
                              (True, 8, "a sliding drafter (window 8): causal, as vLLM runs Poolside's")):
    mask = dflash_attention_mask(block_positions.cpu(), ctx_pos, cfg.block_size, window, causal=causal)[0]
    viz.visibility_mask_figure(mask, query_positions=block_positions[0], key_positions=torch.cat(
        [ctx_pos, block_positions[0].cpu()]), context_len=12, title=f"Which keys each block query sees: {label}").show()

# %% [markdown]
# ### The same block with the trained pair: draft → verify → accept
#
# The pair the lab loads (the shipped one, the tiny Laguna code target and its trained DFlash drafter,
# unless `$DFLASH_LAB_TARGET` / `$DFLASH_LAB_DRAFTER` name yours; the cell prints which) generates
# 32 tokens after a held-out Python prompt, in blocks of 8. Move the step slider (or press ▶):
# each step shows the block the drafter read, its guess at every position, the target's
# choice from its one [verification](GLOSSARY.md#verification) forward, which guesses were
# accepted, the first rejection, the [correction](GLOSSARY.md#correction-token) or
# [bonus](GLOSSARY.md#bonus-token) token, and how many target forwards the step saved. The
# grid beside it is this drafter's attention inside the block. Step 0 is the prefill (the target
# reads the prompt and says the first new token; nothing is drafted); the slider opens on the
# first step that keeps some drafts and then rejects one, the step printed below the figure.
# Chapter 3 measures this over many prompts.

# %%
# NBVAL_IGNORE_OUTPUT
PAIR = "the shipped pair" if is_shipped_pair() else f"your pair ({target_path().name} + {drafter_path().name})"
print("pair:", PAIR)
target_t, drafter_t, tokenizer = load_default_pair(device=device)
prompt_ids = tokenizer(heldout_prompts()[0]["text"])["input_ids"][-64:]
run = speculative_generate(target_t, drafter_t, prompt_ids, max_new_tokens=32, block_size=8)
step_through(run, tokenizer, drafter=drafter_t, title=f"{PAIR[0].upper()}{PAIR[1:]}, block 8, greedy")

# %%
shown = next((i for i, st in enumerate(run.steps) if 0 < st.num_accepted < len(st.draft_ids)), 1)  # the slider opens here
first = run.steps[shown]
print(f"step 0: the prefill, {len(run.steps[0].draft_ids)} drafted, emitted {len(run.steps[0].token_ids)} token")
print(f"step {shown} (the slider's first): drafted {len(first.draft_ids)}, accepted {first.num_accepted}, emitted "
      f"{len(first.token_ids)} tokens for one target forward")
st = run.stats
emitted = st.num_drafts + st.num_accepted_tokens  # every verification step emits its accepted drafts + one token
print(setting_line("held-out prompt 1 (its last 64 tokens)", 32, 8, "one prompt, a short budget, a smaller block"))
print(f"τ {st.mean_acceptance_length:.2f} = 1 + {st.num_accepted_tokens} accepted / {st.num_drafts} drafts: the "
      f"{st.num_drafts} verification steps emitted {emitted} tokens, {emitted - (st.num_generated_tokens - 1)} of "
      "them past the 32-token budget; vLLM counts those too (it counts accepted drafts before its stop check)")
print(f"what the run kept: {st.num_generated_tokens} tokens in {st.num_target_forwards} target forwards (the prefill "
      f"included) = {st.num_generated_tokens / st.num_target_forwards:.2f} tokens per target forward")

# %% [markdown]
# ## Answer
#
# **What is a Laguna DFlash drafter made of, and how does vLLM validate and load it?** The
# numbers this chapter computed:

# %%
s21 = DFlashDrafterConfig.from_dict(d_s21)
with torch.device("meta"):
    s21_params = sum(t.numel() for t in DFlashLagunaDrafter(s21).state_dict().values())
print(f"- Made of: {cfg.num_hidden_layers} Laguna decoder layers + the adapter (aux norms, fc, hidden norm): "
      f"{len(rows)} tensors, {sum(r[2] for r in rows):,} parameters here; no embedding, no lm_head.")
print(f"- Poolside's Laguna-S-2.1-DFlash: {s21.num_hidden_layers} sliding layers, {s21_params / 1e9:.3f} B parameters, "
      f"causal inside the block: {s21.is_causal}, theta served {s21.rope['rope_theta']:g} "
      f"(file: {d_s21['rope_theta']:g}).")
print(f"- vLLM refuses {len(cases)} kinds of broken config; a drafter pairs with a target only if vocabulary, "
      "layer ids, mask token and widths fit.")
print(f"- It registers as {drafter.attention_layer_names()[0]} ... after the target's {target_config.num_hidden_layers} "
      "layers; the lab's config.json is read by vLLM 0.33 unchanged.")
print(f"- One step of {PAIR} (step {shown}): {len(first.draft_ids)} drafted in one drafter forward, "
      f"{first.num_accepted} accepted by one target forward; over the run (one prompt, 32 new tokens, block 8), "
      f"τ {run.stats.mean_acceptance_length:.2f}, {st.num_generated_tokens / st.num_target_forwards:.2f} tokens "
      "per target forward.")

# %% [markdown]
# **Where next.** Chapter 2 opens up step 3, the context K/V: what the three
# implementations compute and what the sliding window hides. Chapter 3 runs the
# draft → verify → accept loop with the trained pair over many prompts and counts how far
# into the block the drafter stays right.
