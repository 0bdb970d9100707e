"""Fast greedy decoding: static buffers, one CUDA graph per step, several prompts per batch.

    fast_generate(target, drafter, input_ids, max_new_tokens=...)        one prompt -> SpecDecodeResult
    fast_generate_batch(target, drafter, prompts, max_new_tokens=...)    a batch -> list of SpecDecodeResult

``drafter`` is a ``DFlashLagunaDrafter``, ``"ngram"`` (prompt lookup) or None
(no drafter: plain greedy decoding through the same machinery, the fair baseline;
the eager loop spells it the same way). Greedy only; the output is token for token what
``speculative_generate`` and ``target.generate`` give (float32; in bf16 a
different order of computation can flip an argmax near-tie, as in the eager loop).

A DFlash step runs entirely on the device, for every sequence at once:

    draft    ``StaticDrafter.draft``: B-1 drafts per sequence
    verify   ``StaticTarget.forward`` over [x_t, d_1 .. d_{B-1}] at positions t .. t+B-1
    append   the drafter's context K/V of the block positions (``StaticDrafter.append``)
    accept   ``sampling.greedy_accept_batch`` (the eager loop's rule, every row at once):
             n accepted drafts and the next token; the emitted tokens (argmax 0 .. n)
             are written to the output at t+1 .. t+n+1; t += n + 1 (ragged: each
             sequence its own n); each verified draft's (size, n) goes to a device log
             that ``SpecDecodeStats.observe_drafts`` counts at the end; a sequence that
             reached max_new_tokens or emitted a stop token is frozen (its later steps
             change nothing that is read back)

Before the first step, the prefill: every prompt right-padded to a multiple of
PREFILL_STEP tokens, its target forward, the drafter's context K/V and the first token,
as one graph per padded length (captured the first time a batch that long comes).

Nothing is read back inside the loop: the host replays ceil(remaining / B) steps
(no sequence can finish sooner, as a step emits at most B tokens), then reads how
many tokens remain (on CUDA while the burst's last step still runs), and repeats.
Prompt lookup drafts on the host from the tokens so far, so its loop reads back
every step (as vLLM's ngram proposer does).
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict

import torch

from ...drafter import DFlashLagunaDrafter
from ...runtime import first_parameter
from .cuda_graphs import GraphedStep, new_pool
from ..loop import SpecDecodeResult
from ..proposers import NoDrafter, check_block_size, default_block_size, resolve_drafter
from ..sampling import greedy_accept_batch
from .static_drafter import StaticDrafter
from .static_target import StaticTarget, round_up
from ..stats import SpecDecodeStats

PHASES = ("draft", "verify", "append", "accept")  # the order of one step
MAX_STOP_TOKENS = 8
PREFILL_STEP = 64  # prompts are right-padded to a multiple of this: one prefill graph per padded length


class FastDecoder:
    """Static buffers and graphed steps for one (pair, batch size, block size, capacity).

    method: "dflash", "ngram" (drafts from the proposer's ``propose``, on the host) or "target" (block 1),
    from ``proposers.resolve_drafter``: an object that is none of its kinds is refused.
    Build once, then ``generate`` any number of batches of up to ``batch`` prompts
    whose prompt + max_new_tokens fit ``capacity``.
    """

    def __init__(self, target, drafter=None, *, batch: int, block_size: int, capacity: int, cuda_graphs: bool = True,
                 moe: str = "auto", phase_graphs: bool = False):
        proposer = resolve_drafter(drafter)
        is_dflash = isinstance(proposer, DFlashLagunaDrafter)
        self.method = "dflash" if is_dflash else ("target" if isinstance(proposer, NoDrafter) else "ngram")
        if self.method == "target":
            block_size = 1
        else:  # a block above the trained one runs, as in vLLM (it never reads block_size)
            block_size = check_block_size(block_size, proposer)
        if is_dflash:
            drafter.config.validate_against_target(target.config)
        self.target, self.drafter, self.B, self.batch = target, drafter, block_size, batch
        self.lookup = None if is_dflash else proposer  # the host-side proposer (prompt lookup, or any propose())
        p = first_parameter(target)
        self.device, self.dtype = p.device, p.dtype
        slack = 2 * block_size + 1  # frozen and overrunning steps write past the last kept position
        layer_ids = list(drafter.config.target_layer_ids) if self.method == "dflash" else []
        self.tgt = StaticTarget(target, batch=batch, capacity=capacity + slack, layer_ids=layer_ids, moe=moe)
        self.dft = (StaticDrafter(drafter, target, batch=batch, capacity=capacity + slack, block_size=block_size)
                    if self.method == "dflash" else None)
        self.capacity = capacity
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=self.device)  # noqa: E731
        S, K = self.tgt.capacity, block_size - 1
        # decode state (device)
        self.tokens = z(batch, S + block_size)  # every sequence's ids at their positions
        self.pos, self.last, self.limit = z(batch), z(batch), z(batch)  # t, x_t, position of the final token
        self.active = z(batch, dt=torch.bool)
        self.stop_ids = torch.full((MAX_STOP_TOKENS,), -1, dtype=torch.long, device=self.device)  # -1: unused
        self.offsets = torch.arange(block_size, device=self.device)
        # per-step values passed between the phases
        self.block_pos, self.drafts, self.argmax = z(batch, block_size), z(batch, K), z(batch, block_size)
        self.n_draft = torch.full((batch,), K, dtype=torch.long, device=self.device)  # drafts to verify (ngram: 0 .. K)
        self.aux = None
        # prefill inputs (device): right-padded prompts, and lengths | live rows | max_new_tokens | stop ids
        self.prompt_ids = z(batch, S)
        self.slot_positions = torch.arange(S, device=self.device).expand(batch, S)
        self.meta = z(2 * batch + 1 + MAX_STOP_TOKENS)
        self._host_meta = torch.zeros(self.meta.shape, dtype=torch.long)
        # what remains after a burst's next-to-last step, copied back while its last step runs (CUDA)
        cuda = self.device.type == "cuda"
        self._peek = torch.zeros((), dtype=torch.long, pin_memory=cuda)
        self._peek_done = torch.cuda.Event() if cuda else None
        # what each step verified (device); SpecDecodeStats counts it at the end (last column: a dump)
        self.n_steps, self.n_drafts = z(batch), z(batch)
        self.draft_log, self.accepted_log = z(batch, capacity + 2), z(batch, capacity + 2)

        pool = new_pool(self.device)
        def graphed(fn, reset=self._reset):
            return GraphedStep(fn, enabled=cuda_graphs, device=self.device, reset=reset, pool=pool)
        self._graphed = graphed
        self.prefills: dict[int, GraphedStep] = {}  # padded prompt length -> its prefill, captured on first use
        self.step = graphed(self._step)
        self.step_plain = graphed(self._step_without_drafts) if self.method == "ngram" else None
        noop = {"append"} if self.method != "dflash" else set()  # an empty graph cannot be captured
        self.phases = {name: GraphedStep(getattr(self, f"_{name}"), enabled=False, device=self.device) if name in noop
                       else graphed(getattr(self, f"_{name}")) for name in PHASES} if phase_graphs else None
        self.cuda_graphs = self.step.captured

    # --- state -----------------------------------------------------------------
    def _reset(self) -> None:
        """A valid state to warm up and capture from (positions 0, everything inactive)."""
        for t in (self.pos, self.last, self.limit, self.tokens, self.n_steps, self.n_drafts, self.draft_log,
                  self.accepted_log, self.block_pos, self.drafts):
            t.zero_()
        self.active.zero_()

    # --- the four phases of a step (device only) --------------------------------
    def _draft(self) -> None:
        self.block_pos.copy_(self.pos[:, None] + self.offsets)
        if self.method == "dflash":
            self.drafts.copy_(self.dft.draft(self.last, self.pos, self.B))

    def _verify(self, width: int | None = None) -> None:
        width = width or self.B
        ids = torch.cat([self.last[:, None], self.drafts[:, :width - 1]], dim=1)  # (b, width)
        logits, aux = self.tgt.forward(ids, self.block_pos[:, :width])
        self.argmax[:, :width].copy_(logits.argmax(dim=-1))
        if aux is not None:
            if self.aux is None:
                self.aux = torch.empty_like(aux)
            self.aux.copy_(aux)

    def _append(self) -> None:
        if self.method == "dflash":
            self.dft.append(self.aux, self.block_pos)

    def _accept(self, width: int | None = None) -> None:
        width = width or self.B
        K = width - 1
        argmax, active = self.argmax[:, :width], self.active
        n, nxt = greedy_accept_batch(self.drafts[:, :K], argmax, self.n_draft)  # accepted drafts, next token
        # emitted: argmax[:, 0 .. n] at positions t+1 .. t+n+1 (stale entries past n are overwritten later)
        self.tokens.scatter_(1, self.pos[:, None] + 1 + self.offsets[:width], argmax)
        emitted = self.offsets[:width] <= n[:, None]
        stopped = ((argmax[..., None] == self.stop_ids).any(-1) & emitted).any(-1)
        new_pos = self.pos + n + 1
        drafted = active & (self.n_draft > 0) & (K > 0)  # a step that verified drafts (the others are no draft)
        col = torch.where(drafted, self.n_drafts, self.draft_log.shape[1] - 1)[:, None]
        self.draft_log.scatter_(1, col, self.n_draft.clamp(max=K)[:, None])
        self.accepted_log.scatter_(1, col, n[:, None])
        self.n_steps += active
        self.n_drafts += drafted
        self.pos.copy_(torch.where(active, new_pos, self.pos))
        self.last.copy_(torch.where(active, nxt, self.last))
        self.active &= ~(stopped | (new_pos >= self.limit))

    def _step(self) -> None:
        self._draft()
        self._verify()
        self._append()
        self._accept()

    def _step_without_drafts(self) -> None:
        """A prompt-lookup step in which no sequence found a draft: verify x_t alone."""
        self.block_pos.copy_(self.pos[:, None] + self.offsets)
        self._verify(1)
        self._accept(1)

    # --- prefill (one graph per padded prompt length) ------------------------------
    def _prefill(self, width: int) -> None:
        """The prefill of the prompts in ``prompt_ids[:, :width]``, entirely on the device (graphable).

        Reads ``meta`` (lengths | live rows | max_new_tokens | stop ids, written by ``prefill``).
        Prompts are right-padded to ``width``: a pad token's K/V lands at a slot >= its prompt's
        length, which the first verification overwrites before any query can see it (as the
        rejected drafts of a step), and only each prompt's last position's logits are kept.
        """
        self._reset()
        b = self.batch
        ids, positions = self.prompt_ids[:, :width], self.slot_positions[:, :width]
        length, live, max_new = self.meta[:b], self.meta[b:2 * b].bool(), self.meta[2 * b]
        self.stop_ids.copy_(self.meta[2 * b + 1:])
        logits, aux = self.tgt.forward(ids, positions, last_index=length - 1)
        if self.method == "dflash":
            self.dft.append(aux, positions)
        first = logits.argmax(dim=-1)
        self.tokens[:, :width].copy_(ids)
        self.tokens.scatter_(1, length[:, None], first[:, None])
        self.pos.copy_(length)
        self.last.copy_(first)
        self.limit.copy_(length + max_new - 1)
        self.active.copy_(live & (self.pos < self.limit) & ~(first[:, None] == self.stop_ids).any(-1))

    def prefill_width(self, longest: int) -> int:
        """The padded length a batch whose longest prompt has ``longest`` tokens is prefilled at."""
        return min(round_up(longest, PREFILL_STEP), self.tgt.capacity)

    def prefill(self, prompts: list[torch.Tensor], max_new_tokens: int, stop_token_ids=()) -> None:
        n = len(prompts)
        lengths = [int(p.shape[-1]) for p in prompts]
        T = max(lengths)
        if n > self.batch:
            raise ValueError(f"{n} prompts, but this decoder was built for batch {self.batch}")
        if T + max_new_tokens > self.capacity:
            raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds the decoder's capacity {self.capacity}")
        stops = sorted(stop_token_ids)
        if len(stops) > MAX_STOP_TOKENS:
            raise ValueError(f"at most {MAX_STOP_TOKENS} stop_token_ids, got {len(stops)}")
        self.host_steps = 0  # batch steps of this generation
        # everything the prefill graph reads, in two copies: the prompts (right-padded) and one meta vector
        self.prompt_ids.zero_()
        for b, p in enumerate(prompts):
            self.prompt_ids[b, :lengths[b]].copy_(p.reshape(-1))
        meta = self._host_meta
        meta.zero_()
        meta[:self.batch] = 1  # unused rows: a 1-token "prompt", never live
        meta[:n] = torch.tensor(lengths)
        meta[self.batch:self.batch + n] = 1
        meta[2 * self.batch] = max_new_tokens
        meta[2 * self.batch + 1:] = -1  # -1: no stop token
        if stops:
            meta[2 * self.batch + 1:2 * self.batch + 1 + len(stops)] = torch.tensor(stops)
        self.meta.copy_(meta)
        width = self.prefill_width(T)
        if width not in self.prefills:  # first batch this long: warm up and capture its graph
            self.prefills[width] = self._graphed(lambda: self._prefill(width), reset=None)
        self.prefills[width]()
        self._lengths = lengths

    # --- decoding -----------------------------------------------------------------
    def _remaining(self) -> torch.Tensor:
        """The most tokens any live sequence still has to emit (a device scalar)."""
        return torch.where(self.active, self.limit - self.pos, 0).max()

    def _run_on_device(self) -> None:
        """Replay steps in bursts that cannot overshoot the last sequence's end.

        A burst of k = ceil(remaining / B) steps cannot overshoot, as a step emits at most B
        tokens. On CUDA the host does not wait for a burst to end: what remains after its
        next-to-last step is copied back while the last step runs, and that, less B, is a safe
        size for the next burst, launched at once (the device never idles on a read-back).
        Only when that bound reaches 0 does the host wait for the exact count.
        """
        remaining = int(self._remaining())  # a sync (after the prefill)
        while remaining > 0:
            k = max(1, math.ceil(remaining / self.B))
            for _ in range(k - 1):
                self.step()
            if self._peek_done is None:  # off CUDA: the count after the burst
                self.step()
                self.host_steps += k
                remaining = int(self._remaining())
                continue
            self._peek.copy_(self._remaining(), non_blocking=True)
            self._peek_done.record()
            self.step()
            self.host_steps += k
            self._peek_done.synchronize()  # the next-to-last step is done; the last one is running
            remaining = int(self._peek) - self.B  # the last step emits at most B tokens per sequence
            if remaining <= 0:
                remaining = int(self._remaining())  # a sync: the exact count

    def _run_prompt_lookup(self, prompts, max_new_tokens: int, stop: set) -> None:
        """Host-driven: draft from each sequence's tokens, verify on the device, read back, repeat."""
        seqs = [p.reshape(-1).tolist() for p in prompts]
        state = torch.stack([self.pos, self.last, self.active.long()], 1).tolist()
        for b, s in enumerate(seqs):
            s.append(state[b][1])
        live = [bool(state[b][2]) for b in range(len(seqs))]
        K = self.B - 1
        host_drafts = torch.zeros((self.batch, K), dtype=torch.long, pin_memory=self.device.type == "cuda")
        host_n = torch.zeros(self.batch, dtype=torch.long, pin_memory=self.device.type == "cuda")
        while any(live):
            host_n.zero_()
            for b, s in enumerate(seqs):
                d = self.lookup.propose(s, K) if live[b] else []
                host_n[b] = len(d)
                if d:
                    host_drafts[b, :len(d)] = torch.tensor(d)
            self.drafts.copy_(host_drafts, non_blocking=True)
            self.n_draft.copy_(host_n, non_blocking=True)
            (self.step if bool(host_n.any()) else self.step_plain)()
            self.host_steps += 1
            back = torch.cat([self.argmax, self.pos[:, None], self.active[:, None].long()], 1).tolist()
            for b, s in enumerate(seqs):
                if live[b]:
                    new_pos, still = back[b][-2], back[b][-1]
                    s.extend(back[b][:new_pos - (len(s) - 1)])  # argmax 0 .. n
                    live[b] = bool(still)

    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor], *, max_new_tokens: int, stop_token_ids=()) -> list[SpecDecodeResult]:
        """Greedy continuations of up to ``batch`` prompts (each (T,) or (1, T)), one result per prompt."""
        stop = set(stop_token_ids or ())
        prompts = [p.to(self.device) for p in prompts]
        if max_new_tokens < 1:
            return [SpecDecodeResult(p.reshape(1, -1).clone(), SpecDecodeStats(), [], int(p.shape[-1])) for p in prompts]
        self.prefill(prompts, max_new_tokens, stop)
        if self.method == "ngram":
            self._run_prompt_lookup(prompts, max_new_tokens, stop)
        else:
            self._run_on_device()
        return self._results(prompts, max_new_tokens, stop)

    def _results(self, prompts, max_new_tokens: int, stop: set) -> list[SpecDecodeResult]:
        # one read-back (one sync) for everything: tokens | pos | steps | drafts | draft_log | accepted_log
        S, L = self.tokens.shape[1], self.draft_log.shape[1]
        counts = torch.stack([self.pos, self.n_steps, self.n_drafts], dim=1)
        rows = torch.cat([self.tokens, counts, self.draft_log, self.accepted_log], dim=1)[:len(self._lengths)].tolist()
        tokens, draft_log, accepted_log = ([r[a:a + w] for r in rows] for a, w in
                                           ((0, S), (S + 3, L), (S + 3 + L, L)))
        pos, steps, drafts = ([r[S + i] for r in rows] for i in range(3))
        out = []
        for b, T in enumerate(self._lengths):
            new = tokens[b][T:min(pos[b] + 1, T + max_new_tokens)]
            for i, tok in enumerate(new):
                if tok in stop:
                    new = new[:i + 1]
                    break
            stats = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * (self.B - 1), num_generated_tokens=len(new),
                                    num_target_forwards=1 + steps[b])
            stats.observe_drafts(draft_log[b][:drafts[b]], accepted_log[b][:drafts[b]])
            ids = torch.tensor([tokens[b][:T] + new], dtype=torch.long, device=self.device)
            out.append(SpecDecodeResult(ids, stats, [], T))
        return out


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def _capacity(prompts, max_new_tokens: int) -> int:
    return max(int(p.shape[-1]) for p in prompts) + max_new_tokens


