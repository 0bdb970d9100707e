"""Benchmark: how much of τ is the target repeating itself, and τ on a prompt set where it does not.

    python -m dflash_lab.tools.bench repetition [--quick]

For the held-out and docstring-first prompts and for the non-repetitive set (``checkpoints/
nonrepetitive_prompts.json``), greedy, 64 new tokens: each continuation's repeated 4-gram share
(``measure.repetition``), the share of repetitive continuations, and τ of every drafter of the pair (blocks
4/8/16) and of prompt lookup (block 16) on the repetitive and non-repetitive continuations apart.
``--cut-set`` first (re)cuts the non-repetitive set: prompts cut from held-out files of the training corpus by
the held-out set's rule (another seed, none overlapping the two sets), kept where the shipped target does not
loop (at most 48). Writes benchmarks/repetition.{json,md}.
"""

from __future__ import annotations

import time

import torch

from ..assets import (
    NONREPETITIVE_PROMPTS, docstring_prompts, heldout_prompts, is_shipped_pair, load_pair, nonrepetitive_prompts,
    pair_fingerprint,
)
from ..config import DEFAULT_BLOCK_SIZE
from ..corpus import cut_prompts, save_prompts
from ..measure.drafters import bootstrap_tau
from ..measure.repetition import NGRAM, REPETITIVE_AT, continuation_shares, select_non_repetitive, tau_by_repetition
from ..runtime import device_name, resolve_device
from ..spec_decode import generate_on_prompts
from ..train.code_corpus import STDLIB_PACKAGE, build_code_corpus
from ..train.evaluate import evaluate_acceptance
from .bench_common import OUT_HELP, pair_out_dir, write_results

NONREPETITIVE_DESCRIPTION = (
    "Non-repetitive prompts: cut from held-out files of the training corpus (dflash_lab.train.code_corpus; held out "
    "by path): the standard library and the lab's own dependencies (torch, transformers, vLLM, numpy, ...), by the "
    "held-out set's rule "
    "(dflash_lab.corpus.cut_prompts, seed 7, 240 cut, none overlapping heldout_prompts.json or "
    "docstring_prompts.json), "
    f"kept where the shipped target's greedy 64-token continuation repeats fewer than {REPETITIVE_AT:.0%} of its "
    f"{NGRAM}-grams (dflash_lab.measure.repetition); neither the target nor the drafters train on them.")


def lab_dependency_modules() -> set[str]:
    """Top-level import names of the distributions the lab itself depends on (its package metadata)."""
    import importlib.metadata as metadata
    import re

    wanted = {re.split(r"[ ;<>=!\[~]", r)[0].lower().replace("_", "-")
              for r in metadata.requires("dflash_lab") or [] if "extra ==" not in r}
    return {top for top, dists in metadata.packages_distributions().items()
            if any(d.lower().replace("_", "-") in wanted for d in dists)}


def cut_non_repetitive(target, tokenizer, avoid: list[dict], n: int = 48, candidates: int = 240,
                       at_least: int = 16) -> list[dict]:
    """Cut ``candidates`` held-out prompts, measure the target's continuations, keep up to ``n`` that do not loop."""
    probes = {p["text"][:120] for p in avoid}
    ours = lab_dependency_modules()
    files = [f for f, package in zip(*build_code_corpus()[:2]) if package == STDLIB_PACKAGE
             or f.relpath.split("/")[0] in ours]
    pool = [p for p in cut_prompts(files, candidates, seed=7) if p["text"][:120] not in probes
            and not any(p["text"][:120] in q["text"] or q["text"][:120] in p["text"] for q in avoid)]
    shares = continuation_shares(target, tokenizer, pool)
    chosen = select_non_repetitive(pool, shares, n)
    print(f"{len(chosen)} of {len(pool)} candidates do not loop", flush=True)
    if len(chosen) < at_least:
        raise SystemExit(f"only {len(chosen)} of {len(pool)} candidates do not loop (wanted {at_least})")
    return chosen


def measure_set(target, drafters: dict, tokenizer, prompts: list[dict], blocks, max_new_tokens: int) -> dict:
    """One prompt set: shares, then τ split by repetition for every drafter and block, and for prompt lookup."""
    shares = continuation_shares(target, tokenizer, prompts, max_new_tokens)
    entry = {"num_prompts": len(prompts), "shares": [round(s, 4) for s in shares], "drafters": {}}
    for name, drafter in drafters.items():
        evs = evaluate_acceptance(target, drafter, tokenizer, prompts, block_sizes=blocks,
                                  max_new_tokens=max_new_tokens)
        entry["drafters"][name] = {
            str(bs): {**tau_by_repetition(ev.per_prompt_counts(), shares), "interval": bootstrap_tau(
                ev.per_prompt_counts()), "per_prompt_drafts_accepted": ev.per_prompt_counts()}
            for bs, ev in evs.items()}
    ids = [tokenizer.encode(p["text"], add_special_tokens=False) for p in prompts]
    _, runs = generate_on_prompts(target, "ngram", ids, max_new_tokens=max_new_tokens, block_size=max(blocks),
                                  progress=False)
    counts = [[r.stats.num_drafts, r.stats.num_accepted_tokens] for r in runs]
    entry["prompt_lookup"] = {str(max(blocks)): {**tau_by_repetition(counts, shares),
                                                 "per_prompt_drafts_accepted": counts}}
    return entry


