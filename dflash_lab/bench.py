"""Benchmarks, one subcommand each, results as JSON + a markdown table under benchmarks/.

    python -m dflash_lab.bench context-kv [--quick]   # the three context-K/V paths vs the GEMM floor
    python -m dflash_lab.bench spec-decode [--quick]  # tokens/s of the shipped pair; speedup projected to Laguna-XS.2
    python -m dflash_lab.bench acceptance [--quick]   # acceptance of the shipped pair on the held-out prompts

Timings are taken in one process, after warm-up, with CUDA events on a GPU
(a host clock on a CPU), and reported as medians. This module imports neither
plotly nor vLLM: it runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from . import kernels
from .checkpoint import atomic_file
from .config import DFlashDrafterConfig
from .drafter import DFlashLagunaDrafter, _build_context_kv_buffers, context_kv_batched

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"

# Laguna-XS.2's attention and width (transformers' LagunaConfig defaults); a drafter shares them.
XS2 = dict(hidden_size=2048, num_attention_heads=48, num_key_value_heads=8, head_dim=128, intermediate_size=8192)
CONTEXT_KV_PATHS = ("reference", "batched", "batched_compiled", "folded", "folded_triton", "gemm_floor")


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def time_ms(fn, device: torch.device, *, warmup: int = 3, reps: int = 20, budget_s: float = 0.5) -> float:
    """Median wall time of fn() in milliseconds, after warm-up; fewer reps for slow calls."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    first = time.perf_counter() - t0
    reps = max(5, min(reps, int(budget_s / max(first, 1e-6))))
    times = []
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _pick_device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def _write(out_dir: Path, stem: str, records, markdown: str | None = None) -> list[Path]:
    """Write <stem>.json (and <stem>.md) atomically: a failed run leaves the old files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {out_dir / f"{stem}.json": json.dumps(records, indent=1) + "\n"}
    if markdown is not None:
        files[out_dir / f"{stem}.md"] = markdown
    for path, text in files.items():
        atomic_file(path, lambda tmp: tmp.write_text(text))
    return list(files)


# ---------------------------------------------------------------------------
# context-kv: reference / batched / compiled / folded / folded+Triton vs the GEMM floor
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
            weights[x.dtype] = _build_context_kv_buffers(drafter, x.device, x.dtype)["folded_weight"]
        return x @ weights[x.dtype].T

    paths["gemm_floor"] = gemm_floor
    return paths


def _errors(out, ref) -> dict:
    errs = [(a.float() - b.float()).abs() for a, b in zip(out, ref)]
    return {"max": max(e.max().item() for e in errs), "mean": max(e.mean().item() for e in errs)}


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
                        diag[f"{path}_err"] = _errors(out, ref)
                    if path == "batched_compiled":
                        diag["compile_s"] = round(time.perf_counter() - t0, 1)
                    del out
                    ms = time_ms(lambda: fn(x, pos), device, budget_s=0.3)
                    records.append({"path": path, "layers": L, "context": N, "ms": round(ms, 4), "device": name})
                    progress(f"  L={L} N={N:>6} {path:17s} {ms:9.3f} ms")
                if fused:  # the epilogue alone: how close to the memory system is it?
                    bufs = _build_context_kv_buffers(drafter, device, dtype)
                    kv = (x @ bufs["folded_weight"].T).view(N, L, 2, cfg.num_key_value_heads, cfg.head_dim)
                    rstd = kernels.row_rstd(x, cfg.rms_norm_eps)
                    ep = time_ms(lambda: kernels.knorm_rope_split(kv, bufs["k_norm_weights"], pos, cfg, row_scale=rstd), device)
                    rs = time_ms(lambda: kernels.row_rstd(x, cfg.rms_norm_eps), device)
                    nbytes = kernels.epilogue_bytes(N, L, cfg.num_key_value_heads, cfg.head_dim, dtype)
                    diag.update(epilogue_ms=round(ep, 4), epilogue_GBps=round(nbytes / ep / 1e6, 1), row_rstd_ms=round(rs, 4))
                    del kv
                diagnostics.append(diag)
            del x, ref
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del drafter, paths
        if checkpoint is not None:
            checkpoint(records, diagnostics)
    return records, diagnostics


def _lookup(records, path, L, N):
    for r in records:
        if (r["path"], r["layers"], r["context"]) == (path, L, N):
            return r["ms"]
    return None


def context_kv_targets(records, L: int = 5, N: int = 32768) -> list[dict]:
    """The issue's three targets at (L, N): measured ratio, goal, met?"""
    t = {p: _lookup(records, p, L, N) for p in CONTEXT_KV_PATHS}
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


