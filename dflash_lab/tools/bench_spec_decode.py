"""Benchmark: speculative decoding speed of the pair in use (by default the shipped one), measured.

    python -m dflash_lab.tools.bench spec-decode [--quick] [--prompt-set {heldout,docstring,both}] [--eager-loop]

1. Measured (``measure.decoding``, tables by ``bench_fast_decode``): tokens/s of
   target-only greedy decoding, DFlash (both shipped drafters) and prompt lookup at
   each block size, at batch 1, 8 and 32, with CUDA graphs on and/or off, on the static
   path (``dflash_lab.spec_decode.fast.decoder``), on each prompt set of
   ``--prompt-set``: the held-out prompts (``assets.heldout_prompts``) and the
   docstring-first prompts (``assets.docstring_prompts``: a function's signature and
   docstring, the continuation its body), the same number of prompts, prompt length
   and new tokens for both; then where a step's time goes (draft, verify, context
   K/V, accept), on the held-out prompts.
2. The goal, per prompt set (``goal_check``): at batch 1, graphs on, DFlash at the
   largest block over target-only (>= 3x?), and over the best prompt lookup.
3. ``--eager-loop``: the paper's drafter, prompt lookup and target-only through
   ``speculative_generate`` (the eager teaching loop, transformers' forward and
   DynamicCache, ``measure.decoding.measure_eager_loop``) on 8 held-out prompts,
   under "eager_records"; without it the previous run's are carried over, marked
   as such ("eager_records_carried_over").

Writes benchmarks/spec_decode.{json,md}. Every record is in the one format of
``measure.decoding`` (``RECORD_KEYS``: backend, prompt_set, method, block_size,
batch, tokens_per_s, mean_acceptance_length, ...); "records" holds the static
path's (backend "static"), "eager_records" the eager loop's (backend "eager"), so
a reader of either list compares like with like. Records of the last run in the
output folder that this run does not re-measure (the other graphs setting, a
prompt set left out) are kept when the last run timed the same pair; a record
written before ``prompt_set`` existed is a held-out one, before ``backend`` a
static one; the eager loop's rows of the earlier format ("shipped_pair") read as
eager records (``eager_records_of``). "goal" is the held-out set's goal, "goals"
every set's; "prompt_sets" says how many prompts and new tokens each set's
records were measured with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..assets import docstring_prompts, heldout_prompts, load_pair, pair_fingerprint
from ..measure.decoding import (
    EXTRA_KEYS, PROMPT_SETS, RECORD_KEYS, measure_eager_loop, measure_fast_decoding, phase_breakdown, prompt_set_of,
    records_of, speedups,
)
from ..runtime import DOCSTRING_PROMPTS, HELDOUT_PROMPTS, REPO_ROOT, device_name, resolve_device
from .bench_common import OUT_HELP, pair_out_dir, write_results
from .bench_fast_decode import PROMPT_SET_TEXT, fast_markdown

# prompt set -> (its loader, its file)
PROMPT_SET_SOURCES = {"heldout": (heldout_prompts, HELDOUT_PROMPTS),
                      "docstring": (docstring_prompts, DOCSTRING_PROMPTS)}
PROMPT_LENGTH = 256  # every prompt is cut to its last PROMPT_LENGTH tokens

# ---------------------------------------------------------------------------
# Prompts, and the eager loop's records of the earlier format
# ---------------------------------------------------------------------------


def prompt_ids(tokenizer, prompt_set: str, n: int, max_tokens: int, device) -> list[torch.Tensor]:
    """The first n prompts of ``prompt_set`` ("heldout" or "docstring"), each cut to its last max_tokens tokens,
    (1, T) each."""
    load = PROMPT_SET_SOURCES[prompt_set][0]
    return [tokenizer(p["text"], return_tensors="pt")["input_ids"][:, -max_tokens:].to(device) for p in load()[:n]]


def held_out(tokenizer, n: int, max_tokens: int, device) -> list[torch.Tensor]:
    """The first n held-out prompts, each cut to its last max_tokens tokens, (1, T) each."""
    return prompt_ids(tokenizer, "heldout", n, max_tokens, device)


def eager_record_of_row(row: dict) -> dict:
    """A row of the eager loop's earlier format (under "shipped_pair": methods "target_only" with block_size
    None, "dflash_b16", "prompt_lookup_b16", ...) as a record of ``measure.decoding``'s format, no number
    changed: backend "eager", batch 1, held-out prompts (the only ones it timed), target-only at block 1."""
    if "backend" in row:
        return dict(row)
    method = row["method"] if row["method"] == "target_only" else row["method"].rsplit("_b", 1)[0]
    new = {"backend": "eager", "prompt_set": "heldout", "method": method,
           "block_size": 1 if method == "target_only" else row["block_size"], "batch": 1}
    keys = [k for k in (*RECORD_KEYS, *EXTRA_KEYS["eager"]) if k not in new and k in row]
    return {**new, **{k: row[k] for k in keys}}


def eager_records_of(result: dict) -> list[dict]:
    """A result's eager-loop records: its "eager_records", or its earlier "shipped_pair" rows converted."""
    return [eager_record_of_row(r) for r in result.get("eager_records") or result.get("shipped_pair") or []]


