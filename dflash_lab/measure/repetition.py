"""How much of τ is the target repeating itself: an n-gram measure of each continuation, τ split by it.

The measure (stated once, used everywhere the lab reports τ): a continuation's **repeated 4-gram share**
is the fraction of its token 4-grams that already occurred earlier in the same continuation. A greedy
continuation that loops ("_bg_bg_bg") scores near 1; running code that does not repeat itself scores near 0.
A continuation is **repetitive** when its share is at least ``REPETITIVE_AT`` (a quarter of its 4-grams).

A looping continuation is easy to draft (the drafter, like prompt lookup, only has to copy), so τ over a
prompt set mixes two things: how well the drafter predicts new text and how often the target loops. The
lab reports both: the share of repetitive continuations, and τ on the repetitive and non-repetitive ones.
"""

from __future__ import annotations

import numpy as np
import torch

NGRAM = 4
REPETITIVE_AT = 0.25


def repeated_ngram_share(tokens, n: int = NGRAM) -> float:
    """Fraction of the n-grams of ``tokens`` (a continuation's ids) already seen earlier in ``tokens``.

    0.0 for a sequence with no n-gram at all (shorter than n): nothing in it repeats.
    """
    tokens = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
    if n < 1:
        raise ValueError(f"`n` must be at least 1, got {n}")
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen, repeated = set(), 0
    for g in grams:
        repeated += g in seen
        seen.add(g)
    return repeated / len(grams)


def is_repetitive(share: float, threshold: float = REPETITIVE_AT) -> bool:
    return share >= threshold


@torch.no_grad()
def greedy_continuations(target, prompt_ids: list, max_new_tokens: int = 64) -> list[list[int]]:
    """The target's greedy continuation (``max_new_tokens`` ids) of each prompt (a list of ids).

    Greedy speculative decoding emits exactly these tokens, so they are what a τ on the prompt was counted over.
    """
    from ..train.common import greedy_generate

    device = next(target.parameters()).device
    out = []
    for ids in prompt_ids:
        seq = greedy_generate(target, torch.tensor([list(ids)], device=device), max_new_tokens)[0]
        out.append(seq[len(ids):].tolist())
    return out


def continuation_shares(target, tokenizer, prompts: list[dict], max_new_tokens: int = 64) -> list[float]:
    """The repeated 4-gram share of the target's greedy continuation of each prompt (dicts with ``text``)."""
    ids = [p.get("input_ids") or tokenizer.encode(p["text"], add_special_tokens=False) for p in prompts]
    return [repeated_ngram_share(c) for c in greedy_continuations(target, ids, max_new_tokens)]


def _tau(counts) -> float | None:
    """τ of [[drafts, accepted], ...] pooled as vLLM pools them; None for no drafts (no prompt in the subset)."""
    counts = np.asarray(counts, dtype=float).reshape(-1, 2)
    drafts = counts[:, 0].sum()
    return None if drafts == 0 else float(1 + counts[:, 1].sum() / drafts)


def tau_by_repetition(per_prompt_counts, shares, threshold: float = REPETITIVE_AT) -> dict:
    """τ over all prompts, over the repetitive and over the non-repetitive continuations.

    per_prompt_counts: [[drafts, accepted tokens], ...] per prompt (``AcceptanceEval.per_prompt_counts``);
    shares: each prompt's repeated 4-gram share, in the same order. A subset with no prompt has τ None.
    """
    counts = np.asarray(per_prompt_counts, dtype=float).reshape(-1, 2)
    shares = np.asarray(shares, dtype=float)
    if len(counts) != len(shares):
        raise ValueError(f"{len(counts)} prompts' counts but {len(shares)} shares: they must be the same prompts")
    rep = shares >= threshold
    corr = None
    if len(shares) > 2 and shares.std() > 0:
        taus = 1 + counts[:, 1] / np.maximum(counts[:, 0], 1)
        corr = float(np.corrcoef(shares, taus)[0, 1]) if taus.std() > 0 else None
    return {"num_prompts": int(len(shares)), "num_repetitive": int(rep.sum()),
            "share_repetitive": float(rep.mean()) if len(rep) else None,
            "tau": _tau(counts), "tau_repetitive": _tau(counts[rep]), "tau_non_repetitive": _tau(counts[~rep]),
            "correlation": corr, "ngram": NGRAM, "threshold": threshold}


def describe(split: dict) -> str:
    """One line: the share of repetitive continuations and τ on each side, e.g. for a chapter's printout."""
    def fmt(x):
        return "-" if x is None else f"{x:.2f}"

    return (f"{split['num_repetitive']} of {split['num_prompts']} continuations repetitive (≥ "
            f"{split['threshold']:.0%} of their {split['ngram']}-grams repeated): τ {fmt(split['tau_repetitive'])} on "
            f"those, {fmt(split['tau_non_repetitive'])} on the other {split['num_prompts'] - split['num_repetitive']}")


def select_non_repetitive(prompts: list[dict], shares, n: int, threshold: float = REPETITIVE_AT) -> list[dict]:
    """The first ``n`` prompts whose continuation is not repetitive, each with its share, renumbered."""
    keep = [dict(p, repeated_4gram_share=round(float(s), 4)) for p, s in zip(prompts, shares) if s < threshold][:n]
    return [dict(p, id=i) for i, p in enumerate(keep)]


# The setting of the headline τ (the README's table and chapter 6's): every other τ the lab prints says its own
# setting and why it differs from this one.
HEADLINE_SETTING = "48 held-out prompts, 64 new tokens, block 16, greedy, CPU float32"


def setting_line(prompts: str, new_tokens, block, why: str) -> str:
    """The line a chapter prints before a τ: its prompts, new-token budget and block, and why its τ is not the
    headline's (e.g. ``setting_line("8 held-out prompts (last 64 tokens)", 32, 16, "fewer, shorter prompts")``)."""
    return (f"τ setting: {prompts}, {new_tokens} new tokens, block {block}; "
            f"not the headline's ({HEADLINE_SETTING}): {why}")
