# %% [markdown]
# # Chapter 9 · Draft trees
#
# **Question.** A DFlash block holds a whole distribution at every depth, and the chain keeps only
# each depth's argmax. What does a tree of the block's best prefixes, verified in the same one
# target forward, buy over the chain, and where does it stop paying?
#
# One DFlash forward gives, after `x_t`, a distribution `q_d` at every depth `d = 1 … K`. The chain
# drafts `argmax q_d` at each depth and loses the whole rest of the block at its first wrong guess.
# **DDTree** (arXiv 2604.12989, a [draft tree](GLOSSARY.md#draft-tree)) spends a node budget `N`
# instead: it scores a prefix `y_1 … y_d` by its path probability `q_1(y_1) ⋯ q_d(y_d)` and keeps the
# `N` prefixes that score highest, grown best first from a heap. The target reads `[x_t, the N
# nodes]` in **one** forward, each node at position `t + depth` and seeing only its own ancestors
# (a tree attention mask); then the walk starts at the root and steps to the child whose token is
# the target's own choice, while there is one. The target keeps its decoding rule at every node
# (greedy: its argmax), so the output is the target's, exactly as the chain's is. The drafter and
# its one forward are the chain's: no retraining.
#
# The lab counts a tree step in vLLM's counters as the chain's is counted: one draft per step, every
# verified node a draft token, the accepted path's depths the accepted positions, so τ = 1 +
# accepted / drafts keeps its meaning. vLLM 0.33 has no tree verification: no speculative option
# takes a tree, no attention backend takes a tree mask, and the drafter's only mention of one is a
# note for later (`v1/spec_decode/llm_base_proposer.py:1627-1628`). vllm#42910 proposes DDTree for
# DFlash (a comment there measured it 31.6 % slower than the chain at batch 1 with CUDA graphs on
# Qwen3.5-4B); SGLang's work is open (sglang#22887). The paper reports 8.22x against the chain's
# 6.09x on Qwen3-30B-MoE (HumanEval, T = 0). The lab runs it both ways:
# `speculative_generate(..., tree_budget=N)` (eager) and `FastDecoder(..., tree_budget=N)` (graphed).

# %%
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the lab reaches the network

import json

import torch

from dflash_lab import viz, widgets
from dflash_lab.assets import (default_device, heldout_prompts, is_shipped_pair, load_pair, record_note,
                               second_drafter_missing)
from dflash_lab.measure.tree import measure_tree_acceptance
from dflash_lab.runtime import BENCHMARKS_DIR, device_name, drafter_path, seed_everything, target_path
from dflash_lab.spec_decode import speculative_generate
from dflash_lab.spec_decode.tree import best_first_tree, build_draft_tree

seed_everything(0)
device = default_device()
target, drafters, tokenizer = load_pair(device, dtype=torch.float32)
drafter = drafters["paper"]
BLOCK = 16  # 1 real token + 15 drafted depths, as the committed records
PAIR = "the shipped pair" if is_shipped_pair() else f"your pair ({target_path().name} + {drafter_path().name})"
print(f"{PAIR}, float32 on {device_name(device)}; drafters: {', '.join(drafters)}; blocks of {BLOCK}")

# %% [markdown]
# ## 1. One real block
#
# One held-out prompt (its last 48 tokens), 48 new tokens, greedy, a tree of 32 nodes at every step.
# For each step, `widgets.replay_block` runs the step's drafter forward again (the run's own context
# K/V, so the same logits: the same tree), and verifies the **chain** of that block (each depth's
# argmax) in the same way, to say what the chain would have kept. The step shown is the one where
# the tree gained most over its chain.

# %%
prompt = tokenizer(heldout_prompts()[6]["text"])["input_ids"][-48:]
run = speculative_generate(target, drafter, prompt, max_new_tokens=48, block_size=BLOCK, tree_budget=32)
reference = speculative_generate(target, None, prompt, max_new_tokens=48).new_token_ids
print(f"{len(run.steps) - 1} tree steps for 48 new tokens; the same tokens as target-only: "
      f"{run.new_token_ids == reference}")
gains = {}
for s in range(1, len(run.steps)):
    b = widgets.replay_block(target, drafter, run, s, [32])
    gains[s] = (b["trees"][32]["num_accepted"], b["chain"]["num_accepted"])
print("drafts kept per step, tree (32 nodes) / chain:", " ".join(f"{n}/{m}" for n, m in gains.values()))
step_index = max(gains, key=lambda s: (gains[s][0] - gains[s][1], -s))
if gains[step_index][0] <= gains[step_index][1]:
    print("no step of this run kept more along the tree than along its chain: the first step is shown")
    step_index = 1