# ---------------------------------------------------------------------------
# The goal, the report and the command
# ---------------------------------------------------------------------------


def goal_check(records, block: int = 16, prompt_set: str = "heldout") -> dict | None:
    """The issue's goal at batch 1, block 16, graphs on, on one prompt set's records (a record without
    ``prompt_set`` is a held-out one): DFlash >= 3x target-only and ahead of prompt lookup."""
    get = {(r["method"], r["block_size"]): r for r in records_of(records, prompt_set)
           if r["batch"] == 1 and r["cuda_graphs"]}
    base, dflash = get.get(("target_only", 1)), get.get(("dflash", block))
    lookup = [r for (m, _), r in get.items() if m == "prompt_lookup"]
    if not (base and dflash and lookup):
        return None
    best = max(lookup, key=lambda r: r["tokens_per_s"])
    x = dflash["tokens_per_s"] / base["tokens_per_s"]
    return {"prompt_set": prompt_set, "block_size": block, "dflash_over_target_only": round(x, 3),
            "goal_3x_met": x >= 3, "best_prompt_lookup_block": best["block_size"],
            "dflash_over_best_prompt_lookup": round(dflash["tokens_per_s"] / best["tokens_per_s"], 3),
            "ahead_of_prompt_lookup": dflash["tokens_per_s"] > best["tokens_per_s"]}


def goals(result: dict) -> dict:
    """{prompt set: goal_check of its records}, held-out first, for every set with the records the goal needs;
    at the block of the result's (held-out) "goal", the run's largest block, else DFlash's largest in the records."""
    blocks = [r["block_size"] for r in result.get("records", []) if r["method"] == "dflash"]
    block = (result.get("goal") or {}).get("block_size") or max(blocks, default=16)
    out = {s: goal_check(result.get("records", []), block, s) for s in PROMPT_SETS}
    return {s: g for s, g in out.items() if g}


def _leader(goal: dict) -> str:
    x = goal["dflash_over_best_prompt_lookup"]
    return "DFlash ahead" if goal["ahead_of_prompt_lookup"] else "level" if x == 1 else "prompt lookup ahead"


def goal_lines(result: dict) -> list[str]:
    """The goal, one line per prompt set, computed from the records."""
    per_set = goals(result)
    if not per_set:
        return []
    block = next(iter(per_set.values()))["block_size"]
    lines = ["", f"**Goal (batch 1, block {block}, graphs on), per prompt set:**", ""]
    for s, goal in per_set.items():
        met = "met" if goal["goal_3x_met"] else "NOT met"
        lines.append(f"- {PROMPT_SET_TEXT[s][0]} prompts: DFlash / target-only = "
                     f"{goal['dflash_over_target_only']:.2f}x (goal >= 3x: {met}); DFlash / best prompt lookup "
                     f"(block {goal['best_prompt_lookup_block']}) = {goal['dflash_over_best_prompt_lookup']:.2f}x "
                     f"({_leader(goal)}).")
    return lines


