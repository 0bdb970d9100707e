"""Fast greedy decoding: static buffers, one CUDA graph per step, several prompts per batch.

    FastDecoder(target, drafter, batch=.., block_size=.., capacity=..)   buffers and graphs, built once
        .generate(prompts, max_new_tokens=..)                             a static batch -> SpecDecodeResults
        .prefill / .fill / .step / .results                               what continuous batching drives
                                                                          (``serving.serve``)
(``generate.fast_generate`` / ``fast_generate_batch``: one call, over a cached decoder.)

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
every step (as the V1 runner's ngram proposer does); ``"ngram_gpu"`` drafts inside the step
from ``tokens`` (``spec_decode.ngram_gpu``, as vLLM 0.33 does on a GPU) and reads nothing back.
"""

from __future__ import annotations

import math

import torch

from ...runtime import first_parameter, is_int, upload
from . import chunked_fill as chunked_fill_ops, host_drafting, readback, triton_ops
from .argmax import argmax as pick
from .accept import accept_step
from .cuda_graphs import GraphedStep, new_pool
from ..loop import SpecDecodeResult
from ..proposers import check_block_size, resolve_drafter
from ..ngram_gpu import ngram_gpu_drafts
from ..sampling import greedy_accept_batch
from .static_target import StaticTarget, round_up
from ..stats import SpecDecodeStats
from ..tree import check_budget
from .tree_step import tree_step

PHASES = ("draft", "verify", "append", "accept")  # the order of one step
MAX_STOP_TOKENS = 8
PREFILL_STEP = 64  # prompts are right-padded to a multiple of this: one prefill graph per padded length


