"""Benchmark: serving a request stream at a concurrency, continuous against static batching, with the phases.

    python -m dflash_lab.tools.bench serve [--quick] [--prompt-set {heldout,docstring,both}]
        [--concurrency 1 8 32 64] [--block-sizes 4 8 16] [--requests 128]

1. ``measure.serving``: a stream of ``--requests`` requests (each prompt set's prompts cycled) served at
   every concurrency by target-only, every drafter of the pair in use and prompt lookup at every block,
   continuously batched (vLLM's scheduler) and statically (a batch at a time), graphs on.
2. The phases at every concurrency (``measure.decoding.phase_breakdown``): a step's draft / verify / append /
   accept, each its own graph, and the whole step, on a static batch of that many held-out prompts; the
   bound they give (tau x target step / drafter step).
3. The schedule (``spec_decode.schedule``): from the continuous records, the ``num_speculative_tokens_
   per_batch_size`` that maximises tokens/s per batch range, as the ``--speculative-config`` JSON.

Writes benchmarks/spec_decode_serving.{json,md} (the shipped pair; another pair's go under runs/).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..assets import load_pair, pair_fingerprint
from ..measure.decoding import LOOKUP, PROMPT_SETS, drafter_methods, measurements_from_record
from ..measure.decoding import phase_breakdown
from ..measure.serving import BATCHINGS, CONCURRENCIES, NUM_REQUESTS, best_blocks, measure_serving, request_stream
from ..runtime import device_name, resolve_device
from ..spec_decode.fast.serving import REFILLS
from ..spec_decode.schedule import SpeculationSchedule, recommend_schedule
from .bench_common import OUT_HELP, pair_out_dir, write_results
from .bench_spec_decode import PROMPT_LENGTH, prompt_ids

STEM = "spec_decode_serving"
FLAGS_RECORDED = ("concurrency", "block_sizes", "requests", "prompt_set", "batching", "refill_at", "schedule_from",
                  "read_behind", "refill")


def serving_markdown(result: dict) -> str:
    """Tables: best block per method, concurrency and batching (tokens/s, x target-only, tau, latency), phases."""
    lines = [f"# Serving a request stream ({result['device']})", "",
             f"`{result['command']}`: {result['requests']} requests per run (the prompt set cycled), "
             f"{result['max_new_tokens']} new tokens each, every request arriving at 0; graphs on.", ""]
    for s in result["prompt_sets"]:
        recs = [r for r in result["records"] if r["prompt_set"] == s]
        base = {(r["batch"], r["batching"]): r["tokens_per_s"] for r in recs if r["method"] == "target_only"}
        lines += [f"## {s} prompts", "",
                  "| concurrency | batching | method | best block | tokens/s | x target-only | tau | batch steps "
                  "| mean E2EL ms | p99 E2EL ms |", "|---|---|---|---|---|---|---|---|---|---|"]
        for batching in BATCHINGS:
            best = best_blocks(recs, batching)
            for (_, method, c), r in sorted(best.items(), key=lambda kv: (kv[0][2], kv[0][1])):
                b = base.get((c, batching))
                if b:
                    lines.append(f"| {c} | {batching} | {method} | {r['block_size']} | {r['tokens_per_s']:.0f} | "
                                 f"{r['tokens_per_s'] / b:.2f}x | {r['mean_acceptance_length'] or '-'} | "
                                 f"{r['batch_steps']} | {r['mean_e2el_ms']:.1f} | {r['p99_e2el_ms']:.1f} |")
        scheduled = {r["method"]: r["schedule"] for r in recs if r.get("schedule")}
        if scheduled:  # vLLM's ``num_speculative_tokens_per_batch_size``: [first batch, last batch, K] ranges
            lines += ["", "Scheduled runs draft the K of `num_speculative_tokens_per_batch_size` for the running "
                      "requests (block = the largest K + 1): " + "; ".join(f"{m} `{json.dumps(v)}`"
                                                                          for m, v in scheduled.items()) + "."]
        lines.append("")
    if result.get("phases"):
        lines += ["## Phases per step (ms), a static batch of held-out prompts", "",
                  "| batch | method | block | draft | verify | append | accept | whole step | steps |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c, per in result["phases"].items():
            for method, p in per.items():
                lines.append(f"| {c} | {method} | {p['block_size']} | {p['draft_ms_per_step']} | "
                             f"{p['verify_ms_per_step']} | {p['append_ms_per_step']} | {p['accept_ms_per_step']} | "
                             f"{p['whole_step_ms']} | {p['steps']} |")
    return "\n".join(lines) + "\n"


def parse_refill_at(text: str | None):
    """``--refill-at``: "N" (a fixed number of free rows) or "c/N" (the concurrency over N, at least 1)."""
    if text is None:
        return None
    try:
        if text.startswith("c/"):
            n = int(text[2:])
            return lambda c: max(1, c // n)
        n = int(text)
        return lambda c: n
    except ValueError:
        raise ValueError(f"--refill-at must be N or c/N (N an integer), got {text!r}") from None


def schedules_from(paths, prompt_set: str, methods, max_batch: int) -> dict | None:
    """{method: the schedule ``spec_decode.schedule`` recommends from the continuous rows of the first serving
    record in ``paths`` (one path, or several) that holds the method} for one prompt set; None without a path."""
    if not paths:
        return None
    records = [json.loads(Path(p).read_text()) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    out = {}
    for method in methods:
        for record in records:
            try:
                ms = measurements_from_record(record, method, prompt_set=prompt_set, batching="continuous")
            except ValueError:
                continue  # a method this record does not hold
            rec = recommend_schedule(ms, max_batch=max_batch)
            if rec.num_speculative_tokens > 0:
                out[method] = SpeculationSchedule.from_config(rec.schedule, max_batch, rec.num_speculative_tokens)
            break
    return out


def serving(args) -> int:
    device = resolve_device(args.device)
    quick = args.quick
    concurrencies = args.concurrency or ([1, 4] if quick else list(CONCURRENCIES))
    blocks = args.block_sizes or ([8] if quick else [4, 8, 16])
    requests = args.requests or (16 if quick else NUM_REQUESTS)
    max_new = args.max_new_tokens or (32 if quick else 96)
    sets = list(PROMPT_SETS) if args.prompt_set == "both" else [args.prompt_set]
    target, drafters, tokenizer = load_pair(device)
    methods = drafter_methods(drafters)
    value = lambda v: "" if v is True else f" {' '.join(map(str, v)) if isinstance(v, list) else v}"  # noqa: E731
    flags = " ".join(f"--{k.replace('_', '-')}{value(v)}"
                     for k, v in vars(args).items()
                     if k in FLAGS_RECORDED and v)
    result = {"command": f"python -m dflash_lab.tools.bench serve{' --quick' if quick else ''} {flags}".strip(),
              "device": device_name(device), "requests": requests, "max_new_tokens": max_new,
              "prompt_sets": sets, "pair": pair_fingerprint(), "records": [], "phases": {}}
    out = pair_out_dir(args.out)
    save = lambda: write_results(out, STEM, result, serving_markdown(result))  # noqa: E731
    print(f"serve on {result['device']}: concurrency {concurrencies}, blocks {blocks}, {requests} requests x "
          f"{max_new} tokens, prompt sets {sets}", flush=True)
    done = []
    for s in sets:
        prompts = [p[0] for p in prompt_ids(tokenizer, s, 48, PROMPT_LENGTH, device)]

        def on_record(rs):
            result["records"] = done + list(rs)
            save()
        done += measure_serving(target, methods, prompts, concurrencies=concurrencies, block_sizes=blocks,
                                num_requests=requests, max_new_tokens=max_new, prompt_set=s,
                                batchings=BATCHINGS if args.batching == "both" else (args.batching,),
                                refill_at=parse_refill_at(args.refill_at), read_behind=args.read_behind,
                                refills=REFILLS if args.refill == "both" else (args.refill,),
                                schedules=schedules_from(args.schedule_from, s, [*methods, *LOOKUP],
                                                         max(concurrencies)),
                                progress=lambda line: print(line, flush=True), on_record=on_record)
        result["records"] = list(done)
        save()
    if not args.no_phases:
        heldout = [p[0] for p in prompt_ids(tokenizer, "heldout", max(concurrencies), PROMPT_LENGTH, device)]
        for c in concurrencies:
            result["phases"][str(c)] = phase_breakdown(target, drafters, request_stream(heldout, c), batch=c,
                                                       block_size=max(blocks), max_new_tokens=max_new)
            print(f"  phases at batch {c}: " + ", ".join(f"{m} {p['whole_step_ms']} ms"
                                                       for m, p in result["phases"][str(c)].items()), flush=True)
            save()
    paths = save()
    print(serving_markdown(result))
    print("wrote", *paths)
    return 0


def add_command(subparsers) -> None:
    p = subparsers.add_parser("serve", help="a request stream at each concurrency: continuous vs static batching, "
                                            "tokens/s, latency and the phases per batch")
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 4, block 8, 16 requests of 32 tokens")
    p.add_argument("--concurrency", type=int, nargs="+", help="concurrencies (default 1 8 32 64)")
    p.add_argument("--block-sizes", type=int, nargs="+", help="block sizes (default 4 8 16)")
    p.add_argument("--requests", type=int, help=f"requests per run (default {NUM_REQUESTS})")
    p.add_argument("--max-new-tokens", type=int, help="tokens per request (default 96)")
    p.add_argument("--prompt-set", choices=["heldout", "docstring", "both"], default="both")
    p.add_argument("--no-phases", action="store_true", help="skip the per-batch phase timing")
    p.add_argument("--batching", choices=["continuous", "static", "both"], default="both")
    p.add_argument("--schedule-from", nargs="+", help="serving records (benchmarks/spec_decode_serving*.json): each "
                                                      "method also runs at the per-batch schedule recommended from "
                                                      "the continuous rows of the first record that holds it")
    p.add_argument("--refill-at", help="continuous batching refills once N rows are free: N, or c/N for the "
                                       "concurrency over N (default 1, vLLM's rule)")
    p.add_argument("--read-behind", action="store_true", help="CUDA: read the rows' state one step behind, as "
                                                              "vLLM's async scheduling does (serving.serve)")
    p.add_argument("--refill", choices=[*REFILLS, "both"], default="prefill",
                   help="how a freed row takes its next request: its own prefill forward, or chunked (its prompt "
                        "rides in the next steps, as vLLM mixes prefill and decode tokens; continuous, drafted on "
                        "the device); both: each drafter runs both ways")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.set_defaults(func=serving)
