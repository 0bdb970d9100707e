"""The accept rules: turning logits into tokens, and deciding how much of a draft to keep.

The target's logits go through temperature, top-k and top-p (``logits_to_probs``); a
sampled draft and its q through the temperature only (``draft_distribution``), as vLLM
does. Rejection sampling is lossless for any q. Greedy decoding keeps the
longest prefix the target's argmax agrees with; sampling keeps each draft with
probability min(1, p/q) and resamples the first rejection from (p - q)+, which
leaves every emitted token distributed exactly as the target's own sample.
(vLLM: ``v1/sample/rejection_sampler.py``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .stats import conditional_acceptance_rates

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


def draft_distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """q for a sampled draft: softmax(logits / T), no top-k or top-p, as vLLM 0.33 drafts.

    vLLM ignores every sampling parameter but the temperature when drafting, for the draft
    sample and for the q the accept test uses: V1 ``compute_probs_and_sample_next_token``
    (``v1/spec_decode/llm_base_proposer.py:1842-1851``), V2 ``_copy_request_inputs`` and
    ``gumbel_sample(apply_temperature=True)`` (``v1/worker/gpu/spec_decode/speculator.py:460-476,
    536-541``), its rejection kernels dividing the stored logits by T only
    (``rejection_sampler_utils.py:168-181, 909-920``). With top-k / top-p set, a draft outside
    the target's kept set has p = 0 and is always rejected: acceptance drops, the output law
    does not change.
    """
    return logits_to_probs(logits, temperature if temperature > 0 else 1.0)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of (..., V) probabilities -> (...,) token ids."""
    flat = probs.reshape(-1, probs.shape[-1])  # (rows, V): multinomial wants 2-D
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


# ---------------------------------------------------------------------------
# Accepting a draft: the kept prefix, greedy match and speculative rejection sampling
# ---------------------------------------------------------------------------


def accepted_prefix_length(kept: torch.Tensor) -> torch.Tensor:
    """(..., K) booleans, draft j passed its test -> (...) drafts kept: the Trues before the first False.

    Every rule and backend counts with it: a draft is kept up to its first rejection, whatever follows."""
    if not isinstance(kept, torch.Tensor) or kept.dtype != torch.bool or kept.dim() == 0:
        got = f"a {kept.dtype} tensor of shape {tuple(kept.shape)}" if isinstance(kept, torch.Tensor) else type(kept)
        raise TypeError(f"kept must be a bool tensor (..., K) of per-position decisions, got {got}")
    return kept.long().cumprod(-1).sum(-1)  # 1 up to the first False, 0 after; summed


