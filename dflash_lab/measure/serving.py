"""A stream of requests served at a concurrency on the fast path: tokens/s and latency, continuous and static.

One record per (method, block size, concurrency, batching), built by ``measure.decoding.timing_record``
(backend "serving"; batch = the concurrency) with these keys of its own:

    batching             "continuous" (a finished row takes the next request: vLLM's scheduler) or
                         "static" (a new batch only when the last one is done)
    requests             the stream's length; every request arrives at 0 (``vllm bench serve
                         --request-rate inf --max-concurrency B``)
    request_throughput, mean/median/p99 _ttft_ms, _tpot_ms, _e2el_ms     ``vllm bench serve``'s names
    batch_steps          graph replays (host-drafted steps for prompt lookup)
    request_steps        each request's own target forwards after its prefill, in stream order
    static_batch_steps   static batching: the steps each batch ran (its slowest request's), in order
    outputs_equal_target_only   requests whose tokens equal target-only's at the same concurrency
    refill               "prefill" (a freed row's request gets its own prefill forward) or "chunked" (its
                         prompt rides in the next steps, ``spec_decode.fast.chunked_fill``; continuous only)

Every configuration first serves the whole stream for 2 tokens (each prompt length's prefill graph is
captured then, outside the clock), then the stream for real. At concurrency 1 the two batchings admit
alike, so only "continuous" is run there. ``python -m dflash_lab.tools.bench spec-decode --serve``
writes these records; the "Serving at batch" chapter times them live.
"""

from __future__ import annotations

from datetime import datetime, timezone

import torch

from ..spec_decode.fast.decoder import FastDecoder
from ..spec_decode.fast.serving import REFILLS, serve
from .decoding import EXTRA_KEYS, LOOKUP, timing_record

BATCHINGS = ("continuous", "static")
CONCURRENCIES = (1, 8, 32, 64)  # the issue's and ``vllm bench serve``'s usual sweep
NUM_REQUESTS = 128


def request_stream(prompts, num_requests: int) -> list[torch.Tensor]:
    """``num_requests`` prompts, the given ones in order and again from the start as often as needed."""
    if not prompts:
        raise ValueError("request_stream needs at least one prompt")
    return [prompts[i % len(prompts)] for i in range(num_requests)]


def static_batch_steps(request_steps: list[int], concurrency: int) -> list[int]:
    """Static batching: each batch of ``concurrency`` consecutive requests runs until its slowest is done."""
    return [max(request_steps[i:i + concurrency]) for i in range(0, len(request_steps), concurrency)]


def capture_fills(decoder: FastDecoder, prompts) -> None:
    """Run (and on CUDA capture) the prefill of every rows bucket at every padded width ``prompts`` need, so that
    no graph is captured inside a timed stream. Clobbers the decoder's state (``prefill`` resets it)."""
    by_width = {decoder.prefill_width(int(p.shape[-1])): p for p in prompts}
    for n in decoder.fill_buckets:
        for p in by_width.values():
            decoder.prefill([p] * n, 2)


def serving_methods(drafters: dict, block_sizes) -> list[tuple[str, object, int]]:
    """(method, drafter argument, block) in the order they are measured; drafters as ``drafter_methods`` names them
    ({"dflash": d, "dflash_poolside": d2})."""
    runs = [("target_only", None, 1)]
    runs += [(m, d, b) for m, d in drafters.items() for b in block_sizes]
    return runs + [(m, p, b) for m, p in LOOKUP.items() for b in block_sizes]


def chunkable(method: str, block: int) -> bool:
    """Whether a refill's prompt can ride in this method's steps: drafted on the device, more than one token wide
    (target-only's one-token step would carry a prompt a token a step; host prompt lookup reads every step)."""
    return block > 1 and LOOKUP.get(method) != "ngram"