def context_kv_markdown(records, diagnostics=(), *, dtype="bfloat16", command="",
                        shapes_note="drafter hidden 2048, 8 KV heads x head_dim 128 (Laguna-XS.2 shapes)") -> str:
    """A table of median times per path and the ratios that matter."""
    shapes = sorted({(r["layers"], r["context"]) for r in records})
    paths = [p for p in CONTEXT_KV_PATHS if any(r["path"] == p for r in records)]
    dev = records[0]["device"] if records else "?"
    lines = [
        "# Context K/V precompute",
        "",
        f"Device: {dev}; {dtype}; {shapes_note}, partial rotary 0.5, positions 0..N-1. "
        f"Median ms after warm-up ({'CUDA events' if 'CPU' not in dev else 'host clock'}), one process. "
        "gemm_floor is the folded path's GEMM alone ([N, H] x [H, L*2*nkv*hd]).",
        "",
        "| L | N | " + " | ".join(paths) + " | ref / triton | compiled / triton | triton / floor |",
        "|---|---|" + "---|" * (len(paths) + 3),
    ]
    for L, N in shapes:
        t = {p: _lookup(records, p, L, N) for p in paths}
        ratio = lambda a, b: f"{t[a] / t[b]:.2f}" if t.get(a) and t.get(b) else "-"  # noqa: E731
        cells = [f"{t[p]:.3f}" if t[p] is not None else "-" for p in paths]
        lines.append(f"| {L} | {N} | " + " | ".join(cells) + f" | {ratio('reference', 'folded_triton')} | "
                     f"{ratio('batched_compiled', 'folded_triton')} | {ratio('folded_triton', 'gemm_floor')} |")
    targets = context_kv_targets(records)
    if targets:
        lines += ["", "## Targets at L=5, N=32768", "", "| ratio | measured | goal | met |", "|---|---|---|---|"]
        lines += [f"| {t['ratio']} | {t['value']:.3f} | {t['goal']} | {'yes' if t['met'] else 'NO'} |" for t in targets]
    if diagnostics and any("epilogue_ms" in d for d in diagnostics):
        lines += ["", "## The fused epilogue alone", "",
                  "One read of the GEMM output, one write of K and V; bytes counted that way over the time.", "",
                  "| L | N | epilogue ms | GB/s | row 1/rms ms | folded_triton bf16 err max / mean |", "|---|---|---|---|---|---|"]
        for d in sorted(diagnostics, key=lambda d: (d["layers"], d["context"])):
            if "epilogue_ms" in d:
                e = d.get("folded_triton_err", {})
                lines.append(f"| {d['layers']} | {d['context']} | {d['epilogue_ms']:.3f} | {d['epilogue_GBps']:.0f} | "
                             f"{d['row_rstd_ms']:.3f} | {e.get('max', math.nan):.3g} / {e.get('mean', math.nan):.2g} |")
    if command:
        lines += ["", f"Command: `{command}`"]
    return "\n".join(lines) + "\n"


