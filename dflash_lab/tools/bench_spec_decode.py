"""Benchmark: speculative decoding speed of the shipped pair, and a projection to Laguna-XS.2.

    python -m dflash_lab.tools.bench spec-decode [--quick]

Part 1 runs the shipped pair (the tiny Laguna target and its DFlash drafter):
tokens/s and target forwards per token for target-only decoding, DFlash at each
block size and prompt lookup, all through the same ``speculative_generate``
loop. Part 2 (GPU only) times one target forward and one drafter step at
Laguna-XS.2's shapes and projects the speedup from the measured acceptance.
Writes benchmarks/spec_decode.{json,md}.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, LagunaConfig, LagunaForCausalLM

from ..assets import heldout_prompts, load_default_pair
from ..runtime import BENCHMARKS_DIR, device_name, resolve_device, synchronized_time
from ..spec_decode import SpecDecodeStats, crop_cache, speculative_generate
from .bench_common import kernel_ms, time_ms, write_results, xs2_drafter

# ---------------------------------------------------------------------------
# The shipped pair
# ---------------------------------------------------------------------------


class NoDraft:
    """A proposer that proposes nothing: speculative_generate becomes plain greedy decoding
    through the same loop (same cache handling, same overheads)."""

    def propose(self, tokens, num_draft):
        return []


def _prompts(tokenizer, n: int, max_tokens: int, device) -> list[torch.Tensor]:
    """The first n held-out prompts, each cut to its last max_tokens tokens."""
    return [tokenizer(p["text"], return_tensors="pt")["input_ids"][:, -max_tokens:].to(device)
            for p in heldout_prompts()[:n]]


def measure_shipped_pair(*, device, n_prompts: int, max_new_tokens: int, block_sizes, progress=print,
                         on_row=None) -> list[dict]:
    """tokens/s and target forwards per token: target only, DFlash at each block size, prompt lookup.

    on_row(rows), if given, runs after each method (partial results survive a timeout).
    """
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
            t0 = synchronized_time(device)
            res = speculative_generate(target, proposer, prompt, max_new_tokens=max_new_tokens, block_size=block)
            wall += synchronized_time(device) - t0
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


# ---------------------------------------------------------------------------
# The projection to Laguna-XS.2
# ---------------------------------------------------------------------------


def xs2_target_times(*, device, block_sizes, context: int, layer_counts=(2, 4), total_layers: int = 40,
                     progress=print, **config_overrides) -> dict:
    """One target forward of B tokens at Laguna-XS.2 shapes, extrapolated to 40 layers.

    transformers' LagunaForCausalLM with LagunaConfig's defaults (hidden 2048, 48 heads /
    8 KV x 128, 256 experts top-8, expert and shared width 512, vocab 100352), random bf16
    weights, every layer sparse-MoE; built with 2 and 4 layers: per-layer time = the
    difference / 2, the rest (embedding, final norm, lm_head) = what remains.
    """
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
                kern = kernel_ms(step, device)
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
            kern = kernel_ms(step, device)
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


# ---------------------------------------------------------------------------
# Report and command
# ---------------------------------------------------------------------------


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
    """The `spec-decode` subcommand."""
    device = resolve_device(args.device, caller="bench spec-decode")
    blocks = args.block_sizes
    n_prompts = args.prompts or (4 if args.quick else 8)
    max_new = args.max_new_tokens or (32 if args.quick else 96)
    print(f"spec-decode on {device_name(device)}: blocks {blocks}, {n_prompts} prompts x {max_new} tokens", flush=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    result = {"n_prompts": n_prompts, "max_new_tokens": max_new, "shipped_pair": [],
              "command": "python -m dflash_lab.tools.bench spec-decode" + (" --quick" if args.quick else "")}
    stem = "spec_decode_quick" if args.quick else "spec_decode"
    out = Path(args.out)

    def save():  # after every section: a timeout keeps what was measured
        return write_results(out, stem, result, spec_decode_markdown(result))

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


def add_command(subparsers) -> None:
    p = subparsers.add_parser("spec-decode", help="tokens/s of the shipped pair, speedup projected to Laguna-XS.2")
    p.add_argument("--quick", action="store_true", help="few prompts, short generations")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--prompts", type=int, help="held-out prompts (default 8)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 96)")
    p.add_argument("--projection-context", type=int, default=2048, help="KV-cache length of the projection")
    p.add_argument("--drafter-layers", type=int, default=5, help="layers of the projected XS.2 drafter")
    p.add_argument("--no-projection", action="store_true", help="skip the Laguna-XS.2 projection (GPU only)")
    p.add_argument("--device", help="default: $DFLASH_LAB_DEVICE, else cuda when present")
    p.add_argument("--out", default=str(BENCHMARKS_DIR), help="output folder (default benchmarks/)")
    p.set_defaults(func=spec_decode)
