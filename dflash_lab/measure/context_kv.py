"""Timing the three context-K/V paths against the GEMM floor (what chapter 5 runs live on a GPU).

``run_context_kv`` times reference / batched / batched + torch.compile / folded / folded +
the fused Triton epilogue at Laguna-XS.2's drafter shapes, next to the folded path's GEMM
alone (what no path can beat), and checks every path against the reference with
``context_kv_agreement``; ``context_kv_targets`` reads the three ratios the lab aims for.
``time_context_kv_live`` times the three paths on a drafter as it is (chapter 5 runs it on
the shipped drafter, on whatever machine runs the chapter, CPU or GPU).
``python -m dflash_lab.tools.bench context-kv`` writes them to benchmarks/.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch

from ..context_kv import build_context_kv_buffers, context_kv_agreement, context_kv_batched
from ..drafter import DFlashLagunaDrafter
from ..runtime import device_name
from .. import context_kv_kernel as kernels
from .timing import time_ms, xs2_drafter

# What is timed: the three paths of context_kv.py, two variants, and the floor.
TIMED_PATHS = ("reference", "batched", "batched_compiled", "folded", "folded_triton", "gemm_floor")


def context_kv_paths(drafter: DFlashLagunaDrafter, *, compiled: bool, fused: bool) -> dict:
    """name -> fn(context, positions) for every path this machine can run."""
    paths = {
        "reference": lambda x, p: drafter.precompute_context_kv(x, p, "reference"),
        "batched": lambda x, p: drafter.precompute_context_kv(x, p, "batched"),
        "folded": lambda x, p: drafter.precompute_context_kv(x, p, "folded", fused=False),
    }
    if fused:
        paths["folded_triton"] = lambda x, p: drafter.precompute_context_kv(x, p, "folded", fused=True)
    if compiled:
        paths["batched_compiled"] = torch.compile(functools.partial(context_kv_batched, drafter))

    weights = {}

    def gemm_floor(x, p):  # the folded path's one GEMM and nothing else: what no path can beat
        if x.dtype not in weights:
            weights[x.dtype] = build_context_kv_buffers(drafter, x.device, x.dtype)["folded_weight"]
        return x @ weights[x.dtype].T

    paths["gemm_floor"] = gemm_floor
    return paths


def run_context_kv(*, layers, contexts, device, dtype, compiled: bool, fused: bool, progress=print,
                   checkpoint=None, **shape) -> tuple[list, list]:
    """Time every path at every (layers, context); return (records, diagnostics).

    checkpoint(records, diagnostics), if given, runs after each drafter depth (partial results survive a timeout).
    """
    name = device_name(device)
    records, diagnostics = [], []
    for L in layers:
        drafter = xs2_drafter(L, device, dtype, **shape)
        paths = context_kv_paths(drafter, compiled=compiled, fused=fused)
        cfg = drafter.config
        # Largest context first: torch.compile specialises on the first shape it sees
        # (the one the targets are set at), then turns dynamic for the others.
        for N in sorted(contexts, reverse=True):
            g = torch.Generator(device).manual_seed(N)
            x = torch.randn(N, cfg.hidden_size, device=device, generator=g).to(dtype)
            pos = torch.arange(N, device=device)
            with torch.no_grad():
                ref = paths["reference"](x, pos)
                diag = {"layers": L, "context": N}
                for path, fn in paths.items():
                    t0 = time.perf_counter()
                    out = fn(x, pos)  # first call: compiles where there is something to compile
                    if path not in ("reference", "gemm_floor"):
                        agree = context_kv_agreement(out, ref)
                        diag[f"{path}_err"] = {"max": agree["max_err"], "mean": agree["mean_err"], "ok": agree["ok"]}
                        del agree
                    if path == "batched_compiled":
                        diag["compile_s"] = round(time.perf_counter() - t0, 1)
                    del out
                    ms = time_ms(lambda: fn(x, pos), device, budget_s=0.3)
                    records.append({"path": path, "layers": L, "context": N, "ms": round(ms, 4), "device": name})
                    progress(f"  L={L} N={N:>6} {path:17s} {ms:9.3f} ms")
                if fused:  # the epilogue alone: how close to the memory system is it?
                    bufs = build_context_kv_buffers(drafter, device, dtype)
                    kv = (x @ bufs["folded_weight"].T).view(N, L, 2, cfg.num_key_value_heads, cfg.head_dim)
                    rstd = kernels.row_rstd(x, cfg.rms_norm_eps)
                    ep = time_ms(lambda: kernels.knorm_rope_split(kv, bufs["k_norm_weights"], pos, cfg, row_scale=rstd),
                                 device)
                    rs = time_ms(lambda: kernels.row_rstd(x, cfg.rms_norm_eps), device)
                    nbytes = kernels.epilogue_bytes(N, L, cfg.num_key_value_heads, cfg.head_dim, dtype)
                    diag.update(epilogue_ms=round(ep, 4), epilogue_GBps=round(nbytes / ep / 1e6, 1),
                                row_rstd_ms=round(rs, 4))
                    del kv
                diagnostics.append(diag)
            del x, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del drafter, paths
        if checkpoint is not None:
            checkpoint(records, diagnostics)
    return records, diagnostics


def lookup_ms(records, path, L, N):
    """The milliseconds of one (path, layers, context) among the records, or None."""
    for r in records:
        if (r["path"], r["layers"], r["context"]) == (path, L, N):
            return r["ms"]
    return None


def context_kv_targets(records, L: int = 5, N: int = 32768) -> list[dict]:
    """The issue's three targets at (L, N): measured ratio, goal, met?"""
    t = {p: lookup_ms(records, p, L, N) for p in TIMED_PATHS}
    out = []
    for what, num, den, goal, higher in [
        ("reference / folded_triton", "reference", "folded_triton", 4.0, True),
        ("batched_compiled / folded_triton", "batched_compiled", "folded_triton", 1.5, True),
        ("folded_triton / gemm_floor", "folded_triton", "gemm_floor", 1.25, False),
    ]:
        if t[num] is None or t[den] is None:
            continue
        ratio = t[num] / t[den]
        out.append({"ratio": what, "value": round(ratio, 3), "goal": f"{'>=' if higher else '<='} {goal}",
                    "met": ratio >= goal if higher else ratio <= goal})
    return out


