"""vLLM's four rejection_sample_methods side by side on a pair: τ with intervals over prompts, and what FLy gives up.

    python -m dflash_lab.tools.bench_verification --prompts 16 --max-new-tokens 64 --block-size 8 \\
        --temperatures 0,0.7,1 --out benchmarks/verification_methods.json

The grid itself is ``dflash_lab.measure.verification.run_grid`` (chapter 7 runs it too); this
is its command line, writing <out>.json and a markdown table beside it.
"""

from __future__ import annotations

import argparse

import torch

from ..measure.verification import METHODS, markdown, run_grid


def main(argv=None) -> None:
    from ..assets import heldout_prompts, load_default_pair, pair_fingerprint
    from ..runtime import resolve_device

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="paper", choices=["paper", "poolside"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--temperatures", default="0,0.7,1")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="write the rows as JSON (and a .md table beside it)")
    args = ap.parse_args(argv)
    device = resolve_device(args.device)
    target, drafter, tok = load_default_pair(device, dtype=torch.float32, drafter=args.drafter)
    prompts = [tok(p["text"])["input_ids"][-args.prompt_tokens:] for p in heldout_prompts()[:args.prompts]]
    rows = run_grid(target, drafter, prompts, temperatures=[float(x) for x in args.temperatures.split(",")],
                    methods=args.methods.split(","), block_size=args.block_size, max_new_tokens=args.max_new_tokens)
    table = markdown(rows)
    print(table)
    if args.out:
        from pathlib import Path

        from .bench_common import write_results

        out = Path(args.out)
        meta = {"drafter": args.drafter, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                "max_new_tokens": args.max_new_tokens, "block_size": args.block_size, "device": str(device)}
        settings = ", ".join(f"{k} {v}" for k, v in meta.items())
        write_results(out.parent, out.stem, {"settings": meta, "rows": rows, "pair": pair_fingerprint()},
                      f"Settings: {settings} (the first {args.prompts} held-out prompts, each cut to its last "
                      f"{args.prompt_tokens} tokens).\n\n" + table + "\n")

if __name__ == "__main__":
    main()
