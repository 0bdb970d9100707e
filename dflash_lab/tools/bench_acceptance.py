"""Benchmark: acceptance of the shipped pair on the held-out prompts.

    python -m dflash_lab.tools.bench acceptance [--quick]

Greedy DFlash speculative decoding (``speculative_generate``) of every held-out
prompt at each block size, counted with vLLM's acceptance counters (mean
acceptance length, per-position acceptance rate). Writes
benchmarks/acceptance.{json,md}.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from ..assets import heldout_prompts, load_default_pair
from ..config import DEFAULT_BLOCK_SIZE
from ..runtime import device_name, resolve_device
from ..spec_decode import SpecDecodeStats, speculative_generate
from .bench_common import OUT_HELP, pair_out_dir, write_results


def measure_acceptance(*, device, block_sizes, n_prompts: int | None, max_new_tokens: int,
                       progress=print) -> list[dict]:
    """vLLM's acceptance counters of greedy speculative decoding, one row per block size."""
    target, drafter, tokenizer = load_default_pair(device=device)
    prompts = heldout_prompts()[:n_prompts]
    ids = [torch.tensor([tokenizer.encode(p["text"], add_special_tokens=False)], device=device) for p in prompts]
    rows = []
    for block in block_sizes:
        stats, t0 = SpecDecodeStats(), time.perf_counter()
        for x in tqdm(ids, desc=f"block {block}", leave=False, disable=None):
            run = speculative_generate(target, drafter, x, max_new_tokens=max_new_tokens, block_size=block)
            stats = stats + run.stats
        row = {
            "block_size": block, "prompts": len(ids), "max_new_tokens": max_new_tokens,
            "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
            "mean_acceptance_length": round(stats.mean_acceptance_length, 4),
            "per_position_acceptance_rate": [round(r, 4) for r in stats.per_position_acceptance_rate],
            "seconds": round(time.perf_counter() - t0, 2), "device": device_name(device),
            "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        }
        rows.append(row)
        progress(f"  block {block:2d}: mean acceptance length {row['mean_acceptance_length']:.3f} over "
                 f"{row['num_drafts']} drafts; per position "
                 + " ".join(f"{r:.2f}" for r in row["per_position_acceptance_rate"]))
    return rows


def acceptance_markdown(result: dict) -> str:
    rows = result["rows"]
    width = max(len(r["per_position_acceptance_rate"]) for r in rows)
    lines = [
        "# Acceptance of the shipped pair on the held-out prompts",
        "",
        f"Greedy DFlash speculative decoding (`speculative_generate`), {rows[0]['prompts']} held-out prompts "
        f"(`checkpoints/heldout_prompts.json`), {result['max_new_tokens']} new tokens each, on {rows[0]['device']} "
        f"in {rows[0]['dtype']}. Mean acceptance length = 1 + accepted / drafts; the rate at position i is the "
        "share of drafts whose first i draft tokens were all accepted (vLLM's definitions).",
        "",
        "| block | drafts | mean acceptance length | " + " | ".join(f"pos {i}" for i in range(1, width + 1)) + " |",
        "|---|---|---|" + "---|" * width,
    ]
    for r in rows:
        rates = r["per_position_acceptance_rate"] + [None] * (width - len(r["per_position_acceptance_rate"]))
        lines.append(f"| {r['block_size']} | {r['num_drafts']} | **{r['mean_acceptance_length']:.3f}** | "
                     + " | ".join("" if x is None else f"{x:.2f}" for x in rates) + " |")
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def acceptance(args) -> int:
    """The `acceptance` subcommand."""
    device = resolve_device(args.device, caller="bench acceptance")
    blocks = [DEFAULT_BLOCK_SIZE] if args.quick and not args.block_sizes else (args.block_sizes or [16, 8, 4])
    n_prompts = args.prompts or (12 if args.quick else None)
    print(f"acceptance on {device_name(device)}: blocks {blocks}, {n_prompts or 'all'} held-out prompts x "
          f"{args.max_new_tokens} tokens", flush=True)
    rows = measure_acceptance(device=device, block_sizes=blocks, n_prompts=n_prompts,
                              max_new_tokens=args.max_new_tokens, progress=lambda s: print(s, flush=True))
    result = {"max_new_tokens": args.max_new_tokens, "rows": rows,
              "command": "python -m dflash_lab.tools.bench acceptance" + (" --quick" if args.quick else "")}
    md = acceptance_markdown(result)
    paths = write_results(pair_out_dir(args.out), "acceptance_quick" if args.quick else "acceptance", result, md)
    print(md)
    print("wrote", *paths)
    return 0


def add_command(subparsers) -> None:
    p = subparsers.add_parser("acceptance", help="acceptance of the shipped pair on the held-out prompts")
    p.add_argument("--quick", action="store_true", help="block 16 on 12 prompts")
    p.add_argument("--block-sizes", type=int, nargs="+", help="default 16 8 4")
    p.add_argument("--prompts", type=int, help="first N held-out prompts (default all)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", help="default: $DFLASH_LAB_DEVICE, else cuda when present")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.set_defaults(func=acceptance)
