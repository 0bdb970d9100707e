"""Measured tokens/s of speculative decoding, one record format for every backend, and where a step's time goes.

Two backends, one record each per (method, block size, batch[, CUDA graphs on/off]):

    backend "static"     the fast path (``spec_decode.fast.decoder``): ``measure_fast_decoding``, at every
                         batch, with CUDA graphs on and/or off
    backend "eager"      the eager teaching loop (``speculative_generate``: transformers' forward and
                         DynamicCache, batch 1, no graphs): ``measure_eager_loop``

Every record (``timing_record`` builds it, the keys in ``RECORD_KEYS``):

    backend              "static", "eager" or "serving" (a request stream, ``measure.serving``); a record
                         without it is a static one (``backend_of``)
    prompt_set           "heldout" or "docstring" (``PROMPT_SETS``); a record without it is a held-out one
    method               "target_only", "dflash" (the default drafter, the paper's), "dflash_poolside"
                         (the Poolside-style drafter: sliding, causal), "prompt_lookup" (drafted on the host,
                         vLLM's V1 rule) or "prompt_lookup_gpu" (on the device, vLLM 0.33's GPU rule) (``METHODS``)
    block_size           tokens verified per step: 1 for target-only, 1 real + block_size - 1 drafts otherwise
    batch, tokens_per_s, mean_acceptance_length (None for target-only), tokens, seconds,
    target_forwards_per_token, outputs_equal_target_only ("same/prompts", against target-only on the
    same backend and setting), device, dtype

and each backend's own keys (``EXTRA_KEYS``): the static path's cuda_graphs, batch_steps,
ms_per_batch_step, setup_s, moe, measured and outputs_equal_graphs_off (graphed output against the
same kernels launched eagerly); the eager loop's per_position_acceptance_rate and where its time goes
(target_ms_per_forward, drafter_ms_per_step: drafter forward + context K/V append).

The static path runs the same prompts in chunks of ``batch``, after an untimed warm-up (every prompt
once, then one full-length chunk: one-off costs such as Triton specialisations and cuDNN attention
plans for each new prompt length stay out of the clock); the clock covers prefill and decoding, host
work included. "Graphs off" launches the same kernels one by one from Python. The eager loop times
each prompt's ``speculative_generate`` after one untimed generation per method. ``phase_breakdown``
times each phase of a static step (draft, verify, context-K/V append, accept) as its own graph.
Chapter 5 runs these live on a GPU; ``python -m dflash_lab.tools.bench spec-decode`` writes them to
benchmarks/ (the eager loop's with ``--eager-loop``).
"""

from __future__ import annotations

from datetime import datetime, timezone

import torch

from ..runtime import device_name, synchronized_time
from ..spec_decode import speculative_generate
from ..spec_decode.fast.decoder import PHASES, FastDecoder
from ..spec_decode.schedule import Measurement
from ..spec_decode.stats import SpecDecodeStats

METHODS = ("target_only", "dflash", "dflash_poolside", "prompt_lookup", "prompt_lookup_gpu")
LOOKUP = {"prompt_lookup": "ngram", "prompt_lookup_gpu": "ngram_gpu"}  # host-drafted (V1) and device (V2)
PROMPT_SETS = ("heldout", "docstring")  # assets.heldout_prompts, assets.docstring_prompts, in report order
BACKENDS = ("static", "eager", "serving", "tree")
RECORD_KEYS = ("backend", "prompt_set", "method", "block_size", "batch", "tokens_per_s", "mean_acceptance_length",
               "tokens", "seconds", "target_forwards_per_token", "outputs_equal_target_only", "device", "dtype")
EXTRA_KEYS = {"static": ("cuda_graphs", "batch_steps", "ms_per_batch_step", "setup_s", "moe", "measured",
                         "outputs_equal_graphs_off"),
              "eager": ("per_position_acceptance_rate", "target_ms_per_forward", "drafter_ms_per_step"),
              "serving": ("batching", "cuda_graphs", "batch_steps", "requests", "max_new_tokens", "request_throughput",
                          *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "e2el") for s in ("mean", "median", "p99")),
                          "request_steps", "static_batch_steps", "refill_at", "read_behind", "schedule", "moe",
                          "measured", "bursts", "fills", "refill"),
              "tree": ("path", "tree_budget", "accepted_per_node", "per_position_acceptance_rate", "cuda_graphs",
                       "batch_steps", "ms_per_batch_step", "step_ms", "verify_ms", "moe", "measured")}


