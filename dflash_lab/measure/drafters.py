"""The two shipped drafters compared as a result: tau per prompt set and block size, with bootstrap intervals.

Each (prompt set, drafter) pass is ``train.evaluate_acceptance`` (the decoder's exact counters, from the
target's greedy continuation), kept prompt by prompt. A bootstrap over prompts resamples whole prompts
(the unit that varies: one prompt's drafts are not independent of each other) and recomputes

    tau = 1 + sum(accepted tokens) / sum(drafts)

over the resample, as vLLM's counters would over those prompts. The difference between the drafters is
paired: both are resampled on the same prompts, so what the prompts share cancels.
"""

from __future__ import annotations

import numpy as np

from ..config import DEFAULT_BLOCK_SIZE
from ..drafter import with_window
from ..spec_decode import generate_on_prompts
from ..train.evaluate import evaluate_acceptance

RESAMPLES = 4000
LEVEL = 0.95


def tau_of(counts: np.ndarray) -> float:
    """Mean acceptance length of [drafts, accepted] rows (one row per prompt)."""
    drafts, accepted = counts.sum(0)
    return float("nan") if drafts == 0 else 1.0 + accepted / drafts


def _resampled_taus(counts: np.ndarray, index: np.ndarray) -> np.ndarray:
    summed = counts[index].sum(1)  # (resamples, 2)
    with np.errstate(invalid="ignore", divide="ignore"):
        return 1.0 + summed[:, 1] / summed[:, 0]


def _check_counts(counts, name: str = "counts") -> np.ndarray:
    counts = np.asarray(counts, dtype=np.float64)
    if counts.ndim != 2 or counts.shape[1] != 2 or len(counts) == 0:
        raise ValueError(f"{name} must be a non-empty list of [drafts, accepted] per prompt, got shape {counts.shape}")
    return counts


