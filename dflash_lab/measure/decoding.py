"""Measured tokens/s of the fast backend (``spec_decode.fast.decoder``), and where a step's time goes.

One record per (method, block size, batch, CUDA graphs on/off):

    method               "target_only" (greedy, block 1), "dflash" (the default drafter, the
                         paper's), "dflash_poolside" (the Poolside-style drafter: sliding, causal),
                         "prompt_lookup"
    block_size, batch, cuda_graphs, tokens_per_s, mean_acceptance_length, device
    prompt_set           "heldout" or "docstring" (``PROMPT_SETS``), set by the caller that chose the
                         prompts (``bench spec-decode``); a record without it is a held-out one
    + tokens, seconds, batch_steps, ms_per_batch_step, target_forwards_per_token,
      outputs_equal_target_only (same batch and graphs setting), outputs_equal_graphs_off

Every configuration runs the same prompts in chunks of ``batch``, after an untimed warm-up
(every prompt once, then one full-length chunk: one-off costs such as Triton specialisations
and cuDNN attention plans for each new prompt length stay out of the clock); the clock covers
prefill and decoding, host work included. "Graphs off" launches the same kernels one by one
from Python. ``phase_breakdown`` times each phase of a step (draft, verify, context-K/V append,
accept) as its own graph. Chapter 5 runs these live on a GPU; ``python -m dflash_lab.tools.bench
spec-decode`` writes them to benchmarks/.
"""

from __future__ import annotations

from datetime import datetime, timezone

import torch

from ..runtime import device_name, synchronized_time
from ..spec_decode.fast.decoder import PHASES, FastDecoder
from ..spec_decode.stats import SpecDecodeStats

METHODS = ("target_only", "dflash", "dflash_poolside", "prompt_lookup")
PROMPT_SETS = ("heldout", "docstring")  # assets.heldout_prompts, assets.docstring_prompts, in report order


def prompt_set_of(record: dict) -> str:
    """The prompt set a record was measured on: its ``prompt_set``, "heldout" for records written before
    the field existed (every earlier run timed the held-out prompts)."""
    return record.get("prompt_set") or "heldout"


def records_of(records, prompt_set: str) -> list[dict]:
    """The records measured on ``prompt_set`` ("heldout" or "docstring"), in their order."""
    return [r for r in records if prompt_set_of(r) == prompt_set]


def drafter_methods(drafters: dict) -> dict:
    """{method: drafter}: "dflash" for the shipped default, "dflash_<name>" for every other shipped drafter."""
    return {("dflash" if name == "paper" else f"dflash_{name}"): d for name, d in drafters.items()}


def runs(block_sizes, methods=("dflash",)) -> list[tuple[str, int]]:
    """(method, block size) in the order they are measured."""
    return [("target_only", 1)] + [(m, b) for m in (*methods, "prompt_lookup") for b in block_sizes]


def _proposer(method: str, drafters: dict):
    return {"target_only": None, "prompt_lookup": "ngram"}.get(method, drafters.get(method))


def measure_fast_decoding(target, drafters: dict, prompts, *, batches, block_sizes, graphs=(True, False),
                          max_new_tokens: int, progress=print, on_record=None) -> list[dict]:
    """tokens/s of every (method, block, batch, graphs) on ``prompts``; see the module docstring.

    drafters: {"paper": drafter, "poolside": drafter, ...} (see ``drafter_methods``)."""
    drafters = drafter_methods(drafters)
    device = next(target.parameters()).device
    dtype = str(next(target.parameters()).dtype).replace("torch.", "")
    capacity = max(int(p.shape[-1]) for p in prompts) + max_new_tokens
    outputs, records = {}, []
    measured = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    for batch in batches:
        chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        for cuda_graphs in graphs:
            for method, block in runs(block_sizes, tuple(drafters)):
                t0 = synchronized_time(device)
                dec = FastDecoder(target, _proposer(method, drafters), batch=batch, block_size=block, capacity=capacity,
                                  cuda_graphs=cuda_graphs)
                setup_s = synchronized_time(device) - t0
                # Warm-up, untimed: every prompt once (each new prompt length costs one-off work: Triton
                # specialisations, cuDNN attention plans), then a full-length generation (the step shapes).
                for chunk in chunks:
                    dec.generate(chunk, max_new_tokens=min(2, max_new_tokens))
                dec.generate(chunks[0], max_new_tokens=max_new_tokens)
                results, steps = [], 0
                t0 = synchronized_time(device)
                for chunk in chunks:
                    results += dec.generate(chunk, max_new_tokens=max_new_tokens)
                    steps += dec.host_steps
                wall = synchronized_time(device) - t0
                stats = sum((r.stats for r in results), SpecDecodeStats())
                key = (method, block, batch, cuda_graphs)
                outputs[key] = [r.new_token_ids for r in results]
                rec = {
                    "method": method, "block_size": block, "batch": batch, "cuda_graphs": dec.cuda_graphs,
                    "tokens_per_s": round(stats.num_generated_tokens / wall, 1),
                    "mean_acceptance_length": None if method == "target_only" else round(stats.mean_acceptance_length, 4),
                    "device": device_name(device), "dtype": dtype,
                    "tokens": stats.num_generated_tokens, "seconds": round(wall, 4), "batch_steps": steps,
                    "ms_per_batch_step": round(1e3 * wall / max(steps, 1), 4),
                    "target_forwards_per_token": round(stats.target_forwards_per_token, 4),
                    "setup_s": round(setup_s, 3), "moe": dec.tgt.moe, "measured": measured,
                }
                ref = outputs.get(("target_only", 1, batch, cuda_graphs))
                rec["outputs_equal_target_only"] = f"{sum(a == b for a, b in zip(outputs[key], ref))}/{len(ref)}"
                records.append(rec)
                progress(f"  batch {batch:>2} graphs {'on ' if dec.cuda_graphs else 'off'} {method:14s} block {block:>2}: "
                         f"{rec['tokens_per_s']:9.1f} tok/s  tau {rec['mean_acceptance_length']}  "
                         f"{rec['ms_per_batch_step']:.3f} ms/step  same as target-only {rec['outputs_equal_target_only']}")
                del dec
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if on_record is not None:
                    on_record(records)
    for rec in records:  # graphed outputs against the same kernels launched eagerly
        if rec["cuda_graphs"]:
            on, off = (outputs.get((rec["method"], rec["block_size"], rec["batch"], g)) for g in (True, False))
            rec["outputs_equal_graphs_off"] = None if off is None else f"{sum(a == b for a, b in zip(on, off))}/{len(on)}"
    return records