def prompt_set_of(record: dict) -> str:
    """The prompt set a record was measured on: its ``prompt_set``, "heldout" for records written before
    the field existed (every earlier run timed the held-out prompts)."""
    return record.get("prompt_set") or "heldout"


def backend_of(record: dict) -> str:
    """The backend a record was measured on: its ``backend``, "static" for records written before the field
    existed (the eager loop's older rows sat under their own key, in another format)."""
    return record.get("backend") or "static"


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
    return {"target_only": None, **LOOKUP}.get(method, drafters.get(method))


def _dtype(target) -> str:
    return str(next(target.parameters()).dtype).replace("torch.", "")


def timing_record(backend: str, method: str, block_size: int, *, batch: int, stats: SpecDecodeStats, seconds: float,
                  outputs, reference, device, dtype: str, prompt_set: str, **extra) -> dict:
    """One timing record (``RECORD_KEYS``, then the backend's ``EXTRA_KEYS`` given as ``extra``): the counters
    of every generation of one configuration pooled in ``stats``, their wall time in ``seconds``.

    outputs, reference: the new token ids per prompt, of this configuration and of target-only on the same
    backend and setting (equal prompts counted)."""
    if backend not in BACKENDS or method not in METHODS or prompt_set not in PROMPT_SETS:
        raise ValueError(f"unknown backend, method or prompt set: {backend!r}, {method!r}, {prompt_set!r}")
    unknown = set(extra) - set(EXTRA_KEYS[backend])
    if unknown:
        raise ValueError(f"keys {sorted(unknown)} are not {backend} record keys ({EXTRA_KEYS[backend]})")
    tokens = stats.num_generated_tokens
    return {"backend": backend, "prompt_set": prompt_set, "method": method, "block_size": block_size, "batch": batch,
            "tokens_per_s": round(tokens / seconds, 1),
            "mean_acceptance_length": None if method == "target_only" else round(stats.mean_acceptance_length, 4),
            "tokens": tokens, "seconds": round(seconds, 4),
            "target_forwards_per_token": round(stats.target_forwards_per_token, 4),
            "outputs_equal_target_only": f"{sum(a == b for a, b in zip(outputs, reference))}/{len(reference)}",
            "device": device_name(device), "dtype": dtype, **extra}


def measure_fast_decoding(target, drafters: dict, prompts, *, batches, block_sizes, graphs=(True, False),
                          max_new_tokens: int, prompt_set: str = "heldout", progress=print,
                          on_record=None) -> list[dict]:
    """tokens/s of every (method, block, batch, graphs) on the static path, on ``prompts`` ((T,) each): records
    of backend "static" (see the module docstring). on_record(records), if given, runs after each configuration.

    drafters: {"paper": drafter, "poolside": drafter, ...} (see ``drafter_methods``)."""
    drafters = drafter_methods(drafters)
    device = next(target.parameters()).device
    capacity = max(int(p.shape[-1]) for p in prompts) + max_new_tokens
    outputs, records = {}, []
    measured = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    for batch in batches:
        chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        for cuda_graphs in graphs:
            for method, block in runs(block_sizes, tuple(drafters)):
                t0 = synchronized_time(device)
                dec = FastDecoder(target, _proposer(method, drafters), batch=batch, block_size=block,
                                  capacity=capacity, cuda_graphs=cuda_graphs)
                setup_s = synchronized_time(device) - t0
                results, steps, wall = timed_generations(dec, chunks, max_new_tokens)
                outputs[method, block, batch, cuda_graphs] = [r.new_token_ids for r in results]
                rec = timing_record(
                    "static", method, block, batch=batch, stats=sum((r.stats for r in results), SpecDecodeStats()),
                    seconds=wall, outputs=outputs[method, block, batch, cuda_graphs],
                    reference=outputs["target_only", 1, batch, cuda_graphs], device=device, dtype=_dtype(target),
                    prompt_set=prompt_set, cuda_graphs=dec.cuda_graphs, batch_steps=steps,
                    ms_per_batch_step=round(1e3 * wall / max(steps, 1), 4), setup_s=round(setup_s, 3),
                    moe=dec.tgt.moe, measured=measured, outputs_equal_graphs_off=None)
                records.append(rec)
                progress(f"  batch {batch:>2} graphs {'on ' if dec.cuda_graphs else 'off'} {method:14s} "
                         f"block {block:>2}: {rec['tokens_per_s']:9.1f} tok/s  tau {rec['mean_acceptance_length']}  "
                         f"{rec['ms_per_batch_step']:.3f} ms/step  "
                         f"same as target-only {rec['outputs_equal_target_only']}")
                del dec
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if on_record is not None:
                    on_record(records)
    for rec in records:  # graphed outputs against the same kernels launched eagerly
        if rec["cuda_graphs"]:
            on, off = (outputs.get((rec["method"], rec["block_size"], rec["batch"], g)) for g in (True, False))
            if off is not None:
                rec["outputs_equal_graphs_off"] = f"{sum(a == b for a, b in zip(on, off))}/{len(on)}"
    return records