def bootstrap_index(n: int, *, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """(resamples, n) prompt indices drawn with replacement: share one between drafters to pair them."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_tau(counts, *, index: np.ndarray | None = None, level: float = LEVEL) -> dict:
    """tau and its percentile interval over prompts: {"tau", "low", "high"}."""
    counts = _check_counts(counts)
    index = bootstrap_index(len(counts)) if index is None else index
    low, high = np.nanpercentile(_resampled_taus(counts, index), [50 * (1 - level), 50 * (1 + level)])
    return {"tau": tau_of(counts), "low": float(low), "high": float(high)}


def paired_difference(counts_a, counts_b, *, index: np.ndarray | None = None, level: float = LEVEL) -> dict:
    """tau(a) - tau(b) on the same prompts, its interval, and the share of resamples where a is ahead."""
    a, b = _check_counts(counts_a, "counts_a"), _check_counts(counts_b, "counts_b")
    if len(a) != len(b):
        raise ValueError(f"a paired difference needs the same prompts: {len(a)} vs {len(b)} rows")
    index = bootstrap_index(len(a)) if index is None else index
    diff = _resampled_taus(a, index) - _resampled_taus(b, index)
    low, high = np.nanpercentile(diff, [50 * (1 - level), 50 * (1 + level)])
    return {"difference": tau_of(a) - tau_of(b), "low": float(low), "high": float(high),
            "share_a_ahead": float(np.mean(diff > 0))}


def compare_drafters(target, drafters: dict, tokenizer, prompt_sets: dict, *, block_sizes=(4, 8, 16),
                     max_new_tokens: int = 64, prompt_lookup_block: int | None = DEFAULT_BLOCK_SIZE,
                     progress=print) -> dict:
    """Every drafter on every prompt set: per-prompt counts, tau with intervals, paired differences.

    drafters: name -> drafter (the first two are compared); prompt_sets: name -> prompt dicts with ``text``.
    prompt_lookup_block: also run prompt lookup (n-gram) at this block, the drafter-free baseline.
    """
    names = list(drafters)
    result = {"block_sizes": list(block_sizes), "max_new_tokens": max_new_tokens, "level": LEVEL,
              "resamples": RESAMPLES, "sets": {}}
    for set_name, prompts in prompt_sets.items():
        index = bootstrap_index(len(prompts))
        entry = {"num_prompts": len(prompts), "drafters": {}, "differences": {}}
        for name, drafter in drafters.items():
            progress(f"{set_name}: {name} drafter, blocks {list(block_sizes)} on {len(prompts)} prompts")
            evs = evaluate_acceptance(target, drafter, tokenizer, prompts, block_sizes=block_sizes,
                                      max_new_tokens=max_new_tokens)
            entry["drafters"][name] = {
                str(bs): {**bootstrap_tau(ev.per_prompt_counts(), index=index), "record": ev.record()}
                for bs, ev in evs.items()}
        if len(names) >= 2:
            a, b = names[:2]
            entry["differences"][f"{a} - {b}"] = {
                str(bs): paired_difference(entry["drafters"][a][str(bs)]["record"]["per_prompt_drafts_accepted"],
                                           entry["drafters"][b][str(bs)]["record"]["per_prompt_drafts_accepted"],
                                           index=index)
                for bs in block_sizes}
        if prompt_lookup_block:
            progress(f"{set_name}: prompt lookup, block {prompt_lookup_block}")
            ids = [tokenizer.encode(p["text"], add_special_tokens=False) for p in prompts]
            _, runs = generate_on_prompts(target, "ngram", ids, max_new_tokens=max_new_tokens,
                                          block_size=prompt_lookup_block, progress=False)
            counts = [[r.stats.num_drafts, r.stats.num_accepted_tokens] for r in runs]
            entry["prompt_lookup"] = {str(prompt_lookup_block): {**bootstrap_tau(counts, index=index),
                                                                 "per_prompt_drafts_accepted": counts}}
        result["sets"][set_name] = entry
    return result


def window_study(target, drafters: dict, tokenizer, prompts, *, cut_tokens: int = 64,
                 block_size: int = DEFAULT_BLOCK_SIZE,
                 max_new_tokens: int = 64, progress=print) -> dict:
    """Where a sliding drafter loses on long prompts: every drafter on the full prompts and on their last
    ``cut_tokens`` tokens, and each sliding drafter again on the full prompts with its window removed.

    Cutting a prompt changes the target's continuation too (it sees less), so the cut rows are a
    different task; the widened row keeps the task and changes only what the drafter may attend to.
    """
    full = [{"input_ids": tokenizer.encode(p["text"], add_special_tokens=False)} for p in prompts]
    cut = [{"input_ids": p["input_ids"][-cut_tokens:]} for p in full]
    lengths = [len(p["input_ids"]) for p in full]
    index = bootstrap_index(len(prompts))
    runs = {}
    for name, drafter in drafters.items():
        variants = {"full prompts": (drafter, full), f"last {cut_tokens} tokens": (drafter, cut)}
        if drafter.window is not None:
            variants[f"full prompts, window {drafter.window} removed"] = (with_window(drafter, None), full)
        for label, (d, ps) in variants.items():
            progress(f"window study: {name}, {label}")
            ev = evaluate_acceptance(target, d, tokenizer, ps, block_sizes=(block_size,),
                                     max_new_tokens=max_new_tokens)[block_size]
            runs[f"{name}: {label}"] = {**bootstrap_tau(ev.per_prompt_counts(), index=index),
                                        "per_prompt_drafts_accepted": ev.per_prompt_counts()}
    return {"block_size": block_size, "max_new_tokens": max_new_tokens, "cut_tokens": cut_tokens,
            "num_prompts": len(prompts), "prompt_tokens": {"min": min(lengths), "max": max(lengths),
                                                            "mean": sum(lengths) / len(lengths)},
            "runs": runs}


def window_drops(study: dict) -> dict:
    """Paired over prompts: each drafter's tau on full prompts minus on their cut tails, and how much more
    the sliding drafter drops than the full-attention one (the same resamples throughout)."""
    runs, cut = study["runs"], f"last {study['cut_tokens']} tokens"
    counts = {name: np.asarray(r["per_prompt_drafts_accepted"], dtype=np.float64) for name, r in runs.items()}
    index = bootstrap_index(study["num_prompts"])
    drafters = [name.split(": ")[0] for name in runs if name.endswith(": full prompts")]
    out, drop = {}, {}
    for d in drafters:
        full, tail = counts[f"{d}: full prompts"], counts[f"{d}: {cut}"]
        out[f"{d}: full - {cut}"] = paired_difference(full, tail, index=index)
        drop[d] = _resampled_taus(full, index) - _resampled_taus(tail, index)
    if len(drafters) == 2:
        a, b = drafters
        diff = drop[b] - drop[a]
        low, high = np.nanpercentile(diff, [50 * (1 - LEVEL), 50 * (1 + LEVEL)])
        out[f"{b}'s drop - {a}'s drop"] = {"difference": out[f"{b}: full - {cut}"]["difference"]
                                           - out[f"{a}: full - {cut}"]["difference"], "low": float(low),
                                           "high": float(high), "share_a_ahead": float(np.mean(diff > 0))}
    return out


def window_markdown(study: dict) -> str:
    t = study["prompt_tokens"]
    lines = [f"### Long prompts and the window (block {study['block_size']}, {study['num_prompts']} held-out "
             f"prompts of "
             f"{t['min']}-{t['max']} tokens, {study['max_new_tokens']} new tokens)", "",
             "| drafter: prompts | τ | 95 % interval |", "|---|---|---|"]
    lines += [f"| {name} | {r['tau']:.2f} | [{r['low']:.2f}, {r['high']:.2f}] |" for name, r in study["runs"].items()]
    lines += ["", "Paired over prompts (the same bootstrap resamples):", "", "| difference | τ | 95 % interval |",
              "|---|---|---|"]
    lines += [f"| {name} | {d['difference']:+.2f} | [{d['low']:+.2f}, {d['high']:+.2f}] |"
              for name, d in window_drops(study).items()]
    return "\n".join(lines) + "\n"


def markdown(result: dict, repetition: dict | None = None) -> str:
    """The comparison as tables: tau [interval] per drafter and block, then the paired differences.

    repetition: ``benchmarks/repetition.json`` of the same pair; each set then also says how many of its
    continuations are repetitive and each proposer's τ on the repetitive and other ones (block 16).
    """
    pct = round(100 * result["level"])
    lines = []
    for set_name, entry in result["sets"].items():
        names = list(entry["drafters"])
        blocks = result["block_sizes"]
        lines += [f"### {set_name} ({entry['num_prompts']} prompts, {result['max_new_tokens']} new tokens, greedy)", "",
                  "| | " + " | ".join(f"τ block {bs}" for bs in blocks) + " |", "|---|" + "---|" * len(blocks)]
        for name in names:
            cells = [entry["drafters"][name][str(bs)] for bs in blocks]
            lines.append(f"| {name} | " + " | ".join(f"{c['tau']:.2f} [{c['low']:.2f}, {c['high']:.2f}]"
                                                     for c in cells) + " |")
        for pair, diffs in entry["differences"].items():
            lines.append(f"| {pair} (paired) | " + " | ".join(
                f"{d['difference']:+.2f} [{d['low']:+.2f}, {d['high']:+.2f}]"
                for d in (diffs[str(bs)] for bs in blocks))
                + " |")
        for bs, c in entry.get("prompt_lookup", {}).items():
            lines.append(f"| prompt lookup (block {bs}) | " + " | ".join(
                f"{c['tau']:.2f} [{c['low']:.2f}, {c['high']:.2f}]" if str(b) == bs else "" for b in blocks) + " |")
        lines.append("")
        split = (repetition or {}).get("sets", {}).get(set_name)
        if split:
            by = {**split["drafters"], "prompt lookup": split["prompt_lookup"]}
            first = next(iter(split["drafters"].values()))["16"]
            lines += [f"Repetition (`benchmarks/repetition.md`): {first['num_repetitive']} of {first['num_prompts']} "
                      f"continuations repetitive; τ at block 16 on those / on the others: " + ", ".join(
                          f"{name} {r['16']['tau_repetitive']:.2f} / {r['16']['tau_non_repetitive']:.2f}"
                          for name, r in by.items() if r.get("16") and r["16"]["tau_non_repetitive"] is not None)
                      + ".", ""]
    lines.append(f"Intervals: {pct} % percentile bootstrap over prompts ({result['resamples']} resamples, "
                 "the same resamples for every row of a set, so differences are paired).")
    return "\n".join(lines) + "\n"
