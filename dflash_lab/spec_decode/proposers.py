"""Proposers: where the drafts come from, behind one interface every backend calls.

    DFlash         ONE drafter forward over [x_t, MASK x (B-1)], conditioned on
                   the context K/V of every accepted position (``DFlashContext``);
                   the target's lm_head turns its hidden states into B-1 drafts
    prompt lookup  no model: copy what followed an earlier occurrence of the
                   sequence's last n-gram (vLLM's ``ngram`` method); ``"ngram"`` as the CPU
                   engine's V1 runner proposes, ``"ngram_gpu"`` as vLLM 0.33 drafts on a GPU
                   (``spec_decode.ngram_gpu``: on the device, inside the fast path's graph)
    no drafter     ``drafter=None`` everywhere: nothing is proposed, so the loop is plain
                   greedy decoding with the same overheads

The interface (``Proposer``), as vLLM's proposers share one (``v1/spec_decode/``):

    session(target, capacity=..)      one generation on the eager loop: ``extend(aux)`` takes the
                                      accepted positions' target features (the context append),
                                      ``propose(tokens, num_draft)`` gives a ``Proposal``
    device_session(target, batch=..)  the same on the fast path's static buffers, or None when the
                                      proposer drafts on the host from the tokens (prompt lookup)
    block_size, max_block_size        the default block and the largest one it supports
    layer_ids                         the target layers whose hidden states it reads

``resolve_drafter`` turns every backend's ``drafter`` argument into one (or refuses it), so a
backend never asks which method it runs. (vLLM: ``v1/spec_decode/dflash.py`` and
``v1/spec_decode/ngram_proposer.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from ..block_attention import draft_block_ids
from ..config import DEFAULT_BLOCK_SIZE
from ..drafter import DFlashLagunaDrafter
from ..runtime import first_parameter, is_int
from .fast.static_drafter import StaticDrafter
from .ngram_gpu import check_ngram_sizes, ngram_gpu_drafts

# ---------------------------------------------------------------------------
# The interface
# ---------------------------------------------------------------------------


class Proposal(NamedTuple):
    """One step's drafts d_1 .. d_K (K may be below the number asked for: prompt lookup finds fewer)."""

    ids: torch.Tensor  # (K,) long
    logits: torch.Tensor | None  # (K, V) the drafter's logits; None: no model, q is one-hot at ids
    block_ids: list[int]  # what went into the drafter ([x_t, MASK x K]); [] without one


class Proposer:
    """What every backend drafts with. A subclass sets the attributes and overrides what differs."""

    kind = "custom"  # a record's name for the method
    block_size: int | None = DEFAULT_BLOCK_SIZE  # used when a backend is given none
    max_block_size: int | None = None  # None: no limit
    layer_ids: tuple[int, ...] = ()  # target layers whose hidden states ``extend`` reads
    proposes = True  # False: never drafts (the fast path then verifies x_t alone, block 1)
    drafts_from_model = False  # True: a Proposal carries the drafter's logits (sampling can draw drafts from q)
    drafts_on_device = False  # True: the fast path drafts it in its graphed step (``ngram_gpu``), not on the host

    def check_target(self, target) -> None:
        """Refuse a target the proposer cannot draft for (a model-free proposer fits any)."""

    def propose(self, tokens: list[int], num_draft: int) -> list[int]:
        """Drafts from the tokens so far alone (a host-side proposer): at most ``num_draft`` ids."""
        raise NotImplementedError(f"{type(self).__name__} drafts on the device only")

    def session(self, target, *, capacity: int, device, dtype):
        """One generation on the eager loop (``HostSession`` unless the proposer reads the target)."""
        return HostSession(self, device)

    def device_session(self, target, *, batch: int, capacity: int, block_size: int):
        """The fast path's drafter on static buffers; None: drafts come from ``propose`` on the host."""
        return None


class HostSession:
    """A generation of a proposer without a model: drafts from the tokens, nothing to append."""

    context = None

    def __init__(self, proposer: Proposer, device):
        self.proposer, self.device = proposer, device

    def extend(self, aux) -> None:
        pass

    def propose(self, tokens: list[int], num_draft: int) -> Proposal:
        ids = list(self.proposer.propose(tokens, num_draft))[:num_draft]
        return Proposal(torch.tensor(ids, dtype=torch.long, device=self.device), None, [])


# ---------------------------------------------------------------------------
# DFlash: the drafter's context K/V, then one forward per block
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
        k, v = drafter.context_kv(aux_hidden, positions)  # (L, n, nkv, hd) each
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
    positions = torch.arange(context.length, context.length + block_size, device=device)[None]  # (1, B)
    ctx_k, ctx_v = context.kv()
    first = torch.tensor([[last_token]], device=device)
    return drafter.block_logits(target, first, positions, context_k=ctx_k, context_v=ctx_v,
                                context_positions=context.positions)[0, 0]  # (B-1, V)