def timed_generations(dec: FastDecoder, chunks, max_new_tokens: int) -> tuple[list, int, float]:
    """(results, batch steps, seconds) of ``dec`` generating every chunk of prompts, after an untimed warm-up:
    every prompt once (each new prompt length costs one-off work: Triton specialisations, cuDNN attention
    plans), then a full-length generation (the step shapes)."""
    for chunk in chunks:
        dec.generate(chunk, max_new_tokens=min(2, max_new_tokens))
    dec.generate(chunks[0], max_new_tokens=max_new_tokens)
    results, steps = [], 0
    t0 = synchronized_time(dec.device)
    for chunk in chunks:
        results += dec.generate(chunk, max_new_tokens=max_new_tokens)
        steps += dec.host_steps
    return results, steps, synchronized_time(dec.device) - t0


def measure_eager_loop(target, drafters: dict, prompts, *, block_sizes, max_new_tokens: int,
                       prompt_set: str = "heldout", progress=print, on_record=None) -> list[dict]:
    """tokens/s of every (method, block) through ``speculative_generate``, the eager teaching loop (transformers'
    forward and DynamicCache, batch 1), on ``prompts`` ((T,) or (1, T) each): records of backend "eager", with
    the per-position acceptance rates and where the time goes (see the module docstring).

    drafters: as ``measure_fast_decoding``'s. on_record(records), if given, runs after each method (partial
    results survive a timeout)."""
    drafters = drafter_methods(drafters)
    device = next(target.parameters()).device
    prompts = [p.reshape(1, -1).to(device) for p in prompts]
    plan = runs(block_sizes, tuple(drafters))

    def generate(method, block, prompt):  # with no drafter the loop verifies 1 token a step at any block (>= 2)
        return speculative_generate(target, _proposer(method, drafters), prompt, max_new_tokens=max_new_tokens,
                                    block_size=max(block, 2))

    for method in dict.fromkeys(m for m, _ in plan):  # warm-up, untimed: each method once, at its largest block
        generate(method, max(b for m, b in plan if m == method), prompts[0])
    reference, records = None, []
    for method, block in plan:
        stats, outputs, wall = SpecDecodeStats(), [], 0.0
        for prompt in prompts:
            t0 = synchronized_time(device)
            res = generate(method, block, prompt)
            wall += synchronized_time(device) - t0
            stats = stats + res.stats
            outputs.append(res.output_ids[0, prompt.shape[1]:].tolist())
        reference = outputs if reference is None else reference  # target-only runs first
        rates = None if method == "target_only" else [round(r, 4) for r in stats.per_position_acceptance_rate]
        drafter_steps = max(stats.num_target_forwards - len(prompts), 1)  # every forward but the prefills
        rec = timing_record(
            "eager", method, block, batch=1, stats=stats, seconds=wall, outputs=outputs, reference=reference,
            device=device, dtype=_dtype(target), prompt_set=prompt_set, per_position_acceptance_rate=rates,
            target_ms_per_forward=round(1e3 * stats.target_time_s / max(stats.num_target_forwards, 1), 3),
            drafter_ms_per_step=round(1e3 * stats.drafter_time_s / drafter_steps, 3))
        records.append(rec)
        if on_record is not None:
            on_record(records)
        progress(f"  {method:14s} block {block:>2}: {rec['tokens_per_s']:8.1f} tok/s  "
                 f"fwd/token {rec['target_forwards_per_token']:.3f}  tau {rec['mean_acceptance_length']}  "
                 f"same as target-only {rec['outputs_equal_target_only']}")
    return records