def markdown(result: dict) -> str:
    def f(x):
        return "-" if x is None else f"{x:.2f}"

    lines = ["# τ and the target repeating itself\n",
             f"{result['device']}, float32, greedy, {result['max_new_tokens']} new tokens. A continuation is "
             f"*repetitive* when at least {result['threshold']:.0%} of its token {result['ngram']}-grams already "
             "occurred earlier in it (`dflash_lab.measure.repetition`).\n"]
    for set_name, entry in result["sets"].items():
        any_split = next(iter(next(iter(entry["drafters"].values())).values()))
        lines += [f"### {set_name} ({entry['num_prompts']} prompts: {any_split['num_repetitive']} repetitive, "
                  f"{any_split['share_repetitive']:.0%})\n",
                  "| proposer | block | τ all | τ repetitive | τ non-repetitive | corr(share, τ) |",
                  "|---|---|---|---|---|---|"]
        rows = [(name, bs, s) for name, by_block in entry["drafters"].items() for bs, s in by_block.items()]
        rows += [("prompt lookup", bs, s) for bs, s in entry["prompt_lookup"].items()]
        for name, bs, s in rows:
            lines.append(f"| {name} | {bs} | {f(s['tau'])} | {f(s['tau_repetitive'])} | {f(s['tau_non_repetitive'])} "
                         f"| {f(s['correlation'])} |")
        lines.append("")
    return "\n".join(lines) + f"\nCommand: `{result['command']}` ({result['seconds']:.0f} s)\n"


def repetition(args) -> int:
    """The `repetition` subcommand."""
    device = resolve_device(args.device, caller="bench repetition")
    torch.set_num_threads(args.threads) if args.threads else None
    n = 8 if args.quick else None
    blocks = [DEFAULT_BLOCK_SIZE] if args.quick else [4, 8, 16]
    args.out = pair_out_dir(args.out)
    target, drafters, tokenizer = load_pair(device)
    start = time.perf_counter()
    sets = {"held-out": heldout_prompts(), "docstring-first": docstring_prompts()}
    if args.cut_set and not is_shipped_pair():
        raise SystemExit("--cut-set chooses the committed set by the shipped target: run it on the shipped pair")
    if args.cut_set:
        chosen = cut_non_repetitive(target, tokenizer, sets["held-out"] + sets["docstring-first"],
                                    candidates=args.candidates)
        save_prompts(chosen, NONREPETITIVE_PROMPTS, description=NONREPETITIVE_DESCRIPTION)
        print(f"wrote {NONREPETITIVE_PROMPTS} ({len(chosen)} prompts)", flush=True)
    sets["non-repetitive"] = nonrepetitive_prompts()
    result = {"ngram": NGRAM, "threshold": REPETITIVE_AT, "max_new_tokens": args.max_new_tokens,
              "block_sizes": blocks, "sets": {}}
    for name, prompts in sets.items():
        print(f"{name}: {len(prompts[:n])} prompts", flush=True)
        result["sets"][name] = measure_set(target, drafters, tokenizer, prompts[:n], blocks, args.max_new_tokens)
    result.update(device=device_name(device), pair=pair_fingerprint(), seconds=round(time.perf_counter() - start, 1),
                  command="python -m dflash_lab.tools.bench repetition" + (" --quick" if args.quick else "")
                  + (" --cut-set" if args.cut_set else ""))
    md = markdown(result)
    print(md)
    print("wrote", *write_results(args.out, "repetition_quick" if args.quick else "repetition", result, md))
    return 0


def add_command(subparsers) -> None:
    p = subparsers.add_parser("repetition", help="τ on repetitive and non-repetitive continuations, three prompt sets")
    p.add_argument("--quick", action="store_true", help="block 16 on 8 prompts of each set")
    p.add_argument("--cut-set", action="store_true", help="first re-cut checkpoints/nonrepetitive_prompts.json")
    p.add_argument("--candidates", type=int, default=240, help="prompts cut before the non-repetitive ones are kept")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads (small matmuls: 1 is fastest)")
    p.add_argument("--device", help="default: $DFLASH_LAB_DEVICE, else cuda when present")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.set_defaults(func=repetition)
