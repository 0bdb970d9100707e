"""Write vllm_metrics_example.txt: a /metrics page in vLLM 0.33's format (illustrative numbers).

The numbers are NOT from a real server. They imitate a DFlash drafter serving with
num_speculative_tokens = 15 (block size 16) on two data-parallel engines: each
draft position is accepted, given the previous one was, with a probability that
falls from 0.84 to 0.56. The spec-decode counters are written by
dflash_lab.spec_decode.metrics.prometheus_text (vLLM's names, HELP texts and labels); a few
other vLLM metrics sit around them, as on a real /metrics page.

    python notebooks/data/make_vllm_metrics_example.py
"""

from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from dflash_lab.spec_decode.metrics import prometheus_text
from dflash_lab.spec_decode import SpecDecodeStats

MODEL = "laguna-xs.2"
K = 15  # num_speculative_tokens
CONDITIONAL = np.linspace(0.84, 0.56, K)  # P(position i accepted | position i-1 accepted)


def engine_stats(num_drafts: int, seed: int) -> SpecDecodeStats:
    rng = np.random.default_rng(seed)
    survive = rng.random((num_drafts, K)) < CONDITIONAL  # (drafts, K)
    accepted = np.cumprod(survive, axis=1).sum(axis=1)  # accepted prefix length per draft
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * K)
    for n in accepted:
        stats.observe_draft(K, int(n))
    stats.num_generated_tokens = int((accepted + 1).sum())
    return stats


def other_vllm_metrics(stats_by_engine) -> str:
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    ["model_name", "engine"], registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    ["model_name", "engine"], registry=registry)
    prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", ["model_name", "engine"], registry=registry)
    generated = Counter("vllm:generation_tokens", "Number of generation tokens processed.", ["model_name", "engine"],
                        registry=registry)
    for (model, engine), s in stats_by_engine.items():
        running.labels(model, engine).set(32)
        waiting.labels(model, engine).set(0)
        prompt.labels(model, engine).inc(s.num_drafts * 3)
        generated.labels(model, engine).inc(s.num_generated_tokens)
    return generate_latest(registry).decode()


def main():
    stats = {(MODEL, "0"): engine_stats(48_000, seed=0), (MODEL, "1"): engine_stats(46_500, seed=1)}
    note = ("# Example /metrics page in vLLM 0.33's format, written by notebooks/data/make_vllm_metrics_example.py.\n"
            "# The numbers are illustrative, not from a real server.\n")
    out = Path(__file__).with_name("vllm_metrics_example.txt")
    out.write_text(note + other_vllm_metrics(stats) + prometheus_text(stats))
    print("wrote", out)


if __name__ == "__main__":
    main()