def context_kv(args) -> int:
    device = _pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    quick = args.quick
    layers = args.layers or ([1, 2] if quick else [1, 3, 5, 8])
    contexts = args.contexts or ([64, 256] if quick else [1024, 8192, 32768])
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=128) if quick else {}
    fused = kernels.fused_available(torch.empty(0, device=device))
    compiled = not args.no_compile and (device.type == "cuda" or not quick)
    print(f"context-kv on {device_name(device)}: L={layers} N={contexts} {args.dtype}; "
          f"folded_triton {'on' if fused else 'off (no CUDA/Triton)'}; torch.compile {'on' if compiled else 'off'}", flush=True)
    stem = "context_kv_quick" if quick else "context_kv"
    records, diagnostics = run_context_kv(
        layers=layers, contexts=contexts, device=device, dtype=dtype, compiled=compiled, fused=fused,
        progress=lambda s: print(s, flush=True), checkpoint=lambda r, d: _write(Path(args.out), stem + "_partial", r), **shape)
    command = "python -m dflash_lab.bench context-kv" + (" --quick" if quick else "")
    note = "drafter hidden {hidden_size}, {num_key_value_heads} KV heads x head_dim {head_dim}".format(**{**XS2, **shape})
    md = context_kv_markdown(records, diagnostics, dtype=args.dtype, command=command,
                             shapes_note=note + ("" if quick else " (Laguna-XS.2 shapes)"))
    paths = _write(Path(args.out), stem, records, md)
    (Path(args.out) / f"{stem}_partial.json").unlink(missing_ok=True)
    paths += _write(Path(args.out), stem + "_diagnostics", diagnostics)
    print(md)
    print("wrote", *paths)
    return 0


# ---------------------------------------------------------------------------
# spec-decode: the shipped pair, then a projection to Laguna-XS.2
# ---------------------------------------------------------------------------


class NoDraft:
    """A proposer that proposes nothing: speculative_generate becomes plain greedy decoding
    through the same loop (same cache handling, same overheads)."""

    def propose(self, tokens, num_draft):
        return []


def _prompts(tokenizer, n: int, max_tokens: int, device) -> list[torch.Tensor]:
    """The first n held-out prompts, each cut to its last max_tokens tokens."""
    from .assets import heldout_prompts

    return [tokenizer(p["text"], return_tensors="pt")["input_ids"][:, -max_tokens:].to(device)
            for p in heldout_prompts()[:n]]


