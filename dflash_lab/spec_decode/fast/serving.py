"""A stream of requests at a concurrency: continuous batching on the fast path, as vLLM's scheduler does it.

    run = serve(decoder, prompts, max_new_tokens=96)                  continuous (vLLM's way)
    run = serve(decoder, prompts, max_new_tokens=96, policy="static") a batch at a time, the worked counter-example
    run.metrics()   what ``vllm bench serve`` prints: request and output-token throughput, TTFT, TPOT, E2EL

Every request arrives at time 0 and at most ``decoder.batch`` run at once (``vllm bench serve
--request-rate inf --max-concurrency B``). vLLM's scheduler keeps up to ``max_num_seqs`` requests
running; when one finishes (its length, a stop token) the next waiting request is scheduled into
the freed place at the next step (``v1/core/sched/scheduler.py``), so the batch stays full until the
queue runs dry. Here a decoder row is that place: a finished row's state is copied back
(``FastDecoder.snapshot``), the row is refilled with the next prompt (``FastDecoder.fill``: that row's
prefill, caches and context K/V overwritten, the other rows untouched) and its result is built on the
host once the next steps are launched; the graphed step goes on at the same (batch, block) shape. Nothing
the loop sends the device makes the host wait for it (``runtime.upload``): a refill and the next burst are
queued behind the running steps.

``policy="static"`` admits a new batch only when every row of the last one is done: a batch runs as
many steps as its slowest sequence needs while finished rows idle (the straggler effect). Both
policies run through the same loop, so they differ in nothing but admission.

Between reads the host replays ceil(r / B) steps, r the fewest tokens any running request still
has to emit: no request can end sooner (a step emits at most B tokens per row), so a row idles only
after a stop token. A refill needs no read after it: the new rows' counts are their limits, the others'
are the last read's, so the next burst is launched behind the refill and the device does not wait for the
host. Prompt lookup drafts on the host and reads back every step (``host_drafting.host_step``).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from ...runtime import is_int, synchronized_time
from ..loop import SpecDecodeResult
from ..stats import SpecDecodeStats
from . import chunked_fill, host_drafting
from .decoder import FastDecoder

POLICIES = ("continuous", "static")
REFILLS = ("prefill", "chunked")  # a refill's own prefill forward, or its prompt carried by the steps


@dataclass
class Request:
    """One request of the stream: its result and its times from arrival (every request arrives at 0)."""

    index: int  # its place in the stream
    row: int  # the decoder row that served it
    result: SpecDecodeResult
    admitted_s: float  # when its prefill was launched (the time it waited for a row)
    first_token_s: float  # TTFT: its prefill done, the first token out (chunked: the read that first saw it)
    finished_s: float  # E2EL: the host saw it finished (its last step done)

    @property
    def num_tokens(self) -> int:
        return self.result.stats.num_generated_tokens

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None for a one-token request."""
        n = self.num_tokens
        return (self.finished_s - self.first_token_s) / (n - 1) if n > 1 else None


@dataclass
class ServeRun:
    """What ``serve`` measured: every request (in stream order), the wall time and the batch steps."""

    policy: str
    concurrency: int
    requests: list[Request]
    seconds: float
    steps: int  # batch steps (graph replays, or host-drafted steps)
    fills: int  # prefill calls (several rows may share one)
    stats: SpecDecodeStats = field(repr=False)
    widths: dict[int, int] = field(default_factory=dict)  # step width (K + 1) -> batch steps run at it
    bursts: int = 0  # host decisions that launched steps: each follows a read of the rows' state
    reads: int = 0  # reads of the rows' state from the device (none after a refill: the host knows it)
    refill: str = "prefill"  # how a freed row took its next request (``REFILLS``)

    @property
    def tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    def steps_per_request(self) -> list[int]:
        """Target forwards after the prefill that each request needed (its own steps, not its batch's)."""
        return [r.result.stats.num_target_forwards - 1 for r in self.requests]

    def metrics(self) -> dict:
        """``vllm bench serve``'s summary: throughputs, and mean / median / p99 of TTFT, TPOT and E2EL in ms."""
        out = {"policy": self.policy, "concurrency": self.concurrency, "requests": len(self.requests),
               "tokens": self.tokens, "seconds": round(self.seconds, 4), "batch_steps": self.steps,
               "bursts": self.bursts, "fills": self.fills, "reads": self.reads, "refill": self.refill,
               "request_throughput": round(len(self.requests) / self.seconds, 3),
               "output_throughput": round(self.tokens / self.seconds, 1)}
        series = {"ttft": [r.first_token_s for r in self.requests],
                  "tpot": [t for r in self.requests if (t := r.tpot_s) is not None],
                  "e2el": [r.finished_s for r in self.requests]}
        for name, values in series.items():
            ms = 1e3 * np.asarray(values or [float("nan")])
            out.update({f"mean_{name}_ms": round(float(ms.mean()), 4),
                        f"median_{name}_ms": round(float(np.median(ms)), 4),
                        f"p99_{name}_ms": round(float(np.percentile(ms, 99)), 4)})
        return out


