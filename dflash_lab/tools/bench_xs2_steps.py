"""Laguna-XS.2's decode steps at their true shape, measured: all 40 layers, random bf16 weights, one GPU.

    python -m dflash_lab.tools.bench_xs2_steps [--out DIR] [--context 1024] [--blocks 1 4 8 16]

Builds transformers' ``LagunaForCausalLM`` from ``presets.LAGUNA_XS_2_FULL`` (one full-attention
layer in four, a dense first layer, 256 experts top-8, per-layer heads 48/64) directly on the
GPU with random bf16 weights (nothing is written to disk), and a drafter shaped like
``presets.LAGUNA_XS_21_DFLASH`` sharing the target's embedding and lm_head. Then, on the
graphed static path (``spec_decode.fast``, one CUDA graph per shape, replayed), after a
``--context``-token prefill:

    target      one forward over B tokens (B = 1: a target-only decode token; B > 1: a
                verification of a block), logits of every position and their argmax
    drafter     one draft of a block of B (B - 1 drafts) plus the context K/V of its B positions
    floors      the bytes each step must read (``measure.step_bytes``) over the H200's
                4.8 TB/s and over the copy bandwidth measured in the same run
    routing     the distinct experts a block of B tokens touches per sparse layer, against
                uniform routing's expectation (random weights do not route like a trained model)
    MoE         one XS.2 MoE layer's routed experts alone, per implementation (gathered, torch's
                grouped GEMM, dense), and the full target's token with the older implementations

Writes xs2_steps.json and xs2_steps.md into --out. Needs CUDA; imports neither vLLM nor plotly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from ..config import DFlashDrafterConfig
from ..drafter import DFlashLagunaDrafter
from ..measure.step_bytes import NOMINAL_BANDWIDTH, drafter_step_bytes, floor_ms, target_step_bytes
from ..measure.timing import graphed_ms
from ..presets import LAGUNA_XS_21_DFLASH, laguna_xs_2_config
from ..spec_decode.fast import argmax as fast_argmax, attention, pdl, residual
from ..spec_decode.fast.moe import distinct_experts, gathered_experts, uniform_distinct
from ..spec_decode.fast.static_drafter import StaticDrafter
from ..spec_decode.fast.static_target import StaticTarget, dense_experts, grouped_experts, grouped_usable
from .xs2_steps_report import xs2_steps_markdown


def copy_bandwidth(device, gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted) on a ``gib`` GiB buffer."""
    n = int(gib * 2**30) // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(10):  # clocks up
        dst.copy_(src)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
    for start, end in events:
        start.record()
        dst.copy_(src)
        end.record()
    torch.cuda.synchronize(device)
    ms = sorted(a.elapsed_time(b) for a, b in events)[len(events) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / (ms * 1e-3)


def build_target(device, **overrides):
    cfg = laguna_xs_2_config(**overrides)  # a transformers without Laguna's per-type YaRN raises here, before 67 GB
    default = torch.get_default_dtype()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        from transformers import LagunaForCausalLM

        with torch.device(device):
            return LagunaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def build_drafter(device) -> DFlashLagunaDrafter:
    torch.manual_seed(1)
    with torch.device(device):
        drafter = DFlashLagunaDrafter(DFlashDrafterConfig.from_dict(LAGUNA_XS_21_DFLASH))
    return drafter.to(torch.bfloat16).eval()


def moe_layer_diagnostics(cfg, device, tokens=(1, 16), progress=print) -> list[dict]:
    """One sparse layer's routed experts alone, per implementation, graphed, beside the bytes of its experts."""
    E, H, I, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    g = torch.Generator(device=device).manual_seed(0)
    ex = SimpleNamespace(gate_up_proj=torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16, generator=g) * .02,
                         down_proj=torch.randn(E, H, I, device=device, dtype=torch.bfloat16, generator=g) * .02,
                         act_fn=torch.nn.functional.silu)
    expert_bytes = 3 * H * I * 2
    impls = {"gathered": gathered_experts, "dense": dense_experts}
    if grouped_usable(torch.device(device), torch.bfloat16):
        impls["grouped"] = grouped_experts
    rows = []
    for n in tokens:
        x = torch.randn(n, H, device=device, dtype=torch.bfloat16, generator=g)
        cpu = torch.Generator().manual_seed(n)
        selected = torch.stack([torch.randperm(E, generator=cpu)[:k] for _ in range(n)]).to(device)
        weights = torch.rand(n, k, generator=cpu).to(device, torch.bfloat16)
        d = int(distinct_experts(selected, E))
        for name, fn in impls.items():
            ms = graphed_ms(lambda fn=fn: fn(ex, x, selected, weights), device)
            rows.append({"tokens": n, "implementation": name, "ms": round(ms, 4), "distinct_experts": d,
                         "floor_ms_chosen": round(floor_ms(d * expert_bytes), 4),
                         "floor_ms_all_experts": round(floor_ms(E * expert_bytes), 4)})
            progress(f"  MoE layer, {n:>2} tokens, {name:>8}: {ms:.4f} ms (chosen experts' floor "
                     f"{rows[-1]['floor_ms_chosen']:.4f} ms, all experts' {rows[-1]['floor_ms_all_experts']:.4f} ms)")
    del ex
    torch.cuda.empty_cache()
    return rows


