# %% [markdown]
# # Chapter 4 · Hybrid KV-cache groups: which group is the drafter's?
#
# **Question.** A hybrid model mixes sliding-window, full-attention and Mamba/GDN
# layers, and a speculative drafter adds attention layers of its own. How does vLLM
# pack all of them into *KV-cache groups*, and how does it know which group belongs
# to the drafter?
#
# Every layer that keeps state per request is described by a **KV-cache spec**
# (`FullAttentionSpec`, `SlidingWindowSpec`, `MambaSpec`, the MLA specs, ...). vLLM
# groups the layers so that the layers of one group share one **block table**: the
# same block ids, allocated and freed together. The scheduler also has to know which
# groups hold the drafter's layers (`KVCacheGroupSpec.is_eagle_group`). If it gets this
# wrong, either the drafter's blocks are never found, or, on a hybrid model, Mamba
# state is treated as draft cache.
#
# Everything below runs **vLLM 0.33's own grouping** (`get_kv_cache_groups`) on the
# CPU. The lab builds the per-layer specs and applies the drafter-group rules of
# upstream vLLM #55390 on top (`dflash_lab/kv_groups.py`).

# %%
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the grouping is host-side bookkeeping
# vLLM's and torch's own notes (padding layers, platform hints, deprecations) would
# land in the printouts; the memory tables below show the facts that matter here.
for noisy in ("vllm", "torch"):
    logging.getLogger(noisy).setLevel(logging.ERROR)

from pathlib import Path

from dflash_lab import kv_groups as kv
from dflash_lab import viz
from dflash_lab.repro import seed_everything
from dflash_lab.widgets import kv_groups_explorer

seed_everything(0)  # nothing here is random; kept so every chapter starts the same way

# %%
# NBVAL_IGNORE_OUTPUT
# The first call imports vLLM (a few seconds; torch may print platform notes).
print("vLLM", kv.vllm_version())


# %% [markdown]
# Small helpers keep the cells short. `group` runs vLLM's grouping plus the rules and
# prints one line per group (`*` marks a layer whose spec carries the draft marker,
# `<- draft group` a flagged group); `group_both` does it on both layouts. `draw` turns
# groups into a figure: one row per group, one cell per layer, coloured by spec kind.

# %%
def group(specs, method, model_type, layout="LBHNC", **kwargs):
    with kv.captured_warnings() as warned:
        groups = kv.kv_cache_groups(specs, method=method, model_type=model_type, layout=layout, **kwargs)
    print(kv.format_groups(groups, specs))
    for message in warned:
        print("WARNING:", message)
    return groups, (warned[0] if warned else None)


def group_both(specs, method, model_type):
    """`group` on the general and the packed layout; the groups of each, by layout."""
    found = {}
    for layout in ("LBHNC", "BLHNC"):
        print(f"{layout} ({kv.LAYOUTS[layout]})")
        found[layout], _ = group(specs, method, model_type, layout=layout)
    return found


def draw(groups, specs, title, warning=None):
    return viz.kv_group_layout_figure(kv.describe_groups(groups, specs), title=title, warning=warning)


# %% [markdown]
# ## 1 · Three models and their groups
#
# ### Laguna + DFlash
#
# A Laguna-shaped target: (sliding, sliding, full) × 2. Its DFlash drafter has 3
# layers. vLLM's `DFlashLagunaModel` registers drafter layer *j* as
# `model.layers.{6 + j}`, after the target's layers, so the two caches never collide.
# Its cache is **full attention** even if its layers are sliding-window layers, because
# DFlash writes the verifier's context K/V at absolute cache slots. The model runner
# marks each drafter attention spec with `is_draft=True`.

# %%
laguna = kv.laguna_dflash_specs()
for name, spec in laguna.items():
    print(f"{name:32s} {type(spec).__name__:18s} window={getattr(spec, 'sliding_window', None)} is_draft={spec.is_draft}")

# %%
laguna_groups, _ = group(laguna, "dflash", "laguna")

# %%
# NBVAL_IGNORE_OUTPUT
draw(laguna_groups, laguna, "Laguna + DFlash · general layout (LBHNC)").show()

