"""The markdown of a Laguna-XS.2 step record (``bench_xs2_steps``' JSON): the step table beside its floors, the
routing and MoE tables, the eager profile, and each switch's steps beside the setting in use. Pure formatting."""

from __future__ import annotations


def xs2_steps_markdown(r: dict) -> str:
    bw = r["copy_bandwidth_Bps"] / 1e12
    lines = [
        "# Laguna-XS.2 decode steps at the true shape (measured)", "",
        f"{r['device']}, torch {r['torch']}, batch 1, bf16, random weights built on the GPU, {r['context']}-token "
        f"context, the graphed static path (one CUDA graph per shape, replayed; median of the replays). Target: "
        f"transformers' LagunaForCausalLM at `presets.LAGUNA_XS_2_FULL` ({r['target_params'] / 1e9:.1f} B parameters, "
        "40 layers, 1 full : 3 sliding, dense first layer, 256 experts top-8, heads 48 full / 64 sliding); routed "
        f"experts: `{r['moe']}`. Drafter: `presets.LAGUNA_XS_21_DFLASH` (5 sliding layers, 64 heads), sharing the "
        "target's embedding and lm_head; its step = one draft of the block + the context K/V of the block's positions.",
        "", "Floor = the bytes the step must read (`measure.step_bytes`) / bandwidth: 4.8 TB/s (the H200's datasheet, "
        "one reference whatever the card) and "
        f"{bw:.2f} TB/s (a device-to-device copy measured in the same run)."
        + (f" Measured at commit {r['code']}." if r.get("code") else ""), "",
        "| step | tokens | measured ms | floor ms @4.8 TB/s | floor ms @copy | measured / floor@copy | GB read "
        "| distinct experts / layer (uniform) |", "|---|---|---|---|---|---|---|---|"]
    for t in r["target"]:
        d = t["distinct_experts"]
        lines.append(f"| target | {t['block']} | {t['ms']:.3f} | {t['floor_ms']:.3f} | {t['floor_ms_copy_bw']:.3f} | "
                     f"{t['over_floor']:.2f}x | {t['bytes'] / 1e9:.2f} | "
                     f"{d['mean']:.1f} ({d['uniform_expected']:.1f}) |")
    for t in r["drafter"]:
        lines.append(f"| drafter | {t['block']} | {t['ms']:.3f} | {t['floor_ms']:.3f} | {t['floor_ms_copy_bw']:.3f} | "
                     f"{t['over_floor']:.2f}x | {t['bytes'] / 1e9:.2f} | - |")
    big = max(r["target"], key=lambda t: t["block"])
    share = big["distinct_experts"]["mean"] / big["distinct_experts"]["uniform_expected"]
    more_or_fewer = "fewer" if share < 1 else "more"
    lines += ["", f"Routing: a block of {big['block']} random tokens through random router weights touched "
              f"{big['distinct_experts']['mean']:.1f} distinct experts per sparse layer (layers range "
              f"{big['distinct_experts']['min']:.1f}-{big['distinct_experts']['max']:.1f}), "
              f"{share:.0%} of what uniform routing would (E(1 - (1 - k/E)^B), in brackets above): {more_or_fewer} "
              "than uniform. Random weights do not route like a trained model (in a random network the tokens' "
              "hidden states share a large common part, so the same experts tend to win). A trained router is "
              "balanced over a corpus but correlated within one text, so a real block's count is its own; at "
              f"uniform routing the {big['block']}-token step's floor would be "
              f"{big['floor_ms_uniform_routing']:.3f} ms "
              f"instead of {big['floor_ms']:.3f} ms (4.8 TB/s).", "",
              "One MoE layer's routed experts alone (graphed):", "",
              "| tokens | implementation | ms | distinct experts | floor ms (chosen experts) "
              "| floor ms (all experts) |",
              "|---|---|---|---|---|---|"]
    for m in r["moe_layer"]:
        lines.append(f"| {m['tokens']} | {m['implementation']} | {m['ms']:.4f} | {m['distinct_experts']} | "
                     f"{m['floor_ms_chosen']:.4f} | {m['floor_ms_all_experts']:.4f} |")
    prof = r.get("target_profile")
    if prof:
        lines += ["", f"Where a target-only token's time goes: one eager forward launches {prof['kernels']} kernels "
                  f"({prof['kernels'] / 40:.0f} a layer) whose GPU time sums to {prof['kernel_ms']:.3f} ms. "
                  "The biggest:", "",
                  "| kernel | launches | ms |", "|---|---|---|"]
        lines += [f"| `{k['name']}` | {k['count']} | {k['ms']:.3f} |" for k in prof["top"]]
    one = min(r["target"], key=lambda t: t["block"])
    biggest = ", ".join(f"`{k['name'][:40]}` {k['ms']:.3f} ms over {k['count']} launches"
                        for k in (prof or {}).get("top", [])[:3])
    lines += ["", f"A target-only token costs {one['ms']:.2f} ms, {one['over_floor']:.1f}x its floor at the copy "
              "bandwidth: the routed experts read only the chosen experts (the MoE table above)"
              + (f"; the largest shares of the eager profile are {biggest}" if biggest else "") + "."]
    sdpa = r.get("target_sdpa_attention")
    if sdpa:
        fused = {t["block"]: t["ms"] for t in r["target"]}
        lines += ["", "Attention: each layer's attention is one kernel (`spec_decode.fast.attention`: visibility from "
                  "positions, only the visible slots read, the gate applied). The same steps with the masks + SDPA "
                  "route it replaced: " + ", ".join(f"{o['block']} token(s) {o['ms']:.3f} ms (fused "
                                                     f"{fused[o['block']]:.3f} ms)" for o in sdpa) + "."]
    steps = {t["block"]: t["ms"] for t in r["target"]}

    def beside(rows, with_label: str, base_label: str) -> str:  # a switch's steps beside their adjacent baseline
        base = [o.get("base_ms", steps[o["block"]]) for o in rows]  # records before the adjacent baseline: the table's
        return ", ".join(f"{o['block']} token(s) {o['ms']:.3f} ms ({base_label} {b:.3f} ms, "
                         f"{o['ms'] / b:.3f}x {with_label})" for o, b in zip(rows, base))

    if r.get("target_without_pdl"):
        lines += ["", "Programmatic dependent launch (`spec_decode.fast.pdl`"
                  + ("" if r.get("pdl_runs") else "; not available on this card or Triton, so both runs are without "
                     "it") + "): each kernel is launched while the previous drains, and the one-row kernel of a dense "
                  "projection loads its first weights before waiting. The same steps without it, each timed next to "
                  "the step with it: " + beside(r["target_without_pdl"], "without", "with") + "."]
    for o in r.get("target_tails_in_producer", []):
        base = o.get("base_ms", steps[o["block"]])
        on, off = (o["ms"], base) if o["in_producer"] else (base, o["ms"])
        lines += ["", "Residual tails in their producers (`residual.IN_PRODUCER`, "
                  f"{'on' if r.get('tails_in_producer') else 'off'} in the steps above): the one-row GEMV that "
                  "writes a tail's delta (o_proj, the routed + shared down, the dense layer's down) runs the add "
                  "and the norm in its last program, so the tails are no launches of their own. A token with it: "
                  f"{on:.3f} ms; without: {off:.3f} ms ({off / on:.2f}x)."]
    if r.get("target_tails_in_consumer"):
        lines += ["", "The attention's add and norm inside the MLP's first product (`residual.IN_CONSUMER`, "
                  f"{'on' if r.get('tails_in_consumer') else 'off'} in the steps above): every program of the router | "
                  "shared gate | up GEMV computes norm(h + the o_proj output) where it would load its input row, so "
                  "that tail is no launch of its own and no program waits on another. Switched: "
                  + beside(r["target_tails_in_consumer"], "switched", "as above") + "."]
    if r.get("target_torch_argmax"):
        lines += ["", "The greedy pick (`spec_decode.fast.argmax`): each row of 100352 logits is reduced by one "
                  "program per 2048 entries, the last to finish merging their keys, where torch's argmax reduces a row "
                  "in one block. The same steps with torch's argmax: "
                  + beside(r["target_torch_argmax"], "with torch's", "split") + "."]
    if r.get("target_rope_apart"):
        lines += ["", "The q/k head norms, RoPE and the K/V write inside the attention kernel (`attention.ROPE_IN`, "
                  f"{'on' if r.get('rope_in') else 'off'} in the steps above; a kernel of their own otherwise, "
                  "`triton_ops.qk_rope_write`): " + beside(r["target_rope_apart"], "switched", "as above") + "."]
    prev = ", ".join(f"moe={o['moe']}: {o['ms']:.3f} ms" for o in r.get("target_other_moe", []))
    lines += ["", f"Before this change `auto` picked `{r['previous_auto_choice']}` here (torch's grouped GEMM "
              f"{'runs' if r['grouped_mm_runs'] else 'does not run'}). The full target's token with the older "
              f"implementations: {prev or '-'}.", "",
              "Laguna-S-2.1 (118 B parameters, 236 GB in bf16) does not fit on one H200 (~139 GiB) "
              "and is not measured."]
    return "\n".join(lines) + "\n"
