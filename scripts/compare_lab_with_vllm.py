"""The lab against vLLM's own engine on the shipped pair: a table of counters, written to benchmarks/.

Greedy, float32, on the CPU: the first 8 held-out prompts (last 64 tokens each,
as token ids), 64 new tokens, DFlash with 15 and 7 speculative tokens and
prompt lookup (vLLM's ``ngram``, n 2..5) with 7. For each: drafts, draft tokens,
accepted tokens per position and tau, from vLLM's Prometheus counters and from
the lab's ``generate_on_prompts``; whether outputs and every counter agree.

    .venv/bin/python scripts/compare_lab_with_vllm.py        (about 2 minutes on 2 cores)

Writes benchmarks/vllm_engine.json and benchmarks/vllm_engine.md. The test
tests/test_vllm_engine.py asserts the same equalities; this script records them.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch

from dflash_lab.assets import heldout_prompts, load_default_pair
from dflash_lab.runtime import BENCHMARKS_DIR, write_json
from dflash_lab.spec_decode import generate_on_prompts
from dflash_lab.vllm_engine import EngineRun, run_offline

NUM_PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 64, 64
CASES = (("dflash", 15), ("dflash", 7), ("ngram", 7))


def row(stats) -> dict:
    return {"drafts": stats.num_drafts, "draft_tokens": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens,
            "accepted_per_position": list(stats.num_accepted_tokens_per_pos),
            "tau": round(stats.mean_acceptance_length, 4)}


def main() -> int:
    torch.set_num_threads(1)
    target, drafter, tokenizer = load_default_pair(device="cpu")
    prompts = [tokenizer(p["text"])["input_ids"][-PROMPT_TOKENS:] for p in heldout_prompts()[:NUM_PROMPTS]]
    runs = [EngineRun(f"{m}{n}", method=m, num_speculative_tokens=n) for m, n in CASES]
    engine = run_offline(prompts, runs, max_new_tokens=NEW_TOKENS)
    records = []
    for (method, n), run in zip(CASES, runs):
        lab_stats, results = generate_on_prompts(target, drafter if method == "dflash" else "ngram", prompts,
                                                 block_size=n + 1, max_new_tokens=NEW_TOKENS, progress=False)
        vllm_result = engine[run.name]
        lab, vllm = row(lab_stats), row(vllm_result.stats)
        records.append({"method": method, "num_speculative_tokens": n, "lab": lab, "vllm": vllm,
                        "outputs_equal": vllm_result.outputs == [r.new_token_ids for r in results],
                        "counters_equal": lab == vllm})
    first = engine[runs[0].name]  # what the runner reports is the same for every run of one call
    meta = {"what": __doc__.splitlines()[0], "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
            "vllm": first.vllm_version, "prompts": NUM_PROMPTS, "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": NEW_TOKENS, "dtype": "float32", "device": "cpu",
            "hybrid_kv_cache_manager_disabled": first.hybrid_manager_disabled, "shim": first.shim}
    write_json(BENCHMARKS_DIR / "vllm_engine.json", {"meta": meta, "records": records})
    lines = [f"# The lab against vLLM {meta['vllm']}'s engine (CPU, float32, greedy)", "",
             f"{NUM_PROMPTS} held-out prompts x {NEW_TOKENS} new tokens; written by scripts/compare_lab_with_vllm.py "
             f"on {meta['date']}.", "",
             "| method | k | side | drafts | draft tokens | accepted | tau | accepted per position | equal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        for side in ("lab", "vllm"):
            s = r[side]
            lines.append(f"| {r['method']} | {r['num_speculative_tokens']} | {side} | {s['drafts']} | {s['draft_tokens']} "
                         f"| {s['accepted']} | {s['tau']:.3f} | {' '.join(map(str, s['accepted_per_position']))} "
                         f"| {'outputs + counters' if r['outputs_equal'] and r['counters_equal'] else 'NO'} |")
    (BENCHMARKS_DIR / "vllm_engine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["outputs_equal"] and r["counters_equal"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