# %% [markdown]
# vLLM first sorts layers by spec: 4 sliding, 5 full (2 target + 3 drafter). Then it
# gives every group the same number of layers, so that one block id means the same
# number of bytes in every group. The 4 sliding layers get one padding slot. The
# drafter's layers end up in **one group with the target's full-attention layers 2
# and 5**.
#
# The memory table shows what that costs. All groups draw blocks from one pool, and a
# block is as wide as the widest group, so the sliding group leaves one page of every
# block it owns empty.

# %%
for m in kv.group_memory(laguna_groups, kv_budget_bytes=1 << 30):
    print(f"g{m.group} {m.kind:15s} layers={m.num_layers} block={m.block_size} tok "
          f"group={m.bytes_per_block} B/block pool={m.pool_bytes_per_block} B/block unused={m.unused_bytes_per_block} "
          f"blocks={m.num_blocks} tokens={m.tokens}")

# %%
# NBVAL_IGNORE_OUTPUT
viz.kv_group_memory_figure(kv.group_memory(laguna_groups), title="Laguna + DFlash · memory per group for 1 GiB").show()

# %% [markdown]
# **General and packed layouts.** The layout says how pages sit in memory. `LBHNC`
# keeps each layer's pages together (layer outermost). `BLHNC` puts block outermost, so
# one block holds a page of every layer. On a block-outermost layout vLLM takes its
# *packed* path, which can put pages of different sizes side by side in one block, but
# only when page sizes differ. Here every layer has the same page size, so both
# layouts group alike:

# %%
_ = group(laguna, "dflash", "laguna", layout="BLHNC")

# %% [markdown]
# A drafter whose attention is shaped differently from the target's changes this.
# Give the drafter 4 KV heads instead of 2: its page doubles. On the general path vLLM
# makes the pages equal again by doubling the *target's* block size, and the drafter
# gets groups of its own (2 + 1 layers, both flagged by the marker). On the packed path
# the drafter's pages sit next to the target's full-attention pages in one group.

# %%
wide_drafter = dict(kv.example_dflash_drafter_config(kv.EXAMPLE_LAGUNA_CONFIG), num_key_value_heads=4)
laguna_wide = kv.laguna_dflash_specs(drafter_config=wide_drafter)
wide = group_both(laguna_wide, "dflash", "laguna")

# %%
# NBVAL_IGNORE_OUTPUT
draw(wide["LBHNC"], laguna_wide, "Drafter with 4 KV heads · general layout (LBHNC)").show()
draw(wide["BLHNC"], laguna_wide, "Drafter with 4 KV heads · packed layout (BLHNC)").show()

# %% [markdown]
# ### Qwen3.5-shaped hybrid + MTP
#
# Repeating [GDN, GDN, GDN, full attention] blocks. A Gated DeltaNet layer keeps a
# fixed-size state (a `MambaSpec`), whatever the sequence length. The MTP drafter
# `mtp.layers.0` reuses the target's decoder layer, so its spec is *identical* to the
# target's attention and carries no marker. Before grouping, vLLM's platform code grows
# the attention block until one attention page holds at least one GDN state, then pads
# the GDN page to the same size. The builder does the same here:

# %%
qwen = kv.qwen3_5_hybrid_specs()
attn, gdn = qwen["model.layers.3.self_attn.attn"], qwen["model.layers.0.linear_attn"]
print("attention block:", attn.block_size, "tokens;", "page:", attn.page_size_bytes, "B")
print("GDN state:", gdn.real_page_size_bytes, "B, padded to", gdn.page_size_bytes, "B")
print("MTP layer spec == target attention spec:", qwen["mtp.layers.0.self_attn.attn"] == attn)

# %%
qwen_groups, _ = group(qwen, "mtp", "qwen3_5")

# %%
# NBVAL_IGNORE_OUTPUT
draw(qwen_groups, qwen, "Qwen3.5 hybrid + MTP · general layout (LBHNC)").show()
viz.kv_group_memory_figure(kv.group_memory(qwen_groups), title="Qwen3.5 hybrid + MTP · memory per group for 1 GiB").show()