def measure_shipped_pair(*, device, n_prompts: int, max_new_tokens: int, block_sizes, progress=print,
                         on_row=None) -> list[dict]:
    """tokens/s and target forwards per token: target only, DFlash at each block size, prompt lookup.

    on_row(rows), if given, runs after each method (partial results survive a timeout).
    """
    from tqdm.auto import tqdm

    from .assets import load_default_pair
    from .spec_decode import SpecDecodeStats, speculative_generate

    target, drafter, tokenizer = load_default_pair(device=device)
    prompts = _prompts(tokenizer, n_prompts, 256, device)
    runs = [("target_only", NoDraft(), 2)] + [(f"dflash_b{b}", drafter, b) for b in block_sizes] + \
           [(f"prompt_lookup_b{b}", "ngram", b) for b in block_sizes]
    for proposer, block in ((NoDraft(), 2), (drafter, max(block_sizes)), ("ngram", max(block_sizes))):
        speculative_generate(target, proposer, prompts[0], max_new_tokens=max_new_tokens, block_size=block)  # warm-up
    reference_outputs, rows = None, []
    for name, proposer, block in runs:
        stats, outputs, wall = SpecDecodeStats(), [], 0.0
        for prompt in tqdm(prompts, desc=name, leave=False, disable=None):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            res = speculative_generate(target, proposer, prompt, max_new_tokens=max_new_tokens, block_size=block)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall += time.perf_counter() - t0
            stats = stats + res.stats
            outputs.append(res.output_ids[0, prompt.shape[1]:].tolist())
        if reference_outputs is None:
            reference_outputs = outputs
        same = sum(a == b for a, b in zip(outputs, reference_outputs))
        row = {
            "method": name, "block_size": None if name == "target_only" else block,
            "tokens": stats.num_generated_tokens, "seconds": round(wall, 3),
            "tokens_per_s": round(stats.num_generated_tokens / wall, 1),
            "target_forwards_per_token": round(stats.target_forwards_per_token, 4),
            "mean_acceptance_length": None if name == "target_only" else round(stats.mean_acceptance_length, 4),
            "per_position_acceptance_rate": None if name == "target_only" else [round(r, 4) for r in stats.per_position_acceptance_rate],
            "outputs_equal_target_only": f"{same}/{len(outputs)}",
            # where the time goes: eager target forwards vs drafter steps (forward + context K/V append)
            "target_ms_per_forward": round(1e3 * stats.target_time_s / max(stats.num_target_forwards, 1), 3),
            "drafter_ms_per_step": round(1e3 * stats.drafter_time_s / max(stats.num_target_forwards - len(prompts), 1), 3),
            "device": device_name(device), "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        }
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        progress(f"  {name:20s} {row['tokens_per_s']:8.1f} tok/s  fwd/token {row['target_forwards_per_token']:.3f}  "
                 f"tau {row['mean_acceptance_length']}  same as target-only {row['outputs_equal_target_only']}")
    return rows


def _kernel_ms(fn, device) -> float | None:
    """Sum of GPU kernel time of one fn() call (what a CUDA graph would leave), via the profiler."""
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

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


def xs2_target_times(*, device, block_sizes, context: int, layer_counts=(2, 4), total_layers: int = 40,
                     progress=print, **config_overrides) -> dict:
    """One target forward of B tokens at Laguna-XS.2 shapes, extrapolated to 40 layers.

    transformers' LagunaForCausalLM with LagunaConfig's defaults (hidden 2048, 48 heads /
    8 KV x 128, 256 experts top-8, expert and shared width 512, vocab 100352), random bf16
    weights, every layer sparse-MoE; built with 2 and 4 layers: per-layer time = the
    difference / 2, the rest (embedding, final norm, lm_head) = what remains.
    """
    from transformers import DynamicCache, LagunaConfig, LagunaForCausalLM

    from .spec_decode import crop_cache

    times = {}
    for n_layers in layer_counts:
        cfg = LagunaConfig(num_hidden_layers=n_layers, layer_types=["full_attention"] * n_layers,
                           mlp_layer_types=["sparse"] * n_layers, max_position_embeddings=context + 64,
                           **config_overrides)
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                model = LagunaForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(default)
        experts_impl = getattr(model.config, "_experts_implementation", None)
        cache = DynamicCache()
        ids = torch.randint(0, cfg.vocab_size, (1, context), device=device)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)  # the context, once
            for B in block_sizes:
                block = torch.randint(0, cfg.vocab_size, (1, B), device=device)
                pos = torch.arange(context, context + B, device=device)[None]

                def step():
                    model(input_ids=block, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=B)
                    crop_cache(cache, context)  # back to the context for the next timing

                wall = time_ms(step, device, warmup=3, reps=20)
                kern = _kernel_ms(step, device)
                times[(n_layers, B)] = (wall, kern)
                progress(f"  target {n_layers} layers B={B:>2}: {wall:.3f} ms wall, "
                         f"{'-' if kern is None else f'{kern:.3f}'} ms in kernels ({experts_impl})")
        del model, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    lo, hi = layer_counts
    out = {"experts_implementation": experts_impl, "context": context, "per_block": {}}
    for B in block_sizes:
        row = {}
        for k, kind in ((0, "wall"), (1, "kernels")):
            a, b = times[(lo, B)][k], times[(hi, B)][k]
            if a is None or b is None:
                continue
            per_layer, rest, how = (b - a) / (hi - lo), None, "difference"
            if per_layer <= 0:  # timing noise: fall back to an upper bound, everything counted per layer
                per_layer, rest, how = b / hi, 0.0, "ratio"
            rest = a - lo * per_layer if rest is None else rest
            row[kind] = {"per_layer_ms": round(per_layer, 4), "rest_ms": round(rest, 4), "extrapolation": how,
                         f"{total_layers}_layers_ms": round(rest + total_layers * per_layer, 4)}
        out["per_block"][B] = row
    return out