def kernel_profile(fn, device, top: int = 15) -> dict:
    """Kernels one eager fn() launches, and their summed GPU time (what a CUDA graph replays without host gaps)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict = {}
    for e in kernels:
        n, t = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (n + 1, t + e.device_time)
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": len(kernels), "kernel_ms": round(sum(e.device_time for e in kernels) / 1e3, 4),
            "top": [{"name": name[:90], "count": n, "ms": round(t / 1e3, 4)} for name, (n, t) in rows]}


def routing_stats(st: StaticTarget, cfg, context: int, block: int, samples: int, device) -> dict:
    """Distinct experts per sparse layer for ``samples`` random blocks of ``block`` tokens (eager forwards)."""
    counts = []
    pos = torch.arange(context, context + block, device=device)[None]
    for _ in range(samples):
        st.routing = []
        st.forward(torch.randint(0, cfg.vocab_size, (1, block), device=device), pos)
        counts.append(distinct_experts(torch.stack(st.routing), cfg.num_experts).float())  # (sparse layers,)
        st.routing = None
    per_layer = torch.stack(counts).mean(0)
    return {"per_layer": [round(float(v), 2) for v in per_layer], "mean": round(float(per_layer.mean()), 2),
            "min": round(float(per_layer.min()), 2), "max": round(float(per_layer.max()), 2),
            "uniform_expected": round(uniform_distinct(block, cfg.num_experts_per_tok, cfg.num_experts), 2)}


def measure(device, *, context: int, blocks, samples: int = 8, progress=print, out: dict | None = None) -> dict:
    """Every measurement, into ``out`` as it goes (a failure late in the run keeps what came before)."""
    out = {} if out is None else out
    bandwidth = copy_bandwidth(device)
    progress(f"copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write), nominal {NOMINAL_BANDWIDTH / 1e12:.1f}")
    cfg = laguna_xs_2_config()
    out.update({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "context": context,
                "copy_bandwidth_Bps": bandwidth, "nominal_bandwidth_Bps": NOMINAL_BANDWIDTH,
                "grouped_mm_runs": grouped_usable(torch.device(device), torch.bfloat16)})
    out["previous_auto_choice"] = "grouped" if out["grouped_mm_runs"] else "dense"
    out["moe_layer"] = moe_layer_diagnostics(cfg, device, progress=progress)
    model = build_target(device)
    n_params = sum(p.numel() for p in model.parameters())
    out["target_config"] = {k: getattr(cfg, k) for k in (
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_attention_heads_per_layer",
        "num_key_value_heads", "head_dim", "layer_types", "mlp_layer_types", "num_experts", "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size", "intermediate_size", "vocab_size", "sliding_window", "rope_parameters")}
    out["target_params"] = n_params
    gib = torch.cuda.memory_allocated(device) / 2**30
    progress(f"target: {n_params / 1e9:.2f} B parameters, {gib:.1f} GiB on the GPU")
    drafter = build_drafter(device)
    layer_ids = list(drafter.config.target_layer_ids)
    blocks = sorted({1, *blocks})
    capacity = context + max(blocks) + 16
    st = StaticTarget(model, batch=1, capacity=capacity, layer_ids=layer_ids)
    out["moe"] = st.moe
    prompt = torch.randint(0, cfg.vocab_size, (1, context), device=device)
    with torch.no_grad():
        st.forward(prompt, torch.arange(context, device=device)[None])  # the context's KV, once
        out["target"] = []
        ids1, pos1 = torch.randint(0, cfg.vocab_size, (1, 1), device=device), torch.tensor([[context]], device=device)
        for B in blocks:
            ids = torch.randint(0, cfg.vocab_size, (1, B), device=device)
            pos = torch.arange(context, context + B, device=device)[None]
            ms = graphed_ms(lambda: pick(st.forward(ids, pos)[0]), device)
            routing = routing_stats(st, cfg, context, B, samples, device)
            measured = target_step_bytes(cfg, B, context, routing["per_layer"])
            uniform = target_step_bytes(cfg, B, context, routing["uniform_expected"])
            row = {"block": B, "ms": round(ms, 4), "bytes": measured["total"], "bytes_parts": measured["parts"],
                   "floor_ms": round(floor_ms(measured["total"]), 4),
                   "floor_ms_copy_bw": round(floor_ms(measured["total"], bandwidth), 4),
                   "floor_ms_uniform_routing": round(floor_ms(uniform["total"]), 4), "distinct_experts": routing}
            row["over_floor"] = round(ms / row["floor_ms_copy_bw"], 2)
            out["target"].append(row)
            progress(f"  target B={B:>2}: {ms:.3f} ms; floor {row['floor_ms']:.3f} ms at 4.8 TB/s, "
                     f"{row['floor_ms_copy_bw']:.3f} ms at the copy bandwidth ({row['over_floor']}x); distinct experts "
                     f"{routing['mean']} per layer (uniform routing: {routing['uniform_expected']})")
        out["target_profile"] = kernel_profile(lambda: pick(st.forward(ids1, pos1)[0]), device)
        progress(f"  target B= 1, one eager forward: {out['target_profile']['kernels']} kernels, "
                 f"{out['target_profile']['kernel_ms']:.3f} ms of kernel time")
        out["target_other_moe"] = []
        for moe in ("grouped", "dense"):  # the implementations "auto" picked before: what a token cost then
            if moe == "grouped" and not out["grouped_mm_runs"]:
                continue
            other = StaticTarget(model, batch=1, capacity=capacity, layer_ids=layer_ids, moe=moe)
            other.cache = st.cache  # same KV, same context
            ids = torch.randint(0, cfg.vocab_size, (1, 1), device=device)
            pos = torch.tensor([[context]], device=device)
            ms = graphed_ms(lambda: pick(other.forward(ids, pos)[0]), device)
            out["target_other_moe"].append({"moe": moe, "block": 1, "ms": round(ms, 4)})
            progress(f"  target B= 1 with moe={moe}: {ms:.3f} ms")
            del other
            torch.cuda.empty_cache()
        out["target_sdpa_attention"] = []  # the same steps with the attention the fused kernel replaced
        sdpa = StaticTarget(model, batch=1, capacity=capacity, layer_ids=layer_ids, fused_attention=False)
        sdpa.cache = st.cache
        for B in sorted({1, max(blocks)}):
            ids = torch.randint(0, cfg.vocab_size, (1, B), device=device)
            pos = torch.arange(context, context + B, device=device)[None]
            ms = graphed_ms(lambda: pick(sdpa.forward(ids, pos)[0]), device)
            out["target_sdpa_attention"].append({"block": B, "ms": round(ms, 4)})
            progress(f"  target B={B:>2} with masks + SDPA attention: {ms:.3f} ms")
        del sdpa
        ends = sorted({1, max(blocks)})

        def switched(label: str, mod, attr: str, value, sizes) -> list[dict]:
            """The steps with ``mod.attr = value``, each beside the same step at the setting in use, timed
            next to it (so a drift of the card's clocks does not enter the ratio)."""
            rows = []
            for B in sizes:
                ids = torch.randint(0, cfg.vocab_size, (1, B), device=device)
                pos = torch.arange(context, context + B, device=device)[None]
                base = graphed_ms(lambda: pick(st.forward(ids, pos)[0]), device)
                was = getattr(mod, attr)
                setattr(mod, attr, value)
                try:
                    ms = graphed_ms(lambda: pick(st.forward(ids, pos)[0]), device)
                finally:
                    setattr(mod, attr, was)
                rows.append({"block": B, "ms": round(ms, 4), "base_ms": round(base, 4)})
                progress(f"  target B={B:>2} with {label}: {ms:.3f} ms (as measured: {base:.3f} ms)")
            return rows

        out["pdl_runs"] = pdl.runs(prompt)
        out["target_without_pdl"] = switched("no programmatic dependent launch", pdl, "ON", False, ends)
        out["tails_in_producer"] = residual.IN_PRODUCER
        out["target_tails_in_producer"] = [dict(r, in_producer=not residual.IN_PRODUCER) for r in switched(
            f"residual.IN_PRODUCER={not residual.IN_PRODUCER}", residual, "IN_PRODUCER", not residual.IN_PRODUCER, [1])]
        out["tails_in_consumer"] = residual.IN_CONSUMER
        out["target_tails_in_consumer"] = switched(f"residual.IN_CONSUMER={not residual.IN_CONSUMER}", residual,
                                                   "IN_CONSUMER", not residual.IN_CONSUMER, [1])
        out["target_torch_argmax"] = switched("torch's argmax", fast_argmax, "ON", False, ends)
        out["rope_in"] = attention.ROPE_IN
        out["target_rope_apart"] = switched(f"attention.ROPE_IN={not attention.ROPE_IN}", attention, "ROPE_IN",
                                            not attention.ROPE_IN, ends)
        out["drafter"] = drafter_steps(drafter, model, LAGUNA_XS_21_DFLASH, context, [b for b in blocks if b > 1],
                                       bandwidth, device, progress)
    return out


def pick(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row, as the decoder picks it (``spec_decode.fast.argmax``)."""
    return fast_argmax.argmax(logits)


def drafter_steps(drafter, model, dcfg: dict, context: int, blocks, bandwidth: float, device, progress) -> list[dict]:
    cfg = drafter.config
    sd = StaticDrafter(drafter, model, batch=1, capacity=context + max(blocks) + 16)
    n_aux = len(cfg.target_layer_ids)
    H = model.config.hidden_size
    sd.append(torch.randn(1, context, n_aux * H, device=device, dtype=torch.bfloat16),
              torch.arange(context, device=device)[None])
    last, start = torch.tensor([5], device=device), torch.tensor([context], device=device)
    rows = []
    for B in blocks:
        aux = torch.randn(1, B, n_aux * H, device=device, dtype=torch.bfloat16)
        pos = torch.arange(context, context + B, device=device)[None]

        def step():
            sd.draft(last, start, B)
            sd.append(aux, pos)

        ms = graphed_ms(step, device)
        b = drafter_step_bytes(dcfg, B, context)
        row = {"block": B, "ms": round(ms, 4), "bytes": b["total"], "bytes_parts": b["parts"],
               "floor_ms": round(floor_ms(b["total"]), 4),
               "floor_ms_copy_bw": round(floor_ms(b["total"], bandwidth), 4)}
        row["over_floor"] = round(ms / row["floor_ms_copy_bw"], 2)
        rows.append(row)
        progress(f"  drafter B={B:>2}: {ms:.3f} ms; floor {row['floor_ms']:.3f} ms at 4.8 TB/s, "
                 f"{row['floor_ms_copy_bw']:.3f} ms at the copy bandwidth ({row['over_floor']}x)")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_lab.tools.bench_xs2_steps", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--samples", type=int, default=8, help="random blocks per size for the routing statistics")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA: Laguna-XS.2 at its true shape is 67 GB of bf16 weights", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    try:
        measure(device, context=args.context, blocks=args.blocks, samples=args.samples, out=result)
    finally:  # what was measured is kept, also when a later part fails
        (out / "xs2_steps.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "xs2_steps.md").write_text(xs2_steps_markdown(result))
    print(xs2_steps_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