CAPACITY_STEP = 256  # cached decoders are sized in steps, so prompts of similar length share one
MAX_CACHED_DECODERS = 4  # per target, least recently used dropped first
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> OrderedDict(key -> FastDecoder)


def cached_decoder(target, drafter, *, batch: int, block_size: int, capacity: int, cuda_graphs: bool = True,
                   moe: str = "auto") -> FastDecoder:
    """The ``FastDecoder`` for (target, drafter, batch, block size, capacity, graphs, moe), built on first use.

    Building one allocates every buffer and captures its CUDA graphs; ``fast_generate`` called
    once per prompt would otherwise pay that on every call (measured on an H200: 1.08x
    target-only instead of the benchmark's 1.7-2.0x). The decoder reads the drafter's weights
    live, but the target's q/k/v and MLP weights are concatenated once: after changing the
    target's weights, call ``clear_decoder_cache()``.
    """
    per_target = _DECODERS.setdefault(target, OrderedDict())
    capacity = min(round_up(capacity, CAPACITY_STEP), target.config.max_position_embeddings)
    key = (drafter, batch, block_size, capacity, cuda_graphs, moe)
    if key in per_target:
        per_target.move_to_end(key)
    else:
        per_target[key] = FastDecoder(target, drafter, batch=batch, block_size=block_size, capacity=capacity,
                                      cuda_graphs=cuda_graphs, moe=moe)
        while len(per_target) > MAX_CACHED_DECODERS:
            per_target.popitem(last=False)
    return per_target[key]