# %% [markdown]
# The same block at every budget the explorer below offers (8 to 128 nodes), each tree verified by the
# target, the run's budget among them:

# %%
WIDGET_BUDGETS = (8, 16, 32, 64, 128)
block = widgets.replay_block(target, drafter, run, step_index, WIDGET_BUDGETS)
step, view = run.steps[step_index], block["trees"][32]
same = (view["token_ids"] == step.tree.token_ids[0].tolist() and view["num_accepted"] == step.num_accepted
        and [view["token_ids"][i - 1] for i in view["path"][1:]] == step.draft_ids)
n, m = view["num_accepted"], block["chain"]["num_accepted"]
print(f"step {step_index} (position {block['position']}): the tree keeps {n} drafts, the chain would keep {m}; "
      f"the replayed tree and path are the run's: {same}")
print("path through the tree (tree index: token):",
      ", ".join(f"{i}: {tokenizer.decode([view['token_ids'][i - 1]])!r}" for i in view["path"][1:])
      or "none (the target's first choice is no node of the tree)")
print("the chain's drafts:", [tokenizer.decode([t]) for t in block["chain"]["token_ids"][:m + 2]], "...")

# %%
viz.draft_tree_figure(view, tokenizer, root_id=block["root"], path=view["path"],
                      target_choices=view["target_choices"], chain=block["chain"]["token_ids"],
                      title=f"Step {step_index}: a tree of 32 nodes from one block; {n} drafts accepted "
                            f"(the chain: {m})")

# %% [markdown]
# Square nodes (framed orange) are the chain's drafts: the best prefix of each depth is the all-argmax
# one, so the chain is in the tree as deep as its prefixes score among the best 32. The green path is
# the accepted one; the triangles below say what the target chose after each node of it, the last
# (blue) the bonus token. Where the target's choice after a node is not its argmax child but another
# child, the chain stops and the tree goes on.
#
# The lab builds the tree with fixed shapes (a beam of `N` prefixes per depth, then the `N` best of
# all depths: no host sync, so it runs inside a CUDA graph). The paper grows it one prefix at a time
# from a heap (`best_first_tree`); on this block they are the same tree:

# %%
def prefixes(nodes):
    """Each node's prefix of tokens, from (parent index, depth, token) triples (parent 0: the root)."""
    out = []
    for parent, _depth, token in nodes:
        out.append((out[parent - 1] if parent else ()) + (token,))
    return out


log_q = torch.log_softmax(block["logits"].float(), dim=-1)
in_order = []
for budget in WIDGET_BUDGETS:
    heap = best_first_tree(log_q, budget)
    built = build_draft_tree(block["logits"], budget)
    nodes = list(zip(built.parents[0].tolist(), built.depths[0].tolist(), built.token_ids[0].tolist()))
    assert set(prefixes(nodes)) == set(prefixes(heap)), budget  # the same prefixes (equal weights could swap)
    in_order.append(nodes == heap)
print(f"the heap's tree and the fixed-shape build hold the same prefixes at budgets {list(WIDGET_BUDGETS)}; "
      f"node for node in the same order: {all(in_order)}")

# %% [markdown]
# ## 2. τ against the budget, live
#
# The first four held-out prompts (their last 256 tokens, as in the committed record), 48 new tokens,
# block 16: the chain, then a tree of 1, 8, 16, 32 and 64 nodes, for each drafter of the pair
# (`measure.tree.measure_tree_acceptance`, the record's own harness). A tree of 15 nodes verifies as
# many tokens as the chain (16); a tree of 1 node is a chain of one draft.

# %%
prompts = [tokenizer(p["text"], return_tensors="pt")["input_ids"][0, -256:].to(device)
           for p in heldout_prompts()[:4]]
if second_drafter_missing():
    print("skipped:", second_drafter_missing())
LIVE_BUDGETS = (1, 8, 16, 32, 64)
live = measure_tree_acceptance(target, drafters, prompts, budgets=LIVE_BUDGETS, block_size=BLOCK,
                               max_new_tokens=48, progress=lambda line: None)
print(f"τ ({len(prompts)} held-out prompts, 48 new tokens, block {BLOCK}):")
for method in dict.fromkeys(r["method"] for r in live):
    print(f"  {method:16s} " + ", ".join(
        f"{'chain' if r['tree_budget'] is None else 'N=' + str(r['tree_budget'])} {r['mean_acceptance_length']:.2f}"
        for r in live if r["method"] == method))
