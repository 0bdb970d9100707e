"""One run, every community's acceptance metric: what each reports, and how to convert between them.

Everyone who runs DFlash reports "acceptance", and they mean different numbers:

    vLLM        counters (drafts D, draft tokens, accepted A, accepted-through-position
                per_pos[i]); τ = 1 + A / D (mean acceptance length, the bonus token
                included); per-position rates r_i = per_pos[i] / D (UNconditional);
                draft acceptance rate A / (D·K)
    papers      conditional per-position rates c_i = P(i accepted | 0..i-1 accepted)
                = r_i / r_{i-1}; τ with or without the bonus token (τ - 1 = A / D)
    z-lab       the acceptance-length histogram: the share of steps that emitted
                a = 1 .. K+1 tokens
    SGLang      ``spec_accept_length`` = (accepted + verify steps) / verify steps = τ
                (the scheduler adds num_accepted_tokens + batch size per step); per
                request, completion_tokens / spec_verify_ct also counts the prefill token
    trainers    teacher-forced expected acceptance length: blocks drafted at anchor
                positions of real text, 1 + the leading run of correct drafts, averaged;
                or 1 + sum_j prod_{i<=j} acc_i from per-position accuracies, which
                assumes independent errors: too low when errors cluster in the same
                blocks, too high when they are spread one per block

All of the decoding-run metrics follow from vLLM's counters alone, so they can be read
off a production server's /metrics as well as off the lab's runs. The table
``CONVERSIONS`` says how; ``every_metric(stats)`` computes them for one run.

A τ near K+1 is censored: every step that accepted the whole block would have gone on
with a longer one, so τ is then a lower bound on what the drafter can do
(``ceiling(stats)``).
"""

from __future__ import annotations

import math

import torch

from .sampling import accepted_prefix_length
from .stats import SpecDecodeStats

# ---------------------------------------------------------------------------
# The decoding-run metrics, each from vLLM's counters
# ---------------------------------------------------------------------------


def tau(stats: SpecDecodeStats) -> float:
    """vLLM's mean acceptance length: tokens per verification step, the bonus token included."""
    return stats.mean_acceptance_length


def accepted_per_draft(stats: SpecDecodeStats) -> float:
    """τ without the bonus token: drafted tokens kept per step (A / D = sum of r_i)."""
    return stats.mean_accepted_tokens


def unconditional_rates(stats: SpecDecodeStats) -> list[float]:
    """vLLM's per-position rates r_i: the share of drafts whose first i+1 tokens were all accepted."""
    return stats.per_position_acceptance_rate


def conditional_rates(stats: SpecDecodeStats) -> list[float]:
    """c_i = r_i / r_{i-1}: position i accepted, given that every position before it was."""
    return stats.conditional_acceptance_rate


def acceptance_length_histogram(stats: SpecDecodeStats) -> list[float]:
    """hist[a-1] = the share of steps that emitted a tokens (a = 1 .. K+1; a - 1 drafts kept, plus one)."""
    return stats.acceptance_length_shares


def sglang_accept_length(stats: SpecDecodeStats) -> float:
    """SGLang's server-wide ``spec_accept_length``: (accepted drafts + one token per step) / steps; equals τ."""
    return (stats.num_accepted_tokens + stats.num_drafts) / stats.num_drafts if stats.num_drafts else math.nan


def sglang_request_accept_length(stats: SpecDecodeStats) -> float:
    """completion_tokens / spec_verify_ct, SGLang's per-request view: counts the prefill's token too."""
    return stats.num_generated_tokens / stats.num_drafts if stats.num_drafts else math.nan