def residual(p: torch.Tensor, q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """(scale·p - q)+, (..., V): the target's mass the draft distribution does not cover (scale: block's w)."""
    return (scale * p - q).clamp_min(0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``residual`` normalised, (V,): what a rejection is resampled from; p itself when nothing is left
    (p == q up to rounding, where the rejection had probability ~0)."""
    left = residual(p, q, scale)
    left = left if left.sum() > 0 else p
    return left / left.sum()


def _next_token(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor, n: int,
                generator, *, scale: float = 1.0) -> int:
    """The token after n kept drafts: the bonus from p_K when all K were kept, else a draw from the residual at n."""
    K = draft_ids.shape[0]
    if n == K:
        return int(sample(target_probs[K], generator))
    q_n = draft_probs[n] if draft_probs is not None else F.one_hot(draft_ids[n], target_probs.shape[-1]).float()
    return int(sample(residual_distribution(target_probs[n], q_n, scale), generator))


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
    n = accepted_prefix_length(agree)  # (b,): agree.long().cumprod(-1).sum(-1), drafts before the first mismatch
    return n, target_ids.gather(1, n[:, None])[:, 0]


def greedy_accept(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> tuple[int, int]:
    """``greedy_accept_batch`` for one sequence: draft_ids (K,), target_ids (K+1,) -> (n, next token)."""
    n, nxt = greedy_accept_batch(draft_ids[None], target_ids[None])
    return int(n[0]), int(nxt[0])


def rejection_sample(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for one block.

    draft_ids (K,): the drafts, d_j drawn from draft_probs[j].
    draft_probs (K, V) q, or None for a deterministic proposer (q is one-hot at the draft, as
        vLLM treats prompt-lookup drafts).
    target_probs (K+1, V) p: the target's distribution at each draft position, plus one more
        row for the bonus token.
    Keeps d_j with probability min(1, p_j(d_j) / q_j(d_j)) until the first rejection; at a
    rejection draws from the normalised residual (p_j - q_j)+; when all K are kept draws the
    bonus from p_K. Every emitted token is then distributed exactly as the target's own sample
    would be. Returns (number of drafts kept n, the next token).
    """
    K = draft_ids.shape[0]
    rows = torch.arange(K, device=draft_ids.device)
    p = target_probs[rows, draft_ids]  # (K,) target probability of each draft
    q = draft_probs[rows, draft_ids] if draft_probs is not None else torch.ones_like(p)
    u = torch.rand(K, generator=generator, device=p.device)
    n = int(accepted_prefix_length(u * q < p))  # u < p/q, without dividing by q
    return n, _next_token(draft_ids, draft_probs, target_probs, n, generator)


# ---------------------------------------------------------------------------
# vLLM 0.33's other verification rules: block, FLy, synthetic
# ---------------------------------------------------------------------------
# vLLM's `SpeculativeConfig.rejection_sample_method` (config/speculative.py:83, :562-590):
#   "standard"   the rule above (Leviathan et al.), one draft at a time; lossless
#   "block"      block verification (Sun et al. 2024, arXiv 2403.10444): the draft is verified
#                jointly; lossless, accepts at least as much (V2 GPU sampler only:
#                v1/worker/gpu/spec_decode/rejection_sampler.py:177-178 sets it,
#                rejection_sampler_utils.py `_rejection_kernel` runs it)
#   "fly"        FLy: a native rejection is deferred when the target is uncertain there and
#                the next W drafts are natively accepted; LOSSY (v1/spec_decode/fly.py)
#   "synthetic"  accept position i with a given probability, whatever the tokens; for load
#                tests, LOSSY (config/speculative.py:571-577, 600-632)
# With draft_sample_method="probabilistic", V1 keeps q only for standard and fly
# (v1/spec_decode/llm_base_proposer.py:257-260): under block or synthetic its drafts are the
# argmax, q one-hot. V2 keeps the draft logits for every rule (speculator.py:180-183). The lab
# samples drafts and uses q under all four: V2's behaviour, not V1's.
REJECTION_SAMPLE_METHODS = ("standard", "block", "fly", "synthetic")
FLY_DEFAULT_ENTROPY_THRESHOLD = 0.3  # config/speculative.py:656
FLY_DEFAULT_ENTROPY_TOP_K = 3  # config/speculative.py:659


def fly_default_window(num_speculative_tokens: int) -> int:
    """vLLM's default ``fly_window_size``: min(6, num_speculative_tokens - 1) (config/speculative.py:2025)."""
    return min(6, num_speculative_tokens - 1)


def acceptance_length_to_rates(length: float, num_speculative_tokens: int) -> list[float]:
    """vLLM's ``synthetic_acceptance_length`` -> per-position unconditional rates, its minimum-variance schedule.

    τ - 1 expected accepted drafts: the first floor(τ - 1) positions always, the next with the
    fractional part, the rest never (config/speculative.py:590-597).
    """
    accepted = length - 1
    full = int(accepted)
    return ([1.0] * full + [accepted - full] + [0.0] * num_speculative_tokens)[:num_speculative_tokens]


def unconditional_to_conditional_rates(rates) -> list[float]:
    """Per-position unconditional rates r_i (drafts accepted through i / drafts) -> conditional c_i = r_i / r_{i-1}.

    What vLLM's sampler draws against (v1/spec_decode/utils.py:848-851), by the lab's one definition
    (``stats.conditional_acceptance_rates``): NaN where r_{i-1} = 0, where vLLM writes a 0.0 it never reads.
    """
    return conditional_acceptance_rates(rates, 1.0)


def fly_entropy(probs: torch.Tensor, top_k: int = FLY_DEFAULT_ENTROPY_TOP_K) -> torch.Tensor:
    """FLy's gate, (..., V) probabilities -> (...): -sum p log p over the top_k most likely tokens only.

    Not renormalised, as vLLM's ``compute_fly_entropy`` (v1/spec_decode/fly.py:16-41).
    """
    top = probs.float().topk(min(top_k, probs.shape[-1]), dim=-1).values
    return -torch.where(top > 0, top * top.clamp_min(1e-30).log(), torch.zeros_like(top)).sum(-1)


def block_verify(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """Block verification (Sun et al. 2024), as vLLM 0.33's V2 sampler runs it.

    Same arguments and result as ``rejection_sample``. With r_j = p_j(d_j) / q_j(d_j):
        w_0 = 1, w_j = min(1, w_{j-1} r_j)                 the running joint ratio
        h_j = m_j / (m_j + 1 - w_j),  m_j = sum_x (w_j p_j+1(x) - q_j+1(x))+   for j < K
        h_K = w_K
    one uniform per position; n = the LAST j with u_j <= h_j (0 if none), so a draft that
    standard sampling would cut at its first rejection can still be kept whole. The next
    token is the bonus from p_K when n = K, else a draw from (w_n p_n - q_n)+ normalised.
    Every emitted token is distributed as the target's own, and no lossless rule accepts
    more in expectation. (vLLM: rejection_sampler_utils.py ``_compute_cumulative_log_p_kernel``,
    ``_compute_local_residual_mass_kernel``, the ``USE_BLOCK_VERIFICATION`` branch of
    ``_rejection_kernel`` and of ``_resample_kernel``.)
    """
    K, V = draft_ids.shape[0], target_probs.shape[-1]
    rows = torch.arange(K, device=draft_ids.device)
    q_rows = draft_probs if draft_probs is not None else F.one_hot(draft_ids, V).float()
    p, q = target_probs[rows, draft_ids].double(), q_rows[rows, draft_ids].double()
    w, weights = 1.0, []
    for j in range(K):  # w_j, kept below 1 as vLLM keeps log w <= 0
        w = min(1.0, w * float(p[j] / q[j])) if q[j] > 0 else 0.0
        weights.append(w)
    h = []
    for j in range(K - 1):
        m = float(residual(target_probs[j + 1].double(), q_rows[j + 1].double(), weights[j]).sum())
        h.append(m / (m + 1.0 - weights[j]) if m + 1.0 - weights[j] > 0 else 1.0)
    h += weights[-1:]  # h_K = w_K
    u = torch.rand(K, generator=generator, device=target_probs.device)
    passed = u.double().cpu() <= torch.tensor(h, dtype=torch.float64)  # (K,)
    # n is the LAST position that passed: K less the run of failures at the end, read backwards.
    n = K - int(accepted_prefix_length(~passed.flip(-1)))
    return n, _next_token(draft_ids, draft_probs, target_probs, n, generator, scale=weights[n - 1] if n else 1.0)


def fly_accept(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
               entropy: torch.Tensor, *, window: int, threshold: float = FLY_DEFAULT_ENTROPY_THRESHOLD,
               target_argmax: torch.Tensor | None = None, target_logits: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> tuple[int, int]:
    """FLy's entropy-gated deferred window, as vLLM 0.33 applies it (v1/spec_decode/fly.py:47-188). LOSSY.

    First each draft gets its native decision: greedy (``target_argmax`` (K+1,) given) d_j ==
    argmax; sampling u_j q_j(d_j) < p_j(d_j) with q_j(d_j) > 0. A native rejection at j is
    overruled (the draft kept) when the target's top-k entropy there, ``entropy`` (K,), is >=
    threshold, j + window < K, the next ``window`` drafts are all natively accepted, and d_j
    is possible for the target: greedy, its raw logit ``target_logits`` (K+1, V) is above -inf
    (fly.py:82-87; a logit whose float32 softmax underflows to 0 still counts); sampling,
    p_j(d_j) > 0 and q_j(d_j) > 0 (fly.py:149-156). The prefix is kept up to the first rejection that
    stands; the next token is standard verification's there (greedy: the argmax; sampling: the residual).
    """
    K = draft_ids.shape[0]
    rows = torch.arange(K, device=draft_ids.device)
    p = target_probs[rows, draft_ids]
    if target_argmax is not None:
        native = draft_ids == target_argmax[:K]
        logits = target_logits if target_logits is not None else target_probs.log()
        possible = logits[rows, draft_ids] > -math.inf
    else:
        q = draft_probs[rows, draft_ids] if draft_probs is not None else torch.ones_like(p)
        u = torch.rand(K, generator=generator, device=p.device)
        native = (u * q < p) & (q > 0)
        possible = (p > 0) & (q > 0)
    later_ok = [bool(native[j + 1:j + 1 + window].all()) for j in range(K)]
    deferred = [(not native[j]) and bool(possible[j]) and j + window < K and float(entropy[j]) >= threshold
                and later_ok[j] for j in range(K)]
    n = int(accepted_prefix_length(native | torch.tensor(deferred, dtype=torch.bool, device=native.device)))
    if target_argmax is not None:
        return n, int(target_argmax[n])
    return n, _next_token(draft_ids, draft_probs, target_probs, n, generator)


def synthetic_accept(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     conditional_rates, *, target_argmax: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """vLLM's synthetic acceptance: keep draft j with probability conditional_rates[j], whatever the tokens. LOSSY.

    Stops at the first rejection, so drafts accepted through position i / drafts -> the
    unconditional rate r_i = c_0 c_1 .. c_i. The next token is what standard verification
    gives there (greedy: the target's argmax; sampling: the residual (p - q)+), the bonus
    from p_K when every draft was kept (v1/sample/rejection_sampler.py:824-836, 934-956).
    """
    K = draft_ids.shape[0]
    rates = torch.tensor(list(conditional_rates)[:K], dtype=torch.float32, device=target_probs.device)
    u = torch.rand(K, generator=generator, device=target_probs.device)
    n = int(accepted_prefix_length(u < rates))  # a NaN rate (no draft gets there) is never passed
    if target_argmax is not None:
        return n, int(target_argmax[n])
    return n, _next_token(draft_ids, draft_probs, target_probs, n, generator)


# ---------------------------------------------------------------------------
# Choosing the rule by vLLM's name, with vLLM's checks
# ---------------------------------------------------------------------------


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class Verifier:
    """One verification rule with its settings, called once per step: build it with ``make_verifier``
    (which checks the settings as vLLM's SpeculativeConfig does). ``conditional_rates``: synthetic's draws."""

    method: str = "standard"
    conditional_rates: tuple[float, ...] | None = None
    fly_window_size: int | None = None
    fly_entropy_threshold: float = FLY_DEFAULT_ENTROPY_THRESHOLD
    fly_entropy_top_k: int = FLY_DEFAULT_ENTROPY_TOP_K

    @property
    def lossless(self) -> bool:
        return self.method in ("standard", "block")

    def __call__(self, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                 to_probs, *, greedy: bool, generator: torch.Generator | None = None) -> tuple[int, int]:
        """Drafts (K,), their q (K, V) or None, the target's logits (K+1, V) -> (drafts kept, next token).

        "standard" is the eager loop's rule exactly: greedy_accept on the argmax when greedy, else
        rejection_sample on to_probs(logits). Greedy decoding: "standard" and "block" are the same
        rule, the longest prefix that matches the target's argmax (vLLM's greedy branch of both);
        FLy's entropy is then taken from the unscaled softmax, as vLLM leaves greedy logits unscaled.
        """
        if greedy:
            argmax = target_logits.argmax(-1)
            if self.method in ("standard", "block"):
                return greedy_accept(draft_ids, argmax)
            if self.method == "synthetic":
                return synthetic_accept(draft_ids, None, target_logits, self.conditional_rates,
                                        target_argmax=argmax, generator=generator)
            probs = target_logits.float().softmax(-1)
            return fly_accept(draft_ids, None, probs, fly_entropy(probs[:-1], self.fly_entropy_top_k),
                              window=self.fly_window_size, threshold=self.fly_entropy_threshold,
                              target_argmax=argmax, target_logits=target_logits, generator=generator)
        probs = to_probs(target_logits)
        if self.method == "standard":
            return rejection_sample(draft_ids, draft_probs, probs, generator)
        if self.method == "block":
            return block_verify(draft_ids, draft_probs, probs, generator)
        if self.method == "synthetic":
            return synthetic_accept(draft_ids, draft_probs, probs, self.conditional_rates, generator=generator)
        return fly_accept(draft_ids, draft_probs, probs, fly_entropy(probs[:-1], self.fly_entropy_top_k),
                          window=self.fly_window_size, threshold=self.fly_entropy_threshold, generator=generator)


def make_verifier(rejection_sample_method: str = "standard", num_speculative_tokens: int = 1, *,
                  synthetic_acceptance_rates=None, synthetic_acceptance_length=None, fly_window_size=None,
                  fly_entropy_threshold: float = FLY_DEFAULT_ENTROPY_THRESHOLD,
                  fly_entropy_top_k: int = FLY_DEFAULT_ENTROPY_TOP_K) -> Verifier:
    """A ``Verifier`` from vLLM's option names, checked as vLLM 0.33 checks them.

    (config/speculative.py:600-632 for the synthetic rates, :2014-2034 for FLy.) Every error
    names the argument. num_speculative_tokens = block_size - 1.
    """
    method = rejection_sample_method
    if method not in REJECTION_SAMPLE_METHODS:
        raise ValueError(f"rejection_sample_method must be one of {list(REJECTION_SAMPLE_METHODS)} (vLLM's "
                         f"SpeculativeConfig.rejection_sample_method), got {method!r}")
    n = num_speculative_tokens
    synthetic_given = synthetic_acceptance_rates is not None or synthetic_acceptance_length is not None
    if method != "synthetic" and synthetic_given:
        raise ValueError("synthetic_acceptance_rates / synthetic_acceptance_length are only valid with "
                         f"rejection_sample_method='synthetic', got rejection_sample_method={method!r}")
    if fly_window_size is not None and (not isinstance(fly_window_size, int) or isinstance(fly_window_size, bool)
                                        or fly_window_size < 1):
        raise ValueError(f"fly_window_size must be None or an integer >= 1, got {fly_window_size!r}")
    # fly_window_size without "fly": vLLM validates it (Field ge=1) and ignores it (only its FLy branch reads it,
    # config/speculative.py:2014-2030); so does the lab. Synthetic settings without "synthetic" it refuses (:1987).
    if not _number(fly_entropy_threshold) or fly_entropy_threshold < 0:
        raise ValueError(f"fly_entropy_threshold must be a number >= 0, got {fly_entropy_threshold!r}")
    if not isinstance(fly_entropy_top_k, int) or isinstance(fly_entropy_top_k, bool) or fly_entropy_top_k < 1:
        raise ValueError(f"fly_entropy_top_k must be an integer >= 1, got {fly_entropy_top_k!r}")
    if method == "synthetic":
        if (synthetic_acceptance_rates is None) == (synthetic_acceptance_length is None):
            raise ValueError("rejection_sample_method='synthetic' needs exactly one of synthetic_acceptance_rates "
                             "or synthetic_acceptance_length")
        if synthetic_acceptance_length is not None:
            L = synthetic_acceptance_length
            if not _number(L) or not 1 <= L <= n + 1:
                raise ValueError(f"synthetic_acceptance_length must be in [1, {n + 1}] (block_size {n + 1}), got {L!r}")
            rates = acceptance_length_to_rates(float(L), n)
        else:
            rates = list(synthetic_acceptance_rates)
            if len(rates) != n:
                raise ValueError(f"synthetic_acceptance_rates must have length {n} (block_size - 1, one per draft "
                                 f"position), got {len(rates)}: {rates}")
            if not all(_number(r) and 0 <= r <= 1 for r in rates):
                raise ValueError(f"synthetic_acceptance_rates entries must be in [0, 1], got {rates}")
            if any(rates[i] > rates[i - 1] for i in range(1, n)):
                raise ValueError(f"synthetic_acceptance_rates must be non-increasing (position i's entry is the share "
                                 f"of drafts accepted through i, unconditional), got {rates}")
        return Verifier(method, conditional_rates=tuple(unconditional_to_conditional_rates(rates)))
    if method == "fly":
        if n < 2:
            raise ValueError(f"rejection_sample_method='fly' needs block_size >= 3 (at least 2 speculative tokens), "
                             f"got block_size {n + 1}")
        window = fly_default_window(n) if fly_window_size is None else fly_window_size
        if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window < n:
            raise ValueError(f"fly_window_size must be an integer in [1, {n - 1}] (smaller than block_size - 1 = {n}), "
                             f"got {fly_window_size!r}")
        return Verifier(method, fly_window_size=window, fly_entropy_threshold=float(fly_entropy_threshold),
                        fly_entropy_top_k=fly_entropy_top_k)
    return Verifier(method)
