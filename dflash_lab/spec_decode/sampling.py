"""The accept rules: turning logits into tokens, and deciding how much of a draft to keep.

Drafter and target logits go through the same processing (``logits_to_probs``),
so the rejection sampler compares like with like. Greedy decoding keeps the
longest prefix the target's argmax agrees with; sampling keeps each draft with
probability min(1, p/q) and resamples the first rejection from (p - q)+, which
leaves every emitted token distributed exactly as the target's own sample.
(vLLM: ``v1/sample/rejection_sampler.py``.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# vLLM's `SpeculativeConfig.draft_sample_method` (config/speculative.py): "greedy" (the default)
# drafts the drafter's argmax and the rejection sampler treats q as one-hot; "probabilistic"
# samples drafts from q and uses q in the accept test. Both are lossless; acceptance differs.
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")

# ---------------------------------------------------------------------------
# Sampling: the same logits processing for drafter and target
# ---------------------------------------------------------------------------


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities: temperature, then top-k, then top-p.

    ``temperature == 0`` is greedy: a one-hot at the argmax. Top-p keeps the
    smallest set of most likely tokens whose mass reaches ``top_p`` (always at
    least the most likely token). This is the order vLLM's sampler applies them.
    """
    logits = logits.float()
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, -math.inf)
        logits = torch.full_like(logits, -math.inf).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of (..., V) probabilities -> (...,) token ids."""
    flat = probs.reshape(-1, probs.shape[-1])  # (rows, V): multinomial wants 2-D
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


# ---------------------------------------------------------------------------
# Accepting a draft: greedy match and speculative rejection sampling
# ---------------------------------------------------------------------------


def greedy_accept_batch(draft_ids: torch.Tensor, target_ids: torch.Tensor,
                        num_draft: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of b drafts at once: keep the longest prefix the target's argmax agrees with.

    draft_ids (b, K): d_1 .. d_K per row. target_ids (b, K+1): the target's argmax after
    x_t, d_1, .., d_K. num_draft (b,), optional: row i proposed only its first num_draft[i]
    drafts (prompt lookup may find fewer; the rest is padding). Returns the number of
    drafts kept n (b,) and the target's token after them, target_ids[i, n_i] (b,): the
    correction if n_i < K, else the bonus token. Runs on the device, no host sync.
    """
    K = draft_ids.shape[1]
    agree = draft_ids == target_ids[:, :K]  # (b, K)
    if num_draft is not None:
        agree &= torch.arange(K, device=draft_ids.device) < num_draft[:, None]
    n = agree.long().cumprod(dim=1).sum(dim=1)  # 1 up to the first mismatch, summed
    return n, target_ids.gather(1, n[:, None])[:, 0]


def greedy_accept(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> tuple[int, int]:
    """``greedy_accept_batch`` for one sequence: draft_ids (K,), target_ids (K+1,) -> (n, next token)."""
    n, nxt = greedy_accept_batch(draft_ids[None], target_ids[None])
    return int(n[0]), int(nxt[0])


def rejection_sample(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for one block.

    draft_ids (K,): the drafts, d_j drawn from draft_probs[j].
    draft_probs (K, V) q, or None for a deterministic proposer (q is one-hot at
        the draft, as vLLM treats prompt-lookup drafts).
    target_probs (K+1, V) p: the target's distribution at each draft position,
        plus one more row for the bonus token.
    Keeps d_j with probability min(1, p_j(d_j) / q_j(d_j)) until the first
    rejection; at a rejection draws from the normalised residual (p_j - q_j)+;
    when all K are kept draws the bonus from p_K. Every emitted token is then
    distributed exactly as the target's own sample would be.
    Returns (number of drafts kept n, the next token).
    """
    K = draft_ids.shape[0]
    rows = torch.arange(K, device=draft_ids.device)
    p = target_probs[rows, draft_ids]  # (K,) target probability of each draft
    q = draft_probs[rows, draft_ids] if draft_probs is not None else torch.ones_like(p)
    u = torch.rand(K, generator=generator, device=p.device)
    kept = (u * q < p).int().cumprod(0)  # u < p/q, without dividing by q
    n = int(kept.sum())
    if n == K:
        return n, int(sample(target_probs[K], generator))  # bonus
    q_n = draft_probs[n] if draft_probs is not None else F.one_hot(draft_ids[n], target_probs.shape[-1]).float()
    residual = (target_probs[n] - q_n).clamp_min(0)
    if residual.sum() <= 0:  # only when p == q up to rounding, where rejection had probability ~0
        residual = target_probs[n]
    return n, int(sample(residual / residual.sum(), generator))