@torch.no_grad()
def serve(decoder: FastDecoder, prompts, *, max_new_tokens, stop_token_ids=(), policy: str = "continuous",
          schedule=None, refill_at: int = 1, read_behind: bool = False, refill: str = "prefill") -> ServeRun:
    """Serve ``prompts`` (each (T,) or (1, T)) at concurrency ``decoder.batch``; see the module docstring.

    ``max_new_tokens``: one for every request, or one per request (a list as long as ``prompts``).
    ``schedule``: a ``spec_decode.schedule.SpeculationSchedule`` (vLLM's ``num_speculative_tokens_per_batch_size``):
    each step drafts the K it gives for the number of running requests, as vLLM's scheduler reads it; the
    decoder must hold a step for every K + 1 (``FastDecoder(widths=[k + 1 for k in schedule.ks])``).
    ``refill_at`` (continuous): refill once this many rows are free (or the queue has no more, or nothing
    runs). 1 is vLLM's rule; more shares one prefill among several requests, at the price of rows idling.
    ``refill``: "prefill" (each refill its own forward) or "chunked" (the first batch is prefilled, a refilled
    row's prompt then rides in the next steps, ``chunked_fill``; a decoder built with ``chunked_fill=True``).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if refill not in REFILLS:
        raise ValueError(f"refill must be one of {REFILLS}, got {refill!r}")
    if refill == "chunked" and decoder.fill_ids is None:
        raise ValueError("refill='chunked' needs a FastDecoder built with chunked_fill=True")
    if not is_int(refill_at) or not 1 <= refill_at <= decoder.batch:
        raise ValueError(f"refill_at must be an integer in 1..{decoder.batch} (the batch), got {refill_at!r}")
    prompts = list(prompts)
    limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * len(prompts)
    if len(limits) != len(prompts) or not all(is_int(n) and n >= 1 for n in limits):
        raise ValueError(f"max_new_tokens must be an integer >= 1, or one per prompt ({len(prompts)}), "
                         f"got {max_new_tokens!r}")
    device, host = decoder.device, decoder.lookup is not None
    def width_for(batch: int) -> int:  # the step's width: K + 1 for this many running requests
        return decoder.B if schedule is None or decoder.B == 1 else min(schedule.k_for_batch(batch) + 1, decoder.B)
    if schedule is not None:
        if schedule.max_batch < decoder.batch:
            raise ValueError(f"the schedule ends at batch {schedule.max_batch}, below the decoder's {decoder.batch}")
        for b in range(1, decoder.batch + 1):
            decoder.step_at(width_for(b))  # refused now, not mid-stream, when a width was not captured
    waiting = deque((i, torch.as_tensor(p).reshape(-1).to(device)) for i, p in enumerate(prompts))
    running: dict[int, int] = {}  # row -> request index
    free: set[int] = set()  # rows that wait for a request
    admitted: dict[int, tuple] = {}  # request index -> (launched, its prefill's end: a device event on CUDA)
    unseen: dict[int, int] = {}  # row -> its request, filled by chunks, whose first token no read has seen yet
    seqs: dict[int, list[int]] = {}  # host drafting: live row -> its tokens
    done: list[tuple] = []  # (request, row, result, finished)
    unbuilt: list[tuple] = []  # finished requests whose results wait for the host: (ended, rows, snapshot, finished)

    def build() -> None:  # the host's share of finished requests, while the device runs what was launched
        for ended, rows, snap, now in unbuilt:
            done.extend((i, b, result, now) for (i, b), result in zip(ended, decoder.results(rows, snap)))
        unbuilt.clear()
    steps = fills = bursts = reads = 0
    widths: dict[int, int] = {}  # step width -> batch steps run at it
    clock = _Clock(device)  # no sync for a first token's time: an event on CUDA
    stale = False  # host drafting: seqs behind the device after steps without drafts (a schedule's K = 0)

    def admit(rows) -> None:
        nonlocal fills
        batch, limit = {}, {}
        for b in rows:
            if not waiting:
                break
            i, p = waiting.popleft()
            batch[b], limit[b], running[b] = p, limits[i], i
            free.discard(b)
        if not batch:
            return {}
        launched = clock.host()
        chunked = fills > 0 and refill == "chunked"
        if fills == 0:
            decoder.prefill(list(batch.values()), limit, stop_token_ids)  # rows 0 .. n-1, all reset
        else:
            decoder.fill(batch, limit, stop_token_ids, chunked=chunked)
        fills += 1
        first = None if chunked else clock.mark()
        for b in batch:
            admitted[running[b]] = (launched, first)
            if chunked:
                unseen[b] = running[b]
        if host and not stale:
            seqs.update(host_drafting.host_rows(decoder, batch))
        # the fewest tokens each new row has left (its limit, as ``FastDecoder._prefill`` sets it): known without a read
        return {b: min(len(p) + limit[b] - 1, decoder.max_pos - 1) - len(p) for b, p in batch.items()}

    peek = _Peek(decoder, read_behind)  # on CUDA: the state one step behind, read while the next step runs
    admit(range(min(decoder.batch, len(waiting))))
    floor: dict[int, int] | None = None  # row -> the fewest tokens it may have left, when known without a read
    while running:
        if host and not stale:
            finished = [b for b in running if b not in seqs]
        elif floor is not None:  # nothing ran since the last read but a refill: no read, no wait for the refill
            finished = []
        else:
            # a burst's last step may still run: remaining is then an upper bound
            active, remaining, filling = peek.read()
            reads += 1
            for b in [b for b in unseen if not filling[b]]:  # its prompt's last chunk ran: its first token is out
                admitted[unseen[b]] = (admitted[unseen[b]][0], clock.host())
                del unseen[b]
            finished = [b for b in running if not active[b]]
            floor = {b: remaining[b] - peek.lag for b in running}
        if finished:
            now = clock.host()
            snap = decoder.snapshot(finished)  # copied back beside what follows; a refill may overwrite the rows
            ended = [(running.pop(b), b) for b in finished]
            for b in finished:
                unseen.pop(b, None)
            free.update(finished)
            filled = {}
            if not running or (policy == "continuous" and len(free) >= min(refill_at, len(waiting) or 1)):
                filled = admit(sorted(free))
            # the next burst is sized from what the host knows (the other rows' floors, the new rows' limits) and
            # launched behind the refill at once; a new row whose first token was a stop token idles until the
            # next read, as a row that stops inside a burst does
            if floor is not None:
                floor = {b: floor[b] for b in running if b not in filled} | filled or None
            unbuilt.append((ended, finished, snap, now))  # built once the next steps are launched
            continue
        width = width_for(len(running))
        if host and width > 1:
            if stale:
                seqs, stale = host_drafting.live_tokens(decoder, running), False
            host_drafting.host_step(decoder, seqs, width)
            k, floor = 1, None
        else:  # drafted on the device, or no drafts at all: bursts without a read-back
            if host and not stale:  # coming from host drafting: how far each row still has to go
                remaining = (decoder.limit - decoder.pos).tolist()
                floor = {b: remaining[b] for b in running}
            stale = host
            # the state read may miss the last step launched: floor is remaining less ``peek.lag`` tokens a row
            k = max(1, math.ceil(min(floor[b] for b in running) / width))
            floor = None  # the burst moves every row: the next decision reads the state
            step = decoder.step_at(width)
            for _ in range(k - 1):
                step()
            peek.launch(width)  # the state after k - 1 steps, copied back while the k-th runs
            step()
        build()
        steps += k
        bursts += 1
        widths[width] = widths.get(width, 0) + k
    build()
    seconds = clock.host(sync=True)
    first = {i: finished if admitted[i][1] is None else clock.resolve(admitted[i][1]) for i, _, _, finished in done}
    requests = sorted((Request(i, b, result, admitted[i][0], first[i], finished) for i, b, result, finished in done),
                      key=lambda r: r.index)
    return ServeRun(policy, decoder.batch, requests, seconds, steps, fills,
                    sum((r.result.stats for r in requests), SpecDecodeStats()), widths, bursts, reads, refill)


class _Peek:
    """Each row's (live, tokens left, being filled) for the host's next decision.

    Off CUDA, without ``behind``, and after anything but a burst, ``read`` synchronises and is exact. On
    CUDA with ``behind`` a burst calls ``launch`` before its last step: the copy goes back while that step
    runs, so the device never idles on the host's decision (vLLM's async scheduling reads its outputs one
    step late the same way). The state
    is then one step behind: a row it shows inactive is done, and a live row has at most ``remaining``
    tokens left and at least ``remaining - lag`` (the missed step's width).
    """

    def __init__(self, decoder: FastDecoder, behind: bool = True):
        self.decoder, self.pending, self.lag = decoder, 0, 0  # pending: the width of the step the copy misses
        cuda = decoder.device.type == "cuda" and behind
        self.buf = torch.zeros((3, decoder.batch), dtype=torch.long, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None

    def _state(self) -> torch.Tensor:
        return chunked_fill.row_state(self.decoder)

    def launch(self, width: int) -> None:
        """Copy the state back now; the caller launches one more step of ``width`` right after."""
        if self.event is not None:
            self.buf.copy_(self._state(), non_blocking=True)
            self.event.record()
            self.pending = width

    def read(self) -> list[list[int]]:
        """(live, tokens left, being filled) per row (``chunked_fill.row_state``); ``lag`` says by how many tokens
        a row may have moved since."""
        self.lag, self.pending = self.pending, 0
        if self.lag:
            self.event.synchronize()
            return self.buf.tolist()
        return self._state().tolist()


class _Clock:
    """Seconds since the stream started: the host's clock, and device marks (CUDA events, resolved at the end,
    so that timing a prefill costs no sync; off CUDA a mark is the synchronised host time)."""

    def __init__(self, device):
        self.device, self.cuda = device, device.type == "cuda"
        self.t0 = synchronized_time(device)
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def host(self, sync: bool = False) -> float:
        return (synchronized_time(self.device) if sync else time.perf_counter()) - self.t0

    def mark(self):
        if not self.cuda:
            return self.host(sync=True)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self, mark) -> float:
        return mark if isinstance(mark, float) else self.start.elapsed_time(mark) / 1e3