def clock_lines(result: dict, dflash: dict, target: dict | None, d: dict, t: dict, goal: dict) -> list[str]:
    """The measured clock per generation at batch 1: whole-step graphs, then the prefill and the host's rest
    (split where the run timed the prefill on its own)."""
    if target is None or d.get("whole_step_ms") is None or t.get("whole_step_ms") is None:
        return ["", f"The measured ratio ({goal['dflash_over_target_only']:.2f}x) also counts each generation's "
                "prefill and the host's work between steps (not split out in this run)."]
    n = (result.get("prompt_sets") or {}).get("heldout", {}).get("n_prompts", result.get("n_prompts"))
    parts, texts = [], []
    for name, r, p in (("DFlash", dflash, d), ("target-only", target, t)):
        wall, steps = 1e3 * r["seconds"] / n, r["batch_steps"] / n
        rest = wall - steps * p["whole_step_ms"]
        parts.append((wall, steps, p, rest))
        head = f"{name} {wall:.2f} ms = {steps:.1f} steps x {p['whole_step_ms']:.3f} ms (one graph each) + "
        prefill = p.get("prefill_ms_per_generation")
        if prefill is None:
            texts.append(head + f"{rest:.2f} ms for the prefill and the host's work between steps")
        elif rest - prefill >= 0:
            texts.append(head + f"prefill {prefill:.2f} ms + {rest - prefill:.2f} ms on the host between steps")
        else:  # the loop's steps ran a little faster than their graph timed alone: no host time to see
            texts.append(head + f"prefill {prefill:.2f} ms, and {rest - prefill:.2f} ms left over: the loop's steps "
                         f"ran {(prefill - rest) / steps * 1e3:.0f} us faster each than their graph timed alone, "
                         "so no host time shows")
    (_, dsteps, dp, drest), (_, tsteps, tp, trest) = parts
    decode_only = (tsteps * tp["whole_step_ms"]) / (dsteps * dp["whole_step_ms"])
    return ["", f"The clock per generation (batch 1, held-out, {n} prompts): {'; '.join(texts)}. "
            f"Whole-step graphs alone give {decode_only:.2f}x; the rest ({drest:.2f} vs {trest:.2f} ms) is a larger "
            f"share of DFlash's shorter generation, hence the measured {goal['dflash_over_target_only']:.2f}x."]


def gap_lines(result: dict) -> list[str]:
    """Where the batch-1 speedup stops, from the phase graphs (held-out prompts): the decode-only bound and what
    the clock adds; then, for every other prompt set, the bound its own tau gives at those step times."""
    per_set, phases = goals(result), result.get("phases") or {}
    goal, d, t = per_set.get("heldout"), phases.get("dflash"), phases.get("target_only")
    records = result.get("records", [])
    rec = {(r["method"], r["block_size"]): r for r in records_of(records, "heldout")
           if r["batch"] == 1 and r["cuda_graphs"]}
    if not (goal and d and t and ("dflash", d["block_size"]) in rec):
        return []
    step = lambda p: sum(p[f"{k}_ms_per_step"] for k in ("draft", "verify", "append", "accept"))  # noqa: E731
    tau = rec[("dflash", d["block_size"])]["mean_acceptance_length"]
    sd, st = step(d), step(t)
    overhead = d["draft_ms_per_step"] + d["append_ms_per_step"] + d["accept_ms_per_step"]
    lines = ["", f"Why (held-out prompts; GPU time per step, phase graphs): a DFlash step takes {sd:.3f} ms for tau = "
                 f"{tau:.2f} tokens, a target-only step {st:.3f} ms for 1 token, so decoding alone is bounded by "
                 f"tau x {st:.3f} / {sd:.3f} = {tau * st / sd:.2f}x. At 8.8 M parameters every kernel is "
                 f"latency-bound: verifying {d['block_size']} tokens costs "
                 f"{d['verify_ms_per_step'] / t['verify_ms_per_step']:.2f}x one token's forward, and drafting + "
                 f"context K/V + acceptance add {overhead:.3f} ms ({overhead / st:.2f} of a target-only step). "
                 f"3x at this tau needs a DFlash step of at most {tau * st / 3:.3f} ms."]
    lines += clock_lines(result, rec[("dflash", d["block_size"])], rec.get(("target_only", 1)), d, t, goal)
    for s, other in per_set.items():
        r = next((r for r in records_of(records, s) if r["method"] == "dflash" and r["block_size"] == d["block_size"]
                  and r["batch"] == 1 and r["cuda_graphs"]), None)
        if s == "heldout" or r is None:
            continue
        tau_s = r["mean_acceptance_length"]
        lines += ["", f"On the {PROMPT_SET_TEXT[s][0]} prompts DFlash's tau is {tau_s:.2f} ({tau:.2f} held-out): "
                      f"at the held-out step times above that bounds decoding at {tau_s:.2f} x {st:.3f} / {sd:.3f} = "
                      f"{tau_s * st / sd:.2f}x; measured {other['dflash_over_target_only']:.2f}x."]
    return lines