def xs2_drafter_times(*, device, block_sizes, context: int, layers: int, accepted: float, progress=print,
                      **shape) -> dict:
    """One drafter step at Laguna-XS.2 shapes: append the accepted tokens' context K/V, one
    block forward over [context ; block], and the target's lm_head on the B-1 drafted positions."""
    dtype = torch.bfloat16
    drafter = xs2_drafter(layers, device, dtype, **shape)
    cfg = drafter.config
    n_aux = len(cfg.target_layer_ids)
    with torch.device(device):
        lm_head = torch.nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False).to(dtype)
    ctx = torch.randn(context, cfg.hidden_size, device=device, dtype=dtype)
    ctx_pos = torch.arange(context, device=device)
    n_new = max(1, round(accepted))
    aux = torch.randn(n_new, n_aux * cfg.hidden_size, device=device, dtype=dtype)
    new_pos = torch.arange(context - n_new, context, device=device)
    out = {"layers": layers, "context": context, "new_context_tokens_per_step": n_new, "per_block": {}}
    with torch.no_grad():
        k, v = drafter.precompute_context_kv(ctx, ctx_pos)
        for B in block_sizes:
            embeds = torch.randn(1, B, cfg.hidden_size, device=device, dtype=dtype)
            pos = torch.arange(context, context + B, device=device)[None]

            def step():
                drafter.precompute_context_kv(drafter.combine_hidden_states(aux), new_pos)  # the step's new context
                h = drafter(embeds, pos, k, v, ctx_pos, window=None)
                return lm_head(h[0, 1:]).argmax(-1)

            wall = time_ms(step, device, warmup=3, reps=20)
            kern = _kernel_ms(step, device)
            out["per_block"][B] = {"wall_ms": round(wall, 4), "kernels_ms": None if kern is None else round(kern, 4)}
            progress(f"  drafter L={layers} B={B:>2}: {wall:.3f} ms wall, {'-' if kern is None else f'{kern:.3f}'} ms in kernels")
    return out


def project_speedups(pair_rows, target_t, drafter_t, block_sizes) -> list[dict]:
    """speedup = tokens per step x T_target(1) / (T_target(B) + T_drafter(B)), per timing kind."""
    tau = {r["block_size"]: r["mean_acceptance_length"] for r in pair_rows if r["method"].startswith("dflash_b")}
    rows = []
    for B in block_sizes:
        if B not in tau:
            continue
        row = {"block_size": B, "tokens_per_step": tau[B]}
        for kind, dkey in (("wall", "wall_ms"), ("kernels", "kernels_ms")):
            t1 = target_t["per_block"].get(1, {}).get(kind)
            tb = target_t["per_block"].get(B, {}).get(kind)
            td = drafter_t["per_block"][B][dkey]
            if not (t1 and tb and td):
                continue
            key = "40_layers_ms"
            row[kind] = {"T_target_1_ms": t1[key], "T_target_B_ms": tb[key], "T_drafter_B_ms": td,
                         "speedup": round(tau[B] * t1[key] / (tb[key] + td), 3)}
        rows.append(row)
    return rows


