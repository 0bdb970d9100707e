"""Benchmark: the context-K/V paths against the GEMM floor.

    python -m dflash_lab.tools.bench context-kv [--quick]

Times reference / batched / batched + torch.compile / folded / folded + the
fused Triton epilogue at Laguna-XS.2's drafter shapes, next to the folded
path's GEMM alone (what no path can beat), and checks every path against the
reference with ``context_kv_agreement``. Writes benchmarks/context_kv.{json,md}
and context_kv_diagnostics.json (errors, compile time, the epilogue's GB/s).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..context_kv import build_context_kv_buffers, context_kv_agreement
from ..runtime import BENCHMARKS_DIR, device_name, resolve_device
from .. import context_kv_kernel as kernels
from ..measure.context_kv import TIMED_PATHS, context_kv_targets, lookup_ms, run_context_kv
from ..measure.timing import XS2, graphed_ms, time_ms, xs2_drafter
from .bench_common import write_results

# ---------------------------------------------------------------------------
# Small N: the decode-time regime (context K/V of the newly accepted tokens only)
# ---------------------------------------------------------------------------

SMALL_N_PATHS = ("gemm_floor", "folded_triton", "gemm_floor_graphed", "folded_triton_graphed")
SMALL_N_CONTEXTS = (16, 128, 1024)
# Ceilings measured on an H200: copy bandwidth and bf16 GEMM rate.
H200_BYTES_PER_S, H200_FLOP_PER_S = 4.3e12, 790e12


def roofline_ms(N: int, L: int, H: int, nkv: int, hd: int, dtype=torch.bfloat16) -> float:
    """The GEMM's floor from the ceilings: weights + context read once, output written once, or its FLOPs."""
    width, size = L * 2 * nkv * hd, torch.finfo(dtype).bits // 8
    nbytes = (width * H + N * H + N * width) * size
    return 1e3 * max(nbytes / H200_BYTES_PER_S, 2 * N * H * width / H200_FLOP_PER_S)


def run_small_n(*, device, dtype, layers: int = 5, contexts=SMALL_N_CONTEXTS, progress=print) -> list[dict]:
    """At N tokens per step (accepted x batch): the folded path with the fused epilogue and the GEMM alone,
    launched eagerly and captured as one CUDA graph each (a decode step runs it inside its graph)."""
    if device.type != "cuda":
        raise RuntimeError("the small-N context-K/V benchmark times the fused kernel and CUDA graphs: it needs a GPU")
    drafter = xs2_drafter(layers, device, dtype)
    cfg = drafter.config
    name = device_name(device)
    weight = build_context_kv_buffers(drafter, device, dtype)["folded_weight"]
    records = []
    for N in contexts:
        g = torch.Generator(device).manual_seed(N)
        x = torch.randn(N, cfg.hidden_size, device=device, generator=g).to(dtype)
        pos = torch.arange(4096, 4096 + N, device=device)  # decode-time positions: somewhere into a long context
        fns = {"gemm_floor": lambda: x @ weight.T,
               "folded_triton": lambda: drafter.precompute_context_kv(x, pos, "folded", fused=True)}
        with torch.no_grad():
            ref = drafter.precompute_context_kv(x, pos, "reference")
            agree = context_kv_agreement(fns["folded_triton"](), ref)
            for path, fn in fns.items():
                for graphed in (False, True):
                    ms = graphed_ms(fn, device) if graphed else time_ms(fn, device, budget_s=0.3)
                    rec = {"path": path + ("_graphed" if graphed else ""), "layers": layers, "context": N,
                           "ms": round(ms, 4), "device": name}
                    if path == "folded_triton":
                        rec.update(max_err=agree["max_err"], ok=agree["ok"])
                    if path == "gemm_floor" and not graphed:
                        rec["roofline_ms"] = round(roofline_ms(N, layers, cfg.hidden_size, cfg.num_key_value_heads,
                                                               cfg.head_dim, dtype), 4)
                    records.append(rec)
                    progress(f"  L={layers} N={N:>5} {rec['path']:22s} {ms:8.4f} ms")
    return records


def small_n_markdown(records) -> list[str]:
    rows = [r for r in records if r["path"] in SMALL_N_PATHS and r["context"] in SMALL_N_CONTEXTS]
    if not any(r["path"].endswith("_graphed") for r in rows):
        return []
    t = {(r["path"], r["layers"], r["context"]): r for r in rows}
    lines = ["", "## Small N: decode-time context K/V (the newly accepted tokens only)", "",
             "Each decode step precomputes context K/V for the tokens it accepted (N = accepted x batch). "
             "'graphed': the call captured as one CUDA graph and replayed, as it runs inside a decode step's graph; "
             "eager: launched from Python. Roofline: the GEMM's bytes at 4.3 TB/s or FLOPs at 790 TFLOP/s, "
             "whichever is larger. Goal: folded path within 2x the GEMM floor.", "",
             "| L | N | GEMM eager | GEMM graphed | roofline | folded_triton eager | folded_triton graphed "
             "| graphed / graphed GEMM | graphed / roofline |", "|---|---|---|---|---|---|---|---|---|"]
    cell = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"  # noqa: E731
    for L, N in sorted({(r["layers"], r["context"]) for r in rows if r["path"].endswith("_graphed")}):
        ms = {p: t.get((p, L, N), {}).get("ms") for p in SMALL_N_PATHS}
        roof = t.get(("gemm_floor", L, N), {}).get("roofline_ms")
        fg, gg = ms["folded_triton_graphed"], ms["gemm_floor_graphed"]
        lines.append(f"| {L} | {N} | {cell(ms['gemm_floor'])} | {cell(gg)} | {cell(roof)} | "
                     f"{cell(ms['folded_triton'])} | "
                     f"{cell(fg)} | {ratio(fg, gg)} | {ratio(fg, roof)} |")
    return lines