class DFlashSession:
    """One eager generation of a DFlash drafter: its context K/V, and a block forward per step."""

    def __init__(self, drafter: DFlashLagunaDrafter, target, capacity: int, device, dtype):
        self.drafter, self.target = drafter, target
        self.context = DFlashContext(drafter, capacity, device, dtype)  # accepted positions < capacity

    def extend(self, aux: torch.Tensor) -> None:
        """The accepted positions' target features (n, n_aux * H_t): their context K/V, nothing recomputed."""
        self.context.append(self.drafter, aux)

    def propose(self, tokens: list[int], num_draft: int) -> Proposal:
        logits = dflash_draft_logits(self.drafter, self.target, self.context, tokens[-1], num_draft + 1)  # (K, V)
        block = draft_block_ids(torch.tensor(tokens[-1]), num_draft + 1, self.drafter.config.mask_token_id)
        return Proposal(logits.argmax(-1), logits, block.tolist())


class _Wrapper(Proposer):
    """A proposer around one object (its first field): equal to another when both wrap the same object, so a
    decoder cached per proposer is found again for the same drafter (never for an equal-looking copy)."""

    def _wrapped(self):
        return getattr(self, fields(self)[0].name)

    def __eq__(self, other):
        return type(other) is type(self) and other._wrapped() is self._wrapped()

    def __hash__(self):
        return hash((type(self), id(self._wrapped())))


@dataclass(frozen=True, eq=False)  # one drafter, one proposer: equal when they hold the same drafter
class DFlashProposer(_Wrapper):
    """A ``DFlashLagunaDrafter`` behind the interface."""

    drafter: DFlashLagunaDrafter
    kind = "dflash"
    drafts_from_model = True
    max_block_size = None  # vLLM runs any num_speculative_tokens for DFlash, above the trained block too

    @property
    def block_size(self) -> int:
        return self.drafter.config.block_size

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(self.drafter.config.target_layer_ids)

    def check_target(self, target) -> None:
        """The drafter fits the target: its config, and the same device and dtype."""
        self.drafter.config.validate_against_target(target.config)
        d_param, t_param = first_parameter(self.drafter), first_parameter(target)
        if d_param.device != t_param.device:
            raise ValueError(f"target and drafter must be on the same device: target on {t_param.device}, "
                             f"drafter on {d_param.device} (move one with .to(device))")
        if d_param.dtype != t_param.dtype:
            raise ValueError(f"target and drafter must have the same dtype: target {t_param.dtype}, "
                             f"drafter {d_param.dtype} (convert one with .to(dtype))")

    def session(self, target, *, capacity: int, device, dtype) -> DFlashSession:
        return DFlashSession(self.drafter, target, capacity, device, dtype)

    def device_session(self, target, *, batch: int, capacity: int, block_size: int) -> StaticDrafter:
        self.check_target(target)
        return StaticDrafter(self.drafter, target, batch=batch, capacity=capacity, block_size=block_size)


# ---------------------------------------------------------------------------
# Prompt lookup: drafts copied from the sequence itself
# ---------------------------------------------------------------------------


def prompt_lookup(tokens: list[int], num_draft: int, prompt_lookup_min: int = 2,
                  prompt_lookup_max: int = 5) -> list[int]:
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


@dataclass(frozen=True)  # hashable: the fast path keeps one decoder per (drafter, shape)
class PromptLookupDrafter(Proposer):
    """Prompt-lookup drafting (vLLM ``method="ngram"``): drafts copied from the sequence itself.

    vLLM's own defaults are prompt_lookup_min = prompt_lookup_max = 5; a shorter minimum
    finds more matches in short prompts.
    """

    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    block_size: int = DEFAULT_BLOCK_SIZE  # 1 real token + up to 15 drafts, like the DFlash drafter
    max_block_size: int | None = None  # no model, no limit
    kind = "ngram"

    def __post_init__(self):
        check_ngram_sizes(self.prompt_lookup_min, self.prompt_lookup_max)
        if not is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")

    def propose(self, tokens: list[int], num_draft: int) -> list[int]:
        return prompt_lookup(tokens, num_draft, self.prompt_lookup_min, self.prompt_lookup_max)


