"""Timing what the lab runs: wall and kernel time of a call, graphed time, Laguna-XS.2-sized drafters.

Timings are taken in one process, after warm-up, with CUDA events on a GPU (a host clock
on a CPU), and reported as medians. The chapters time live with these; the benchmark CLIs
(``dflash_lab.tools``) time with them too and write the results to benchmarks/.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..config import DFlashDrafterConfig
from ..drafter import DFlashLagunaDrafter
from ..runtime import synchronized_time
from ..spec_decode.fast.cuda_graphs import GraphedStep

# Laguna-XS.2's attention and width (transformers' LagunaConfig defaults); a drafter shares them.
XS2 = dict(hidden_size=2048, num_attention_heads=48, num_key_value_heads=8, head_dim=128, intermediate_size=8192)


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def time_ms(fn, device: torch.device, *, warmup: int = 3, reps: int = 20, budget_s: float = 0.5) -> float:
    """Median wall time of fn() in milliseconds, after warm-up; fewer reps for slow calls."""
    for _ in range(warmup):
        fn()
    t0 = synchronized_time(device)
    fn()
    first = synchronized_time(device) - t0
    reps = max(5, min(reps, int(budget_s / max(first, 1e-6))))
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(start.elapsed_time(end) for start, end in events)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernel_ms(fn, device: torch.device) -> float | None:
    """Sum of GPU kernel time of one fn() call (what a CUDA graph would leave), via the profiler.

    None on a CPU, or when the profiler is not available.
    """
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile  # only the GPU projection needs the profiler

        fn()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize(device)
        total_us = sum(e.self_device_time_total for e in prof.key_averages())
        return total_us / 3 / 1e3
    except Exception as e:  # the profiler is a nicety; wall times still stand
        print("  (profiler unavailable:", type(e).__name__, e, ")")
        return None


def graphed_ms(fn, device: torch.device, *, reps: int = 50) -> float | None:
    """Median time of fn() captured as ONE CUDA graph and replayed (launch gaps gone); None off CUDA.

    fn must be capturable (no host syncs) and must not move state that later calls
    depend on: the same graph is replayed ``reps`` times.
    """
    if device.type != "cuda":
        return None
    step = GraphedStep(fn, enabled=True, device=device)
    return time_ms(step, device, warmup=3, reps=reps, budget_s=0.3)


# ---------------------------------------------------------------------------
# A drafter at Laguna-XS.2's shapes
# ---------------------------------------------------------------------------


def xs2_drafter(layers: int, device, dtype, *, seed: int = 0, **shape) -> DFlashLagunaDrafter:
    """A drafter with Laguna-XS.2's shapes (or ``shape`` overrides) and random, non-trivial weights."""
    s = dict(XS2, **shape)
    cfg = DFlashDrafterConfig.from_dict({
        **s, "num_hidden_layers": layers, "layer_types": ["full_attention"] * layers, "draft_vocab_size": 100352,
        "dflash_config": {"target_layer_ids": [1, 19, 37], "mask_token_id": 3}, "target_layer_count": 40,
    })
    torch.manual_seed(seed)
    with torch.device(device):
        drafter = DFlashLagunaDrafter(cfg)
    with torch.no_grad():  # norm weights away from 1, so that folding them in matters
        for layer in drafter.layers:
            for norm in (layer.input_layernorm, layer.self_attn.k_norm):
                norm.weight.normal_(1.0, 0.25)
    return drafter.to(dtype).eval()
