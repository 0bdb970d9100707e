"""DFlash speculative decoding: draft a block, verify it, keep the agreed prefix.

One step, once the target has processed positions 0 .. t-1 and x_t is the last
token it produced:

    draft   block [x_t, MASK x (B-1)] at positions t .. t+B-1, ONE drafter forward
            conditioned on the context K/V of positions < t; position j >= 1
            predicts the token AT t+j through the target's lm_head: d_1 .. d_{B-1}
    verify  ONE target forward over [x_t, d_1 .. d_{B-1}] with its KV cache:
            the target's distribution for positions t+1 .. t+B
    accept  greedy: the longest prefix with d_j == argmax; sampling: rejection
            sampling (keep d_j with probability min(1, p/q), else resample from
            the residual (p - q)+); then one token from the target (the bonus
            when every draft was kept, the correction otherwise)
    keep    crop the target's KV cache to the accepted length; append only the
            accepted positions' target features to the drafter's context K/V

Prompt-lookup drafting (vLLM's ``ngram`` method) replaces the drafter forward
with a search of the sequence itself; verify, accept and the statistics are the
same code. The statistics are vLLM's (``vllm/v1/spec_decode/metrics.py``).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .drafter import DFlashLagunaDrafter
from .target import target_forward

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
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


# ---------------------------------------------------------------------------
# Accepting a draft: greedy match and speculative rejection sampling
# ---------------------------------------------------------------------------


def greedy_accept(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> tuple[int, int]:
    """Keep the longest prefix of the draft that the target's argmax agrees with.

    draft_ids (K,): d_1 .. d_K.  target_ids (K+1,): the target's argmax after
    x_t, d_1, .., d_K. Returns (number of drafts kept n, the target's token after
    them): target_ids[n] is the correction if n < K, else the bonus token.
    """
    kept = (draft_ids == target_ids[:-1]).int().cumprod(0)  # 1 up to the first mismatch
    n = int(kept.sum())
    return n, int(target_ids[n])


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


# ---------------------------------------------------------------------------
# Drafters: DFlash (one forward per block) and prompt lookup (no model)
# ---------------------------------------------------------------------------


class DFlashContext:
    """The drafter's context K/V: every position the target has accepted so far.

    Like vLLM, K/V are written at absolute slots of a buffer sized for the whole
    generation; each step appends only the newly accepted positions, so the
    context is never recomputed.
    """

    def __init__(self, drafter: DFlashLagunaDrafter, capacity: int, device, dtype):
        cfg = drafter.config
        shape = (cfg.num_hidden_layers, capacity, cfg.num_key_value_heads, cfg.head_dim)  # (L, capacity, nkv, hd)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0

    def append(self, drafter: DFlashLagunaDrafter, aux_hidden: torch.Tensor) -> None:
        """Add the next positions from their target aux hidden states (n, n_aux * H_t)."""
        n = aux_hidden.shape[0]
        positions = torch.arange(self.length, self.length + n, device=aux_hidden.device)
        context = drafter.combine_hidden_states(aux_hidden)  # (n, H)
        k, v = drafter.precompute_context_kv(context, positions)  # (L, n, nkv, hd) each
        self.k[:, self.length:self.length + n] = k
        self.v[:, self.length:self.length + n] = v
        self.length += n

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.length, device=self.k.device)

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :self.length], self.v[:, :self.length]  # (L, N, nkv, hd) each


def dflash_draft_logits(drafter: DFlashLagunaDrafter, target, context: DFlashContext, last_token: int,
                        block_size: int) -> torch.Tensor:
    """ONE drafter forward over [x_t, MASK x (B-1)] at positions t .. t+B-1 (t = context.length).

    Returns (B-1, V) logits for positions t+1 .. t+B-1, from the target's lm_head.
    """
    device = context.k.device
    block_ids = torch.full((1, block_size), drafter.config.mask_token_id, dtype=torch.long, device=device)
    block_ids[0, 0] = last_token
    noise_embeds = target.get_input_embeddings()(block_ids)  # (1, B, H): the target's embedding table
    positions = torch.arange(context.length, context.length + block_size, device=device)[None]  # (1, B)
    ctx_k, ctx_v = context.kv()
    hidden = drafter(noise_embeds, positions, ctx_k, ctx_v, context.positions)  # (1, B, H)
    return target.lm_head(hidden[0, 1:])  # (B-1, V): position j predicts the token AT t+j


def prompt_lookup(tokens: list[int], num_draft: int, prompt_lookup_min: int = 2, prompt_lookup_max: int = 5) -> list[int]:
    """vLLM's ``ngram`` proposer, in plain Python.

    Find the longest n-gram (prompt_lookup_min <= n <= prompt_lookup_max) that
    ends the sequence and also occurs earlier in it; propose up to ``num_draft``
    tokens that followed its earliest earlier occurrence. No match, no draft.
    """
    T = len(tokens)
    for n in range(min(prompt_lookup_max, T - 1), prompt_lookup_min - 1, -1):
        suffix = tokens[T - n:]
        for start in range(T - n):  # earlier occurrences (they may overlap the suffix)
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + num_draft]
    return []


@dataclass
class PromptLookupDrafter:
    """Prompt-lookup drafting (vLLM ``method="ngram"``): drafts copied from the sequence itself.

    Any object with ``block_size`` and ``propose(tokens, num_draft)`` can stand
    in the loop the same way. vLLM's own defaults are prompt_lookup_min =
    prompt_lookup_max = 5; a shorter minimum finds more matches in short prompts.
    """

    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    block_size: int = 16  # default block: 1 real token + up to 15 drafts, like the DFlash drafter
    max_block_size: int | None = None  # no model, no limit

    def __post_init__(self):
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={self.prompt_lookup_min} must be <= prompt_lookup_max={self.prompt_lookup_max}")

    def propose(self, tokens: list[int], num_draft: int) -> list[int]:
        return prompt_lookup(tokens, num_draft, self.prompt_lookup_min, self.prompt_lookup_max)


# ---------------------------------------------------------------------------
# Statistics: vLLM's counters, plus what a lab wants to see
# ---------------------------------------------------------------------------


@dataclass
class SpecDecodeStats:
    """Speculative-decoding counters with vLLM's definitions.

    num_accepted_tokens_per_pos[i] counts the drafts whose first i+1 drafted
    tokens were all accepted; a draft that proposed nothing is not a draft.
    Stats of several runs merge with ``+`` (``sum(stats_list)`` works too).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)  # per draft: 1 + accepted (bonus included)
    num_generated_tokens: int = 0  # tokens emitted after the prompt
    num_target_forwards: int = 0  # prefill + one verification per step
    drafter_time_s: float = 0.0  # drafter forwards + context K/V appends
    target_time_s: float = 0.0  # prefill + verification forwards

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Count one verified draft, exactly as vLLM's SpecDecodingStats.observe_draft does."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} of {num_draft_tokens} draft tokens is impossible")
        if len(self.num_accepted_tokens_per_pos) < num_draft_tokens:
            self.num_accepted_tokens_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
        self.acceptance_lengths.append(1 + num_accepted_tokens)

    # --- what vLLM logs ------------------------------------------------------
    @property
    def num_speculative_tokens(self) -> int:
        return len(self.num_accepted_tokens_per_pos)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per verification, the bonus token included."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        """Fraction of drafts whose first i+1 tokens were all accepted."""
        return [c / self.num_drafts if self.num_drafts else 0.0 for c in self.num_accepted_tokens_per_pos]

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    # --- derived views for the lab -------------------------------------------
    @property
    def conditional_acceptance_rate(self) -> list[float]:
        """P(position i accepted | positions < i accepted): per_pos[i] / per_pos[i-1]."""
        prev = [self.num_drafts] + self.num_accepted_tokens_per_pos[:-1]
        return [c / p if p else math.nan for c, p in zip(self.num_accepted_tokens_per_pos, prev)]

    def acceptance_length_counts(self) -> list[int]:
        """counts[a-1] = drafts with acceptance length a (1 .. K+1).

        Exact from the per-position counters alone (a draft with n accepted adds
        1 to positions 0..n-1), so it works for stats read from vLLM's /metrics too.
        """
        per_pos = self.num_accepted_tokens_per_pos
        at_least = [self.num_drafts] + per_pos + [0]  # drafts with >= n accepted, n = 0 .. K+1
        return [at_least[n] - at_least[n + 1] for n in range(len(per_pos) + 1)]

    @property
    def target_forwards_per_token(self) -> float:
        """Target forwards per generated token: 1.0 for plain decoding, lower is better."""
        return self.num_target_forwards / self.num_generated_tokens if self.num_generated_tokens else math.nan

    # --- merging -------------------------------------------------------------
    def __add__(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        if not isinstance(other, SpecDecodeStats):
            return NotImplemented
        return SpecDecodeStats(
            num_drafts=self.num_drafts + other.num_drafts,
            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
            num_accepted_tokens_per_pos=_per_pos(self, other, 1),
            acceptance_lengths=self.acceptance_lengths + other.acceptance_lengths,
            num_generated_tokens=self.num_generated_tokens + other.num_generated_tokens,
            num_target_forwards=self.num_target_forwards + other.num_target_forwards,
            drafter_time_s=self.drafter_time_s + other.drafter_time_s,
            target_time_s=self.target_time_s + other.target_time_s,
        )

    def __radd__(self, other):
        return self if other == 0 else NotImplemented  # so that sum(list_of_stats) works

    def __sub__(self, other: "SpecDecodeStats") -> "SpecDecodeStats":
        """Counters of ``self`` minus ``other``: a run between two scrapes of vLLM's cumulative counters."""
        if not isinstance(other, SpecDecodeStats):
            return NotImplemented
        diff = SpecDecodeStats(
            num_drafts=self.num_drafts - other.num_drafts,
            num_draft_tokens=self.num_draft_tokens - other.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - other.num_accepted_tokens,
            num_accepted_tokens_per_pos=_per_pos(self, other, -1),
            num_generated_tokens=self.num_generated_tokens - other.num_generated_tokens,
            num_target_forwards=self.num_target_forwards - other.num_target_forwards,
        )
        if min([diff.num_drafts, diff.num_draft_tokens, diff.num_accepted_tokens, *diff.num_accepted_tokens_per_pos]) < 0:
            raise ValueError("counters went down: subtract the EARLIER stats from the later ones (did the server restart?)")
        return diff

    def summary(self, digits: int = 3) -> dict:
        """The headline numbers, rounded (small enough to print in a notebook); None where undefined."""
        r = lambda x: (round(x, digits) if math.isfinite(x) else None) if isinstance(x, float) else x  # noqa: E731
        return {
            "drafts": self.num_drafts,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": r(self.mean_acceptance_length),
            "per_position_acceptance_rate": [r(x) for x in self.per_position_acceptance_rate],
        }


