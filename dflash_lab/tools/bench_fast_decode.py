"""The markdown of the fast backend's speed records (``measure.decoding`` measures them).

``fast_markdown`` turns the records of ``measure.decoding.measure_fast_decoding`` (one per
prompt set, method, block size, batch and graphs setting) and its ``phase_breakdown`` into the
tables of benchmarks/spec_decode.md: one tokens/s table per prompt set (held-out first, then
docstring-first; a record without ``prompt_set`` is a held-out one), then the phases.
"""

from __future__ import annotations

from ..measure.decoding import METHODS, PROMPT_SETS, backend_of, records_of

# prompt set -> (its name in prose, what it is)
PROMPT_SET_TEXT = {
    "heldout": ("held-out", "`checkpoints/heldout_prompts.json`: standard-library code neither model trained on"),
    "docstring": ("docstring-first", "`checkpoints/docstring_prompts.json`, `corpus.cut_docstring_prompts`: "
                                     "a function's signature and docstring from the same held-out files; the "
                                     "continuation is its body, "
                                     "new code the prompt does not contain"),
}


def _per_set(value, prompt_set: str):
    """``value`` itself, or its entry for ``prompt_set`` when it is a {prompt set: value} dict."""
    return value.get(prompt_set) if isinstance(value, dict) else value


def speed_table(records) -> list[str]:
    """Markdown lines: tokens/s (rows: method and block; columns: batch x graphs) of one prompt set's records."""
    batches = sorted({r["batch"] for r in records})
    graphs = sorted({r["cuda_graphs"] for r in records}, reverse=True)
    cols = [(b, g) for b in batches for g in graphs]
    get = {(r["method"], r["block_size"], r["batch"], r["cuda_graphs"]): r for r in records}
    lines = ["| method | block | " + " | ".join(f"batch {b}, graphs {'on' if g else 'off'}" for b, g in cols) + " |",
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
    return lines


def fast_markdown(records, phases=None, *, n_prompts, max_new_tokens) -> list[str]:
    """Markdown lines: per prompt set, the tokens/s table (x target-only on the same set, batch and graphs
    setting); then the phases (measured on the held-out prompts).

    n_prompts, max_new_tokens: one number for every set, or {prompt set: number}. Records of another backend
    than the static path are left out (``bench_spec_decode.eager_lines`` tables the eager loop's)."""
    records = [r for r in records if backend_of(r) == "static"]
    if not records:
        return []
    r0 = records[0]
    settings = {bool(r["cuda_graphs"]) for r in records}
    graphs = "CUDA graphs on and off" if len(settings) == 2 else f"CUDA graphs {'on' if True in settings else 'off'}"
    lines = [f"## Measured: the static path, {graphs} ({r0['device']}, {r0['dtype']}, greedy)", "",
             "Each prompt cut to its last 256 tokens, in batches; static KV caches, MoE as "
             f"`{r0.get('moe', '?')}`, the prefill (prompts padded to a multiple of 64 tokens) and each step one "
             "CUDA graph where graphs are on (`dflash_lab.spec_decode.fast.decoder`). Clock: prefill + "
             "decoding + host work, after an untimed warm-up (every prompt once). One table per prompt set: tokens/s "
             "(x target-only on the same prompts, batch and graphs setting; tau = mean acceptance length)."]
    for prompt_set in PROMPT_SETS:
        rs = records_of(records, prompt_set)
        if not rs:
            continue
        name, what = PROMPT_SET_TEXT[prompt_set]
        runs = ", ".join(sorted({f"graphs {'on' if r['cuda_graphs'] else 'off'}: {r.get('measured', '?')}"
                                 for r in rs}))
        lines += ["", f"### {name[0].upper() + name[1:]} prompts", "",
                  f"{_per_set(n_prompts, prompt_set)} {name} prompts ({what}) x {_per_set(max_new_tokens, prompt_set)} "
                  f"new tokens. Runs: {runs}.", ""]
        lines += speed_table(rs)
        same = [f"{r['method']} b{r['block_size']} batch {r['batch']}: {r['outputs_equal_graphs_off']}"
                for r in rs if r["cuda_graphs"] and r.get("outputs_equal_graphs_off")]
        if same:
            lines += ["", "Graphed output equal to the same kernels launched eagerly (prompts): "
                      + "; ".join(same) + "."]
    if phases:
        lines += ["", "### Where a step's time goes (held-out prompts, batch 1, each phase its own graph, "
                  "ms per step)", "",
                  "| method | block | steps | draft | verify | context K/V append | accept | whole step, one graph "
                  "| prefill per generation |", "|---|---|---|---|---|---|---|---|---|"]
        cell = lambda p, k: f"{p[k]:.3f}" if p.get(k) is not None else "-"  # noqa: E731 (older runs lack the last two)
        for m, p in phases.items():
            lines.append(f"| {m} | {p['block_size']} | {p['steps']} | {p['draft_ms_per_step']:.3f} | "
                         f"{p['verify_ms_per_step']:.3f} | {p['append_ms_per_step']:.3f} | "
                         f"{p['accept_ms_per_step']:.3f} | "
                         f"{cell(p, 'whole_step_ms')} | {cell(p, 'prefill_ms_per_generation')} |")
    return lines