def measure_serving(target, drafters: dict, prompts, *, concurrencies=CONCURRENCIES, block_sizes=(16,),
                    batchings=BATCHINGS, num_requests: int = NUM_REQUESTS, max_new_tokens: int,
                    prompt_set: str = "heldout", cuda_graphs: bool = True, refill_at=None, schedules=None,
                    read_behind: bool = False, refills=("prefill",), progress=print, on_record=None) -> list[dict]:
    """Serve a stream of ``num_requests`` (``prompts`` cycled) at every concurrency, for target-only, every
    drafter ({method: drafter}) and prompt lookup at every block size, under each batching; see the module
    docstring. ``refill_at``: continuous batching refills once this many rows are free (a function of the
    concurrency, or None: 1, vLLM's rule; ``serving.serve``), and ``read_behind`` as there. ``schedules``:
    {method: SpeculationSchedule}: that method also runs continuously at the schedule's K per running batch
    (its record's ``schedule``). ``refills``: with "chunked", each method whose step drafts on the device also
    serves continuously on a decoder built with ``chunked_fill`` (its own graphs: the prefill runs keep theirs)."""
    unknown = (set(batchings) - set(BATCHINGS)) | (set(refills) - set(REFILLS))
    if unknown or not refills:
        raise ValueError(f"batchings must be among {BATCHINGS} and refills among {REFILLS}, got "
                         f"{sorted(batchings)}, {sorted(refills)}")
    p = next(target.parameters())
    device, dtype = p.device, str(p.dtype).replace("torch.", "")
    stream = request_stream([torch.as_tensor(q).reshape(-1) for q in prompts], num_requests)
    capacity = max(int(q.shape[-1]) for q in stream) + max_new_tokens
    measured = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    records, reference = [], {}
    for c in concurrencies:
        runs = [(m, d, b, None) for m, d, b in serving_methods(drafters, block_sizes)]
        runs += [(m, {**drafters, **LOOKUP}[m], max(s.ks) + 1, s) for m, s in (schedules or {}).items()]
        runs = [(*r, refill) for refill in refills for r in runs if refill == "prefill" or chunkable(r[0], r[2])]
        for method, drafter, block, schedule, refill in runs:
            chunked = refill == "chunked"
            dec = FastDecoder(target, drafter, batch=c, block_size=block, capacity=capacity, cuda_graphs=cuda_graphs,
                              widths=[k + 1 for k in schedule.ks] if schedule else (), chunked_fill=chunked)
            if not chunked:  # a chunked stream prefills its first batch only, which the warm-up stream captures
                capture_fills(dec, stream)  # warm-up: every (rows, width) prefill graph captured outside the clock
            serve(dec, stream, max_new_tokens=2, refill=refill)
            one = schedule is not None or chunked  # continuous only
            for batching in ("continuous",) if one else batchings if c > 1 else batchings[:1]:
                at = 1 if refill_at is None or batching == "static" else max(1, min(c, refill_at(c)))
                run = serve(dec, stream, max_new_tokens=max_new_tokens, policy=batching, refill_at=at,
                            schedule=schedule, refill=refill)
                outputs = [r.result.new_token_ids for r in run.requests]
                reference.setdefault((c, batching), outputs)  # target-only runs first
                m = run.metrics()
                steps = run.steps_per_request()
                rec = timing_record("serving", method, block, batch=c, stats=run.stats, seconds=run.seconds,
                                    outputs=outputs, reference=reference[c, batching], device=device, dtype=dtype,
                                    prompt_set=prompt_set, batching=batching, cuda_graphs=dec.cuda_graphs,
                                    max_new_tokens=max_new_tokens, request_steps=steps,
                                    static_batch_steps=static_batch_steps(steps, c) if batching == "static" else None,
                                    refill_at=at, read_behind=read_behind, moe=dec.tgt.moe, measured=measured,
                                    schedule=[list(r) for r in schedule.ranges] if schedule else None,
                                    **{k: m[k] for k in EXTRA_KEYS["serving"] if k in m})
                records.append(rec)
                progress(f"  concurrency {c:>2} {batching:10s} {method:15s} block {block:>2}"
                         f"{' scheduled' if schedule else ''}{' chunked' if chunked else ''}: "
                         f"{rec['tokens_per_s']:9.1f} tok/s  tau {rec['mean_acceptance_length']}  "
                         f"{rec['batch_steps']:>5} steps  e2el {rec['mean_e2el_ms']:.1f} ms  "
                         f"same as target-only {rec['outputs_equal_target_only']}")
                if on_record is not None:
                    on_record(records)
            del dec
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return records