def _per_pos(a: SpecDecodeStats, b: SpecDecodeStats, sign: int) -> list[int]:
    """a's per-position counts plus (sign=1) or minus (sign=-1) b's; the shorter list counts as zeros."""
    x, y = a.num_accepted_tokens_per_pos, b.num_accepted_tokens_per_pos
    n = max(len(x), len(y))
    x, y = x + [0] * (n - len(x)), y + [0] * (n - len(y))
    return [i + sign * j for i, j in zip(x, y)]


@dataclass
class SpecDecodeStep:
    """What one step proposed and what it kept (for colouring tokens by their origin)."""

    position: int  # position of the first token this step emitted
    draft_ids: list[int]  # d_1 .. d_K (empty for the prefill, or when prompt lookup found nothing)
    num_accepted: int  # drafts kept
    token_ids: list[int]  # emitted: draft_ids[:num_accepted] + [target token], cut at a stop


@dataclass
class SpecDecodeResult:
    output_ids: torch.Tensor  # (1, prompt + generated)
    stats: SpecDecodeStats
    steps: list[SpecDecodeStep] = field(default_factory=list)
    prompt_length: int = 0
    context: DFlashContext | None = field(default=None, repr=False)  # the drafter's final context K/V

    @property
    def new_token_ids(self) -> list[int]:
        return self.output_ids[0, self.prompt_length:].tolist()


