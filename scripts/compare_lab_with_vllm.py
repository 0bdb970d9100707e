"""The lab against vLLM's own engine on the shipped pair: a table of counters, written to benchmarks/.

Greedy, float32, on the CPU: the first 8 held-out prompts (last 64 tokens each,
as token ids), 64 new tokens, DFlash with 15 and 7 speculative tokens for each
shipped drafter (the paper's: full attention, non-causal; the Poolside-style one:
sliding window 64, causal) and prompt lookup (vLLM's ``ngram``, n 2..5) with 7.
For each: drafts, draft tokens, accepted tokens per position and tau, from vLLM's
Prometheus counters and from the lab's ``generate_on_prompts``; whether outputs
and every counter agree. One vLLM process runs every engine (one per row).

    .venv/bin/python scripts/compare_lab_with_vllm.py        (about 3 minutes on 2 cores)

Writes benchmarks/vllm_engine.json and benchmarks/vllm_engine.md. The test
tests/test_vllm_engine.py asserts the same equalities; this script records them.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch

from dflash_lab.assets import DRAFTERS, heldout_prompts, load_default_pair, pair_fingerprint
from dflash_lab.runtime import BENCHMARKS_DIR, REPO_ROOT, write_json
from dflash_lab.spec_decode import generate_on_prompts
from dflash_lab.vllm_engine import EngineRun, run_offline

NUM_PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 64, 64
CASES = (("paper", "dflash", 15), ("paper", "dflash", 7), ("poolside", "dflash", 15), ("poolside", "dflash", 7),
         (None, "ngram", 7))  # (shipped drafter, method, speculative tokens)


def relative(path):
    """A checkpoint directory as the record names it: inside the repository relative to it, else absolute."""
    if path is None:
        return None
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def row(stats) -> dict:
    return {"drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens,
            "accepted_per_position": list(stats.num_accepted_tokens_per_pos),
            "tau": round(stats.mean_acceptance_length, 4)}


def main() -> int:
    torch.set_num_threads(1)
    target, paper, tokenizer = load_default_pair(device="cpu")
    drafters = {"paper": paper, "poolside": load_default_pair(device="cpu", drafter="poolside")[1]}
    prompts = [tokenizer(p["text"])["input_ids"][-PROMPT_TOKENS:] for p in heldout_prompts()[:NUM_PROMPTS]]
    runs = [EngineRun(f"{d or ''}{m}{n}", method=m, num_speculative_tokens=n,
                      drafter=DRAFTERS[d] if d not in (None, "paper") else None) for d, m, n in CASES]
    engine = run_offline(prompts, runs, max_new_tokens=NEW_TOKENS)
    records = []
    for (name, method, n), run in zip(CASES, runs):
        lab_stats, results = generate_on_prompts(target, drafters[name] if method == "dflash" else "ngram", prompts,
                                                 block_size=n + 1, max_new_tokens=NEW_TOKENS, progress=False)
        vllm_result = engine[run.name]
        lab, vllm = row(lab_stats), row(vllm_result.stats)
        records.append({"drafter": name, "method": method, "num_speculative_tokens": n, "lab": lab, "vllm": vllm,
                        "drafter_dir": relative(vllm_result.drafter),
                        "hybrid_kv_cache_manager_disabled": vllm_result.hybrid_manager_disabled,
                        "engine_start_s": vllm_result.engine_start_s, "generate_s": vllm_result.generate_s,
                        "outputs_equal": vllm_result.outputs == [r.new_token_ids for r in results],
                        "counters_equal": lab == vllm})
    first = engine[runs[0].name]  # what the runner reports is the same for every run of one call
    meta = {"what": __doc__.splitlines()[0], "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
            "vllm": first.vllm_version, "prompts": NUM_PROMPTS, "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": NEW_TOKENS, "dtype": "float32", "device": "cpu",
            "shim": first.shim, "pair": pair_fingerprint()}
    write_json(BENCHMARKS_DIR / "vllm_engine.json", {"meta": meta, "records": records})
    lines = [f"# The lab against vLLM {meta['vllm']}'s engine (CPU, float32, greedy)", "",
             f"{NUM_PROMPTS} held-out prompts x {NEW_TOKENS} new tokens; written by scripts/compare_lab_with_vllm.py "
             f"on {meta['date']}.", "",
             "Drafters: `paper` = `checkpoints/laguna-tiny-code-dflash` (full attention, non-causal), `poolside` = "
             "`checkpoints/laguna-tiny-code-dflash-poolside` (sliding window 64, causal). vLLM ran with its defaults "
             "(hybrid KV-cache manager on) for: "
             f"{', '.join(sorted({r['drafter'] for r in records if r['drafter'] and not r['hybrid_kv_cache_manager_disabled']})) or 'none'}"
             "; with `--disable-hybrid-kv-cache-manager` (a split drafter's way into one KV-cache group) for: "
             f"{', '.join(sorted({r['drafter'] for r in records if r['hybrid_kv_cache_manager_disabled']})) or 'none'}.",
             "",
             "| method | drafter | k | side | drafts | draft tokens | accepted | tau | accepted per position | equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        for side in ("lab", "vllm"):
            s = r[side]
            lines.append(f"| {r['method']} | {r['drafter'] or '-'} | {r['num_speculative_tokens']} | {side} "
                         f"| {s['drafts']} | {s['draft_tokens']} "
                         f"| {s['accepted']} | {s['tau']:.3f} | {' '.join(map(str, s['accepted_per_position']))} "
                         f"| {'outputs + counters' if r['outputs_equal'] and r['counters_equal'] else 'NO'} |")
    (BENCHMARKS_DIR / "vllm_engine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["outputs_equal"] and r["counters_equal"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