def serving_speedups(records) -> list[dict]:
    """tokens/s over target-only's at the same prompt set, concurrency and batching, and over target-only with
    continuous batching (what a server runs without speculation)."""
    key = lambda r: (r.get("prompt_set", "heldout"), r["batch"], r["batching"])  # noqa: E731
    base = {key(r): r["tokens_per_s"] for r in records if r["method"] == "target_only"}
    out = []
    for r in records:
        same, served = base.get(key(r)), base.get((*key(r)[:2], "continuous"))
        if same:
            out.append({"prompt_set": key(r)[0], "method": r["method"], "block_size": r["block_size"],
                        "batch": r["batch"], "batching": r["batching"], "speedup": round(r["tokens_per_s"] / same, 3),
                        "over_continuous_target_only": round(r["tokens_per_s"] / served, 3) if served else None,
                        "mean_acceptance_length": r["mean_acceptance_length"]})
    return out


def run_label(record: dict) -> str:
    """The method as the tables name a run: "<method>", "<method> (scheduled)" (K followed the running batch),
    "<method> (chunked)" (refills rode in the steps), or both."""
    how = [w for w, on in (("scheduled", record.get("schedule")), ("chunked", record.get("refill") == "chunked")) if on]
    return record["method"] + (f" ({', '.join(how)})" if how else "")


def best_blocks(records, batching: str = "continuous") -> dict:
    """{(prompt_set, label, concurrency): the record with the most tokens/s over the block sizes}, the label
    ``run_label``'s: a scheduled or chunked run is its own row, never a method's best block."""
    best = {}
    for r in records:
        if r["batching"] != batching:
            continue
        k = (r.get("prompt_set", "heldout"), run_label(r), r["batch"])
        if k not in best or r["tokens_per_s"] > best[k]["tokens_per_s"]:
            best[k] = r
    return best


def time_split(record: dict, prompt_set: str = "heldout") -> list[dict]:
    """Where each continuous run's wall time went, for the methods and blocks the record's ``phases`` timed:
    its batch steps at the whole step's graphed time, and the rest (refills, the host's reads of the rows'
    state and its decisions). occupancy: the share of row-steps that served a live request. Scheduled and chunked
    runs are left out: their steps are not the timed step."""
    phases, out = record.get("phases", {}), []
    for r in record["records"]:
        p = phases.get(str(r["batch"]), {}).get(r["method"])
        if (r["batching"] != "continuous" or run_label(r) != r["method"] or r.get("prompt_set", "heldout") != prompt_set
                or not p or p["block_size"] != r["block_size"]):
            continue
        in_steps = r["batch_steps"] * p["whole_step_ms"] / 1e3
        out.append({"method": r["method"], "batch": r["batch"], "block_size": r["block_size"],
                    "seconds": r["seconds"], "in_steps_s": round(in_steps, 4),
                    "outside_s": round(r["seconds"] - in_steps, 4),
                    "outside_ms_per_request": round(1e3 * (r["seconds"] - in_steps) / r["requests"], 3),
                    "occupancy": round(sum(r["request_steps"]) / (r["batch"] * r["batch_steps"]), 3),
                    "bursts": r.get("bursts")})
    return sorted(out, key=lambda row: (row["batch"], row["method"]))
