"""The older Laguna-XS.2 projection (chapter 5's committed ``projection_graphed``), kept for ``bench spec-decode``.

Superseded: ``bench_xs2_steps`` measures Laguna-XS.2 at all 40 layers with its real layer
pattern (``benchmarks/xs2_steps.json``) and ``measure.speed_model`` predicts from those steps;
what follows extrapolates from 2 and 4 all-full-attention sparse layers, as it always did.

The shipped pair is far too small to say what DFlash buys on a real model, so
the speedup at Laguna-XS.2's size is projected:

    speedup(B) = tau(B) x T_target(1) / (T_target(B) + T_drafter(B))

tau(B): the shipped pair's measured mean acceptance length at block B.
T_target(B): one target forward over B tokens (and its argmax) at Laguna-XS.2's
    shapes (transformers' LagunaConfig defaults, random bf16 weights), built with 2
    and 4 sparse layers and extrapolated per layer to 40.
T_drafter(B): one drafter step at the same width: the block forward with the
    target's lm_head, and the context K/V of the block's positions.

Two timings of each: eager (``xs2_target_times`` / ``xs2_drafter_times``: wall
time of transformers' forward, and the sum of its kernel times from the
profiler) and graphed (``xs2_graphed_times``: the static path of
``spec_decode.fast.decoder`` captured as one CUDA graph per block size, replayed).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, LagunaConfig, LagunaForCausalLM

from ..drafter import with_window
from ..spec_decode import crop_cache
from ..spec_decode.fast.static_drafter import StaticDrafter
from ..spec_decode.fast.static_target import StaticTarget
from ..measure.timing import graphed_ms, kernel_ms, time_ms, xs2_drafter


def build_xs2_target(n_layers: int, context: int, device, **config_overrides) -> LagunaForCausalLM:
    """transformers' LagunaForCausalLM at LagunaConfig's defaults with ``n_layers`` sparse full-attention layers,
    random bf16 weights, on ``device``."""
    cfg = LagunaConfig(num_hidden_layers=n_layers, layer_types=["full_attention"] * n_layers,
                       mlp_layer_types=["sparse"] * n_layers, max_position_embeddings=context + 64, **config_overrides)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return LagunaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def _extrapolate(times: dict, block_sizes, layer_counts, total_layers: int, kinds) -> dict:
    """{B: {kind: per-layer ms, rest ms, total at total_layers}} from timings at two layer counts."""
    lo, hi = layer_counts
    out = {}
    for B in block_sizes:
        row = {}
        for k, kind in enumerate(kinds):
            a, b = times[(lo, B)][k], times[(hi, B)][k]
            if a is None or b is None:
                continue
            per_layer, rest, how = (b - a) / (hi - lo), None, "difference"
            if per_layer <= 0:  # timing noise: fall back to an upper bound, everything counted per layer
                per_layer, rest, how = b / hi, 0.0, "ratio"
            rest = a - lo * per_layer if rest is None else rest
            row[kind] = {"per_layer_ms": round(per_layer, 4), "rest_ms": round(rest, 4), "extrapolation": how,
                         f"{total_layers}_layers_ms": round(rest + total_layers * per_layer, 4)}
        out[B] = row
    return out


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
        model = build_xs2_target(n_layers, context, device, **config_overrides)
        cfg = model.config
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
    out = {"experts_implementation": experts_impl, "context": context,
           "per_block": _extrapolate(times, block_sizes, layer_counts, total_layers, ("wall", "kernels"))}
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
    unwindowed = with_window(drafter, None)
    with torch.no_grad():
        k, v = drafter.precompute_context_kv(ctx, ctx_pos)
        for B in block_sizes:
            embeds = torch.randn(1, B, cfg.hidden_size, device=device, dtype=dtype)
            pos = torch.arange(context, context + B, device=device)[None]

            def step():
                drafter.precompute_context_kv(drafter.combine_hidden_states(aux), new_pos)  # the step's new context
                h = unwindowed(embeds, pos, k, v, ctx_pos)
                return lm_head(h[0, 1:]).argmax(-1)

            wall = time_ms(step, device, warmup=3, reps=20)
            kern = kernel_ms(step, device)
            out["per_block"][B] = {"wall_ms": round(wall, 4), "kernels_ms": None if kern is None else round(kern, 4)}
            progress(f"  drafter L={layers} B={B:>2}: {wall:.3f} ms wall, {'-' if kern is None else f'{kern:.3f}'} ms in kernels")
    return out


# ---------------------------------------------------------------------------
# Graphed: the static path, one CUDA graph per block size
# ---------------------------------------------------------------------------


class _EmbeddingAndHead(nn.Module):
    """A stand-in for the target's embedding table and lm_head at Laguna-XS.2's vocabulary."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def get_input_embeddings(self):
        return self.embed_tokens


