"""DFlash vs prompt lookup on the shipped pair: acceptance on the held-out prompts.

    python -m dflash_lab.tools.compare_drafters --prompts 48 --max-new-tokens 64 --block-sizes 4 8 16

Prints one JSON line per (method, block size): vLLM's headline counters
(``SpecDecodeStats.summary``) and the target forwards per generated token.
"""

from __future__ import annotations

import argparse
import json

from ..assets import heldout_prompts, load_default_pair
from ..runtime import resolve_device
from ..spec_decode import generate_on_prompts


def main(argv=None) -> None:
    """Acceptance of the shipped pair on the held-out prompts, DFlash vs prompt lookup:

        python -m dflash_lab.tools.compare_drafters --prompts 48 --max-new-tokens 64 --block-sizes 4 8 16
    """
    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=48, help="held-out prompts to use")
    p.add_argument("--prompt-tokens", type=int, default=64, help="keep the last N tokens of each prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    target, drafter, tokenizer = load_default_pair(device=resolve_device(None))
    prompts = [tokenizer(q["text"])["input_ids"][-args.prompt_tokens:] for q in heldout_prompts()[:args.prompts]]
    rows = []
    for method, proposer in (("DFlash", drafter), ("prompt lookup", "ngram")):
        for block in args.block_sizes:
            stats, _ = generate_on_prompts(target, proposer, prompts, max_new_tokens=args.max_new_tokens,
                                           block_size=block,
                                           temperature=args.temperature, seed=0, desc=f"{method}, block {block}")
            rows.append({"method": method, "block_size": block, **stats.summary(),
                         "target_forwards_per_token": round(stats.target_forwards_per_token, 3)})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