# %% [markdown]
# ### DeepSeek-V4-shaped + MTP
#
# Each decoder layer keeps two MLA caches: a sliding-window one with one latent per
# token (`swa_attn`) and a compressed one with one latent per 4 tokens (`attn`). The
# MTP draft layer `model.layers.3` reuses the target's decoder layer: same specs, no
# marker, registered last. The two caches have different page sizes, so the layouts
# now differ:
#
# * the general path makes the pages equal (the compressed cache gets a 4× larger
#   block) and forms two groups;
# * the packed path keeps each layer's own page and splits the sliding-window layers
#   into one group each, so that every group fills about one block.

# %%
dsv4 = kv.deepseek_v4_specs()
dsv4_groups = group_both(dsv4, "mtp", "deepseek_v4")

# %%
# NBVAL_IGNORE_OUTPUT
draw(dsv4_groups["LBHNC"], dsv4, "DeepSeek-V4-shaped + MTP · general layout (LBHNC)").show()
draw(dsv4_groups["BLHNC"], dsv4, "DeepSeek-V4-shaped + MTP · packed layout (BLHNC)").show()
viz.kv_group_memory_figure(kv.group_memory(dsv4_groups["BLHNC"], layout="BLHNC"),
                           title="DeepSeek-V4-shaped · packed · memory per group").show()

# %% [markdown]
# ## 2 · The rules that flag the drafter's group (upstream vLLM #55390)
#
# vLLM 0.33's `get_kv_cache_groups` flags no group. The lab applies three rules on
# top, for the EAGLE family of drafters (eagle, eagle3, mtp, dflash, dspark: drafters
# that read the target's hidden states and keep a KV cache of their own):
#
# 1. **Marker rule.** A group that holds a layer whose spec carries `is_draft` is the
#    drafter's. It works wherever the grouping puts the layer, but only for drafters
#    whose layers are marked.
# 2. **Trailing-layer rule.** An MTP block reuses the target's decoder layer (no
#    marker) and always registers after every target layer. So the group holding the
#    **last registered layer** is the drafter's. This holds for MTP on any model, and
#    for `dspark` on DeepSeek V4/V4.1. The rule is applied only when the groups
#    partition the layers **exactly** (each layer in exactly one group). Otherwise
#    "the group holding the last layer" could be no group, or two.
# 3. **Warning.** If a drafter is on, no group is flagged and some group holds Mamba
#    layers, log *"no KV cache group could be identified as the draft model's"*. vLLM's
#    coordinator then falls back to flagging **every** group, Mamba state included.
#
# Which drafters does the trailing-layer rule cover?

# %%
for method in kv.EAGLE_METHODS:
    print(f"{method:7s}", {mt: kv.uses_trailing_mtp_layers(method, mt) for mt in ("deepseek_v4", "deepseek_v41", "qwen3_5", "laguna")})

# %% [markdown]
# ### Case 1 · DeepSeek V4 on the packed path: the group holding its last layer
#
# The draft layer `model.layers.3.self_attn.attn` has no marker. Only its position
# finds it: for MTP, and for dspark on DeepSeek V4 and V4.1.

# %%
last_layer = next(reversed(dsv4))
print("last registered layer:", last_layer)
for method, model_type in [("mtp", "deepseek_v4"), ("dspark", "deepseek_v4"), ("dspark", "deepseek_v41")]:
    groups = kv.kv_cache_groups(dsv4, method=method, model_type=model_type, layout="BLHNC")
    flagged = [i for i, g in enumerate(groups) if g.is_eagle_group]
    print(f"{method:6s} on {model_type:12s} -> flagged: {['g%d' % i for i in flagged]}, "
          f"holds the last layer: {[last_layer in groups[i].layer_names for i in flagged]}")

# %%
# NBVAL_IGNORE_OUTPUT
case1 = kv.kv_cache_groups(dsv4, method="dspark", model_type="deepseek_v41", layout="BLHNC")
draw(case1, dsv4, "Case 1 · dspark on deepseek_v41, packed: the group holding the last layer").show()