def xs2_graphed_times(*, device, block_sizes, context: int, drafter_layers: int, layer_counts=(2, 4),
                      total_layers: int = 40, progress=print) -> dict:
    """Graphed T_target(B) (extrapolated to 40 layers) and T_drafter(B) at Laguna-XS.2's shapes, batch 1."""
    blocks = sorted({1, *block_sizes})
    times = {}
    for n_layers in layer_counts:
        model = build_xs2_target(n_layers, context, device)
        st = StaticTarget(model, batch=1, capacity=context + max(blocks) + 16)
        with torch.no_grad():
            st.forward(torch.randint(0, model.config.vocab_size, (1, context), device=device),
                       torch.arange(context, device=device)[None])  # the context's KV, once
            for B in blocks:
                ids = torch.randint(0, model.config.vocab_size, (1, B), device=device)
                pos = torch.arange(context, context + B, device=device)[None]
                ms = graphed_ms(lambda: st.forward(ids, pos)[0].argmax(-1), device)  # same slots every replay
                times[(n_layers, B)] = (ms,)
                progress(f"  graphed target {n_layers} layers B={B:>2}: {ms:.3f} ms (experts: {st.moe})")
        moe = st.moe
        del model, st
        torch.cuda.empty_cache()
    target = _extrapolate(times, blocks, layer_counts, total_layers, ("graphed",))

    dtype = torch.bfloat16
    drafter = xs2_drafter(drafter_layers, device, dtype)
    cfg = drafter.config
    with torch.device(device):
        head = _EmbeddingAndHead(cfg.draft_vocab_size, cfg.hidden_size).to(dtype)
    sd = StaticDrafter(drafter, head, batch=1, capacity=context + max(blocks) + 16)
    n_aux = len(cfg.target_layer_ids)
    drafter_ms = {}
    with torch.no_grad():
        sd.append(torch.randn(1, context, n_aux * cfg.hidden_size, device=device, dtype=dtype),
                  torch.arange(context, device=device)[None])
        last, start = torch.tensor([5], device=device), torch.tensor([context], device=device)
        for B in block_sizes:
            aux = torch.randn(1, B, n_aux * cfg.hidden_size, device=device, dtype=dtype)
            pos = torch.arange(context, context + B, device=device)[None]

            def step():
                sd.draft(last, start, B)
                sd.append(aux, pos)

            drafter_ms[B] = round(graphed_ms(step, device), 4)
            progress(f"  graphed drafter L={drafter_layers} B={B:>2}: {drafter_ms[B]:.3f} ms (draft + append {B} positions)")
    del drafter, head, sd
    torch.cuda.empty_cache()
    return {"context": context, "experts": moe, "drafter_layers": drafter_layers, "target_per_block": target,
            "drafter_ms": drafter_ms}


def layer_read_floor_ms(block: int, bytes_per_s: float = 4.3e12, **config_overrides) -> float:
    """Time to read one sparse Laguna-XS.2 layer's weights once for ``block`` tokens (bf16), at the
    measured copy bandwidth: attention + shared expert, plus every routed expert the block may touch
    (all distinct: min(E, block x top-k)). The floor a memory-bound engine approaches."""
    c = LagunaConfig(**config_overrides)
    H, hd = c.hidden_size, c.head_dim
    attention = H * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + H * c.num_attention_heads
    expert = 3 * H * c.moe_intermediate_size
    experts = min(c.num_experts, block * c.num_experts_per_tok)
    params = attention + 3 * H * c.shared_expert_intermediate_size + experts * expert + c.num_experts * H
    return 1e3 * 2 * params / bytes_per_s


def project_graphed(taus: dict, graphed: dict, total_layers: int = 40) -> list[dict]:
    """speedup(B) = tau(B) x T_target(1) / (T_target(B) + T_drafter(B)), graphed timings."""
    key = f"{total_layers}_layers_ms"
    t = graphed["target_per_block"]
    t1 = t[1]["graphed"][key]
    rows = []
    for B, tau in sorted(taus.items()):
        if B not in graphed["drafter_ms"] or B not in t:
            continue
        tb, td = t[B]["graphed"][key], graphed["drafter_ms"][B]
        rows.append({"block_size": B, "tokens_per_step": tau, "T_target_1_ms": t1, "T_target_B_ms": tb,
                     "T_drafter_B_ms": td, "speedup": round(tau * t1 / (tb + td), 3)})
    return rows