print("every run's tokens equal target-only's:", sorted({r["outputs_equal_target_only"] for r in live}))

# %%
viz.tau_vs_budget_figure(live, title=f"Live: τ against the budget ({len(prompts)} held-out prompts, 48 new "
                                     f"tokens, block {BLOCK}); dashed: the chain")

# %% [markdown]
# τ grows with the budget, but each added node is a smaller bet: the tree adds prefixes in falling
# order of path probability, so the accepted drafts per verified node fall as `N` grows. On four
# prompts the curve need not rise at every step (a longer path at one block moves every later block).
# At small budgets a tree can lose to the chain: a tree of `N` nodes is at most `N` deep, and the
# chain's long agreement runs need all 15 depths. At 16 nodes, one token more than the chain verifies,
# the tree is already ahead on the shipped pair.
#
# ## 3. The committed records
#
# `python -m dflash_lab.tools.bench tree` measured τ on 24 prompts of each set, 96 new tokens, block
# 16, on the eager loop in float32 (`benchmarks/tree_acceptance.json`); with `--speed`, tokens per
# second and the verify forward alone on the graphed fast path (`benchmarks/tree_speed.json`).

# %%
acceptance = json.loads((BENCHMARKS_DIR / "tree_acceptance.json").read_text())
acc_note = record_note(acceptance)
print(f"τ record: {acceptance['device']}, {acceptance['dtype']}; {acceptance['prompts']} prompts per set, "
      f"{acceptance['max_new_tokens']} new tokens, block {acceptance['block_size']}"
      + (f"\nwhose numbers: {acc_note}" if acc_note else ""))
top = acceptance["budgets"][-1]
for s in acceptance["prompt_sets"]:
    for method in ("dflash", "dflash_poolside"):
        rows = {r["tree_budget"]: r for r in acceptance["records"] if r["method"] == method and r["prompt_set"] == s}
        if rows:
            print(f"  {s:9s} {method:16s} chain τ {rows[None]['mean_acceptance_length']:.2f}; tree "
                  + ", ".join(f"{b}: {rows[b]['mean_acceptance_length']:.2f}" for b in acceptance["budgets"])
                  + f"; accepted per node at {top}: {rows[top]['accepted_per_node']:.3f} "
                  f"(chain {rows[None]['accepted_per_node']:.3f})")

# %%
viz.tau_vs_budget_figure(acceptance["records"], title=f"The record: τ against the budget ({acceptance['device']}, "
                         f"{acceptance['prompts']} prompts per set, block {acceptance['block_size']}); dashed: chains")

# %% [markdown]
# More τ is not more speed: the verify forward reads `N + 1` tokens instead of the chain's 16, and
# builds the tree first. Whether that pays is a GPU question: the speed record (bf16, CUDA graphs,
# batch 1) holds target-only, the chain and every budget.

# %%
speed_path = BENCHMARKS_DIR / "tree_speed.json"
speed = json.loads(speed_path.read_text()) if speed_path.exists() else None
verdicts = {}
if speed is None:
    print("benchmarks/tree_speed.json is not committed: the GPU speed record has not been measured yet, so this "
          "part is skipped (python -m dflash_lab.tools.bench tree --speed writes it on a GPU)")
else:
    speed_note = record_note(speed)
    print(f"speed record: {speed['device']}, {speed['dtype']}"
          + (f"\nwhose numbers: {speed_note}" if speed_note else ""))
    batch = min(r["batch"] for r in speed["records"])
    for method in ("dflash", "dflash_poolside"):
        ups = viz.tree_speedups(speed["records"], method, batch=batch)
        if None not in ups or len(ups) < 2:  # the chain and at least one tree
            continue
        verdicts[method] = v = viz.where_tree_stops_paying(ups)
        below = v["first_below_chain"]
        print(f"  {method:16s} batch {batch}: chain {v['chain']:.2f}x target-only; best tree N={v['best']} "
              f"{v['best_speedup']:.2f}x; " + (f"below the chain from N={below}" if below else
                                              "every budget above the chain"))

# %% [markdown]
# Where a tree step's time goes, against the chain's step on the same record: the verify forward's
# growth (`N + 1` tokens instead of 16), and the rest, the tree's own kernels (the build, its mask,
# the walk, moving the accepted path's K/V). The tree pays once its step costs less than the chain's
# step times τ_tree / τ_chain; the last column is what the tree would give if its own kernels were
# free (only the wider verify paid).

