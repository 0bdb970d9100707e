"""Where a DDTree step's time goes on a GPU: the kernels of one step (chain, and a tree at each budget), launched
one by one under torch.profiler, counted and summed by name.

    python scripts/profile_tree_step.py [--budgets 32 128] [--batch 1]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_lab.assets import heldout_prompts, load_default_pair
from dflash_lab.spec_decode import FastDecoder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    target, drafter, tok = load_default_pair("cuda", dtype=torch.bfloat16)
    prompts = [torch.tensor(tok(p["text"])["input_ids"][-200:], device="cuda") for p in heldout_prompts()[:args.batch]]
    for budget in (None, *args.budgets):
        dec = FastDecoder(target, drafter, batch=args.batch, block_size=16, capacity=400, cuda_graphs=False,
                          tree_budget=budget)
        dec.prefill(prompts, 96)
        for _ in range(3):
            dec.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total, by_name = 0.0, defaultdict(lambda: [0, 0.0])
        for e in kernels:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.device_time
            total += e.device_time
        name = "chain" if budget is None else f"tree {budget}"
        print(f"{name}: {len(kernels)} kernels, {total / 1e3:.3f} ms of kernel time")
        for k, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"   {k[:90]:90s} x{n:<4d} {t / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