def spec_decode_markdown(result: dict) -> str:
    lines = ["# Speculative decoding speed", ""]
    sets = result.get("prompt_sets") or {}  # older results: one (held-out) set, measured with the run's settings
    lines += fast_markdown(result.get("records", []), result.get("phases"),
                           n_prompts={s: sets.get(s, {}).get("n_prompts", result["n_prompts"]) for s in PROMPT_SETS},
                           max_new_tokens={s: sets.get(s, {}).get("max_new_tokens", result["max_new_tokens"])
                                           for s in PROMPT_SETS})
    if result.get("phases_note"):  # a known fault of one run's phase timings, said where the table is
        lines += ["", f"Note: {result['phases_note']}"]
    lines += goal_lines(result)
    lines += gap_lines(result)
    lines += eager_lines(eager_records_of(result), carried_over=result.get("eager_records_carried_over"))
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def eager_lines(records, *, carried_over=False) -> list[str]:
    """Markdown lines: the eager loop's records (backend "eager") as one table; none without records."""
    if not records:
        return []
    note = " (carried over from an earlier run)" if carried_over else ""
    r0 = records[0]
    lines = ["", f"## The eager teaching loop (`speculative_generate`){note}", "",
             f"{r0['device']}, {r0['dtype']}, batch {r0['batch']}, {PROMPT_SET_TEXT[prompt_set_of(r0)][0]} prompts, "
             "transformers' forward and DynamicCache, no graphs; block 1 = target-only, one token verified a step.",
             "", "| method | block | tokens/s | target forwards / token | tau | same output as target-only "
             "| ms / target forward | ms / drafter step |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        tau = r["mean_acceptance_length"] if r["mean_acceptance_length"] is not None else "-"
        lines.append(f"| {r['method']} | {r['block_size']} | {r['tokens_per_s']:.1f} | "
                     f"{r['target_forwards_per_token']:.3f} | {tau} | {r['outputs_equal_target_only']} | "
                     f"{r.get('target_ms_per_forward', '-')} | {r.get('drafter_ms_per_step', '-')} |")
    return lines


def _previous(out: Path, stem: str) -> dict:
    """The last run's results in ``out`` (empty when there is none)."""
    path = out / f"{stem}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def kept_records(last: dict, *, pair: dict, graphs, prompt_sets) -> tuple[list[dict], dict]:
    """The last run's records this run does not re-measure (a graphs setting not in ``graphs``, a prompt set
    not in ``prompt_sets``), when it timed the same ``pair``, each with its ``prompt_set`` (none: "heldout");
    and {prompt set: its settings} of the sets not re-measured that kept records (the last run's "prompt_sets",
    or for a result without them its n_prompts and max_new_tokens, which were the held-out set's)."""
    if last.get("pair") != pair:
        return [], {}
    kept = [dict(r, prompt_set=prompt_set_of(r)) for r in last.get("records", [])
            if r["cuda_graphs"] not in graphs or prompt_set_of(r) not in prompt_sets]
    settings = {}
    for s in PROMPT_SETS:
        older = {"n_prompts": last.get("n_prompts"), "max_new_tokens": last.get("max_new_tokens")}
        before = (last.get("prompt_sets") or {}).get(s) or (older if s == "heldout" else None)
        if s not in prompt_sets and before and records_of(kept, s):
            settings[s] = before
    return kept, settings


def spec_decode(args) -> int:
    """The `spec-decode` subcommand."""
    device = resolve_device(args.device, caller="bench spec-decode")
    blocks = args.block_sizes
    n_prompts = args.prompts or (8 if args.quick else 32)
    max_new = args.max_new_tokens or (32 if args.quick else 96)
    batches = args.batches or ([1, 4] if args.quick else [1, 8, 32])
    graphs = {"both": (True, False), "on": (True,), "off": (False,)}[args.graphs] if device.type == "cuda" else (False,)
    sets = PROMPT_SETS if args.prompt_set == "both" else (args.prompt_set,)
    print(f"spec-decode on {device_name(device)}: blocks {blocks}, batches {batches}, prompt sets {', '.join(sets)}, "
          f"{n_prompts} prompts each x {max_new} tokens", flush=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    stem = "spec_decode_quick" if args.quick else "spec_decode"
    out = pair_out_dir(args.out)
    flags = (" --quick" if args.quick else "") + (
        "" if args.prompt_set == "both" else f" --prompt-set {args.prompt_set}")
    result = {"n_prompts": n_prompts, "max_new_tokens": max_new, "records": [], "prompt_sets": {},
              "pair": pair_fingerprint(), "command": "python -m dflash_lab.tools.bench spec-decode" + flags}
    last = _previous(out, stem)
    same_pair = last.get("pair") == result["pair"]
    previous = eager_records_of(last) if same_pair else []  # the last run's eager-loop records
    kept, result["prompt_sets"] = kept_records(last, pair=result["pair"], graphs=graphs, prompt_sets=sets)

    def save():  # after every section: a timeout keeps what was measured
        return write_results(out, stem, result, spec_decode_markdown(result))

    target, drafters, tokenizer = load_pair(device)  # and the second drafter where the target in use has one
    measured = []
    for s in sets:  # every set with the same prompt count, prompt length and new tokens
        prompts = prompt_ids(tokenizer, s, n_prompts, PROMPT_LENGTH, device)
        result["prompt_sets"][s] = {"n_prompts": len(prompts), "max_new_tokens": max_new,
                                    "file": str(PROMPT_SET_SOURCES[s][1].relative_to(REPO_ROOT))}
        log(f"{PROMPT_SET_TEXT[s][0]} prompts ({len(prompts)}):")

        def on_record(rs):  # save after every configuration
            result.update(records=kept + measured + list(rs))
            save()

        measured += measure_fast_decoding(target, drafters, [p[0] for p in prompts], batches=batches,
                                          block_sizes=blocks, graphs=graphs, max_new_tokens=max_new, prompt_set=s,
                                          progress=log, on_record=on_record)
    records = sorted(kept + measured,
                     key=lambda r: (PROMPT_SETS.index(r["prompt_set"]), r["batch"], not r["cuda_graphs"]))
    result.update(records=records, speedups=speedups(records), goal=goal_check(records, max(blocks)))
    result["goals"] = goals(result)
    save()
    heldout = (prompt_ids(tokenizer, "heldout", n_prompts, PROMPT_LENGTH, device)
               if "heldout" in sets or args.eager_loop else [])
    if "heldout" in sets:  # the phases: held-out prompts only
        result["phases"] = phase_breakdown(target, drafters, [p[0] for p in heldout[:8]], block_size=max(blocks),
                                           max_new_tokens=max_new)
    elif same_pair and last.get("phases"):
        result["phases"] = last["phases"]
    save()
    if args.eager_loop:  # the paper's drafter only: the eager loop is slow on a GPU
        result["eager_records"] = measure_eager_loop(
            target, {"paper": drafters["paper"]}, heldout[:8], block_sizes=blocks, max_new_tokens=max_new,
            prompt_set="heldout", progress=log, on_record=lambda rs: (result.update(eager_records=list(rs)), save()))
    elif previous:
        result.update(eager_records=previous, eager_records_carried_over=True)
    paths = save()
    print(spec_decode_markdown(result))
    print("wrote", *paths)
    return 0


def add_command(subparsers) -> None:
    p = subparsers.add_parser("spec-decode", help="tokens/s of the shipped pair (graphed, batched) on the held-out and "
                                                  "docstring-first prompts, projected to Laguna-XS.2")
    p.add_argument("--quick", action="store_true", help="few prompts, short generations")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 8 32; --quick: 1 4)")
    p.add_argument("--prompts", type=int, help="prompts per prompt set (default 32; --quick: 8)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 96; --quick: 32)")
    p.add_argument("--prompt-set", choices=["heldout", "docstring", "both"], default="both",
                   help="which prompts to time: the held-out ones (checkpoints/heldout_prompts.json), the "
                        "docstring-first ones (checkpoints/docstring_prompts.json) or both, each with --prompts "
                        "prompts cut to their last 256 tokens (default both); the other set's rows are kept from the "
                        "last run of the same pair. The phases and --eager-loop use the held-out prompts")
    p.add_argument("--graphs", choices=["both", "on", "off"], default="both",
                   help="CUDA graphs on, off or both (GPU); rows of the other setting are kept from the last run")
    p.add_argument("--eager-loop", action="store_true",
                   help="also time speculative_generate on held-out prompts (slow on a GPU)")
    p.add_argument("--device", help="default: $DFLASH_LAB_DEVICE, else cuda when present")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.set_defaults(func=spec_decode)
