"""vLLM's speculative-decoding counters, read from a server's /metrics or from ``LLM.get_metrics()``.

vLLM 0.33 (``vllm/v1/spec_decode/metrics.py``, ``SpecDecodingProm``) exports four
counters, one series per engine, labelled ``model_name`` and ``engine``:

    vllm:spec_decode_num_drafts_total{engine="0",model_name="m"}                     drafts verified
    vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"}               tokens drafted
    vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"}            tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="i"}
                                              drafts whose first i+1 tokens were all accepted

They are the lab's ``SpecDecodeStats`` counters under the same definitions, so
every figure in ``viz`` draws a production server's numbers as it draws the
lab's own. The counters are cumulative since the server started: subtract a
scrape taken before a run (``after - before``) to get that run alone.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from .stats import SpecDecodeStats

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
# name -> HELP text, exactly as vLLM registers them
DOCUMENTATION = {
    NUM_DRAFTS: "Number of spec decoding drafts.",
    NUM_DRAFT_TOKENS: "Number of draft tokens.",
    NUM_ACCEPTED_TOKENS: "Number of accepted tokens.",
    NUM_ACCEPTED_TOKENS_PER_POS: "Accepted tokens per draft position.",
}
LABEL_NAMES = ["model_name", "engine"]  # vLLM's per-engine labels; the per-position counter adds "position"


class MetricsError(ValueError):
    """The /metrics input lacks a counter, holds a bad value, or no series matches the labels asked for."""


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def stats_from_prometheus_text(text, *, model_name: str | None = None, engine=None,
                               labels: dict | None = None) -> SpecDecodeStats:
    """``SpecDecodeStats`` from a vLLM /metrics exposition (parsed by prometheus_client).

    Series of several engines (data parallel) or models are summed; pass
    ``model_name=``, ``engine=`` or any ``labels={...}`` to keep only matching
    ones. For convenience, ``text`` may also be the list that
    ``LLM.get_metrics()`` returns (see ``stats_from_vllm_metrics``).
    """
    if isinstance(text, (list, tuple)):
        return stats_from_vllm_metrics(text, model_name=model_name, engine=engine, labels=labels)
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if not isinstance(text, str):
        raise TypeError(f"text must be the /metrics exposition as str, got {type(text).__name__}")
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise MetricsError(f"/metrics text is not valid Prometheus exposition: {_bad_line(text) or e}") from None
    samples = [(s.name, s.labels, s.value) for family in families for s in family.samples]
    return _stats_from_samples(samples, _wanted(model_name, engine, labels), source="/metrics text")


def stats_from_vllm_metrics(metrics, *, model_name: str | None = None, engine=None,
                            labels: dict | None = None) -> SpecDecodeStats:
    """``SpecDecodeStats`` from ``LLM.get_metrics()``: vLLM's reader objects.

    ``vllm.v1.metrics.reader.Counter`` carries ``name``, ``labels`` and ``value``;
    the per-position counter comes as one ``Vector`` (``values[i]`` = position i)
    per engine. Other metrics in the list are ignored.
    """
    samples = []
    for m in metrics:
        name, lab = getattr(m, "name", None), getattr(m, "labels", None)
        if not isinstance(name, str) or not isinstance(lab, dict):
            raise TypeError(f"metrics must be vLLM metric objects with name and labels, got {type(m).__name__}")
        if hasattr(m, "values") and isinstance(m.values, (list, tuple)):  # reader.Vector
            samples += [(name, {**lab, "position": str(i)}, v) for i, v in enumerate(m.values)]
        elif hasattr(m, "value"):  # reader.Counter / Gauge
            samples.append((name, lab, m.value))
    return _stats_from_samples(samples, _wanted(model_name, engine, labels), source="LLM.get_metrics()")


def _wanted(model_name, engine, labels) -> dict[str, str]:
    wanted = {k: str(v) for k, v in (labels or {}).items()}
    if model_name is not None:
        wanted["model_name"] = str(model_name)
    if engine is not None:
        wanted["engine"] = str(engine)
    return wanted


def _stats_from_samples(samples, wanted: dict[str, str], source: str) -> SpecDecodeStats:
    """Sum the counters over the series whose labels include ``wanted``."""
    by_metric: dict[str, list[tuple[dict, float]]] = {}
    for name, labels, value in samples:
        base = name.removesuffix("_total")
        if base in DOCUMENTATION and not name.endswith("_created"):
            by_metric.setdefault(base, []).append((labels, value))

    def matching(metric: str, required: bool = True):
        series = by_metric.get(metric)
        if not series:
            if required:
                raise MetricsError(f"{source} has no {metric}_total counter: was vLLM started with "
                                   "speculative decoding (--speculative-config)?")
            return []
        chosen = [(lab, _count(metric, lab, value, source)) for lab, value in series
                  if all(lab.get(key) == want for key, want in wanted.items())]
        if not chosen:
            present = sorted({tuple(sorted((k, v) for k, v in lab.items() if k != "position")) for lab, _ in series})
            raise MetricsError(f"{source}: no {metric} series has labels {wanted}; series present: "
                               f"{[dict(p) for p in present]}")
        return chosen

    stats = SpecDecodeStats(
        num_drafts=sum(v for _, v in matching(NUM_DRAFTS)),
        num_draft_tokens=sum(v for _, v in matching(NUM_DRAFT_TOKENS)),
        num_accepted_tokens=sum(v for _, v in matching(NUM_ACCEPTED_TOKENS)),
    )
    per_pos: dict[int, int] = {}
    for lab, v in matching(NUM_ACCEPTED_TOKENS_PER_POS, required=False):  # optional: older servers lack it
        pos = lab.get("position")
        if pos is None or not pos.isdigit():
            raise MetricsError(f"{source}: {NUM_ACCEPTED_TOKENS_PER_POS} has a series with position={pos!r}; "
                               "expected a non-negative integer label")
        per_pos[int(pos)] = per_pos.get(int(pos), 0) + v
    stats.num_accepted_tokens_per_pos = [per_pos.get(i, 0) for i in range(max(per_pos, default=-1) + 1)]
    # One snapshot of vLLM's counters always satisfies these; anything else is a damaged page.
    if stats.num_accepted_tokens > stats.num_draft_tokens:
        raise MetricsError(f"{source}: {NUM_ACCEPTED_TOKENS} ({stats.num_accepted_tokens}) exceeds "
                           f"{NUM_DRAFT_TOKENS} ({stats.num_draft_tokens}); the counters are inconsistent")
    over = [i for i, n in enumerate(stats.num_accepted_tokens_per_pos) if n > stats.num_drafts]
    if over:
        raise MetricsError(f"{source}: {NUM_ACCEPTED_TOKENS_PER_POS} at position {over[0]} "
                           f"({stats.num_accepted_tokens_per_pos[over[0]]}) exceeds {NUM_DRAFTS} ({stats.num_drafts})")
    return stats


def _count(metric: str, labels: dict, value: float, source: str) -> int:
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise MetricsError(f"{source}: {metric}{_fmt(labels)} is {value!r}; a counter must be a non-negative integer")
    return int(value)


def _fmt(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _bad_line(text: str) -> str | None:
    """The first sample line the parser rejects, with its number (the parser's own error names none)."""
    for no, line in enumerate(text.splitlines(), 1):
        if line.strip() and not line.startswith("#"):
            try:
                list(text_string_to_metric_families(line + "\n"))
            except ValueError as e:
                return f"line {no} {line.strip()[:120]!r}: {e}"
    return None


# ---------------------------------------------------------------------------
# Writing: the exposition a vLLM server would serve for these stats
# ---------------------------------------------------------------------------


def prometheus_text(stats, *, model_name: str = "laguna", engine="0") -> str:
    """The four spec-decode counters in vLLM's exact names, HELP texts and labels.

    ``stats``: one ``SpecDecodeStats`` (for ``model_name`` / ``engine``), or a
    dict ``{(model_name, engine): SpecDecodeStats}`` for several series. Written
    by prometheus_client, as vLLM's server writes them (``_created`` samples included).
    """
    series = stats if isinstance(stats, dict) else {(model_name, engine): stats}
    registry = CollectorRegistry()
    counters = {name: Counter(name, DOCUMENTATION[name], labelnames=LABEL_NAMES, registry=registry)
                for name in (NUM_DRAFTS, NUM_DRAFT_TOKENS, NUM_ACCEPTED_TOKENS)}
    per_pos = Counter(NUM_ACCEPTED_TOKENS_PER_POS, DOCUMENTATION[NUM_ACCEPTED_TOKENS_PER_POS],
                      labelnames=LABEL_NAMES + ["position"], registry=registry)
    for (model, eng), s in series.items():
        counters[NUM_DRAFTS].labels(model, str(eng)).inc(s.num_drafts)
        counters[NUM_DRAFT_TOKENS].labels(model, str(eng)).inc(s.num_draft_tokens)
        counters[NUM_ACCEPTED_TOKENS].labels(model, str(eng)).inc(s.num_accepted_tokens)
        for pos, count in enumerate(s.num_accepted_tokens_per_pos):
            per_pos.labels(model, str(eng), str(pos)).inc(count)
    return generate_latest(registry).decode()