# ---------------------------------------------------------------------------
# The target's KV cache
# ---------------------------------------------------------------------------


def new_target_cache() -> DynamicCache:
    """A cache that can be cropped back after a rejected block.

    Built WITHOUT the model config: every layer is a full ``DynamicLayer``. A
    config-built cache gives sliding layers a ring of the last ``window`` tokens,
    which cannot be rolled back; here the sliding window stays what it is in the
    target's attention, a mask.
    """
    return DynamicCache()


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer.

    ``crop(-n)`` removes n tokens in every transformers version we support
    (5.20 rejects a positive argument; older ones read it as the new length).
    ``crop(0)`` is avoided: older versions read it as "keep nothing".
    """
    surplus = cache.get_seq_length() - length
    if surplus < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if surplus:
        cache.crop(-surplus)


def verify_forward(target, input_ids: torch.Tensor, cache: DynamicCache, start: int, layer_ids: list[int]):
    """The target over input_ids (1, n) at positions start .. start+n-1 -> (logits (n, V), aux (n, .) or None)."""
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
    if layer_ids:
        out = target_forward(target, input_ids, layer_ids, past_key_values=cache, position_ids=positions)
        return out.logits[0], out.aux_hidden[0]
    out = target(input_ids=input_ids, past_key_values=cache, use_cache=True, position_ids=positions)
    return out.logits[0], None


# ---------------------------------------------------------------------------
# Argument checks: every error names the argument
# ---------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _param(module):
    try:
        return next(module.parameters())
    except (StopIteration, AttributeError):
        return None


def check_generation_args(target, drafter, input_ids, *, max_new_tokens, block_size, temperature, top_p, top_k,
                          seed, stop_token_ids):
    """Validate everything ``speculative_generate`` is given; return (prompt (1, T), block_size, stop set)."""
    config = getattr(target, "config", None)
    vocab, max_pos = getattr(config, "vocab_size", None), getattr(config, "max_position_embeddings", None)
    if vocab is None or max_pos is None or _param(target) is None:
        raise TypeError(f"target must be a LagunaForCausalLM (a model with a config), got {type(target).__name__}")
    t_param = _param(target)

    # drafter
    if isinstance(drafter, DFlashLagunaDrafter):
        drafter.config.validate_against_target(config)
        d_param = _param(drafter)
        if d_param.device != t_param.device:
            raise ValueError(f"target and drafter must be on the same device: target on {t_param.device}, "
                             f"drafter on {d_param.device} (move one with .to(device))")
        if d_param.dtype != t_param.dtype:
            raise ValueError(f"target and drafter must have the same dtype: target {t_param.dtype}, "
                             f"drafter {d_param.dtype} (convert one with .to(dtype))")
        max_block = drafter.config.block_size
    elif callable(getattr(drafter, "propose", None)):
        max_block = getattr(drafter, "max_block_size", None)
    else:
        raise TypeError(f"drafter must be a DFlashLagunaDrafter, 'ngram' or a proposer with "
                        f"propose(tokens, num_draft), got {type(drafter).__name__}")

    # block_size
    if block_size is None:
        block_size = drafter.config.block_size if isinstance(drafter, DFlashLagunaDrafter) else getattr(drafter, "block_size", None)
        if block_size is None:
            raise ValueError(f"block_size must be given: {type(drafter).__name__} has no default block_size")
    if not _is_int(block_size):
        raise TypeError(f"block_size must be an integer, got {block_size!r}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (1 real token + at least 1 draft), got {block_size}")
    if max_block is not None and block_size > max_block:
        raise ValueError(f"block_size {block_size} is larger than the drafter supports "
                         f"(its config.block_size is {max_block})")

    # prompt
    if isinstance(input_ids, (list, tuple)):
        input_ids = torch.tensor(input_ids, dtype=torch.long)
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a LongTensor of token ids or a list of ints, got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must hold one sequence, shape (1, T) or (T,), got {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.long, torch.int, torch.int16, torch.int8, torch.uint8):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if input_ids.shape[1] > max_pos:
        raise ValueError(f"input_ids has {input_ids.shape[1]} tokens, longer than the target's "
                         f"max_position_embeddings ({max_pos})")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(f"input_ids holds token id {lo if lo < 0 else hi}, outside the vocabulary [0, {vocab})")

    # lengths and sampling
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if seed is not None and (not _is_int(seed) or seed < 0):
        raise ValueError(f"seed must be None or a non-negative integer, got {seed!r}")
    if stop_token_ids is None:
        stop = set()
    else:
        if isinstance(stop_token_ids, torch.Tensor):
            stop_token_ids = stop_token_ids.tolist()
        stop_list = [stop_token_ids] if _is_int(stop_token_ids) else list(stop_token_ids)
        bad = [s for s in stop_list if not _is_int(s) or not 0 <= s < vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad}")
        stop = set(stop_list)
    return input_ids.to(t_param.device, torch.long), block_size, stop


@contextmanager
def _timed(stats: SpecDecodeStats, attr: str, device: torch.device):
    """Add the wall time of the block to stats.<attr> (synchronising a GPU on both ends)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    setattr(stats, attr, getattr(stats, attr) + time.perf_counter() - t0)


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------