def speedups(records) -> list[dict]:
    """tokens/s over target-only's on the same prompt set, at the same batch and graphs setting."""
    key = lambda r: (prompt_set_of(r), r["batch"], r["cuda_graphs"])  # noqa: E731
    base = {key(r): r["tokens_per_s"] for r in records if r["method"] == "target_only"}
    out = []
    for r in records:
        b = base.get(key(r))
        if b:
            out.append({"prompt_set": prompt_set_of(r), "method": r["method"], "block_size": r["block_size"],
                        "batch": r["batch"], "cuda_graphs": r["cuda_graphs"], "speedup": round(r["tokens_per_s"] / b, 3),
                        "mean_acceptance_length": r["mean_acceptance_length"]})
    return out


def phase_breakdown(target, drafters: dict, prompts, *, block_size: int, max_new_tokens: int) -> dict:
    """Milliseconds per step in each phase, batch 1, each phase its own CUDA graph (each drafter and target only)."""
    device = next(target.parameters()).device
    capacity = max(int(p.shape[-1]) for p in prompts) + max_new_tokens
    drafters = drafter_methods(drafters)
    out = {}
    for method, block in [(m, block_size) for m in drafters] + [("target_only", 1)]:
        dec = FastDecoder(target, _proposer(method, drafters), batch=1, block_size=block, capacity=capacity,
                          cuda_graphs=True, phase_graphs=True)
        for p in prompts:  # warm-up: each prompt's prefill width captures its graph once, outside the clock
            phase_times(dec, [p], max_new_tokens=max_new_tokens)
        total = {"steps": 0, "prefill_s": 0.0, **{f"{p}_s": 0.0 for p in PHASES}}
        for p in prompts:
            for k, v in phase_times(dec, [p], max_new_tokens=max_new_tokens).items():
                total[k] += v
        steps = max(total["steps"], 1)
        out[method] = {"block_size": block, "steps": total["steps"], "cuda_graphs": dec.cuda_graphs,
                       **{f"{p}_ms_per_step": round(1e3 * total[f"{p}_s"] / steps, 4) for p in PHASES},
                       "whole_step_ms": round(1e3 * whole_step_seconds(dec), 4),  # the one graph generate replays
                       "generations": len(prompts),
                       "prefill_ms_per_generation": round(1e3 * total["prefill_s"] / len(prompts), 4)}
        del dec
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------
# Timing one decoder: its phases, its whole step
# ---------------------------------------------------------------------------


def phase_times(decoder: FastDecoder, prompts, *, max_new_tokens: int) -> dict:
    """Seconds spent in each phase (draft, verify, append, accept) over one generation, each phase its own graph,
    and in its prefill (``prefill_s``: host preparation and the prefill graph, synchronised).

    The decoder must be built with ``phase_graphs=True``. Phases run back to back
    with device events between them; the sum is a little above a whole-step graph's time.
    """
    if decoder.phases is None:
        raise ValueError("build the FastDecoder with phase_graphs=True to time its phases")
    timed = decoder.device.type == "cuda"
    start = synchronized_time(decoder.device)
    decoder.prefill([p.to(decoder.device) for p in prompts], max_new_tokens, ())
    prefill_s = synchronized_time(decoder.device) - start  # host preparation + the prefill (graph)
    totals = dict.fromkeys(PHASES, 0.0)
    steps = 0
    while bool(decoder.active.any()):
        marks = []
        for name in PHASES:
            start = torch.cuda.Event(enable_timing=True) if timed else synchronized_time(decoder.device)
            if timed:
                start.record()
            decoder.phases[name]()
            if timed:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                marks.append((name, start, end))
            else:
                totals[name] += synchronized_time(decoder.device) - start
        if timed:
            torch.cuda.synchronize(decoder.device)
            for name, start, end in marks:
                totals[name] += start.elapsed_time(end) / 1e3
        steps += 1
    return {"steps": steps, "prefill_s": prefill_s, **{f"{k}_s": v for k, v in totals.items()}}


def whole_step_seconds(decoder: FastDecoder, replays: int = 64) -> float:
    """Mean seconds of one whole-step replay (the graph ``generate`` runs), after a prefill.

    A step's kernels do not depend on which sequences are still live, so replaying past the
    end of a generation times the same work.
    """
    timed = decoder.device.type == "cuda"
    decoder.step()  # warm
    if timed:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    else:
        t0 = synchronized_time(decoder.device)
    for _ in range(replays):
        decoder.step()
    if timed:
        end.record()
        torch.cuda.synchronize(decoder.device)
        return start.elapsed_time(end) / 1e3 / replays
    return (synchronized_time(decoder.device) - t0) / replays