# %%
if speed is not None:
    by = {(r["method"], r["tree_budget"]): r for r in speed["records"]
          if r["batch"] == batch and r["prompt_set"] == speed["prompt_sets"][0]}
    chain_rec = by[("dflash", None)]
    print(f"dflash, {speed['prompt_sets'][0]} prompts, batch {batch}, block {speed['block_size']}, "
          f"{speed['max_new_tokens']} new tokens: the chain's step {chain_rec['step_ms']:.3f} ms "
          f"(verify {chain_rec['verify_ms']:.3f}), τ {chain_rec['mean_acceptance_length']:.2f}")
    for n in speed["budgets"]:
        t = by[("dflash", n)]
        wider = t["verify_ms"] - chain_rec["verify_ms"]
        own = t["step_ms"] - chain_rec["step_ms"] - wider
        gain = t["mean_acceptance_length"] / chain_rec["mean_acceptance_length"]
        print(f"  N={n:>3}: step {t['step_ms']:.3f} ms = chain + verify {wider:+.3f} + the tree's own kernels "
              f"{own:+.3f}; pays below {chain_rec['step_ms'] * gain:.3f} ms; with its own kernels free "
              f"{gain * chain_rec['step_ms'] / (chain_rec['step_ms'] + wider):.2f}x the chain")

# %%
if speed is not None:
    display_fig = viz.tree_speed_figure(speed["records"], batch=batch, title=f"Speed-up and verify forward against "
                                        f"the budget ({speed['device']}, {speed['dtype']}, batch {batch})")
    display_fig.show()

# %% [markdown]
# ## 4. Explore one block's tree
#
# The block of §1 at every budget from 8 to 128 nodes, each tree built from the same drafter logits and
# verified by the target: move the slider to see the tree grow, where the accepted path leaves the
# chain, and when a larger tree finds a longer path.

# %%
widgets.draft_tree_explorer(block, tokenizer, budget=32)

# %% [markdown]
# ## Answer

# %%
def taus(method, rows):
    by = {r["tree_budget"]: r["mean_acceptance_length"] for r in rows if r["method"] == method}
    return by[None], by


live_from = f"this run ({len(prompts)} held-out prompts, 48 new tokens, block {BLOCK}, {device_name(device)})"
rows = [["one block (step " + str(step_index) + "): drafts kept, chain / tree at N = 8, 16, 32, 64, 128",
         f"{m} / " + ", ".join(str(block['trees'][b]['num_accepted']) for b in WIDGET_BUDGETS), "this run"]]
for method in dict.fromkeys(r["method"] for r in live):
    chain, by = taus(method, live)
    rows.append([f"{method}: τ chain / tree at N = {', '.join(map(str, LIVE_BUDGETS))}",
                 f"{chain:.2f} / " + ", ".join(f"{by[b]:.2f}" for b in LIVE_BUDGETS), live_from])
for s in acceptance["prompt_sets"]:
    chain, by = taus("dflash", [r for r in acceptance["records"] if r["prompt_set"] == s])
    rows.append([f"dflash, {s} prompts: τ chain / tree at N = {top}", f"{chain:.2f} / {by[top]:.2f}",
                 f"record ({acceptance['device']})" + (f", {acc_note}" if acc_note else "")])
if verdicts:
    for method, v in verdicts.items():
        rows.append([f"{method}: best budget, its speed-up / the chain's; first budget below the chain",
                     f"N={v['best']}: {v['best_speedup']:.2f}x / {v['chain']:.2f}x; "
                     + (f"N={v['first_below_chain']}" if v["first_below_chain"] else "none"),
                     f"record ({speed['device']})" + (f", {speed_note}" if speed_note else "")])
else:
    rows.append(["speed: where the tree stops paying", "not known yet",
                 "no GPU speed record committed (benchmarks/tree_speed.json)"])
viz.answer_table(["what", "value", "from"], rows, caption="Chapter 9's answer")

# %% [markdown]
# In words: a tree from one DFlash block keeps the drafts the chain would keep wherever the chain's
# prefixes rank among the tree's `N` best, and more where the target's choice at some depth is the
# drafter's second or third guess; τ rises with the budget, by less per node as the budget grows, and
# a tree too small to reach the chain's depth can lose to it. What the tree costs is a wider verify
# forward (`N + 1` tokens instead of `K + 1`) and its build; the speed record, where one is committed,
# says at which budget that cost outruns the gain on its GPU.