@torch.no_grad()
def speculative_generate(target, drafter, input_ids, *, max_new_tokens: int, block_size: int | None = None,
                         temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                         stop_token_ids=None) -> SpecDecodeResult:
    """Generate with speculative decoding; the output is distributed exactly as the target's own.

    target: a ``LagunaForCausalLM``; its KV cache, embedding table and lm_head are used.
    drafter: a ``DFlashLagunaDrafter``, ``"ngram"`` (prompt lookup, see
        ``PromptLookupDrafter``) or any object with ``propose(tokens, num_draft)``.
    input_ids: one prompt, (1, T) or (T,).
    block_size: tokens per block, 1 real + (block_size - 1) drafts; default the
        drafter's config.block_size.
    temperature / top_p / top_k: 0 is greedy; otherwise rejection sampling with
        the same processing applied to drafter and target distributions.
    seed: seeds the sampling generator (None: torch's global RNG).
    stop_token_ids: generation ends right after emitting one of them (it is
        kept in the output). None: only max_new_tokens ends it.
    Generation also ends when the sequence reaches the target's
    max_position_embeddings.
    """
    if isinstance(drafter, str):
        if drafter != "ngram":
            raise ValueError(f"drafter must be a DFlashLagunaDrafter, 'ngram' or a proposer, got {drafter!r}")
        drafter = PromptLookupDrafter()
    prompt, block_size, stop = check_generation_args(
        target, drafter, input_ids, max_new_tokens=max_new_tokens, block_size=block_size, temperature=temperature,
        top_p=top_p, top_k=top_k, seed=seed, stop_token_ids=stop_token_ids)
    device, dtype = prompt.device, _param(target).dtype
    is_dflash = isinstance(drafter, DFlashLagunaDrafter)
    layer_ids = list(drafter.config.target_layer_ids) if is_dflash else []
    greedy = temperature == 0
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    max_pos = target.config.max_position_embeddings
    T = prompt.shape[1]
    max_len = min(T + max_new_tokens, max_pos)  # the output never grows past this

    tokens = prompt[0].tolist()
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * (block_size - 1))
    steps: list[SpecDecodeStep] = []
    context = DFlashContext(drafter, max_len, device, dtype) if is_dflash else None  # accepted positions < max_len

    def emit(new: list[int]) -> tuple[list[int], bool]:
        """Append tokens until a stop token or the length limit; say whether generation is done."""
        kept = []
        for tok in new:
            tokens.append(tok)
            kept.append(tok)
            if tok in stop or len(tokens) >= max_len:
                return kept, True
        return kept, False

    if max_len <= T:
        return SpecDecodeResult(prompt.clone(), stats, steps, T, context)

    # Prefill: the target reads the prompt; its last prediction is the first new token.
    cache = new_target_cache()
    with _timed(stats, "target_time_s", device):
        logits, aux = verify_forward(target, prompt, cache, 0, layer_ids)
    stats.num_target_forwards += 1
    if is_dflash:
        with _timed(stats, "drafter_time_s", device):
            context.append(drafter, aux)  # positions 0 .. T-1
    if greedy:
        first = int(logits[-1].argmax())
    else:
        first = int(sample(logits_to_probs(logits[-1], temperature, top_k, top_p), generator))
    kept, done = emit([first])
    steps.append(SpecDecodeStep(position=T, draft_ids=[], num_accepted=0, token_ids=kept))

    while not done:
        t = len(tokens) - 1  # position of x_t, the newest token; the target's cache holds 0 .. t-1
        num_draft = min(block_size - 1, max_pos - 1 - t)  # block positions stay below max_position_embeddings

        # 1. Draft d_1 .. d_K.
        draft_probs = None
        with _timed(stats, "drafter_time_s", device):
            if is_dflash:
                draft_logits = dflash_draft_logits(drafter, target, context, tokens[-1], num_draft + 1)  # (K, V)
                if greedy:
                    draft = draft_logits.argmax(-1)
                else:
                    draft_probs = logits_to_probs(draft_logits, temperature, top_k, top_p)  # (K, V) q
                    draft = sample(draft_probs, generator)
            else:
                draft = torch.tensor(drafter.propose(tokens, num_draft)[:num_draft], dtype=torch.long, device=device)
        num_draft = draft.shape[0]  # prompt lookup may find fewer, or none

        # 2. Verify [x_t, d_1 .. d_K] in ONE target forward.
        block = torch.cat([torch.tensor([tokens[-1]], device=device), draft])[None]  # (1, K+1)
        with _timed(stats, "target_time_s", device):
            logits, aux = verify_forward(target, block, cache, t, layer_ids)  # (K+1, V): positions t+1 .. t+K+1
        stats.num_target_forwards += 1

        # 3. Accept a prefix of the draft, then one token from the target.
        if greedy:
            n, next_token = greedy_accept(draft, logits.argmax(-1))
        else:
            n, next_token = rejection_sample(draft, draft_probs, logits_to_probs(logits, temperature, top_k, top_p), generator)
        if num_draft:
            stats.observe_draft(num_draft, n)
        draft_ids = draft.tolist()
        kept, done = emit(draft_ids[:n] + [next_token])
        steps.append(SpecDecodeStep(position=t + 1, draft_ids=draft_ids, num_accepted=n, token_ids=kept))

        # 4. Keep what was accepted: x_t and d_1 .. d_n are now part of the sequence.
        crop_cache(cache, t + n + 1)
        if is_dflash and not done:
            with _timed(stats, "drafter_time_s", device):
                context.append(drafter, aux[: n + 1])  # positions t .. t+n, nothing recomputed

    stats.num_generated_tokens = len(tokens) - T
    output = torch.tensor([tokens], dtype=torch.long, device=device)
    return SpecDecodeResult(output, stats, steps, T, context)