def clear_decoder_cache() -> None:
    """Forget every cached decoder (their buffers and graphs go with them)."""
    _DECODERS.clear()


def fast_generate_batch(target, drafter, prompts, *, max_new_tokens: int, block_size: int | None = None,
                        cuda_graphs: bool = True, stop_token_ids=(), moe: str = "auto") -> list[SpecDecodeResult]:
    """Greedy decoding of all ``prompts`` in one batch (see the module docstring); one result per prompt.

    drafter: a DFlashLagunaDrafter, "ngram", None (no drafter) or a proposer; anything else is
    refused (``proposers.resolve_drafter``). block_size defaults to the drafter's config.block_size
    (a proposer's own block_size: 16 for "ngram"). The decoder is built
    once per shape and reused (``cached_decoder``).
    """
    prompts = [torch.as_tensor(p).reshape(-1) for p in prompts]
    if not prompts:
        return []
    if block_size is None:
        block_size = default_block_size(resolve_drafter(drafter))
    max_pos = target.config.max_position_embeddings
    if _capacity(prompts, max_new_tokens) > max_pos:
        raise ValueError(f"prompt + max_new_tokens ({_capacity(prompts, max_new_tokens)}) exceeds the target's "
                         f"max_position_embeddings ({max_pos})")
    dec = cached_decoder(target, drafter, batch=len(prompts), block_size=block_size,
                         capacity=_capacity(prompts, max_new_tokens), cuda_graphs=cuda_graphs, moe=moe)
    return dec.generate(prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)


def fast_generate(target, drafter, input_ids, *, max_new_tokens: int, block_size: int | None = None,
                  cuda_graphs: bool = True, stop_token_ids=(), moe: str = "auto") -> SpecDecodeResult:
    """``speculative_generate``'s greedy result for one prompt, from the static, graphed path."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] != 1:
        raise ValueError(f"input_ids must hold one sequence, got shape {tuple(ids.shape)}")
    return fast_generate_batch(target, drafter, [ids.reshape(-1)], max_new_tokens=max_new_tokens, block_size=block_size,
                               cuda_graphs=cuda_graphs, stop_token_ids=stop_token_ids, moe=moe)[0]
