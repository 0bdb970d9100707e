"""What a continuous-batching refill costs on a GPU: ``FastDecoder.fill`` of 1, 2 and 4 rows on the shipped pair.

A served stream refills a finished row with the next request's prefill (``serving.serve``); at high concurrency
those prefills, not the batch steps, take most of the run (``measure.serving.time_split``). For target-only and
the paper's drafter at batch 32: the graphed fill's ms (median of 20 after warm-up) at each row count, then the
kernels of one eager one-row fill under torch.profiler, counted and summed by name. Needs CUDA.

    python scripts/profile_fill.py [--batch 32] [--rows 1 2 4]
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_lab.assets import load_pair
from dflash_lab.measure.decoding import drafter_methods
from dflash_lab.spec_decode.fast.decoder import FastDecoder
from dflash_lab.tools.bench_spec_decode import PROMPT_LENGTH, prompt_ids


def fill_ms(dec: FastDecoder, rows: dict, reps: int = 20) -> float:
    """Median ms of ``dec.fill(rows)``, each timed with CUDA events after three warm-up fills."""
    for _ in range(3):
        dec.fill(rows, 96)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dec.fill(rows, 96)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_table(dec: FastDecoder, rows: dict, top: int = 12) -> None:
    """The kernels of one fill, launched one by one (no graph): count and GPU ms per name, largest first."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.fill(rows, 96)
        torch.cuda.synchronize()
    by_name = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.device_time / 1e3
    total = sum(n for n, _ in by_name.values())
    print(f"  one eager fill: {total} kernels, {sum(ms for _, ms in by_name.values()):.3f} ms of kernel time")
    for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"    {name[:80]:80s} x{n:<3d} {ms:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: the refill's cost is a GPU question (on a CPU every fill is eager)")
    dev = torch.device("cuda")
    target, drafters, tok = load_pair(dev)
    prompts = [p[0] for p in prompt_ids(tok, "heldout", max(args.batch, max(args.rows)), PROMPT_LENGTH, dev)]
    for name, drafter in (("target_only", None), ("dflash", drafter_methods(drafters)["dflash"])):
        for graphs in (True, False):
            dec = FastDecoder(target, drafter, batch=args.batch, block_size=1 if drafter is None else 16,
                              capacity=PROMPT_LENGTH + 128, cuda_graphs=graphs)
            dec.prefill(prompts[:args.batch], 96)
            for n in args.rows if graphs else args.rows[:1]:
                rows = {b: prompts[b] for b in range(n)}
                width = dec.prefill_width(max(int(p.shape[-1]) for p in rows.values()))
                if graphs:
                    print(f"{name}: graphed fill of {n} row(s), padded to {width}: {fill_ms(dec, rows):.3f} ms")
                else:
                    kernel_table(dec, rows)
            del dec


if __name__ == "__main__":
    main()
