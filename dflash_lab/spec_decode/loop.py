"""The decode loop: draft a block, verify it, keep the agreed prefix.

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
same code. Argument checks run before the loop and timing wraps its calls, so
``speculative_generate`` reads as the four steps above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..config import DEFAULT_BLOCK_SIZE
from ..runtime import first_parameter, is_int, synchronized_time
from ..target import target_forward
from .proposers import DFlashContext, PromptLookupDrafter, check_block_size, resolve_drafter
from .sampling import DRAFT_SAMPLE_METHODS, draft_distribution, logits_to_probs, make_verifier, sample
from .stats import SpecDecodeStats
from .tree import DraftTree, accept_path, build_draft_tree, check_budget, compact_cache, tree_attention_masks

# ---------------------------------------------------------------------------
# What a run returns
# ---------------------------------------------------------------------------


@dataclass
class SpecDecodeStep:
    """What one step proposed and what it kept (for colouring tokens by their origin)."""

    position: int  # position of the first token this step emitted
    draft_ids: list[int]  # d_1 .. d_K (empty for the prefill, or when prompt lookup found nothing)
    num_accepted: int  # drafts kept
    token_ids: list[int]  # emitted: draft_ids[:num_accepted] + [target token], cut at a stop
    # For a step-through (viz.step_through): what went in and what the target preferred.
    block_ids: list[int] = field(default_factory=list)  # the drafter's input [x_t, MASK x K] (DFlash only)
    target_argmax: list[int] = field(default_factory=list)  # target's top token after x_t, d_1 .. d_K (K+1)
    # A tree step (``tree_budget``): the tree verified (one row), draft_ids are its accepted path's tokens
    # and target_argmax has the target's choice after every tree index (N+1).
    tree: DraftTree | None = field(default=None, repr=False)


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
# The target's KV cache and its verification forward
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


def verify_forward(target, input_ids: torch.Tensor, cache: DynamicCache, start: int, layer_ids: list[int],
                   tree: DraftTree | None = None):
    """The target over input_ids (1, n) at positions start .. start+n-1 -> (logits (n, V), aux (n, .) or None).

    ``tree``: input_ids are [x_t, the tree's nodes], at positions start + depth under the tree's mask.
    """
    mask = None
    if tree is None:
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
    else:
        positions = start + tree.depths_with_root()
        mask = tree_attention_masks(tree, start, target.config, first_parameter(target).dtype)
    if layer_ids:
        out = target_forward(target, input_ids, layer_ids, past_key_values=cache, position_ids=positions,
                             attention_mask=mask)
        return out.logits[0], out.aux_hidden[0]
    out = target(input_ids=input_ids, past_key_values=cache, use_cache=True, position_ids=positions,
                 attention_mask=mask)
    return out.logits[0], None


# ---------------------------------------------------------------------------
# Argument checks: every error names the argument
# ---------------------------------------------------------------------------


def check_generation_args(target, drafter, input_ids, *, max_new_tokens, block_size, temperature, top_p, top_k,
                          seed, stop_token_ids, draft_sample_method="greedy"):
    """Validate everything ``speculative_generate`` is given; return (prompt (1, T), block_size, stop set)."""
    config = getattr(target, "config", None)
    vocab, max_pos = getattr(config, "vocab_size", None), getattr(config, "max_position_embeddings", None)
    if vocab is None or max_pos is None or first_parameter(target) is None:
        raise TypeError(f"target must be a LagunaForCausalLM (a model with a config), got {type(target).__name__}")
    t_param = first_parameter(target)

    # drafter
    drafter = resolve_drafter(drafter)
    drafter.check_target(target)
    block_size = check_block_size(block_size, drafter)

    # prompt
    if isinstance(input_ids, (list, tuple)):
        input_ids = torch.tensor(input_ids, dtype=torch.long)
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError("input_ids must be a LongTensor of token ids or a list of ints, "
                        f"got {type(input_ids).__name__}")
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
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if draft_sample_method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_sample_method must be one of {list(DRAFT_SAMPLE_METHODS)} (vLLM's "
                         f"SpeculativeConfig.draft_sample_method), got {draft_sample_method!r}")
    if seed is not None and (not is_int(seed) or seed < 0):
        raise ValueError(f"seed must be None or a non-negative integer, got {seed!r}")
    if stop_token_ids is None:
        stop = set()
    else:
        if isinstance(stop_token_ids, torch.Tensor):
            stop_token_ids = stop_token_ids.tolist()
        stop_list = [stop_token_ids] if is_int(stop_token_ids) else list(stop_token_ids)
        bad = [s for s in stop_list if not is_int(s) or not 0 <= s < vocab]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), got {bad}")
        stop = set(stop_list)
    return input_ids.to(t_param.device, torch.long), block_size, stop


# ---------------------------------------------------------------------------
# Around the loop: timing, and drafting from either kind of proposer
# ---------------------------------------------------------------------------


def _timed(stats: SpecDecodeStats, attr: str, device: torch.device, fn):
    """``fn``, also adding each call's wall time to stats.<attr> (the device synchronised on both ends)."""

    def timed_fn(*args, **kwargs):
        start = synchronized_time(device)
        out = fn(*args, **kwargs)
        setattr(stats, attr, getattr(stats, attr) + synchronized_time(device) - start)
        return out

    return timed_fn


def _propose(session, tokens: list[int], num_draft: int, *, sampled: bool, to_probs, generator):
    """The session's drafts d_1 .. d_K (K,) and, when they are sampled from the drafter, q (K, V); its Proposal.

    Not ``sampled``: the drafter's argmax, q one-hot (None) — greedy decoding, or vLLM's default
    draft_sample_method="greedy" when sampling. ``to_probs`` gives q: temperature only (``draft_distribution``).
    A proposer without a model (prompt lookup) gives K <= num_draft drafts and q one-hot.
    """
    proposal = session.propose(tokens, num_draft)
    if not sampled or proposal.logits is None:
        return proposal.ids, None, proposal
    q = to_probs(proposal.logits)  # (K, V)
    return sample(q, generator), q, proposal


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------


@torch.no_grad()
def speculative_generate(target, drafter, input_ids, *, max_new_tokens: int, block_size: int | None = None,
                         temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                         stop_token_ids=None, draft_sample_method: str = "greedy",
                         rejection_sample_method: str = "standard", synthetic_acceptance_rates=None,
                         synthetic_acceptance_length=None, fly_window_size=None, fly_entropy_threshold: float = 0.3,
                         fly_entropy_top_k: int = 3, tree_budget: int | None = None) -> SpecDecodeResult:
    """Generate with speculative decoding; the output is distributed exactly as the target's own.

    target: a ``LagunaForCausalLM``; its KV cache, embedding table and lm_head are used.
    drafter: a ``DFlashLagunaDrafter``, ``"ngram"`` (prompt lookup, see
        ``PromptLookupDrafter``), None (no drafter: plain decoding through the same loop)
        or any object with ``propose(tokens, num_draft)``.
    input_ids: one prompt, (1, T) or (T,).
    block_size: tokens per block, 1 real + (block_size - 1) drafts = vLLM's
        num_speculative_tokens + 1. Default: the drafter's dflash_config.block_size (the lab's
        convenience: vLLM 0.33 never reads that key for DFlash and requires
        num_speculative_tokens, config/speculative.py:1614-1618). A block larger than the
        trained one runs, as in vLLM, which checks it against nothing.
    temperature / top_p / top_k: 0 is greedy; otherwise rejection sampling against the
        target's distribution after temperature, top-k and top-p. Sampled drafts and their q
        use the temperature only, as vLLM's (``sampling.draft_distribution``): lossless either way,
        but with top-k / top-p set a draft can fall outside the target's kept set.
    seed: seeds the sampling generator (None: torch's global RNG).
    stop_token_ids: generation ends right after emitting one of them (it is
        kept in the output). None: only max_new_tokens ends it.
    draft_sample_method: when sampling (temperature > 0), how DFlash drafts are chosen, as
        vLLM's option of that name: "greedy" (vLLM's default: the drafter's argmax, q
        one-hot in the accept test) or "probabilistic" (drafts sampled from q). Both are
        lossless; they accept differently. Greedy decoding ignores it.
    rejection_sample_method: the verification rule, as vLLM's option of that name
        (``sampling.make_verifier``): "standard" (default), "block" (block verification,
        lossless), "fly" (FLy's deferred window, lossy; ``fly_window_size`` default
        min(6, block_size - 2), ``fly_entropy_threshold``, ``fly_entropy_top_k``) or
        "synthetic" (accept with ``synthetic_acceptance_rates``, one unconditional rate per
        draft position, or ``synthetic_acceptance_length``; lossy, for load tests).
    tree_budget: DDTree (``tree.py``): instead of the block's chain, verify the ``tree_budget``
        prefixes of highest path probability under the block's per-depth distributions, in one
        target forward with a tree mask (DFlash drafters; its own lossless rule, so
        rejection_sample_method stays "standard" and draft_sample_method "greedy").
    Generation also ends when the sequence reaches the target's
    max_position_embeddings.
    """
    drafter = resolve_drafter(drafter)  # refuses what is none of the kinds it names
    prompt, block_size, stop = check_generation_args(
        target, drafter, input_ids, max_new_tokens=max_new_tokens, block_size=block_size, temperature=temperature,
        top_p=top_p, top_k=top_k, seed=seed, stop_token_ids=stop_token_ids, draft_sample_method=draft_sample_method)
    verifier = make_verifier(rejection_sample_method, block_size - 1,
                             synthetic_acceptance_rates=synthetic_acceptance_rates,
                             synthetic_acceptance_length=synthetic_acceptance_length, fly_window_size=fly_window_size,
                             fly_entropy_threshold=fly_entropy_threshold, fly_entropy_top_k=fly_entropy_top_k)
    if tree_budget is not None:
        if drafter.kind != "dflash":
            raise ValueError("tree_budget builds a tree from a DFlash block's distributions; "
                             f"drafter is {drafter.kind!r}")
        if rejection_sample_method != "standard" or draft_sample_method != "greedy":
            raise ValueError("a draft tree has its own lossless rule: leave rejection_sample_method 'standard' and "
                             f"draft_sample_method 'greedy' (got {rejection_sample_method!r}, {draft_sample_method!r})")
        tree_budget = check_budget(tree_budget, target.config.vocab_size, block_size - 1)
    device, dtype = prompt.device, first_parameter(target).dtype
    greedy = temperature == 0
    to_probs = partial(logits_to_probs, temperature=temperature, top_k=top_k, top_p=top_p)  # the target's p
    generator = torch.Generator(device).manual_seed(seed) if seed is not None else None
    max_pos = target.config.max_position_embeddings
    T = prompt.shape[1]
    max_len = min(T + max_new_tokens, max_pos)  # the output never grows past this

    tokens = prompt[0].tolist()
    stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * (block_size - 1),
                            draft_sample_method=draft_sample_method if drafter.drafts_from_model and not greedy
                            else None)
    steps: list[SpecDecodeStep] = []
    session = drafter.session(target, capacity=max_len, device=device, dtype=dtype)  # accepted positions < max_len
    if max_len <= T:
        return SpecDecodeResult(prompt.clone(), stats, steps, T, session.context)

    # The three calls that do the work, each timed into stats.
    propose = _timed(stats, "drafter_time_s", device, partial(
        _propose, session, sampled=not greedy and draft_sample_method == "probabilistic",
        to_probs=partial(draft_distribution, temperature=temperature), generator=generator))
    verify = _timed(stats, "target_time_s", device, partial(verify_forward, target, layer_ids=list(drafter.layer_ids)))
    extend = _timed(stats, "drafter_time_s", device, session.extend)  # the context append (DFlash: its K/V)
    build_tree = _timed(stats, "drafter_time_s", device, partial(build_draft_tree, budget=tree_budget))

    def emit(new: list[int]) -> tuple[list[int], bool]:
        """Append tokens until a stop token or the length limit; say whether generation is done."""
        kept = []
        for tok in new:
            tokens.append(tok)
            kept.append(tok)
            if tok in stop or len(tokens) >= max_len:
                return kept, True
        return kept, False

    # Prefill: the target reads the prompt; its last prediction is the first new token.
    cache = new_target_cache()
    logits, aux = verify(prompt, cache, 0)
    stats.num_target_forwards += 1
    extend(aux)  # positions 0 .. T-1
    first = int(logits[-1].argmax()) if greedy else int(sample(to_probs(logits[-1]), generator))
    kept, done = emit([first])
    steps.append(SpecDecodeStep(position=T, draft_ids=[], num_accepted=0, token_ids=kept,
                                target_argmax=[int(logits[-1].argmax())]))

    while not done:
        t = len(tokens) - 1  # position of x_t, the newest token; the target's cache holds 0 .. t-1
        num_draft = min(block_size - 1, max_pos - 1 - t)  # block positions stay below max_position_embeddings

        # 1. Draft d_1 .. d_K (DDTree: the tree of the block's best prefixes).
        draft, draft_probs, proposal = propose(tokens, num_draft)  # (K,), (K, V) q or None
        num_draft = draft.shape[0]  # prompt lookup may find fewer, or none
        tree = build_tree(proposal.logits) if tree_budget and num_draft else None

        # 2. Verify [x_t, d_1 .. d_K] (or [x_t, the tree's nodes]) in ONE target forward.
        nodes = draft if tree is None else tree.token_ids[0]
        block = torch.cat([torch.tensor([tokens[-1]], device=device), nodes])[None]  # (1, K+1)
        logits, aux = verify(block, cache, t, tree=tree)  # (K+1, V): positions t+1 .. t+K+1
        stats.num_target_forwards += 1

        # 3. Accept a prefix of the draft (a path of the tree), then one token from the target.
        if tree is None:
            n, next_token = verifier(draft, draft_probs, logits, to_probs, greedy=greedy, generator=generator)
            if num_draft:
                stats.observe_draft(num_draft, n)
            draft_ids, path = draft.tolist(), list(range(n + 1))
        else:
            choice = logits.argmax(-1) if greedy else sample(to_probs(logits), generator)  # the target's rule
            n, path, next_token = (x[0] for x in accept_path(tree, choice[None]))
            n, next_token = int(n), int(next_token)
            path = path[:n + 1].tolist()
            stats.observe_draft(tree.num_nodes, n, depth=num_draft)
            draft_ids = [int(tree.token_ids[0, i - 1]) for i in path[1:]]
        kept, done = emit(draft_ids[:n] + [next_token])
        steps.append(SpecDecodeStep(
            position=t + 1, draft_ids=draft_ids, num_accepted=n, token_ids=kept,
            block_ids=proposal.block_ids, target_argmax=logits.argmax(-1).tolist(), tree=tree))

        # 4. Keep what was accepted: x_t and d_1 .. d_n are now part of the sequence.
        if tree is None:
            crop_cache(cache, t + n + 1)
        else:
            compact_cache(cache, t, path)  # the path's K/V at the slots of positions t+1 .. t+n
        if not done:
            extend(aux[path] if aux is not None else None)  # positions t .. t+n, nothing recomputed

    stats.num_generated_tokens = len(tokens) - T
    output = torch.tensor([tokens], dtype=torch.long, device=device)
    return SpecDecodeResult(output, stats, steps, T, session.context)


def prompt_lookup_generate(target, input_ids, *, max_new_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE,
                           prompt_lookup_min: int = 2, prompt_lookup_max: int = 5, **kwargs) -> SpecDecodeResult:
    """``speculative_generate`` with prompt-lookup drafts (vLLM's ``ngram`` method)."""
    drafter = PromptLookupDrafter(prompt_lookup_min, prompt_lookup_max, block_size)
    return speculative_generate(target, drafter, input_ids, max_new_tokens=max_new_tokens, block_size=block_size,
                                **kwargs)


def generate_on_prompts(target, drafter, prompts, *, max_new_tokens: int, seed: int | None = None,
                        progress: bool = True, desc: str | None = None, **kwargs):
    """Run ``speculative_generate`` on every prompt; return (merged stats, results).

    Prompt i is sampled with seed + i (when a seed is given), so runs are
    reproducible and prompts are independent.
    """
    results = []
    for i, prompt in enumerate(tqdm(prompts, desc=desc or "speculative decoding", disable=not progress, leave=False)):
        results.append(speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens,
                                            seed=None if seed is None else seed + i, **kwargs))
    return sum((r.stats for r in results), SpecDecodeStats()), results
