"""Statistics: vLLM's speculative-decoding counters, plus the views a lab wants to see.

The counters and their definitions are vLLM's (``v1/spec_decode/metrics.py``,
``SpecDecodingStats.observe_draft``), so the same figures draw the lab's runs
and a production server's /metrics (``dflash_lab.spec_decode.metrics`` reads those into a
``SpecDecodeStats``).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path


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
    # How drafts were chosen when sampling: "greedy" (vLLM's default: the drafter's argmax, q one-hot)
    # or "probabilistic" (sampled from q); None for greedy decoding, mixed runs or a /metrics page.
    draft_sample_method: str | None = None

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int, depth: int | None = None) -> None:
        """Count one verified draft, exactly as vLLM's SpecDecodingStats.observe_draft does.

        ``depth``: a draft tree's (``tree.py``): its nodes are the draft tokens, its depths the positions.
        """
        depth = num_draft_tokens if depth is None else depth
        if not 0 <= num_accepted_tokens <= min(num_draft_tokens, depth):
            raise ValueError(f"accepted {num_accepted_tokens} of {num_draft_tokens} draft tokens is impossible")
        if len(self.num_accepted_tokens_per_pos) < depth:
            self.num_accepted_tokens_per_pos += [0] * (depth - len(self.num_accepted_tokens_per_pos))
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
        self.acceptance_lengths.append(1 + num_accepted_tokens)

    def observe_drafts(self, num_draft_tokens, num_accepted_tokens, depth: int | None = None) -> None:
        """``observe_draft`` for each pair of two equal-length sequences (lists or 1-D tensors), in order.

        How a backend that logs its drafts on the device (``fast.decoder``) hands them over.
        """
        drafted = num_draft_tokens.tolist() if hasattr(num_draft_tokens, "tolist") else list(num_draft_tokens)
        accepted = num_accepted_tokens.tolist() if hasattr(num_accepted_tokens, "tolist") else list(num_accepted_tokens)
        if len(drafted) != len(accepted):
            raise ValueError(f"{len(drafted)} draft sizes but {len(accepted)} accepted counts")
        for k, n in zip(drafted, accepted):
            self.observe_draft(k, n, depth)

    # --- what vLLM logs ------------------------------------------------------
    @property
    def num_speculative_tokens(self) -> int:
        return len(self.num_accepted_tokens_per_pos)

    @property
    def mean_accepted_tokens(self) -> float:
        """accepted / drafts: drafted tokens kept per verification (τ without the bonus token)."""
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else math.nan

    @property
    def mean_acceptance_length(self) -> float:
        """τ = 1 + accepted / drafts: tokens per verification, the bonus token included."""
        return 1 + self.mean_accepted_tokens

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        """Fraction of drafts whose first i+1 tokens were all accepted (0.0 everywhere when there were no drafts)."""
        return [c / self.num_drafts if self.num_drafts else 0.0 for c in self.num_accepted_tokens_per_pos]

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else math.nan

    # --- derived views for the lab -------------------------------------------
    @property
    def num_drafts_reaching_pos(self) -> list[int]:
        """Drafts that got to position i: every draft at i = 0, then those accepted through i-1."""
        return [self.num_drafts] + self.num_accepted_tokens_per_pos[:-1]

    @property
    def conditional_acceptance_rate(self) -> list[float]:
        """P(position i accepted | positions < i accepted): per_pos[i] / per_pos[i-1]; NaN where no draft got to i."""
        return conditional_acceptance_rates(self.num_accepted_tokens_per_pos, self.num_drafts)

    def acceptance_length_counts(self) -> list[int]:
        """counts[a-1] = drafts with acceptance length a (1 .. K+1).

        Exact from the per-position counters alone (a draft with n accepted adds
        1 to positions 0..n-1), so it works for stats read from vLLM's /metrics too.
        """
        per_pos = self.num_accepted_tokens_per_pos
        at_least = [self.num_drafts] + per_pos + [0]  # drafts with >= n accepted, n = 0 .. K+1
        return [at_least[n] - at_least[n + 1] for n in range(len(per_pos) + 1)]

    @property
    def acceptance_length_shares(self) -> list[float]:
        """The acceptance-length histogram as shares of the drafts (z-lab's view); NaN when there were no drafts."""
        return [c / self.num_drafts if self.num_drafts else math.nan for c in self.acceptance_length_counts()]

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
            draft_sample_method=(self.draft_sample_method if self.draft_sample_method == other.draft_sample_method
                                 else None),
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
        if min([diff.num_drafts, diff.num_draft_tokens, diff.num_accepted_tokens,
                *diff.num_accepted_tokens_per_pos]) < 0:
            raise ValueError("counters went down: subtract the EARLIER stats from the later ones "
                             "(did the server restart?)")
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

    # --- export: JSON and CSV (dflash_lab.export writes several at once) -----
    def to_dict(self) -> dict:
        """Every counter and setting, plus the derived rates; JSON-ready (NaN -> None)."""
        finite = lambda x: x if not isinstance(x, float) or math.isfinite(x) else None  # noqa: E731
        return {**asdict(self),
                "mean_acceptance_length": finite(self.mean_acceptance_length),
                "draft_acceptance_rate": finite(self.draft_acceptance_rate),
                "target_forwards_per_token": finite(self.target_forwards_per_token),
                "per_position_acceptance_rate": self.per_position_acceptance_rate,
                "conditional_acceptance_rate": [finite(x) for x in self.conditional_acceptance_rate]}

    @classmethod
    def from_dict(cls, d: dict) -> "SpecDecodeStats":
        """The stats ``to_dict`` (or its JSON) wrote; derived keys are recomputed, not read."""
        own = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in own})

    def to_json(self, path=None) -> str:
        """``to_dict`` as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def csv_row(self) -> dict:
        """One flat row: the scalar counters and rates, then one column per draft position."""
        d = self.to_dict()
        row = {k: v for k, v in d.items() if not isinstance(v, list)}
        for i, (count, rate) in enumerate(zip(self.num_accepted_tokens_per_pos, self.per_position_acceptance_rate), 1):
            row[f"accepted_through_pos_{i}"] = count
            row[f"rate_pos_{i}"] = round(rate, 6)
        return row

    def to_csv(self, path=None) -> str:
        """``csv_row`` as a two-line CSV (header, values); also written to ``path`` when given."""
        row = self.csv_row()
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(row), lineterminator="\n")
        writer.writeheader()
        writer.writerow(row)
        if path is not None:
            Path(path).write_text(buf.getvalue())
        return buf.getvalue()


def conditional_acceptance_rates(accepted_through, num_drafts=1.0) -> list[float]:
    """c_i = a_i / a_{i-1} with a_{-1} = num_drafts: the one definition of the conditional rate.

    ``accepted_through[i]`` counts the drafts accepted through position i (vLLM's per-position
    counter), or is their share of the drafts with ``num_drafts`` = 1.0 (a synthetic
    schedule's unconditional rates r_i); the ratio is the same either way.
    Where no draft got to position i (a_{i-1} = 0) the rate is 0 / 0: NaN, on measured
    counters and synthetic schedules alike, and the figures draw it as a gap. vLLM 0.33 never
    reports a conditional rate: its log prints the unconditional a_i / drafts, 0.000 at such a
    position (``SpecDecodingLogging.log``, v1/spec_decode/metrics.py). Its one conditional rate,
    the synthetic sampler's (v1/spec_decode/utils.py ``unconditional_to_conditional_rates``),
    writes 0.0 there, but its loop stops at the rejection before and never reads it
    (v1/sample/rejection_sampler.py, ``if not rejected``); the lab's draw ``u < NaN`` is False,
    the same decision.
    """
    a = [float(x) for x in accepted_through]
    return [c / prev if prev > 0 else math.nan for c, prev in zip(a, [float(num_drafts)] + a[:-1])]


def _per_pos(a: SpecDecodeStats, b: SpecDecodeStats, sign: int) -> list[int]:
    """a's per-position counts plus (sign=1) or minus (sign=-1) b's; the shorter list counts as zeros."""
    x, y = a.num_accepted_tokens_per_pos, b.num_accepted_tokens_per_pos
    n = max(len(x), len(y))
    x, y = x + [0] * (n - len(x)), y + [0] * (n - len(y))
    return [i + sign * j for i, j in zip(x, y)]