def ceiling(stats: SpecDecodeStats) -> dict:
    """τ's ceiling K+1 and how much of the run sat on it.

    ``share_at_ceiling`` = r_{K-1}, the steps that kept every draft: for those the drafter
    was never wrong within the block, so a longer block would have kept more. When it is
    not 0, τ is censored: a lower bound on the drafter's acceptance length.
    """
    K = stats.num_speculative_tokens
    share = unconditional_rates(stats)[-1] if K and stats.num_drafts else math.nan
    t = tau(stats)
    return {"num_speculative_tokens": K, "tau_ceiling": K + 1, "tau": t,
            "tau_over_ceiling": t / (K + 1) if K else math.nan,
            "share_at_ceiling": share, "censored": bool(share > 0) if not math.isnan(share) else False}


# ---------------------------------------------------------------------------
# The trainer's view: teacher-forced blocks
# ---------------------------------------------------------------------------


def _rows(correct) -> list[list[bool]]:
    rows = correct.tolist() if hasattr(correct, "tolist") else [list(r) if hasattr(r, "__iter__") else r
                                                                for r in correct]
    if not rows or any(not isinstance(r, list) or len(r) != len(rows[0]) for r in rows):
        raise ValueError("correct must be a non-empty (blocks, K) table of booleans, every row of length K")
    return [[bool(x) for x in r] for r in rows]


def leading_runs(correct) -> list[int]:
    """Drafts greedy verification keeps in each teacher-forced block: the correct positions before the first wrong one.

    The accept rule's own count (``sampling.accepted_prefix_length``), over every block at once.
    """
    rows = _rows(correct)
    return accepted_prefix_length(torch.tensor(rows, dtype=torch.bool)).tolist()  # (blocks, K) -> (blocks,)


def leading_run(row) -> int:
    """``leading_runs`` of one block."""
    return leading_runs([list(row)])[0]


def teacher_forced_acceptance_length(correct) -> float:
    """1 + the mean leading run of correct drafts over teacher-forced blocks ((blocks, K) booleans).

    What a trainer's evaluation logs: drafts at anchor positions of real text, each
    position correct when it equals the label (the target's prediction). It is τ of a
    greedy run only when the blocks are the ones that run would have drafted.
    """
    runs = leading_runs(correct)
    return 1 + sum(runs) / len(runs)


def per_position_accuracy(correct) -> list[float]:
    """acc_j: the share of blocks whose position j is correct, whatever came before (a trainer's usual log)."""
    rows = _rows(correct)
    return [sum(r[j] for r in rows) / len(rows) for j in range(len(rows[0]))]


def acceptance_length_from_accuracies(accuracy) -> float:
    """1 + sum_j prod_{i<=j} acc_i: τ IF position errors were independent (correlated errors bias it either way)."""
    total, prod = 1.0, 1.0
    for a in accuracy:
        prod *= a
        total += prod
    return total


def stats_from_teacher_forcing(correct) -> SpecDecodeStats:
    """The teacher-forced blocks as vLLM would have counted them, had each been one verification step."""
    rows = _rows(correct)
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * len(rows[0]))
    stats.observe_drafts([len(r) for r in rows], leading_runs(rows))
    return stats


# ---------------------------------------------------------------------------
# Conversions between the views
# ---------------------------------------------------------------------------


def rates_from_conditional(conditional) -> list[float]:
    """r_i = c_0 c_1 .. c_i."""
    out, prod = [], 1.0
    for c in conditional:
        prod *= c
        out.append(prod)
    return out


def tau_from_rates(rates) -> float:
    """τ = 1 + sum_i r_i (each draft counts once per position it got through)."""
    return 1 + sum(rates)


def rates_from_histogram(hist) -> list[float]:
    """r_i = the share of steps that emitted more than i + 1 tokens: a tail sum of the histogram."""
    return [sum(hist[i + 1:]) for i in range(len(hist) - 1)]


