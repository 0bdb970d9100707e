"""What a K = 0 step costs against target-only's on a GPU: the step a per-batch schedule runs where it stops drafting.

``num_speculative_tokens_per_batch_size`` turns drafting off (K = 0) at large batches, and served that way a
method should cost what target-only costs. For each batch: target-only's graphed step, and the width-1 step of
the device prompt lookup (block 8) and of each shipped drafter (block 16), which also appends the drafter's
context K/V as vLLM 0.33 does. Each line gives the first replay after the decoder was built and the median of
five runs of 20 replays, with ``cuda_graphs.WARM_REPLAY`` on and off. Needs CUDA.

    python scripts/k0_steps.py [--batches 32 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from dflash_lab.assets import load_pair
from dflash_lab.measure.decoding import LOOKUP, drafter_methods
from dflash_lab.spec_decode.fast import cuda_graphs
from dflash_lab.spec_decode.fast.decoder import FastDecoder


def replay_ms(step, reps: int = 20) -> tuple[float, float]:
    """(the first call's ms, the median ms of a call over five runs of ``reps``), synchronised around each."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t) * 1e3
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t) / reps * 1e3)
    return first, statistics.median(runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 1
    target, drafters, _ = load_pair("cuda")
    methods = [("target_only", None, 1), ("prompt_lookup_gpu", LOOKUP["prompt_lookup_gpu"], 8)]
    methods += [(m, d, 16) for m, d in drafter_methods(drafters).items()]
    g = torch.Generator().manual_seed(0)
    for batch in args.batches:
        prompts = [torch.randint(5, target.config.vocab_size, (40,), generator=g).cuda() for _ in range(batch)]
        for warm in (True, False):
            cuda_graphs.WARM_REPLAY = warm
            for name, proposer, block in methods:
                dec = FastDecoder(target, proposer, batch=batch, block_size=block, capacity=400,
                                  widths=[1] if block > 1 else ())
                dec.prefill(prompts, 300)
                first, ms = replay_ms(dec.step_at(1))
                print(f"batch {batch:>2}, warm replay {'on ' if warm else 'off'}, {name:<17} K = 0 step: "
                      f"first replay {first:.3f} ms, then {ms:.4f} ms", flush=True)
                del dec
    cuda_graphs.WARM_REPLAY = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
