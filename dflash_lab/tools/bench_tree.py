"""Benchmark: DDTree against the chain, per node budget.

    python -m dflash_lab.tools.bench tree [--quick] [--budgets 16 32 64 128] [--prompt-set heldout docstring]
        [--acceptance | --speed] [--batches 1] [--device cuda] [--dtype float32|bfloat16]

``--acceptance`` (what CI's machine can run: the eager loop, float32, batch 1) writes
benchmarks/tree_acceptance.{json,md}; ``--speed`` (the fast path, graphed on a GPU, bf16) writes
benchmarks/tree_speed.{json,md}. Both: the chain at block ``--block-size`` beside a tree at every budget,
for every drafter of the pair in use and both prompt sets. Another pair's results go under runs/.
"""

from __future__ import annotations

import torch

from ..assets import load_pair, pair_fingerprint
from ..measure.decoding import PROMPT_SETS
from ..measure.tree import TREE_BUDGETS, measure_tree_acceptance, measure_tree_speed
from ..runtime import device_name, resolve_device
from .bench_common import OUT_HELP, pair_out_dir, write_results
from .bench_spec_decode import PROMPT_LENGTH, prompt_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _label(r: dict) -> str:
    return "target-only" if r["method"] == "target_only" else \
        f"{r['method']} {'chain' if r['tree_budget'] is None else 'tree ' + str(r['tree_budget'])}"


def tree_markdown(result: dict) -> str:
    """One table per prompt set (and batch): tau, accepted per node, and on the fast path the speed columns."""
    speed = result["kind"] == "speed"
    lines = [f"# DDTree against the chain ({result['device']}, {result['dtype']})", "",
             f"`{result['command']}`: {result['prompts']} prompts of each set, {result['max_new_tokens']} new tokens, "
             f"block {result['block_size']}.", ""]
    if result.get("code"):  # a record kept from earlier code says so
        lines += [f"Measured at commit {result['code']}.", ""]
    head = "| batch | method | tau | accepted per node | same as target-only |"
    if speed:
        head += " tokens/s | x target-only | whole step ms | verify ms |"
    for s in result["prompt_sets"]:
        recs = [r for r in result["records"] if r["prompt_set"] == s]
        base = {r["batch"]: r["tokens_per_s"] for r in recs if r["method"] == "target_only"}
        lines += [f"## {s} prompts", "", head, "|" + "---|" * (head.count("|") - 1)]
        for r in recs:
            row = (f"| {r['batch']} | {_label(r)} | {r['mean_acceptance_length'] or '-'} | "
                   f"{r['accepted_per_node'] if r['method'] != 'target_only' else '-'} | "
                   f"{r['outputs_equal_target_only']} |")
            if speed:
                row += (f" {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base[r['batch']]:.2f}x | {r['step_ms']} | "
                        f"{r['verify_ms']} |")
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


def tree_bench(args) -> int:
    device = resolve_device(args.device)
    speed = args.speed
    dtype = DTYPES[args.dtype or ("bfloat16" if speed and device.type == "cuda" else "float32")]
    budgets = args.budgets or ([8, 32] if args.quick else list(TREE_BUDGETS))
    n_prompts = args.prompts or (4 if args.quick else 24)
    max_new = args.max_new_tokens or (24 if args.quick else 96)
    batches = args.batches or [1]
    sets = args.prompt_set or list(PROMPT_SETS)
    target, drafters, tokenizer = load_pair(device, dtype=dtype)
    stem = "tree_speed" if speed else "tree_acceptance"
    command = " ".join(["python -m dflash_lab.tools.bench tree", "--speed" if speed else "--acceptance",
                        *(["--quick"] if args.quick else []), "--budgets", *map(str, budgets),
                        "--prompt-set", *sets, *(["--batches", *map(str, batches)] if speed else [])])
    result = {"kind": "speed" if speed else "acceptance", "command": command, "device": device_name(device),
              "dtype": str(dtype).replace("torch.", ""), "block_size": args.block_size, "budgets": budgets,
              "prompts": n_prompts, "max_new_tokens": max_new, "prompt_sets": sets, "pair": pair_fingerprint(),
              "records": []}
    out = pair_out_dir(args.out)
    save = lambda: write_results(out, stem, result, tree_markdown(result))  # noqa: E731
    print(f"tree {result['kind']} on {result['device']} ({result['dtype']}): budgets {budgets}, "
          f"{n_prompts} prompts x {max_new} tokens, sets {sets}", flush=True)
    done = []
    for s in sets:
        prompts = [p[0] for p in prompt_ids(tokenizer, s, n_prompts, PROMPT_LENGTH, device)]
        common = dict(budgets=budgets, block_size=args.block_size, max_new_tokens=max_new, prompt_set=s,
                      progress=lambda line: print(line, flush=True))
        if speed:
            def on_record(rs):
                result["records"] = done + list(rs)
                save()
            done += measure_tree_speed(target, drafters, prompts, batches=batches, on_record=on_record, **common)
        else:
            done += measure_tree_acceptance(target, drafters, prompts, **common)
        result["records"] = list(done)
        save()
    paths = save()
    print(tree_markdown(result))
    print("wrote", *paths)
    return 0


def add_command(subparsers) -> None:
    p = subparsers.add_parser("tree", help="DDTree against the chain per node budget: tau (eager, float32) or "
                                           "speed and verify cost (fast path, graphed)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--acceptance", action="store_true", help="tau on the eager loop (the default)")
    kind.add_argument("--speed", action="store_true", help="tokens/s, whole step and verify ms on the fast path")
    p.add_argument("--quick", action="store_true", help="budgets 8 and 32, 4 prompts of 24 new tokens")
    p.add_argument("--budgets", type=int, nargs="+", help=f"node budgets (default {' '.join(map(str, TREE_BUDGETS))})")
    p.add_argument("--block-size", type=int, default=16, help="the block the tree is drafted from (default 16)")
    p.add_argument("--batches", type=int, nargs="+", help="--speed: batch sizes (default 1)")
    p.add_argument("--prompts", type=int, help="prompts per set (default 24)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 96)")
    p.add_argument("--prompt-set", choices=list(PROMPT_SETS), nargs="+", help="default: both")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: bfloat16 for --speed on CUDA, else float32")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.set_defaults(func=tree_bench)