@dataclass(frozen=True)
class PromptLookupGPUDrafter(PromptLookupDrafter):
    """Prompt lookup as vLLM 0.33 drafts it on a GPU (the V2 runner's ``NgramGPUSpeculator``, for ``method``
    "ngram" and "ngram_gpu" alike; ``spec_decode.ngram_gpu``): the longest n-gram's rightmost match, and always
    ``num_draft`` drafts, the last token repeated where the sequence has no more. The fast path drafts it inside
    its graphed step; the eager loop through ``propose``."""

    kind = "ngram_gpu"
    drafts_on_device = True

    def propose(self, tokens: list[int], num_draft: int) -> list[int]:
        if not tokens or num_draft <= 0:
            return []
        t = torch.tensor([tokens])
        return ngram_gpu_drafts(t, torch.tensor([len(tokens)]), t[:, -1], min_n=self.prompt_lookup_min,
                                max_n=self.prompt_lookup_max, k=num_draft)[0].tolist()


class NoDrafter(Proposer):
    """``drafter=None``: proposes nothing, so every step verifies x_t alone (plain decoding through
    the same loop, the fair baseline). The fast path runs it at block 1."""

    kind = "target"
    block_size = 2  # the eager loop's block: 1 real token + room for a draft that never comes
    proposes = False

    def propose(self, tokens: list[int], num_draft: int) -> list[int]:
        return []


@dataclass(frozen=True, eq=False)
class CustomProposer(_Wrapper):
    """Any object with ``propose(tokens, num_draft)`` (and optionally ``block_size`` / ``max_block_size``)."""

    proposer: object

    @property
    def kind(self) -> str:
        return type(self.proposer).__name__

    @property
    def block_size(self) -> int | None:
        return getattr(self.proposer, "block_size", None)

    @property
    def max_block_size(self) -> int | None:
        return getattr(self.proposer, "max_block_size", None)

    def propose(self, tokens: list[int], num_draft: int) -> list[int]:
        return self.proposer.propose(tokens, num_draft)


# ---------------------------------------------------------------------------
# The one gate every backend passes its ``drafter`` argument through
# ---------------------------------------------------------------------------

DRAFTER_KINDS = "a DFlashLagunaDrafter, 'ngram', 'ngram_gpu', None or a proposer"  # prompt lookup, no drafter, ...


def resolve_drafter(drafter) -> Proposer:
    """What a backend drafts with, as a ``Proposer``.

    A DFlashLagunaDrafter becomes a ``DFlashProposer``, None ``NoDrafter``, "ngram" a
    ``PromptLookupDrafter``, an object with ``propose(tokens, num_draft)`` a ``CustomProposer``;
    anything else is refused, never turned into another method.
    """
    if isinstance(drafter, Proposer):
        return drafter
    if drafter is None:
        return NoDrafter()
    if isinstance(drafter, str):
        if drafter not in ("ngram", "ngram_gpu"):
            raise ValueError(f"drafter must be {DRAFTER_KINDS}, got {drafter!r}")
        return PromptLookupDrafter() if drafter == "ngram" else PromptLookupGPUDrafter()
    if isinstance(drafter, DFlashLagunaDrafter):
        return DFlashProposer(drafter)
    if callable(getattr(drafter, "propose", None)):
        return CustomProposer(drafter)
    raise TypeError(f"drafter must be {DRAFTER_KINDS} with propose(tokens, num_draft), got {type(drafter).__name__}")


def require_dflash(drafter, backend: str) -> DFlashLagunaDrafter:
    """For a backend that only replays DFlash drafts (evaluation): the drafter, else a clear refusal."""
    proposer = resolve_drafter(drafter)
    if not isinstance(proposer, DFlashProposer):
        raise TypeError(f"{backend} replays DFlash drafts: drafter must be a DFlashLagunaDrafter, "
                        f"got {type(drafter).__name__}")
    return proposer.drafter


def check_block_size(block_size, drafter) -> int:
    """``block_size`` B = 1 real token + K = B - 1 drafts (vLLM's num_speculative_tokens + 1), checked once.

    None: the proposer's own (DFlash: the drafter's trained block; vLLM 0.33 itself requires
    num_speculative_tokens). A block above the trained one runs, as in vLLM.
    """
    proposer = resolve_drafter(drafter)
    if block_size is None:
        block_size = proposer.block_size
        if block_size is None:
            raise ValueError(f"block_size must be given: {proposer.kind} has no default block_size")
    if not is_int(block_size):
        raise TypeError(f"block_size must be an integer, got {block_size!r}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (1 real token + at least 1 draft), got {block_size}")
    if proposer.max_block_size is not None and block_size > proposer.max_block_size:
        raise ValueError(f"block_size {block_size} is larger than the drafter supports "
                         f"(its max_block_size is {proposer.max_block_size})")
    return block_size
