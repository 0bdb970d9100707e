"""Benchmark: the two shipped drafters compared, on two prompt sets, with bootstrap intervals.

    python -m dflash_lab.tools.bench drafters [--quick] [--update-logs]

The paper's drafter (full attention, non-causal) and the Poolside-style one (sliding window 64,
causal) on the held-out prompts and on the docstring-first prompts (``corpus.cut_docstring_prompts``:
the continuation is a function body, not a repeat of the prompt), blocks 4/8/16, greedy, with prompt
lookup at block 16 beside them (``measure.drafters``). Writes benchmarks/drafters.{json,md};
``--update-logs`` also writes the held-out numbers into each drafter's training log (``final``), as
``python -m dflash_lab.train evaluate --update-log`` does.
"""

from __future__ import annotations

import time

import torch

from ..assets import heldout_prompts, load_default_pair, pair_drafters, pair_fingerprint, second_drafter_missing
from ..config import DEFAULT_BLOCK_SIZE
from ..measure.drafters import compare_drafters, markdown, window_markdown, window_study
from ..runtime import DOCSTRING_PROMPTS, device_name, resolve_device
from ..train.evaluate import update_training_log
from .bench_common import OUT_HELP, pair_out_dir, write_results


def drafters_markdown(result: dict, out_dir) -> str:
    """benchmarks/drafters.md from its record, with the repetition split of benchmarks/repetition.json beside each
    set when that record is of the same pair."""
    import json
    from pathlib import Path

    path = Path(out_dir) / "repetition.json"
    repetition = json.loads(path.read_text()) if path.is_file() else None
    if repetition is not None and repetition.get("pair") != result.get("pair"):
        repetition = None
    return ("# The shipped drafters compared\n\n"
            f"{result['device']}, {result['dtype']}, `evaluate_acceptance` (the decoder's exact counters). "
            "paper = `laguna-tiny-code-dflash` (full attention, non-causal); poolside = "
            "`laguna-tiny-code-dflash-poolside` (sliding window 64, causal).\n\n" + markdown(result, repetition)
            + f"\nCommand: `{result['command']}` ({result['seconds']:.0f} s)\n")


def drafters(args) -> int:
    """The `drafters` subcommand."""
    device = resolve_device(args.device, caller="bench drafters")
    torch.set_num_threads(args.threads) if args.threads else None
    n = args.prompts or (8 if args.quick else None)
    blocks = args.block_sizes or ([DEFAULT_BLOCK_SIZE] if args.quick else [4, 8, 16])
    if second_drafter_missing():  # the comparison needs two drafters of the target in use
        raise SystemExit(f"bench drafters compares two drafters: {second_drafter_missing()}")
    args.out = pair_out_dir(args.out)
    target, paper, tokenizer = load_default_pair(device=device, drafter="paper")
    poolside = load_default_pair(device=device, drafter="poolside")[1]
    sets = {"held-out": heldout_prompts()[:n], "docstring-first": heldout_prompts(DOCSTRING_PROMPTS)[:n]}
    start = time.perf_counter()
    if args.window_study:
        study = window_study(target, {"paper": paper, "poolside": poolside}, tokenizer, sets["held-out"],
                             max_new_tokens=args.max_new_tokens, progress=lambda s: print(s, flush=True))
        study.update(device=device_name(device), pair=pair_fingerprint(),
                     seconds=round(time.perf_counter() - start, 1),
                     command="python -m dflash_lab.tools.bench drafters --window-study")
        md = window_markdown(study) + f"\nCommand: `{study['command']}` ({study['seconds']:.0f} s)\n"
        print(md)
        print("wrote", *write_results(args.out, "drafter_window", study, md))
        return 0
    result = compare_drafters(target, {"paper": paper, "poolside": poolside}, tokenizer, sets, block_sizes=blocks,
                              max_new_tokens=args.max_new_tokens, progress=lambda s: print(s, flush=True))
    result.update(device=device_name(device), pair=pair_fingerprint(),
                  dtype=str(next(target.parameters()).dtype).replace("torch.", ""),
                  seconds=round(time.perf_counter() - start, 1),
                  command="python -m dflash_lab.tools.bench drafters" + (" --quick" if args.quick else ""))
    md = drafters_markdown(result, args.out)
    paths = write_results(args.out, "drafters_quick" if args.quick else "drafters", result, md)
    print(md)
    print("wrote", *paths)
    if args.update_logs and not args.quick:
        for name in ("paper", "poolside"):
            held_out = result["sets"]["held-out"]["drafters"][name]
            print("updated", update_training_log(pair_drafters()[name], {bs: r["record"] for bs, r in held_out.items()},
                                                 device))
    return 0


def add_command(subparsers) -> None:
    p = subparsers.add_parser("drafters", help="the two shipped drafters on two prompt sets, with intervals")
    p.add_argument("--quick", action="store_true", help="block 16 on 8 prompts of each set")
    p.add_argument("--block-sizes", type=int, nargs="+", help="default 4 8 16")
    p.add_argument("--prompts", type=int, help="first N prompts of each set (default all 48)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads (small matmuls: 1 is fastest)")
    p.add_argument("--window-study", action="store_true",
                   help="only the long-prompt study: full vs cut prompts, the sliding drafter's window removed")
    p.add_argument("--update-logs", action="store_true", help="write the held-out numbers into the training logs")
    p.add_argument("--device", help="default: $DFLASH_LAB_DEVICE, else cuda when present")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.set_defaults(func=drafters)