# %% [markdown]
# ### Case 2 · MTP on any model type
#
# The same DeepSeek-shaped layers, served with MTP under other model types. The rule
# does not depend on the model type, only on the method. With `dspark` on a model type
# other than DeepSeek V4/V4.1, nothing is flagged.

# %%
for method, model_type in [("mtp", "glm4_moe"), ("mtp", "laguna"), ("dspark", "glm4_moe")]:
    groups = kv.kv_cache_groups(dsv4, method=method, model_type=model_type, layout="LBHNC")
    print(f"{method:6s} on {model_type:9s} -> flagged:", [f"g{i}" for i, g in enumerate(groups) if g.is_eagle_group])

# %%
# NBVAL_IGNORE_OUTPUT
case2 = kv.kv_cache_groups(dsv4, method="mtp", model_type="glm4_moe", layout="LBHNC")
draw(case2, dsv4, "Case 2 · mtp with model_type=glm4_moe: found by position").show()

# %% [markdown]
# ### Case 3 · Qwen3.5 hybrid + MTP: exactly one group, no Mamba group, no warning
#
# Its MTP layer is spec-identical to the target's attention, so the marker rule cannot
# find it. The trailing-layer rule finds exactly the attention group that holds it, and
# no GDN group is flagged, on both layouts:

# %%
_ = group_both(qwen, "mtp", "qwen3_5")

# %%
# NBVAL_IGNORE_OUTPUT
draw(qwen_groups, qwen, "Case 3 · Qwen3.5 + MTP: only the group holding mtp.layers.0").show()

# %% [markdown]
# ### Case 4 · The same hybrid with eagle, eagle3 or dspark: nothing flagged, a warning
#
# These drafters are not covered by the trailing-layer rule, and their layers carry no
# marker in this spec dict. No group is flagged, and because GDN groups exist, the lab
# warns. vLLM's coordinator would otherwise silently treat every group as draft cache.

# %%
for method in ("eagle", "eagle3", "dspark"):
    print(method)
    _, warning = group(qwen, method, "qwen3_5")

# %%
# NBVAL_IGNORE_OUTPUT
case4, warning = group(qwen, "eagle3", "qwen3_5")
draw(case4, qwen, "Case 4 · Qwen3.5 + eagle3: no group flagged", warning=warning).show()

# %% [markdown]
# ### Case 5 · Groups that do not partition the layers exactly
#
# Suppose a caller drops one layer from its group, or lists a layer twice. The last
# registered layer, `mtp.layers.0`, is still in a group, but the rule does not fire: its
# premise (each layer in exactly one group) no longer holds.

# %%
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

exact = kv.vllm_kv_cache_groups(qwen)
dropped = [KVCacheGroupSpec([n for n in g.layer_names if n != "model.layers.0.linear_attn"], g.kv_cache_spec) for g in exact]
duplicated = [KVCacheGroupSpec(g.layer_names + (["model.layers.0.linear_attn"] if i == 2 else []), g.kv_cache_spec)
              for i, g in enumerate(exact)]
for label, groups in [("exact", exact), ("one layer dropped", dropped), ("one layer twice", duplicated)]:
    kv.annotate_draft_groups("mtp", "qwen3_5", qwen, groups, use_trailing_layer_fallback=True)
    print(f"{label:18s} partition exact: {kv.groups_partition_layers_exactly(qwen, groups)!s:5s} "
          f"flagged: {[f'g{i}' for i, g in enumerate(groups) if g.is_eagle_group]}")

# %%
# NBVAL_IGNORE_OUTPUT
draw(dropped, qwen, "Case 5 · a layer dropped from its group: the trailing-layer rule stays off").show()

# %% [markdown]
# ### And DFlash: found by its marker
#
# The Laguna DFlash drafter is not an MTP block, so the trailing-layer rule is off for
# it (`uses_trailing_mtp_layers('dflash', 'laguna')` is False). It does not need the
# rule: its specs carry the marker. The group is found wherever its layers land, even
# if they were registered first:

# %%
drafter_first = dict(sorted(laguna.items(), key=lambda item: not item[1].is_draft))
_ = group(drafter_first, "dflash", "laguna")