def prompt_lookup_generate(target, input_ids, *, max_new_tokens: int, block_size: int = 16, prompt_lookup_min: int = 2,
                           prompt_lookup_max: int = 5, **kwargs) -> SpecDecodeResult:
    """``speculative_generate`` with prompt-lookup drafts (vLLM's ``ngram`` method)."""
    drafter = PromptLookupDrafter(prompt_lookup_min, prompt_lookup_max, block_size)
    return speculative_generate(target, drafter, input_ids, max_new_tokens=max_new_tokens, block_size=block_size, **kwargs)


def generate_on_prompts(target, drafter, prompts, *, max_new_tokens: int, seed: int | None = None,
                        progress: bool = True, desc: str | None = None, **kwargs):
    """Run ``speculative_generate`` on every prompt; return (merged stats, results).

    Prompt i is sampled with seed + i (when a seed is given), so runs are
    reproducible and prompts are independent.
    """
    from tqdm.auto import tqdm

    results = []
    for i, prompt in enumerate(tqdm(prompts, desc=desc or "speculative decoding", disable=not progress, leave=False)):
        results.append(speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens,
                                            seed=None if seed is None else seed + i, **kwargs))
    return sum((r.stats for r in results), SpecDecodeStats()), results


def main(argv=None) -> None:
    """Acceptance of the shipped pair on the held-out prompts, DFlash vs prompt lookup:

        python -m dflash_lab.spec_decode --prompts 48 --max-new-tokens 64 --block-sizes 4 8 16
    """
    import argparse
    import json

    from .assets import default_device, heldout_prompts, load_default_pair

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=48, help="held-out prompts to use")
    p.add_argument("--prompt-tokens", type=int, default=64, help="keep the last N tokens of each prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    target, drafter, tokenizer = load_default_pair(device=default_device())
    prompts = [tokenizer(q["text"])["input_ids"][-args.prompt_tokens:] for q in heldout_prompts()[:args.prompts]]
    rows = []
    for method, proposer in (("DFlash", drafter), ("prompt lookup", "ngram")):
        for block in args.block_sizes:
            stats, _ = generate_on_prompts(target, proposer, prompts, max_new_tokens=args.max_new_tokens, block_size=block,
                                           temperature=args.temperature, seed=0, desc=f"{method}, block {block}")
            rows.append({"method": method, "block_size": block, **stats.summary(),
                         "target_forwards_per_token": round(stats.target_forwards_per_token, 3)})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
