"""DDTree against the chain, per node budget: tau on the eager loop, speed and the verify cost on the fast path.

    measure_tree_acceptance  the eager loop (``speculative_generate``; the committed record is float32 on a
                             CPU): per drafter, the chain at block B and a tree at every budget: tau, the
                             accepted positions per depth, accepted tokens per verified node, outputs
                             against target-only
    measure_tree_speed       the fast path (``FastDecoder``, graphed on a GPU): target-only, the chain and
                             every budget at each batch: tokens/s, tau, the whole step, and the verify forward
                             alone (1 + N tokens under the tree's mask; the chain's 1 + K; target-only's 1)

Records are ``timing_record``'s with backend "tree" (``EXTRA_KEYS["tree"]``): ``path`` "eager" or "static",
``tree_budget`` None for the chain and for target-only.
"""

from __future__ import annotations

from datetime import datetime, timezone

import torch

from ..runtime import synchronized_time
from ..spec_decode import speculative_generate
from ..spec_decode.fast.decoder import FastDecoder
from ..spec_decode.stats import SpecDecodeStats
from ..spec_decode.tree import build_draft_tree
from .decoding import _dtype, drafter_methods, timed_generations, timing_record, whole_step_seconds
from .timing import graphed_ms, time_ms

TREE_BUDGETS = (16, 32, 64, 128)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _pooled(results) -> SpecDecodeStats:
    return sum((r.stats for r in results), SpecDecodeStats())


def _per_node(stats: SpecDecodeStats) -> float:
    return round(stats.num_accepted_tokens / max(stats.num_draft_tokens, 1), 4)


def measure_tree_acceptance(target, drafters: dict, prompts, *, budgets=TREE_BUDGETS, block_size: int = 16,
                            max_new_tokens: int, prompt_set: str = "heldout", progress=print) -> list[dict]:
    """tau of the chain and of a tree at every budget, per drafter, on the eager loop (batch 1).

    drafters: {"paper": drafter, ...} (``drafter_methods``); prompts: (T,) each."""
    device = next(target.parameters()).device
    kwargs = dict(max_new_tokens=max_new_tokens, block_size=block_size)
    reference = [speculative_generate(target, None, p, max_new_tokens=max_new_tokens).new_token_ids for p in prompts]
    records, measured = [], _now()
    for method, drafter in drafter_methods(drafters).items():
        for budget in (None, *budgets):
            t0 = synchronized_time(device)
            results = [speculative_generate(target, drafter, p, tree_budget=budget, **kwargs) for p in prompts]
            stats = _pooled(results)
            rec = timing_record("tree", method, block_size, batch=1, stats=stats,
                                seconds=synchronized_time(device) - t0, outputs=[r.new_token_ids for r in results],
                                reference=reference, device=device, dtype=_dtype(target), prompt_set=prompt_set,
                                path="eager", tree_budget=budget, accepted_per_node=_per_node(stats),
                                per_position_acceptance_rate=[round(x, 4) for x in stats.per_position_acceptance_rate],
                                measured=measured)
            records.append(rec)
            progress(f"  {method:16s} {'chain' if budget is None else f'tree {budget:>4}'}: tau "
                     f"{rec['mean_acceptance_length']:.3f}, {rec['accepted_per_node']:.3f} accepted per node, "
                     f"same as target-only {rec['outputs_equal_target_only']}")
    return records


def verify_ms(dec: FastDecoder) -> float:
    """The target's verify forward alone, as the decoder's step runs it (graphed on CUDA): 1 + N tokens of a
    tree (built from random block logits), the chain's block, or target-only's one token, per row."""
    b, B, device = dec.batch, dec.B, dec.device
    width = B if dec.tree_budget is None else dec.tree_budget + 1
    start = torch.full((b,), min(dec.capacity // 2, dec.tgt.capacity - width), device=device)  # a context to read
    if dec.tree_budget is None:
        ids = torch.zeros(b, B, dtype=torch.long, device=device)
        fn = lambda: dec.tgt.forward(ids, start[:, None] + dec.offsets)  # noqa: E731
    else:
        g = torch.Generator(device="cpu").manual_seed(0)
        logits = torch.randn(b, B - 1, dec.target.config.vocab_size, generator=g).to(device)
        tree = build_draft_tree(logits, dec.tree_budget)
        ids = torch.cat([torch.zeros_like(tree.token_ids[:, :1]), tree.token_ids], dim=1)
        positions = start[:, None] + tree.depths_with_root()
        fn = lambda: dec.tgt.forward(ids, positions, tree=tree, start=start)  # noqa: E731
    return graphed_ms(fn, device) or time_ms(fn, device)


def measure_tree_speed(target, drafters: dict, prompts, *, budgets=TREE_BUDGETS, block_size: int = 16,
                       batches=(1,), max_new_tokens: int, prompt_set: str = "heldout", progress=print,
                       on_record=None) -> list[dict]:
    """tokens/s, tau, the whole step and the verify forward of target-only, the chain and each budget, per batch,
    on the fast path (graphs on where they run). on_record(records) runs after each configuration."""
    device = next(target.parameters()).device
    capacity = max(int(p.shape[-1]) for p in prompts) + max_new_tokens
    records, measured = [], _now()
    for batch in batches:
        chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        reference = None
        runs = [("target_only", None, 1, None)] + [(m, d, block_size, n) for m, d in drafter_methods(drafters).items()
                                                   for n in (None, *budgets)]
        for method, drafter, block, budget in runs:
            dec = FastDecoder(target, drafter, batch=batch, block_size=block, capacity=capacity, tree_budget=budget)
            results, steps, wall = timed_generations(dec, chunks, max_new_tokens)
            outputs = [r.new_token_ids for r in results]
            reference = reference or outputs
            stats = _pooled(results)
            rec = timing_record("tree", method, block, batch=batch, stats=stats, seconds=wall, outputs=outputs,
                                reference=reference, device=device, dtype=_dtype(target), prompt_set=prompt_set,
                                path="static", tree_budget=budget, accepted_per_node=_per_node(stats),
                                cuda_graphs=dec.cuda_graphs, batch_steps=steps,
                                ms_per_batch_step=round(1e3 * wall / max(steps, 1), 4),
                                step_ms=round(1e3 * whole_step_seconds(dec), 4), verify_ms=round(verify_ms(dec), 4),
                                moe=dec.tgt.moe, measured=measured)
            records.append(rec)
            name = "target-only" if method == "target_only" else f"{method} {'chain' if budget is None else budget}"
            progress(f"  batch {batch:>2} {name:24s}: {rec['tokens_per_s']:9.1f} tok/s  tau "
                     f"{rec['mean_acceptance_length']}  step {rec['step_ms']:.3f} ms  verify {rec['verify_ms']:.3f} ms"
                     f"  same as target-only {rec['outputs_equal_target_only']}")
            del dec
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if on_record is not None:
                on_record(records)
    return records