def context_kv_markdown(records, diagnostics=(), *, dtype="bfloat16", command="",
                        shapes_note="drafter hidden 2048, 8 KV heads x head_dim 128 (Laguna-XS.2 shapes)") -> str:
    """A table of median times per path and the ratios that matter."""
    shapes = sorted({(r["layers"], r["context"]) for r in records if r["path"] in TIMED_PATHS})
    paths = [p for p in TIMED_PATHS if any(r["path"] == p for r in records)]
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
        t = {p: lookup_ms(records, p, L, N) for p in paths}
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
                  "| L | N | epilogue ms | GB/s | row 1/rms ms | folded_triton bf16 err max / mean |",
                  "|---|---|---|---|---|---|"]
        for d in sorted(diagnostics, key=lambda d: (d["layers"], d["context"])):
            if "epilogue_ms" in d:
                e = d.get("folded_triton_err", {})
                lines.append(f"| {d['layers']} | {d['context']} | {d['epilogue_ms']:.3f} | {d['epilogue_GBps']:.0f} | "
                             f"{d['row_rstd_ms']:.3f} | {e.get('max', math.nan):.3g} / {e.get('mean', math.nan):.2g} |")
    lines += small_n_markdown(records)
    if command:
        lines += ["", f"Command: `{command}`"]
    return "\n".join(lines) + "\n"


def context_kv_small_n(args, device, dtype) -> int:
    """`context-kv --small-n`: add (or replace) the small-N rows of benchmarks/context_kv.json."""
    out = Path(args.out)
    path = out / "context_kv.json"
    old = json.loads(path.read_text()) if path.is_file() else []
    diag_path = out / "context_kv_diagnostics.json"
    diagnostics = json.loads(diag_path.read_text()) if diag_path.is_file() else []
    new = run_small_n(device=device, dtype=dtype, progress=lambda s: print(s, flush=True))
    replaced = {(r["path"], r["layers"], r["context"]) for r in new}
    records = [r for r in old if (r["path"], r["layers"], r["context"]) not in replaced] + new
    md = context_kv_markdown(records, diagnostics, dtype=args.dtype,
                             command="python -m dflash_lab.tools.bench context-kv (+ --small-n)",
                             shapes_note="drafter hidden 2048, 8 KV heads x head_dim 128 (Laguna-XS.2 shapes)")
    paths = write_results(out, "context_kv", records, md)
    print("\n".join(small_n_markdown(records)))
    print("wrote", *paths)
    return 0


def context_kv(args) -> int:
    """The `context-kv` subcommand."""
    device = resolve_device(args.device, caller="bench context-kv")
    dtype = getattr(torch, args.dtype)
    if args.small_n:
        return context_kv_small_n(args, device, dtype)
    quick = args.quick
    layers = args.layers or ([1, 2] if quick else [1, 3, 5, 8])
    contexts = args.contexts or ([64, 256] if quick else [1024, 8192, 32768])
    tiny = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=128)
    shape = tiny if quick else {}
    fused = kernels.fused_available(torch.empty(0, device=device))
    compiled = not args.no_compile and (device.type == "cuda" or not quick)
    print(f"context-kv on {device_name(device)}: L={layers} N={contexts} {args.dtype}; "
          f"folded_triton {'on' if fused else 'off (no CUDA/Triton)'}; "
          f"torch.compile {'on' if compiled else 'off'}", flush=True)
    out, stem = Path(args.out), "context_kv_quick" if quick else "context_kv"
    records, diagnostics = run_context_kv(
        layers=layers, contexts=contexts, device=device, dtype=dtype, compiled=compiled, fused=fused,
        progress=lambda s: print(s, flush=True),
        checkpoint=lambda r, d: write_results(out, stem + "_partial", r), **shape)
    command = "python -m dflash_lab.tools.bench context-kv" + (" --quick" if quick else "")
    note = ("drafter hidden {hidden_size}, {num_key_value_heads} KV heads x head_dim {head_dim}"
            .format(**{**XS2, **shape}))
    md = context_kv_markdown(records, diagnostics, dtype=args.dtype, command=command,
                             shapes_note=note + ("" if quick else " (Laguna-XS.2 shapes)"))
    paths = write_results(out, stem, records, md)
    (out / f"{stem}_partial.json").unlink(missing_ok=True)
    paths += write_results(out, stem + "_diagnostics", diagnostics)
    print(md)
    print("wrote", *paths)
    return 0


def add_command(subparsers) -> None:
    p = subparsers.add_parser("context-kv", help="context K/V precompute: every path vs the GEMM floor")
    p.add_argument("--quick", action="store_true", help="small shapes; runs on a CPU")
    p.add_argument("--layers", type=int, nargs="+", help="drafter layers (default 1 3 5 8)")
    p.add_argument("--contexts", type=int, nargs="+", help="context lengths (default 1024 8192 32768)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", help="default: $DFLASH_LAB_DEVICE, else cuda when present")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the batched path")
    p.add_argument("--small-n", action="store_true",
                   help="only the decode-time sizes (L=5, N=16/128/1024), eager and graphed; "
                        "rows added to context_kv.json")
    p.add_argument("--out", default=str(BENCHMARKS_DIR), help="output folder (default benchmarks/)")
    p.set_defaults(func=context_kv)
