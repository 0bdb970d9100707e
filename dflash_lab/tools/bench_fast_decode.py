"""The markdown of the fast backend's speed records (``measure.decoding`` measures them).

``fast_markdown`` turns the records of ``measure.decoding.measure_fast_decoding`` (one per
method, block size, batch and graphs setting) and its ``phase_breakdown`` into the tables
of benchmarks/spec_decode.md.
"""

from __future__ import annotations

from ..measure.decoding import METHODS


def fast_markdown(records, phases=None, *, n_prompts: int, max_new_tokens: int) -> list[str]:
    """Markdown lines: the tokens/s table (rows: method and block; columns: batch x graphs), speedups, phases."""
    if not records:
        return []
    r0 = records[0]
    batches = sorted({r["batch"] for r in records})
    graphs = sorted({r["cuda_graphs"] for r in records}, reverse=True)
    cols = [(b, g) for b in batches for g in graphs]
    get = {(r["method"], r["block_size"], r["batch"], r["cuda_graphs"]): r for r in records}
    lines = [f"## Measured: the static path, CUDA graphs on and off ({r0['device']}, {r0['dtype']}, greedy)", "",
             f"{n_prompts} held-out prompts (last 256 tokens each) x {max_new_tokens} new tokens, in batches; "
             "static KV caches, MoE as " + f"`{r0.get('moe', '?')}`" + ", one CUDA graph per step "
             "(`dflash_lab.spec_decode.fast.decoder`). Clock: prefill + decoding + host work, after an untimed warm-up "
             "(every prompt once). Runs: " + ", ".join(sorted({f"graphs {'on' if r['cuda_graphs'] else 'off'}: "
                                                               f"{r.get('measured', '?')}" for r in records})) + ". "
             "tokens/s (x target-only at the same batch and graphs setting; tau = mean acceptance length):", "",
             "| method | block | " + " | ".join(f"batch {b}, graphs {'on' if g else 'off'}" for b, g in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    keys = sorted({(r["method"], r["block_size"]) for r in records}, key=lambda k: (METHODS.index(k[0]), k[1]))
    for method, block in keys:
        cells = []
        for b, g in cols:
            r, base = get.get((method, block, b, g)), get.get(("target_only", 1, b, g))
            if r is None:
                cells.append("-")
                continue
            x = f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)" if base and method != "target_only" else ""
            tau = f", tau {r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] else ""
            v = r["tokens_per_s"]
            cells.append(f"{v:.0f}{x}{tau}" if v >= 100 else f"{v:.1f}{x}{tau}")
        lines.append(f"| {method} | {block} | " + " | ".join(cells) + " |")
    same = [f"{r['method']} b{r['block_size']} batch {r['batch']}: {r['outputs_equal_graphs_off']}"
            for r in records if r["cuda_graphs"] and r.get("outputs_equal_graphs_off")]
    if same:
        lines += ["", "Graphed output equal to the same kernels launched eagerly (prompts): " + "; ".join(same) + "."]
    if phases:
        lines += ["", "### Where a step's time goes (batch 1, each phase its own graph, ms per step)", "",
                  "| method | block | steps | draft | verify | context K/V append | accept |", "|---|---|---|---|---|---|---|"]
        for m, p in phases.items():
            lines.append(f"| {m} | {p['block_size']} | {p['steps']} | {p['draft_ms_per_step']:.3f} | "
                         f"{p['verify_ms_per_step']:.3f} | {p['append_ms_per_step']:.3f} | {p['accept_ms_per_step']:.3f} |")
    return lines
