"""vLLM's four verification rules side by side on a pair: τ with intervals over prompts, and what the lossy
ones give up.

For every rule x draft-sampling mode x temperature (``run_grid``; one cell is ``run_cell``): τ per
prompt (mean and a 95 % t-interval over prompts), vLLM's per-position rates, tokens per target
forward, and the outputs' fidelity to the target: the mean log-probability the target gives the
emitted tokens (at the run's temperature; T = 0 scores with T = 1) and the share of emitted tokens
that are not the target's argmax (0 for a lossless rule in greedy decoding). Chapter 7 and
``python -m dflash_lab.tools.bench_verification`` run it.
"""

from __future__ import annotations

import math
import time

import torch
from scipy.stats import t as student_t

from ..spec_decode.loop import speculative_generate
from ..spec_decode.sampling import logits_to_probs

METHODS = ("standard", "block", "fly", "synthetic")
DRAFT_MODES = ("greedy", "probabilistic")


def interval(values, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): a t-interval over independent per-prompt values."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(student_t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


@torch.no_grad()
def fidelity(target, result, temperature: float) -> dict:
    """How the target scores what a run emitted: mean log-prob per token, share not its argmax."""
    ids = result.output_ids
    T = result.prompt_length
    logits = target(ids).logits[0, T - 1:-1]  # predicts positions T .. end
    new = ids[0, T:]
    probs = logits_to_probs(logits, temperature if temperature > 0 else 1.0)
    logp = probs[torch.arange(len(new)), new].clamp_min(1e-30).log()
    return {"logp": float(logp.mean()), "not_argmax": float((logits.argmax(-1) != new).float().mean())}


def run_cell(target, drafter, prompts, *, method: str, draft_mode: str, temperature: float, block_size: int,
             max_new_tokens: int, seed: int = 0, synthetic_rates=None, progress=None) -> dict:
    """One method x draft mode x temperature over every prompt: per-prompt τ and the merged counters."""
    kw = {"synthetic_acceptance_rates": synthetic_rates} if method == "synthetic" else {}
    taus, logps, off, merged = [], [], [], None
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        r = speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens, block_size=block_size,
                                 temperature=temperature, seed=seed + i, draft_sample_method=draft_mode,
                                 rejection_sample_method=method, **kw)
        taus.append(r.stats.mean_acceptance_length)
        f = fidelity(target, r, temperature)
        logps.append(f["logp"])
        off.append(f["not_argmax"])
        merged = r.stats if merged is None else merged + r.stats
        if progress is not None:
            progress()
    tau, lo, hi = interval(taus)
    return {"method": method, "draft_sample_method": draft_mode, "temperature": temperature,
            "block_size": block_size, "prompts": len(prompts), "tau": tau, "tau_low": lo, "tau_high": hi,
            "tau_per_prompt": taus, "per_position_rate": merged.per_position_acceptance_rate,
            "tokens_per_target_forward": 1 / merged.target_forwards_per_token,
            "target_logp": sum(logps) / len(logps), "target_logp_per_prompt": logps,
            "not_target_argmax": sum(off) / len(off), "wall_s": time.perf_counter() - start}


def default_synthetic_rates(block_size: int) -> list[float]:
    """A load-test schedule: 0.8, 0.8^2, ... (vLLM checks only that it does not increase)."""
    return [0.8 ** (i + 1) for i in range(block_size - 1)]


def run_grid(target, drafter, prompts, *, temperatures=(0.0, 0.7, 1.0), methods=METHODS, draft_modes=DRAFT_MODES,
             block_size: int = 8, max_new_tokens: int = 48, seed: int = 0, progress=None) -> list[dict]:
    """Every cell; greedy decoding (T = 0) has one draft mode, so it is run once per method."""
    rows = []
    for temperature in temperatures:
        for method in methods:
            for mode in (draft_modes[:1] if temperature == 0 else draft_modes):
                rows.append(run_cell(target, drafter, prompts, method=method, draft_mode=mode,
                                     temperature=temperature, block_size=block_size, max_new_tokens=max_new_tokens,
                                     seed=seed, synthetic_rates=default_synthetic_rates(block_size),
                                     progress=progress))
    return rows


def markdown(rows) -> str:
    lines = ["| T | method | drafts | τ (95 % CI over prompts) | tokens / target forward | target log p / token "
             "| not target argmax |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['temperature']:g} | {r['method']} | {r['draft_sample_method']} | {r['tau']:.2f} "
                     f"[{r['tau_low']:.2f}, {r['tau_high']:.2f}] | {r['tokens_per_target_forward']:.2f} "
                     f"| {r['target_logp']:.3f} | {r['not_target_argmax']:.3f} |")
    return "\n".join(lines)