class FastDecoder:
    """Static buffers and graphed steps for one (pair, batch size, block size, capacity).

    drafter: anything ``proposers.resolve_drafter`` takes (an object that is none of its kinds is
    refused). A proposer with a ``device_session`` (DFlash) drafts inside the graphed step; one
    without drafts on the host from each sequence's tokens (prompt lookup); one that never
    proposes runs at block 1 (``method`` "target").
    Build once, then ``generate`` any number of batches of up to ``batch`` prompts
    whose prompt + max_new_tokens fit ``capacity``.
    """

    def __init__(self, target, drafter=None, *, batch: int, block_size: int, capacity: int, cuda_graphs: bool = True,
                 moe: str = "auto", phase_graphs: bool = False, widths=(), tree_budget: int | None = None,
                 chunked_fill: bool = False):
        self.proposer = proposer = resolve_drafter(drafter)
        # a block above the trained one runs, as in vLLM (it never reads block_size)
        block_size = check_block_size(block_size, proposer) if proposer.proposes else 1
        if tree_budget is not None:  # DDTree: the step verifies a tree of the block's best prefixes (``_tree_step``)
            if proposer.kind != "dflash" or phase_graphs or widths:  # a tree step is one graph per budget
                raise ValueError(f"tree_budget needs a DFlash drafter, no phase_graphs nor widths: {proposer.kind!r}")
            tree_budget = check_budget(tree_budget, target.config.vocab_size, block_size - 1)
        self.tree_budget = tree_budget
        self.method = proposer.kind
        self.target, self.B, self.batch = target, block_size, batch
        p = first_parameter(target)
        self.device, self.dtype = p.device, p.dtype
        slack = 2 * block_size + 1 + (tree_budget or 0)  # frozen and overrunning steps (and trees) write past the end
        self.tgt = StaticTarget(target, batch=batch, capacity=capacity + slack, layer_ids=list(proposer.layer_ids),
                                moe=moe)
        # the drafter on the device (DFlash), else the host-side proposer (prompt lookup, or any propose())
        self.dft = proposer.device_session(target, batch=batch, capacity=capacity + slack, block_size=block_size)
        self.lookup = proposer if proposer.proposes and self.dft is None and not proposer.drafts_on_device else None
        self.ngram = proposer if proposer.drafts_on_device else None  # prompt lookup drafted in the step
        if chunked_fill:
            chunked_fill_ops.check(self, phase_graphs)
        self.capacity = capacity
        self._lengths, self._max_new, self.host_steps = {}, {}, 0  # row -> prompt length, max_new_tokens (host)
        self.max_pos = target.config.max_position_embeddings  # a sequence ends there, as on the eager loop
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=self.device)  # noqa: E731
        S, K = self.tgt.capacity, block_size - 1
        # decode state (device)
        self.tokens = z(batch, S + block_size)  # every sequence's ids at their positions
        self.pos, self.last, self.limit = z(batch), z(batch), z(batch)  # t, x_t, position of the final token
        self.active = z(batch, dt=torch.bool)
        # a row being filled through the steps (``chunked_fill``): its prompt, and its length while pos < it
        self.fill_len = z(batch)
        self.fill_ids = z(batch, S + block_size + 1) if chunked_fill else None
        self.stop_ids = torch.full((MAX_STOP_TOKENS,), -1, dtype=torch.long, device=self.device)  # -1: unused
        self.offsets = torch.arange(block_size, device=self.device)
        # per-step values passed between the phases
        self.block_pos, self.drafts, self.argmax = z(batch, block_size), z(batch, K), z(batch, block_size)
        self.n_draft = torch.full((batch,), K, dtype=torch.long, device=self.device)  # drafts to verify (ngram: 0 .. K)
        self.aux: dict[int, torch.Tensor] = {}  # verify width -> the target features of its block
        # prefill inputs (device): right-padded prompts, and lengths | rows to fill | max_new_tokens | stop ids
        self.prompt_ids = z(batch, S)
        self.slot_positions = torch.arange(S, device=self.device).expand(batch, S)
        self.meta = z(3 * batch + MAX_STOP_TOKENS)
        self._host_meta = torch.zeros(self.meta.shape, dtype=torch.long)
        # what remains after a burst's next-to-last step, copied back while its last step runs (CUDA)
        cuda = self.device.type == "cuda"
        self._peek = torch.zeros((), dtype=torch.long, pin_memory=cuda)
        self._peek_done = torch.cuda.Event() if cuda else None
        # what each step verified (device); SpecDecodeStats counts it at the end (last column: a dump)
        self.n_steps, self.n_drafts = z(batch), z(batch)
        # prompt lookup's drafts, staged on the host
        self._host_drafts = torch.zeros((batch, K), dtype=torch.long, pin_memory=cuda)
        self._host_n = torch.zeros(batch, dtype=torch.long, pin_memory=cuda)
        self.draft_log, self.accepted_log = z(batch, capacity + 2), z(batch, capacity + 2)
        self._accept_kernel = triton_ops.enabled(self.pos)  # the accept phase in one launch (``accept``)

        pool = new_pool(self.device)
        def graphed(fn, reset=self._reset):
            return GraphedStep(fn, enabled=cuda_graphs, device=self.device, reset=reset, pool=pool)
        self._graphed = graphed
        self.prefills: dict[tuple[int, int], GraphedStep] = {}  # (rows, padded length) -> its prefill, on first use
        self.fill_buckets = sorted({1 << i for i in range(batch.bit_length()) if 1 << i < batch} | {batch})
        self.step = graphed(self._step if tree_budget is None else lambda: tree_step(self))
        # narrower steps a per-batch schedule switches to (``step_at``), captured now: capture resets the state
        if not all(is_int(w) and 1 <= w <= block_size for w in widths or ()):
            raise ValueError(f"widths must be step widths in 1 .. {block_size} (the block), got {widths!r}")
        self.steps = {w: graphed(lambda w=w: self._step(w)) for w in sorted(set(widths or ())) if w != block_size}
        self.step_plain = graphed(self._step_without_drafts) if self.lookup is not None else None
        noop = {"append"} if self.dft is None else set()  # an empty graph cannot be captured
        self.phases = {name: GraphedStep(getattr(self, f"_{name}"), enabled=False, device=self.device) if name in noop
                       else graphed(getattr(self, f"_{name}")) for name in PHASES} if phase_graphs else None
        self.cuda_graphs = self.step.captured

    # --- state -----------------------------------------------------------------
    def _reset(self) -> None:
        """A valid state to warm up and capture from (positions 0, everything inactive)."""
        for t in (self.pos, self.last, self.limit, self.fill_len, self.tokens, self.n_steps, self.n_drafts,
                  self.draft_log, self.accepted_log, self.block_pos, self.drafts):
            t.zero_()
        self.active.zero_()

    # --- the four phases of a step (device only) --------------------------------
    # A step of ``width`` W <= B verifies [x_t, d_1 .. d_{W-1}]: the block a per-batch schedule picks
    # (W = K + 1). As vLLM 0.33's DFlash speculator does it, a drafter step at 0 < K < B - 1 still runs the
    # whole block (its graphs are captured for 1 + num_speculative_tokens queries: dflash/speculator.py:565-574)
    # and the drafts past K are dropped (v1/worker/gpu/model_runner.py:2324-2325); with a drafter that is not
    # causal inside the block the first K drafts depend on the block's length, so this is what keeps them
    # vLLM's. W = 1 verifies x_t alone, runs no draft forward and still appends its context K/V, as that
    # speculator does at K = 0 (v1/worker/gpu/spec_decode/dflash/speculator.py:546-553).
    def _draft(self, width: int | None = None) -> None:
        width = width or self.B
        self.block_pos.copy_(self.pos[:, None] + self.offsets)
        if self.dft is not None and width > 1:
            self.drafts[:, :width - 1].copy_(self.dft.draft(self.last, self.pos, self.B)[:, :width - 1])
        if self.ngram is not None and width > 1:  # vLLM's NgramGPUSpeculator: K drafts from the row's own tokens
            g = self.ngram
            self.drafts[:, :width - 1].copy_(ngram_gpu_drafts(self.tokens, self.pos + 1, self.last, k=width - 1,
                                                              min_n=g.prompt_lookup_min, max_n=g.prompt_lookup_max))
        if (self.dft is not None or self.ngram is not None) and width > 1:  # at K = 0 no use of n_draft survives K
            # drafts at positions below max_position_embeddings only (vLLM's scheduler, the eager loop)
            torch.clamp(self.max_pos - 1 - self.pos, min=0, max=width - 1, out=self.n_draft)

    def _verify(self, width: int | None = None) -> None:
        width = width or self.B
        ids = torch.cat([self.last[:, None], self.drafts[:, :width - 1]], dim=1)  # (b, width)
        if self.fill_ids is not None:  # a row being filled verifies its prompt's next chunk instead
            ids = chunked_fill_ops.block_ids(self, ids, width)
        logits, aux = self.tgt.forward(ids, self.block_pos[:, :width])
        pick(logits, out=self.argmax[:, :width])  # the split kernel where it runs (a large vocabulary)
        if aux is not None:
            if width not in self.aux:
                self.aux[width] = torch.empty_like(aux)
            self.aux[width].copy_(aux)

    def _append(self, width: int | None = None) -> None:
        width = width or self.B
        if self.dft is not None:
            self.dft.append(self.aux[width], self.block_pos[:, :width])

    def _accept(self, width: int | None = None) -> None:
        width = width or self.B
        if self._accept_kernel:
            return accept_step(self, width)  # a chunked fill's advance included
        K = width - 1
        verified = self.n_draft.clamp(max=K) if self.tree_budget is None else torch.full_like(self.n_draft,
                                                                                                self.tree_budget)
        argmax, active = self.argmax[:, :width], self.active
        n, nxt = greedy_accept_batch(self.drafts[:, :K], argmax, self.n_draft)  # accepted drafts, next token
        # emitted: argmax[:, 0 .. n] at positions t+1 .. t+n+1 (stale entries past n are overwritten later)
        self.tokens.scatter_(1, self.pos[:, None] + 1 + self.offsets[:width], argmax)
        emitted = self.offsets[:width] <= n[:, None]
        stopped = ((argmax[..., None] == self.stop_ids).any(-1) & emitted).any(-1)
        new_pos = self.pos + n + 1
        drafted = active & (self.n_draft > 0) & (K > 0)  # a step that verified drafts (the others are no draft)
        col = torch.where(drafted, self.n_drafts, self.draft_log.shape[1] - 1)[:, None]
        self.draft_log.scatter_(1, col, verified[:, None])
        self.accepted_log.scatter_(1, col, n[:, None])
        self.n_steps += active
        self.n_drafts += drafted
        self.pos.copy_(torch.where(active, new_pos, self.pos))
        self.last.copy_(torch.where(active, nxt, self.last))
        self.active &= ~(stopped | (new_pos >= self.limit))
        if self.fill_ids is not None:  # rows being filled by chunks move on (``chunked_fill``)
            chunked_fill_ops.advance(self, width)

    def _step(self, width: int | None = None) -> None:
        self._draft(width)
        self._verify(width)
        self._append(width)
        self._accept(width)

    def step_at(self, width: int) -> GraphedStep:
        """The graphed step that verifies ``width`` tokens per row (a schedule's K + 1), captured once."""
        if width == self.B:
            return self.step
        if width == 1 and self.step_plain is not None:  # a host proposer's step without drafts
            return self.step_plain
        if not is_int(width) or not 1 <= width <= self.B:
            raise ValueError(f"a step verifies 1 .. {self.B} tokens per row (the decoder's block), got {width!r}")
        if width not in self.steps:  # capturing resets the decode state: warm every width before decoding
            raise ValueError(f"no step of width {width} was captured: build the FastDecoder with widths={width!r}")
        return self.steps[width]

    def _step_without_drafts(self) -> None:
        """A prompt-lookup step in which no sequence found a draft: verify x_t alone."""
        self.block_pos.copy_(self.pos[:, None] + self.offsets)
        self._verify(1)
        self._accept(1)

    # --- prefill (one graph per padded prompt length) ------------------------------
    def _prefill(self, n: int, width: int) -> None:
        """The prefill of n rows (``meta``'s row ids), their prompts in ``prompt_ids[:n, :width]``, on the device
        (graphable); every other row goes on untouched (continuous batching refills a finished row so).

        Reads ``meta`` (rows | lengths | max_new_tokens, n each, at the start of batch-long fields | stop ids,
        written by ``fill``). Prompts are right-padded to ``width``: a pad token's K/V lands at a slot >= its
        prompt's length, which the first verification overwrites before any query can see it (as the rejected
        drafts of a step), and only each prompt's last position's logits are kept. A bucket's spare entries
        repeat its first row and prompt: the same values written twice.
        """
        b = self.batch
        rows, length, max_new = self.meta[:n], self.meta[b:b + n], self.meta[2 * b:2 * b + n]
        ids, positions = self.prompt_ids[:n, :width], self.slot_positions[:n, :width]
        self.stop_ids.copy_(self.meta[3 * b:])
        logits, aux = self.tgt.forward(ids, positions, last_index=length - 1, rows=rows)
        if self.dft is not None:
            self.dft.append(aux, positions, rows=rows)
        first = logits.argmax(dim=-1)  # (n,)
        self.tokens[:, :width].index_copy_(0, rows, ids)
        self.tokens.index_put_((rows, length), first)
        self.pos.index_copy_(0, rows, length)
        self.last.index_copy_(0, rows, first)
        self.limit.index_copy_(0, rows, (length + max_new - 1).clamp(max=self.max_pos - 1))  # the last fillable
        self.active.index_copy_(0, rows, (length < self.limit[rows]) & ~(first[:, None] == self.stop_ids).any(-1))
        for counter in (self.n_steps, self.n_drafts, self.fill_len):  # its own steps and drafts; no chunk to fill
            counter.index_fill_(0, rows, 0)

    def prefill_width(self, longest: int) -> int:
        """The padded length a batch whose longest prompt has ``longest`` tokens is prefilled at."""
        return min(round_up(longest, PREFILL_STEP), self.tgt.capacity)

    def prefill(self, prompts: list[torch.Tensor], max_new_tokens: int, stop_token_ids=()) -> None:
        """A new batch: every row reset, prompts in rows 0 .. n-1 (the rest never live)."""
        if len(prompts) > self.batch:
            raise ValueError(f"{len(prompts)} prompts, but this decoder was built for batch {self.batch}")
        self._reset()
        self._lengths, self._max_new = {}, {}  # row -> its prompt's length, its max_new_tokens
        self.host_steps = 0  # batch steps of this generation
        self.fill(dict(enumerate(prompts)), max_new_tokens, stop_token_ids)

    def fill(self, rows: dict[int, torch.Tensor], max_new_tokens, stop_token_ids=(), chunked: bool = False) -> None:
        """Prefill ``rows`` {row: prompt (T,)} while every other row goes on as it was (continuous batching).

        ``max_new_tokens``: one for every row, or {row: its own} (a request's ``max_tokens``). The stop
        tokens are the decoder's for every row from here on. ``chunked`` (a decoder built with ``chunked_fill``):
        no prefill forward; the next steps verify each prompt a chunk at a time (``chunked_fill``).
        """
        lengths = {b: int(p.shape[-1]) for b, p in rows.items()}
        if not rows or not all(is_int(b) and 0 <= b < self.batch for b in rows):
            raise ValueError(f"rows must be some of 0 .. {self.batch - 1}, got {sorted(rows)}")
        max_new = max_new_tokens if isinstance(max_new_tokens, dict) else dict.fromkeys(rows, max_new_tokens)
        for b, T in lengths.items():
            n = max_new.get(b)
            if not is_int(n) or n < 1:
                raise ValueError(f"max_new_tokens must be an integer >= 1 for every row, got {n!r} for row {b}")
            if T > self.max_pos:
                raise ValueError(f"prompt has {T} tokens, more than the target's max_position_embeddings "
                                 f"({self.max_pos})")
            if min(T + n, self.max_pos) > self.capacity:
                raise ValueError(f"prompt ({T}) + max_new_tokens ({n}) exceeds the decoder's capacity {self.capacity}")
        stops = sorted(set(stop_token_ids))
        if len(stops) > MAX_STOP_TOKENS:
            raise ValueError(f"at most {MAX_STOP_TOKENS} stop_token_ids, got {len(stops)}")
        self._max_new.update({b: max_new[b] for b in rows})
        self.stop = set(stops)
        if chunked:
            if self.fill_ids is None:
                raise ValueError("a chunked fill needs a decoder built with chunked_fill=True")
            upload(self.stop_ids, torch.tensor(stops + [-1] * (MAX_STOP_TOKENS - len(stops))))
            chunked_fill_ops.stage(self, rows, lengths, max_new)
            self._lengths.update(lengths)
            return
        # everything the prefill graph reads, in two copies: the prompts (right-padded, compacted) and one meta
        # vector; a bucket of n >= the rows filled (powers of two, and the batch) keeps the graphs few
        n = next(k for k in self.fill_buckets if k >= len(rows))
        order = list(rows) + [next(iter(rows))] * (n - len(rows))
        self.prompt_ids[:n].zero_()
        for j, r in enumerate(order):
            self.prompt_ids[j, :lengths[r]].copy_(rows[r].reshape(-1))
        meta = self._host_meta
        meta.zero_()
        meta[:n] = torch.tensor(order)
        meta[self.batch:self.batch + n] = torch.tensor([lengths[r] for r in order])
        meta[2 * self.batch:2 * self.batch + n] = torch.tensor([max_new[r] for r in order])
        meta[3 * self.batch:] = -1  # -1: no stop token
        if stops:
            meta[3 * self.batch:3 * self.batch + len(stops)] = torch.tensor(stops)
        upload(self.meta, meta)  # queued behind the running steps: the host does not wait for them
        key = (n, self.prefill_width(max(lengths.values())))
        if key not in self.prefills:  # first fill of this many rows this long: warm up and capture its graph
            self.prefills[key] = self._graphed(lambda: self._prefill(*key), reset=None)
        self.prefills[key]()
        self._lengths.update(lengths)

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

    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor], *, max_new_tokens: int,
                 stop_token_ids=()) -> list[SpecDecodeResult]:
        """Greedy continuations of up to ``batch`` prompts (each (T,) or (1, T)), one result per prompt."""
        stop = set(stop_token_ids or ())
        prompts = [p.to(self.device) for p in prompts]
        if max_new_tokens < 1:
            return [SpecDecodeResult(p.reshape(1, -1).clone(), SpecDecodeStats(), [], int(p.shape[-1]))
                    for p in prompts]
        self.prefill(prompts, max_new_tokens, stop)
        if self.lookup is not None:  # host-driven: draft from each sequence's tokens, verify, read back, repeat
            seqs = host_drafting.host_rows(self, dict(enumerate(prompts)))
            while seqs:
                host_drafting.host_step(self, seqs)
        else:
            self._run_on_device()
        return self.results(range(len(prompts)))

    def snapshot(self, rows) -> readback.Snapshot:
        """``rows``' state copied back without waiting (``readback.snapshot``), for ``results(rows, snapshot)``."""
        return readback.snapshot(self, rows)

    def results(self, rows, snapshot=None) -> list[SpecDecodeResult]:
        """The generations of ``rows`` (filled since the last ``prefill``): ``readback.results``."""
        return readback.results(self, rows, snapshot)