# %% [markdown]
# **What happens to the target layers that share its group?** A group is one block
# table, so the target's full-attention layers 2 and 5 are allocated, freed and
# prefix-cache-matched together with the drafter's layers. They get the draft group's
# treatment too. For EAGLE-style drafters that treatment is the *last-block drop*: the
# draft K/V of the last position depends on a token that came after it, so the last
# block of a cache hit is not reused, and the target layers in that group give up that
# block as well. (DFlash builds its draft K/V from the target's hidden states alone, so
# vLLM 0.33 does not drop the block for it: `needs_eagle_block_drop()` is False for
# dflash and dspark.) The same sharing shows up in the extreme case where the hybrid
# manager is disabled: sliding layers are promoted to full attention, and the whole
# model forms one group, which is then the draft group:

# %%
_ = group(laguna, "dflash", "laguna", hybrid_manager_disabled=True)

# %% [markdown]
# ## 3 · Explore
#
# Pick a model, a method, a layout, whether the DFlash drafter's layers slide (its
# cache stays full attention either way), and whether the hybrid manager is disabled.
# vLLM 0.33 cannot disable it for the Mamba hybrid or for the DeepSeek shape; the
# explorer then shows vLLM's error.

# %%
# NBVAL_IGNORE_OUTPUT
kv_groups_explorer()

# %% [markdown]
# ## 4 · Your own config
#
# Point `TARGET_CONFIG` at a Laguna `config.json` (or set `DFLASH_LAB_TARGET` to a
# checkpoint folder), and optionally `DRAFTER_CONFIG` at its DFlash drafter's. By
# default this is the lab's shipped tiny target when it is there, otherwise the
# built-in Laguna-shaped example. Without a drafter config, a 3-layer drafter with the
# target's KV heads is assumed.

# %%
# NBVAL_IGNORE_OUTPUT
shipped = Path("../checkpoints/laguna-tiny-code/config.json")
TARGET_CONFIG = os.environ.get("DFLASH_LAB_TARGET") or (shipped if shipped.exists() else None)
DRAFTER_CONFIG = os.environ.get("DFLASH_LAB_DRAFTER")

target_config = kv.load_config(TARGET_CONFIG) if TARGET_CONFIG else kv.EXAMPLE_LAGUNA_CONFIG
drafter_config = kv.load_config(DRAFTER_CONFIG) if DRAFTER_CONFIG else None
print("target:", TARGET_CONFIG or "built-in Laguna-shaped example", "| drafter:", DRAFTER_CONFIG or "3-layer default")
mine = kv.laguna_dflash_specs(target_config, drafter_config)
mine_groups = group_both(mine, "dflash", "laguna")

# %%
# NBVAL_IGNORE_OUTPUT
draw(mine_groups["BLHNC"], mine, "Your config · packed layout (BLHNC)").show()
viz.kv_group_memory_figure(kv.group_memory(mine_groups["BLHNC"], layout="BLHNC"),
                           title="Your config · memory per group for 1 GiB").show()

# %% [markdown]
# ## Closing note: Laguna + DFlash in vLLM 0.33
#
# * **Which groups.** With the drafter shaped like the target (same KV heads and head
#   dim, as in this chapter's preset), every layer has the same page
#   size. Both layouts therefore take the same general path and produce two groups: the
#   target's sliding-window layers, and the target's full-attention layers together
#   with all drafter layers. The drafter's sliding window changes nothing here, because
#   its cache is full attention either way. Only a drafter with a different page size
#   separates the layouts: the general path gives it groups of its own, the packed path
#   packs it next to the target's full-attention layers.
# * **Which group is flagged.** vLLM 0.33's `get_kv_cache_groups` flags none. Its
#   engine-level wrapper (`get_global_kv_cache_groups`) applies the marker rule only
#   when the EAGLE last-block drop is on, and that is never the case for dflash. So vLLM
#   0.33 leaves a DFlash drafter's group unflagged, and it has neither the
#   trailing-layer rule nor the exact-partition check of #55390. With the rules applied
#   here, the marker flags the full-attention group that holds the drafter, on both
#   layouts. The target's full-attention layers in that group share its treatment.
