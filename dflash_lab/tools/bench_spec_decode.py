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
3. ``--eager-loop``: the same pair through ``speculative_generate`` (the eager
   teaching loop, transformers' forward and DynamicCache) on held-out prompts,
   under "shipped_pair" (chapter 3 reads them); without it the previous run's rows
   are carried over, marked as such.

Writes benchmarks/spec_decode.{json,md}; the records under "records" carry
prompt_set ("heldout" or "docstring"), method, block_size, batch, cuda_graphs,
tokens_per_s, mean_acceptance_length and device. Records of the last run in the
output folder that this run does not re-measure (the other graphs setting, a
prompt set left out) are kept when the last run timed the same pair; a record
written before ``prompt_set`` existed is a held-out one. "goal" is the held-out
set's goal, "goals" every set's; "prompt_sets" says how many prompts and new
tokens each set's records were measured with.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..assets import docstring_prompts, heldout_prompts, load_pair, pair_fingerprint
from ..runtime import (
    DOCSTRING_PROMPTS, HELDOUT_PROMPTS, REPO_ROOT, device_name, resolve_device, synchronized_time,
)
from ..spec_decode import SpecDecodeStats, speculative_generate
from .bench_common import OUT_HELP, pair_out_dir, write_results
from ..measure.decoding import PROMPT_SETS, measure_fast_decoding, phase_breakdown, prompt_set_of, records_of, speedups
from .bench_fast_decode import PROMPT_SET_TEXT, fast_markdown

# prompt set -> (its loader, its file)
PROMPT_SET_SOURCES = {"heldout": (heldout_prompts, HELDOUT_PROMPTS), "docstring": (docstring_prompts, DOCSTRING_PROMPTS)}
PROMPT_LENGTH = 256  # every prompt is cut to its last PROMPT_LENGTH tokens

# ---------------------------------------------------------------------------
# The shipped pair through the eager loop (speculative_generate)
# ---------------------------------------------------------------------------


def prompt_ids(tokenizer, prompt_set: str, n: int, max_tokens: int, device) -> list[torch.Tensor]:
    """The first n prompts of ``prompt_set`` ("heldout" or "docstring"), each cut to its last max_tokens tokens,
    (1, T) each."""
    load = PROMPT_SET_SOURCES[prompt_set][0]
    return [tokenizer(p["text"], return_tensors="pt")["input_ids"][:, -max_tokens:].to(device) for p in load()[:n]]


def held_out(tokenizer, n: int, max_tokens: int, device) -> list[torch.Tensor]:
    """The first n held-out prompts, each cut to its last max_tokens tokens, (1, T) each."""
    return prompt_ids(tokenizer, "heldout", n, max_tokens, device)


def measure_eager_loop(target, drafter, prompts, *, device, max_new_tokens: int, block_sizes, progress=print,
                       on_row=None) -> list[dict]:
    """tokens/s and target forwards per token through ``speculative_generate``: target only, DFlash at
    each block size, prompt lookup.

    on_row(rows), if given, runs after each method (partial results survive a timeout).
    """
    runs = [("target_only", None, 2)] + [(f"dflash_b{b}", drafter, b) for b in block_sizes] + \
           [(f"prompt_lookup_b{b}", "ngram", b) for b in block_sizes]
    for proposer, block in ((None, 2), (drafter, max(block_sizes)), ("ngram", max(block_sizes))):
        speculative_generate(target, proposer, prompts[0], max_new_tokens=max_new_tokens, block_size=block)  # warm-up
    reference_outputs, rows = None, []
    for name, proposer, block in runs:
        stats, outputs, wall = SpecDecodeStats(), [], 0.0
        for prompt in tqdm(prompts, desc=name, leave=False, disable=None):
            t0 = synchronized_time(device)
            res = speculative_generate(target, proposer, prompt, max_new_tokens=max_new_tokens, block_size=block)
            wall += synchronized_time(device) - t0
            stats = stats + res.stats
            outputs.append(res.output_ids[0, prompt.shape[1]:].tolist())
        if reference_outputs is None:
            reference_outputs = outputs
        same = sum(a == b for a, b in zip(outputs, reference_outputs))
        row = {
            "method": name, "block_size": None if name == "target_only" else block,
            "tokens": stats.num_generated_tokens, "seconds": round(wall, 3),
            "tokens_per_s": round(stats.num_generated_tokens / wall, 1),
            "target_forwards_per_token": round(stats.target_forwards_per_token, 4),
            "mean_acceptance_length": None if name == "target_only" else round(stats.mean_acceptance_length, 4),
            "per_position_acceptance_rate": None if name == "target_only" else [round(r, 4) for r in stats.per_position_acceptance_rate],
            "outputs_equal_target_only": f"{same}/{len(outputs)}",
            # where the time goes: eager target forwards vs drafter steps (forward + context K/V append)
            "target_ms_per_forward": round(1e3 * stats.target_time_s / max(stats.num_target_forwards, 1), 3),
            "drafter_ms_per_step": round(1e3 * stats.drafter_time_s / max(stats.num_target_forwards - len(prompts), 1), 3),
            "device": device_name(device), "dtype": str(next(target.parameters()).dtype).replace("torch.", ""),
        }
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        progress(f"  {name:20s} {row['tokens_per_s']:8.1f} tok/s  fwd/token {row['target_forwards_per_token']:.3f}  "
                 f"tau {row['mean_acceptance_length']}  same as target-only {row['outputs_equal_target_only']}")
    return rows


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
    return {"prompt_set": prompt_set, "block_size": block, "dflash_over_target_only": round(x, 3), "goal_3x_met": x >= 3,
            "best_prompt_lookup_block": best["block_size"],
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
        lines.append(f"- {PROMPT_SET_TEXT[s][0]} prompts: DFlash / target-only = {goal['dflash_over_target_only']:.2f}x "
                     f"(goal >= 3x: {'met' if goal['goal_3x_met'] else 'NOT met'}); DFlash / best prompt lookup "
                     f"(block {goal['best_prompt_lookup_block']}) = {goal['dflash_over_best_prompt_lookup']:.2f}x "
                     f"({_leader(goal)}).")
    return lines


def clock_lines(result: dict, dflash: dict, target: dict | None, d: dict, t: dict, goal: dict) -> list[str]:
    """The measured clock per generation at batch 1: whole-step graphs, then the prefill and the host's rest
    (split where the run timed the prefill on its own)."""
    if target is None or d.get("whole_step_ms") is None or t.get("whole_step_ms") is None:
        return ["", f"The measured ratio ({goal['dflash_over_target_only']:.2f}x) also counts each generation's prefill "
                "and the host's work between steps (not split out in this run)."]
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
            texts.append(head + f"prefill {prefill:.2f} ms, and {rest - prefill:.2f} ms left over: the loop's steps ran "
                         f"{(prefill - rest) / steps * 1e3:.0f} us faster each than their graph timed alone, so no host time shows")
    (_, dsteps, dp, drest), (_, tsteps, tp, trest) = parts
    decode_only = (tsteps * tp["whole_step_ms"]) / (dsteps * dp["whole_step_ms"])
    return ["", f"The clock per generation (batch 1, held-out, {n} prompts): {'; '.join(texts)}. Whole-step graphs alone "
            f"give {decode_only:.2f}x; the rest ({drest:.2f} vs {trest:.2f} ms) is a larger share of DFlash's "
            f"shorter generation, hence the measured {goal['dflash_over_target_only']:.2f}x."]


def gap_lines(result: dict) -> list[str]:
    """Where the batch-1 speedup stops, from the phase graphs (held-out prompts): the decode-only bound and what
    the clock adds; then, for every other prompt set, the bound its own tau gives at those step times."""
    per_set, phases = goals(result), result.get("phases") or {}
    goal, d, t = per_set.get("heldout"), phases.get("dflash"), phases.get("target_only")
    records = result.get("records", [])
    rec = {(r["method"], r["block_size"]): r for r in records_of(records, "heldout") if r["batch"] == 1 and r["cuda_graphs"]}
    if not (goal and d and t and ("dflash", d["block_size"]) in rec):
        return []
    step = lambda p: sum(p[f"{k}_ms_per_step"] for k in ("draft", "verify", "append", "accept"))  # noqa: E731
    tau = rec[("dflash", d["block_size"])]["mean_acceptance_length"]
    sd, st = step(d), step(t)
    overhead = d["draft_ms_per_step"] + d["append_ms_per_step"] + d["accept_ms_per_step"]
    lines = ["", f"Why (held-out prompts; GPU time per step, phase graphs): a DFlash step takes {sd:.3f} ms for tau = "
                f"{tau:.2f} tokens, a target-only step {st:.3f} ms for 1 token, so decoding alone is bounded by tau x {st:.3f} / {sd:.3f} = "
                f"{tau * st / sd:.2f}x. At 8.8 M parameters every kernel is latency-bound: verifying {d['block_size']} tokens "
                f"costs {d['verify_ms_per_step'] / t['verify_ms_per_step']:.2f}x one token's forward, and drafting + context "
                f"K/V + acceptance add {overhead:.3f} ms ({overhead / st:.2f} of a target-only step). 3x at this tau needs a "
                f"DFlash step of at most {tau * st / 3:.3f} ms."]
    lines += clock_lines(result, rec[("dflash", d["block_size"])], rec.get(("target_only", 1)), d, t, goal)
    for s, other in per_set.items():
        r = next((r for r in records_of(records, s) if r["method"] == "dflash" and r["block_size"] == d["block_size"]
                  and r["batch"] == 1 and r["cuda_graphs"]), None)
        if s == "heldout" or r is None:
            continue
        tau_s = r["mean_acceptance_length"]
        lines += ["", f"On the {PROMPT_SET_TEXT[s][0]} prompts DFlash's tau is {tau_s:.2f} ({tau:.2f} held-out): at the "
                      f"held-out step times above that bounds decoding at {tau_s:.2f} x {st:.3f} / {sd:.3f} = "
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
    eager = result.get("shipped_pair")  # the eager loop's rows (chapter 3 reads them under this key)
    if eager:
        note = " (carried over from an earlier run)" if result.get("shipped_pair_carried_over") else ""
        lines += ["", f"## The eager teaching loop (`speculative_generate`){note}", "",
                  f"{eager[0]['device']}, {eager[0]['dtype']}, batch 1, transformers' forward and DynamicCache, no graphs.", "",
                  "| method | block | tokens/s | target forwards / token | tau | same output as target-only "
                  "| ms / target forward | ms / drafter step |", "|---|---|---|---|---|---|---|---|"]
        for r in eager:
            tau = r["mean_acceptance_length"] if r["mean_acceptance_length"] is not None else "-"
            lines.append(f"| {r['method']} | {r['block_size'] or '-'} | {r['tokens_per_s']:.1f} | "
                         f"{r['target_forwards_per_token']:.3f} | {tau} | {r['outputs_equal_target_only']} | "
                         f"{r.get('target_ms_per_forward', '-')} | {r.get('drafter_ms_per_step', '-')} |")
    lines += ["", f"Command: `{result['command']}`"]
    return "\n".join(lines) + "\n"


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
        before = (last.get("prompt_sets") or {}).get(s) or (
            {"n_prompts": last.get("n_prompts"), "max_new_tokens": last.get("max_new_tokens")} if s == "heldout" else None)
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
    flags = (" --quick" if args.quick else "") + ("" if args.prompt_set == "both" else f" --prompt-set {args.prompt_set}")
    result = {"n_prompts": n_prompts, "max_new_tokens": max_new, "records": [], "prompt_sets": {},
              "pair": pair_fingerprint(), "command": "python -m dflash_lab.tools.bench spec-decode" + flags}
    last = _previous(out, stem)
    previous = last.get("shipped_pair") or []  # eager-loop rows (the key chapter 3 reads)
    same_pair = last.get("pair") == result["pair"]
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

        def on_record(rs, s=s):  # tag and save after every configuration
            for r in rs:
                r["prompt_set"] = s
            result.update(records=kept + measured + list(rs))
            save()

        measured += measure_fast_decoding(target, drafters, [p[0] for p in prompts], batches=batches, block_sizes=blocks,
                                          graphs=graphs, max_new_tokens=max_new, progress=log, on_record=on_record)
        for r in measured:
            r.setdefault("prompt_set", s)
    records = sorted(kept + measured, key=lambda r: (PROMPT_SETS.index(r["prompt_set"]), r["batch"], not r["cuda_graphs"]))
    result.update(records=records, speedups=speedups(records), goal=goal_check(records, max(blocks)))
    result["goals"] = goals(result)
    save()
    heldout = prompt_ids(tokenizer, "heldout", n_prompts, PROMPT_LENGTH, device) if "heldout" in sets or args.eager_loop else []
    if "heldout" in sets:  # the phases: held-out prompts only
        result["phases"] = phase_breakdown(target, drafters, [p[0] for p in heldout[:8]], block_size=max(blocks),
                                           max_new_tokens=max_new)
    elif same_pair and last.get("phases"):
        result["phases"] = last["phases"]
    save()
    if args.eager_loop:
        result["shipped_pair"] = measure_eager_loop(
            target, drafters["paper"], heldout[:8], device=device, max_new_tokens=max_new, block_sizes=blocks, progress=log,
            on_row=lambda rows: (result.update(shipped_pair=list(rows)), save()))
    elif previous:
        result.update(shipped_pair=previous, shipped_pair_carried_over=True)
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
                        "docstring-first ones (checkpoints/docstring_prompts.json) or both, each with --prompts prompts "
                        "cut to their last 256 tokens (default both); the other set's rows are kept from the last run "
                        "of the same pair. The phases and --eager-loop use the held-out prompts")
    p.add_argument("--graphs", choices=["both", "on", "off"], default="both",
                   help="CUDA graphs on, off or both (GPU); rows of the other setting are kept from the last run")
    p.add_argument("--eager-loop", action="store_true",
                   help="also time speculative_generate on held-out prompts (slow on a GPU)")
    p.add_argument("--device", help="default: $DFLASH_LAB_DEVICE, else cuda when present")
    p.add_argument("--out", default=None, help=OUT_HELP)
    p.set_defaults(func=spec_decode)
