"""The static path's attention, fused kernel against masks + SDPA, on the shipped pair (CUDA): per drafter and
prompt set, tau, outputs equal to target-only's (same attention), and outputs equal across the two attentions.

    python scripts/ab_attention.py [--dtype bfloat16] [--prompts 24]

Graphs off (the attention is chosen per forward; tau does not depend on graphs). A bf16 greedy output can
change with any rounding of the target's forward: the counts say how often that happens, and tau whether a
drafter gains or loses from it.
"""

from __future__ import annotations

import argparse

import torch

from dflash_lab.assets import load_default_pair
from dflash_lab.spec_decode import FastDecoder
from dflash_lab.spec_decode.stats import SpecDecodeStats
from dflash_lab.tools.bench_spec_decode import prompt_ids

PROMPT_LENGTH = 200


def run(target, proposer, prompts, block: int, fused: bool, max_new: int):
    dec = FastDecoder(target, proposer, batch=1, block_size=block, capacity=PROMPT_LENGTH + max_new + 64,
                      cuda_graphs=False)
    dec.tgt.fused_attention = fused
    results = [dec.generate([p], max_new_tokens=max_new)[0] for p in prompts]
    return [r.new_token_ids for r in results], sum((r.stats for r in results), SpecDecodeStats())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-sets", nargs="+", default=["heldout", "docstring"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    target, paper, tok = load_default_pair(args.device, dtype=dtype)
    poolside = load_default_pair(args.device, dtype=dtype, drafter="poolside")[1]
    for prompt_set in args.prompt_sets:
        prompts = [p[0] for p in prompt_ids(tok, prompt_set, args.prompts, PROMPT_LENGTH, args.device)]
        ref = {f: run(target, None, prompts, 1, f, args.max_new_tokens)[0] for f in (True, False)}
        same_ref = sum(a == b for a, b in zip(ref[True], ref[False]))
        print(f"{prompt_set} {args.dtype}: target-only outputs equal across attentions {same_ref}/{len(prompts)}")
        for name, drafter in (("paper", paper), ("poolside", poolside)):
            out = {}
            for fused in (True, False):
                out[fused], stats = run(target, drafter, prompts, 16, fused, args.max_new_tokens)
                same = sum(a == b for a, b in zip(out[fused], ref[fused]))
                print(f"  {name:8s} {'fused' if fused else 'sdpa '}: tau {stats.mean_acceptance_length:.4f}, "
                      f"equal to target-only {same}/{len(prompts)}", flush=True)
            across = sum(a == b for a, b in zip(out[True], out[False]))
            print(f"  {name:8s} outputs equal across attentions {across}/{len(prompts)}")


if __name__ == "__main__":
    main()