def speedups(records) -> list[dict]:
    """tokens/s over target-only's on the same prompt set, at the same batch and graphs setting (static records)."""
    key = lambda r: (prompt_set_of(r), r["batch"], r["cuda_graphs"])  # noqa: E731
    base = {key(r): r["tokens_per_s"] for r in records if r["method"] == "target_only"}
    out = []
    for r in records:
        b = base.get(key(r))
        if b:
            out.append({"prompt_set": prompt_set_of(r), "method": r["method"], "block_size": r["block_size"],
                        "batch": r["batch"], "cuda_graphs": r["cuda_graphs"],
                        "speedup": round(r["tokens_per_s"] / b, 3),
                        "mean_acceptance_length": r["mean_acceptance_length"]})
    return out


def phase_breakdown(target, drafters: dict, prompts, *, block_size: int, max_new_tokens: int,
                    batch: int = 1) -> dict:
    """Milliseconds per step in each phase, each phase its own CUDA graph (each drafter and target only), on the
    static path, the prompts generated in static batches of ``batch``; and the whole step's graph. At a batch,
    with target-only's, they bound a drafter's speed-up: tau x target-only step / drafter step (prefill and the
    ragged end left out)."""
    device = next(target.parameters()).device
    capacity = max(int(p.shape[-1]) for p in prompts) + max_new_tokens
    chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    drafters = drafter_methods(drafters)
    out = {}
    for method, block in [(m, block_size) for m in drafters] + [("target_only", 1)]:
        dec = FastDecoder(target, _proposer(method, drafters), batch=batch, block_size=block, capacity=capacity,
                          cuda_graphs=True, phase_graphs=True)
        for chunk in chunks:  # warm-up: each prefill shape captures its graph once, outside the clock
            phase_times(dec, chunk, max_new_tokens=max_new_tokens)
        total = {"steps": 0, "prefill_s": 0.0, **{f"{p}_s": 0.0 for p in PHASES}}
        for chunk in chunks:
            for k, v in phase_times(dec, chunk, max_new_tokens=max_new_tokens).items():
                total[k] += v
        steps = max(total["steps"], 1)
        out[method] = {"block_size": block, "batch": batch, "steps": total["steps"], "cuda_graphs": dec.cuda_graphs,
                       **{f"{p}_ms_per_step": round(1e3 * total[f"{p}_s"] / steps, 4) for p in PHASES},
                       "whole_step_ms": round(1e3 * whole_step_seconds(dec), 4),  # the one graph generate replays
                       "generations": len(chunks),
                       "prefill_ms_per_generation": round(1e3 * total["prefill_s"] / len(chunks), 4)}
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


BATCHINGS = ("continuous", "static")


def record_batching(record: dict, batching: str | None = None) -> str | None:
    """The batching whose rows a schedule is read from: ``batching`` when given ("continuous" or "static"),
    else "continuous" where the record has such rows (a server batches continuously), else None (every row:
    a record from before the serving benchmark, of static batches only)."""
    if batching is not None and batching not in BATCHINGS:
        raise ValueError(f"batching must be one of {BATCHINGS} or None, got {batching!r}")
    have = {r.get("batching") for r in record.get("records", [])}
    if batching is not None and batching not in have:
        raise ValueError(f"the record has no {batching!r} rows (its batchings: {sorted(map(str, have))})")
    return batching or ("continuous" if "continuous" in have else None)


def measurements_from_record(record: dict, method: str, *, prompt_set: str = "heldout", cuda_graphs: bool = True,
                             batching: str | None = None) -> list[Measurement]:
    """``method`` 's and target-only's rows of a spec-decode record, as Measurements (K = block size - 1).

    batching: as ``record_batching`` (a record of both holds two rows of every (batch, K)). Rows served
    under a per-batch schedule are left out: their K changed with the batch."""
    batching = record_batching(record, batching)
    rows = [r for r in records_of(record.get("records", []), prompt_set)
            if r["method"] in (method, "target_only") and bool(r.get("cuda_graphs")) == cuda_graphs
            and (batching is None or r.get("batching") == batching) and r.get("schedule") is None]
    if not any(r["method"] == method for r in rows):
        known = sorted({r["method"] for r in record.get("records", [])} - {"target_only"})
        raise ValueError(f"no {method!r} rows on the {prompt_set!r} prompts with cuda_graphs={cuda_graphs}"
                         + (f" and {batching} batching" if batching else "") + f" in the record; its methods: {known}")
    return [Measurement(batch=r["batch"], k=r["block_size"] - 1, step_ms=r.get("ms_per_batch_step"),
                        tau=None if r["method"] == "target_only" else r.get("mean_acceptance_length"),
                        tokens_per_s=r.get("tokens_per_s")) for r in rows]