CONVERSIONS = [
    {"metric": "τ, mean acceptance length", "reported by": "vLLM (/metrics, logs), DFlash paper, SGLang",
     "definition": "tokens per verification step, bonus included", "from vLLM's counters": "1 + A / D"},
    {"metric": "accepted tokens per step", "reported by": "papers that leave the bonus out",
     "definition": "drafted tokens kept per step", "from vLLM's counters": "A / D = τ - 1 = Σ r_i"},
    {"metric": "draft acceptance rate", "reported by": "vLLM logs",
     "definition": "kept drafts / proposed drafts", "from vLLM's counters": "A / (D·K) = (τ - 1) / K"},
    {"metric": "per-position rate r_i (unconditional)", "reported by": "vLLM per_pos counters",
     "definition": "drafts whose first i+1 tokens were kept / drafts", "from vLLM's counters": "per_pos[i] / D"},
    {"metric": "per-position rate c_i (conditional)", "reported by": "papers, EAGLE-style plots",
     "definition": "P(i kept | 0..i-1 kept)", "from vLLM's counters": "per_pos[i] / per_pos[i-1]; r_i = Π c"},
    {"metric": "acceptance-length histogram h(a)", "reported by": "z-lab DFlash benchmarks",
     "definition": "share of steps emitting a tokens, a = 1..K+1",
     "from vLLM's counters": "h(a) = r_{a-2} - r_{a-1} (r_{-1} = 1, r_K = 0); τ = Σ a h(a)"},
    {"metric": "spec_accept_length", "reported by": "SGLang (server)",
     "definition": "(accepted + steps) / steps", "from vLLM's counters": "(A + D) / D = τ"},
    {"metric": "completion_tokens / spec_verify_ct", "reported by": "SGLang (per request)",
     "definition": "emitted tokens / verification steps", "from vLLM's counters":
     "≈ τ + 1/D per request (the prefill's token); needs the generation-token counter"},
    {"metric": "teacher-forced acceptance length", "reported by": "trainers (speculators, DFlash training)",
     "definition": "1 + mean leading run of correct drafts over anchor blocks", "from vLLM's counters":
     "not derivable: other blocks (real text, not the run's own); equals τ only on the run's own blocks"},
    {"metric": "1 + Σ_j Π_{i≤j} acc_i", "reported by": "trainers logging per-position accuracy",
     "definition": "τ if errors were independent", "from vLLM's counters":
     "uses acc_i (not c_i): too low when errors cluster in blocks, too high when spread one per block"},
    {"metric": "τ at the ceiling", "reported by": "anyone with K too small",
     "definition": "τ → K+1 when nearly every block is kept whole",
     "from vLLM's counters": "share at ceiling = r_{K-1}; if > 0, τ is a lower bound"},
]


def conversion_table_markdown() -> str:
    """``CONVERSIONS`` as a markdown table (for a notebook or the docs)."""
    keys = list(CONVERSIONS[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(row[k].replace("|", "\\|") for k in keys) + " |" for row in CONVERSIONS]  # P(a | b)
    return "\n".join(lines)


def every_metric(stats: SpecDecodeStats, teacher_forced=None) -> dict:
    """One run reported every community's way (NaN where a run has no drafts).

    teacher_forced: optional (blocks, K) booleans from a trainer's evaluation, added as its
    two views (the leading-run mean and the independence estimate from accuracies).
    """
    out = {
        "vllm_counters": {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                          "num_accepted_tokens": stats.num_accepted_tokens,
                          "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos)},
        "tau": tau(stats),
        "accepted_per_draft": accepted_per_draft(stats),
        "draft_acceptance_rate": stats.draft_acceptance_rate,
        "unconditional_rates": unconditional_rates(stats),
        "conditional_rates": conditional_rates(stats),
        "acceptance_length_histogram": acceptance_length_histogram(stats),
        "sglang_accept_length": sglang_accept_length(stats),
        "sglang_request_accept_length": sglang_request_accept_length(stats),
        "ceiling": ceiling(stats),
    }
    if teacher_forced is not None:
        acc = per_position_accuracy(teacher_forced)
        out["teacher_forced_acceptance_length"] = teacher_forced_acceptance_length(teacher_forced)
        out["per_position_accuracy"] = acc
        out["acceptance_length_from_accuracies"] = acceptance_length_from_accuracies(acc)
    return out