def spec_decode_markdown(result: dict) -> str:
    pair, proj = result.get("shipped_pair", []), result.get("projection")
    lines = ["# Speculative decoding speed", ""]
    if pair:
        lines += [f"Shipped pair (laguna-tiny-code target + its DFlash drafter) on {pair[0]['device']}, {pair[0]['dtype']}, "
                  f"greedy, {result['n_prompts']} held-out prompts x {result['max_new_tokens']} new tokens, eager PyTorch. "
                  "Target-only runs the same loop with no drafts.", "",
                  "| method | block | tokens/s | target forwards / token | mean acceptance length | same output as target-only "
                  "| ms / target forward | ms / drafter step |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in pair:
            tau = r["mean_acceptance_length"] if r["mean_acceptance_length"] is not None else "-"
            lines.append(f"| {r['method']} | {r['block_size'] or '-'} | {r['tokens_per_s']:.1f} | "
                         f"{r['target_forwards_per_token']:.3f} | {tau} | {r['outputs_equal_target_only']} | "
                         f"{r.get('target_ms_per_forward', '-')} | {r.get('drafter_ms_per_step', '-')} |")
    if proj and "speedups" in proj:
        t, d = proj["target"], proj["drafter"]
        lines += ["", "## Projected speedup at Laguna-XS.2 scale", "",
                  f"T_target(B): transformers' LagunaForCausalLM at LagunaConfig's defaults (hidden 2048, 48 heads / 8 KV x 128, "
                  f"256 experts top-8, MoE width 512, vocab 100352), random bf16 weights, experts via "
                  f"`{t['experts_implementation']}`, a {t['context']}-token KV cache; measured with 2 and 4 sparse layers and "
                  "extrapolated per layer to 40 (the one dense layer of the real model counted as sparse).",
                  f"T_drafter(B): a {d['layers']}-layer DFlash drafter at the same width (dense MLP 8192), "
                  f"{d['context']}-token context: append {d['new_context_tokens_per_step']} accepted tokens' context K/V, "
                  "one block forward, the lm_head on the B-1 drafts.",
                  "tokens per step: the shipped pair's measured mean acceptance length at that block size.",
                  "'wall' is eager PyTorch (launch overheads included); 'kernels' sums GPU kernel time (what CUDA graphs, "
                  "as vLLM uses, approach).", "",
                  "| block | tokens/step | timing | T_target(1) ms | T_target(B) ms | T_drafter(B) ms | expected speedup |",
                  "|---|---|---|---|---|---|---|"]
        for r in proj["speedups"]:
            for kind in ("wall", "kernels"):
                if kind in r:
                    k = r[kind]
                    lines.append(f"| {r['block_size']} | {r['tokens_per_step']:.3f} | {kind} | {k['T_target_1_ms']:.3f} | "
                                 f"{k['T_target_B_ms']:.3f} | {k['T_drafter_B_ms']:.3f} | {k['speedup']:.2f}x |")
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def spec_decode(args) -> int:
    device = _pick_device(args.device)
    blocks = args.block_sizes
    n_prompts = args.prompts or (4 if args.quick else 8)
    max_new = args.max_new_tokens or (32 if args.quick else 96)
    print(f"spec-decode on {device_name(device)}: blocks {blocks}, {n_prompts} prompts x {max_new} tokens", flush=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    result = {"n_prompts": n_prompts, "max_new_tokens": max_new, "shipped_pair": [],
              "command": "python -m dflash_lab.bench spec-decode" + (" --quick" if args.quick else "")}
    stem = "spec_decode_quick" if args.quick else "spec_decode"
    out = Path(args.out)

    def save():  # after every section: a timeout keeps what was measured
        return _write(out, stem, result, spec_decode_markdown(result))

    project = not args.no_projection and device.type == "cuda"
    target_t = None
    if project:  # the Laguna-XS.2 target first: it needs no acceptance numbers
        for impl in (None, "eager"):  # transformers' default experts kernel (grouped_mm), else its loop
            try:
                target_t = xs2_target_times(device=device, block_sizes=sorted({1, *blocks}),
                                            context=args.projection_context, progress=log,
                                            **({"experts_implementation": impl} if impl else {}))
                result["projection"] = {"target": target_t}
                break
            except Exception as e:  # keep going: the shipped-pair numbers stand on their own
                log(f"  target projection with experts_implementation={impl or 'default'} failed: {type(e).__name__}: {e}")
                result.setdefault("projection_errors", []).append(f"{impl or 'default'}: {type(e).__name__}: {e}")
        save()
    measure_shipped_pair(device=device, n_prompts=n_prompts, max_new_tokens=max_new, block_sizes=blocks,
                         progress=log, on_row=lambda rows: (result.update(shipped_pair=list(rows)), save()))
    if target_t is not None:
        tau_max = max(r["mean_acceptance_length"] or 1 for r in result["shipped_pair"])
        drafter_t = xs2_drafter_times(device=device, block_sizes=blocks, context=args.projection_context,
                                      layers=args.drafter_layers, accepted=tau_max, progress=log)
        result["projection"].update(drafter=drafter_t,
                                    speedups=project_speedups(result["shipped_pair"], target_t, drafter_t, blocks))
    paths = save()
    md = spec_decode_markdown(result)
    print(md)
    print("wrote", *paths)
    return 0


# ---------------------------------------------------------------------------
# acceptance: greedy DFlash decoding of the shipped pair on the held-out prompts
# ---------------------------------------------------------------------------


def measure_acceptance(*, device, block_sizes, n_prompts: int | None, max_new_tokens: int, progress=print) -> list[dict]:
    """vLLM's acceptance counters of greedy speculative decoding, one row per block size."""
    from tqdm.auto import tqdm

    from .assets import heldout_prompts, load_default_pair
    from .spec_decode import SpecDecodeStats, speculative_generate

    target, drafter, tokenizer = load_default_pair(device=device)
    prompts = heldout_prompts()[:n_prompts]
    ids = [torch.tensor([tokenizer.encode(p["text"], add_special_tokens=False)], device=device) for p in prompts]
    rows = []
    for block in block_sizes:
        stats, t0 = SpecDecodeStats(), time.perf_counter()
        for x in tqdm(ids, desc=f"block {block}", leave=False, disable=None):
            stats = stats + speculative_generate(target, drafter, x, max_new_tokens=max_new_tokens, block_size=block).stats
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
                 f"{row['num_drafts']} drafts; per position " + " ".join(f"{r:.2f}" for r in row["per_position_acceptance_rate"]))
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
    device = _pick_device(args.device)
    blocks = [16] if args.quick and not args.block_sizes else (args.block_sizes or [16, 8, 4])
    n_prompts = args.prompts or (12 if args.quick else None)
    print(f"acceptance on {device_name(device)}: blocks {blocks}, {n_prompts or 'all'} held-out prompts x "
          f"{args.max_new_tokens} tokens", flush=True)
    rows = measure_acceptance(device=device, block_sizes=blocks, n_prompts=n_prompts,
                              max_new_tokens=args.max_new_tokens, progress=lambda s: print(s, flush=True))
    result = {"max_new_tokens": args.max_new_tokens, "rows": rows,
              "command": "python -m dflash_lab.bench acceptance" + (" --quick" if args.quick else "")}
    md = acceptance_markdown(result)
    paths = _write(Path(args.out), "acceptance_quick" if args.quick else "acceptance", result, md)
    print(md)
    print("wrote", *paths)
    return 0


# ---------------------------------------------------------------------------
# Command line: one subcommand per benchmark
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dflash_lab.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{context-kv,spec-decode,...}")

    p = sub.add_parser("context-kv", help="context K/V precompute: every path vs the GEMM floor")
    p.add_argument("--quick", action="store_true", help="small shapes; runs on a CPU")
    p.add_argument("--layers", type=int, nargs="+", help="drafter layers (default 1 3 5 8)")
    p.add_argument("--contexts", type=int, nargs="+", help="context lengths (default 1024 8192 32768)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", help="default: cuda when present")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the batched path")
    p.add_argument("--out", default=str(BENCH_DIR), help="output folder (default benchmarks/)")
    p.set_defaults(func=context_kv)

    p = sub.add_parser("spec-decode", help="tokens/s of the shipped pair, speedup projected to Laguna-XS.2")
    p.add_argument("--quick", action="store_true", help="few prompts, short generations")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--prompts", type=int, help="held-out prompts (default 8)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 96)")
    p.add_argument("--projection-context", type=int, default=2048, help="KV-cache length of the projection")
    p.add_argument("--drafter-layers", type=int, default=5, help="layers of the projected XS.2 drafter")
    p.add_argument("--no-projection", action="store_true", help="skip the Laguna-XS.2 projection (GPU only)")
    p.add_argument("--device", help="default: cuda when present")
    p.add_argument("--out", default=str(BENCH_DIR), help="output folder (default benchmarks/)")
    p.set_defaults(func=spec_decode)

    p = sub.add_parser("acceptance", help="acceptance of the shipped pair on the held-out prompts")
    p.add_argument("--quick", action="store_true", help="block 16 on 12 prompts")
    p.add_argument("--block-sizes", type=int, nargs="+", help="default 16 8 4")
    p.add_argument("--prompts", type=int, help="first N held-out prompts (default all)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", help="default: cuda when present")
    p.add_argument("--out", default=str(BENCH_DIR), help="output folder (default benchmarks/)")
    p.set_defaults(func=acceptance)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