# ---------------------------------------------------------------------------
# Live, on the machine the chapter runs on: a drafter as it is (the shipped one)
# ---------------------------------------------------------------------------

# The paths chapter 5 times live, in the order it draws them; folded_triton only where the kernel runs.
LIVE_PATHS = ("reference", "batched", "folded", "folded_triton", "gemm_floor")


@contextlib.contextmanager
def cpu_threads(device, threads: int | None):
    """Run the block with torch on ``threads`` CPU threads (restored after); no change off the CPU or for None."""
    before = torch.get_num_threads()
    if threads is not None and torch.device(device).type == "cpu":
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def live_device_name(device, threads: int | None = 1) -> str:
    """``runtime.device_name`` as it reads inside ``cpu_threads(device, threads)``: a CPU says how many threads
    time it."""
    with cpu_threads(device, threads):
        return device_name(device).replace(" 1 threads)", " 1 thread)")


def time_context_kv_path(drafter: DFlashLagunaDrafter, context, positions, path: str, *, fused: bool | None = False,
                         threads: int | None = 1, budget_s: float = 0.2) -> float:
    """Median milliseconds of one ``precompute_context_kv(context, positions, path, fused=...)`` (``time_ms``)."""
    fused = fused if path == "folded" else None
    with cpu_threads(context.device, threads), torch.no_grad():
        return time_ms(lambda: drafter.precompute_context_kv(context, positions, path, fused=fused), context.device,
                       warmup=2, reps=10, budget_s=budget_s)


def time_context_kv_live(drafter: DFlashLagunaDrafter, *, contexts, device=None, dtype=None, fused: bool | None = None,
                         rounds: int = 3, budget_s: float = 0.1, seed: int = 0, threads: int | None = 1) -> list[dict]:
    """Time reference / batched / folded (and the fused kernel where it runs) on ``drafter`` itself.

    For each context length N: a random (N, H) context at positions 0..N-1, every path
    checked against the reference (``context_kv_agreement``), then timed with
    ``time_ms``. The paths are timed in ``rounds`` interleaved rounds and each keeps its
    fastest round's median, so that a burst of other work on a shared CPU lands on one
    round of every path rather than on all of one path. ``fused``: None = the fused
    Triton epilogue is timed where ``kernels.fused_available`` says it can run, False =
    never, True = insist. ``threads``: on a CPU, torch runs on this many threads while
    timing (default one: a small CPU shared with other work makes multi-threaded
    timings swing by several times; None keeps torch's setting); the device name says it.
    Returns records in benchmarks/context_kv.json's form ({"path", "layers", "context",
    "ms", "device"}) plus "hidden", "dtype" and "agrees".
    """
    device = torch.device(device) if device is not None else next(drafter.parameters()).device
    dtype = dtype or next(drafter.parameters()).dtype
    with cpu_threads(device, threads):
        return _time_context_kv_live(drafter, contexts, device, dtype, fused, rounds, budget_s, seed)


def _time_context_kv_live(drafter, contexts, device, dtype, fused, rounds, budget_s, seed) -> list[dict]:
    cfg, L, name = drafter.config, len(drafter.layers), live_device_name(device, None)  # threads set by the caller
    probe = torch.empty(0, device=device, dtype=dtype)
    run_fused = kernels.fused_available(probe, fused)
    paths = context_kv_paths(drafter, compiled=False, fused=run_fused)
    records = []
    for N in sorted(contexts):
        g = torch.Generator(device).manual_seed(seed + N)
        x = torch.randn(N, cfg.hidden_size, device=device, generator=g).to(dtype)
        pos = torch.arange(N, device=device)
        best, agrees = {}, {}
        with torch.no_grad():
            ref = paths["reference"](x, pos)
            for path in LIVE_PATHS:
                if path in paths and path not in ("reference", "gemm_floor"):
                    agrees[path] = bool(context_kv_agreement(paths[path](x, pos), ref)["ok"])
            del ref
            for i in range(rounds):
                for path in LIVE_PATHS:
                    if path in paths:  # warm-up in the first round only: each path has run by then
                        ms = time_ms(lambda: paths[path](x, pos), device, warmup=1 if i == 0 else 0, reps=10,
                                     budget_s=budget_s)
                        best[path] = min(ms, best.get(path, float("inf")))
        for path in LIVE_PATHS:
            if path in best:
                records.append({"path": path, "layers": L, "context": N, "ms": round(best[path], 4), "device": name,
                                "hidden": cfg.hidden_size, "dtype": str(dtype).removeprefix("torch."),
                                "agrees": agrees.get(path, True)})
    return records


def speedup(records, faster: str, slower: str, N: int) -> float | None:
    """How many times faster ``faster`` ran than ``slower`` at context N (one drafter depth's records)."""
    t_fast = next((r["ms"] for r in records if (r["path"], r["context"]) == (faster, N)), None)
    t_slow = next((r["ms"] for r in records if (r["path"], r["context"]) == (slower, N)), None)
    return None if not t_fast or not t_slow else t_slow / t_fast
