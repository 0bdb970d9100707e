"""vLLM's /metrics counters become SpecDecodeStats with the same definitions.

The expositions here are written by vLLM 0.33's own ``SpecDecodingProm`` (bound
to a private registry), and ``LLM.get_metrics()`` objects come from vLLM's own
reader, so names, HELP texts and label sets are vLLM's, not a copy of them.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_lab.spec_decode.metrics import MetricsError, prometheus_text, stats_from_prometheus_text, stats_from_vllm_metrics
from dflash_lab.spec_decode import SpecDecodeStats

EXAMPLE = Path(__file__).resolve().parents[1] / "notebooks" / "data" / "vllm_metrics_example.txt"

# acceptance counts per draft, per series (model_name, engine)
DRAFTS = {
    ("laguna-xs.2", "0"): [0, 3, 1, 4, 4, 2],
    ("laguna-xs.2", "1"): [1, 1, 0, 4],
    ("other-model", "0"): [2, 2],
}
K = 4  # num_speculative_tokens


def lab_stats(accepted: list[int]) -> SpecDecodeStats:
    s = SpecDecodeStats(num_accepted_tokens_per_pos=[0] * K)
    for n in accepted:
        s.observe_draft(K, n)
    return s


@pytest.fixture(scope="module")
def vllm_registry():
    """A private Prometheus registry filled by vLLM's own SpecDecodingProm."""
    from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

    registry = prometheus_client.CollectorRegistry()

    class PrivateSpecDecodingProm(SpecDecodingProm):
        _counter_cls = functools.partial(prometheus_client.Counter, registry=registry)

    series = list(DRAFTS)
    prom = PrivateSpecDecodingProm(SimpleNamespace(num_speculative_tokens=K), ["model_name", "engine"],
                                   {i: list(labels) for i, labels in enumerate(series)})
    for i, labels in enumerate(series):
        step = SpecDecodingStats.new(K)
        for n in DRAFTS[labels]:
            step.observe_draft(K, n)
        prom.observe(step, engine_idx=i)
    return registry


@pytest.fixture(scope="module")
def vllm_text(vllm_registry) -> str:
    return prometheus_client.generate_latest(vllm_registry).decode()


def counters(s: SpecDecodeStats):
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_accepted_tokens_per_pos


def test_counters_come_out_of_vllms_exposition_with_its_definitions(vllm_text):
    one = stats_from_prometheus_text(vllm_text, model_name="laguna-xs.2", engine="0")
    assert counters(one) == counters(lab_stats(DRAFTS[("laguna-xs.2", "0")])) == (6, 24, 14, [5, 4, 3, 2])
    assert one.mean_acceptance_length == 1 + 14 / 6
    assert one.per_position_acceptance_rate == [5 / 6, 4 / 6, 3 / 6, 2 / 6]


def test_engines_and_models_are_summed_unless_selected(vllm_text):
    everything = stats_from_prometheus_text(vllm_text)
    assert counters(everything) == counters(sum(lab_stats(a) for a in DRAFTS.values()))
    model = stats_from_prometheus_text(vllm_text, model_name="laguna-xs.2")  # both engines of one model
    assert counters(model) == counters(lab_stats(DRAFTS[("laguna-xs.2", "0")]) + lab_stats(DRAFTS[("laguna-xs.2", "1")]))
    engine1 = stats_from_prometheus_text(vllm_text, engine=1)
    assert counters(engine1) == counters(lab_stats(DRAFTS[("laguna-xs.2", "1")]))
    by_labels = stats_from_prometheus_text(vllm_text, labels={"model_name": "other-model"})
    assert counters(by_labels) == counters(lab_stats(DRAFTS[("other-model", "0")]))


def test_get_metrics_objects_give_the_same_stats(vllm_registry, monkeypatch):
    from vllm.v1.metrics import reader

    monkeypatch.setattr(reader, "REGISTRY", vllm_registry)  # what LLM.get_metrics() reads
    metrics = reader.get_metrics_snapshot()
    assert any(isinstance(m, reader.Vector) for m in metrics) and any(isinstance(m, reader.Counter) for m in metrics)
    for kw in ({}, {"engine": "1"}, {"model_name": "other-model"}):
        from_objects = stats_from_vllm_metrics(metrics, **kw)
        assert counters(from_objects) == counters(stats_from_prometheus_text(prometheus_text(_series(**kw))))
    assert counters(stats_from_prometheus_text(metrics)) == counters(stats_from_vllm_metrics(metrics))  # a list works too


def _series(model_name=None, engine=None):
    return {k: lab_stats(v) for k, v in DRAFTS.items()
            if (model_name is None or k[0] == model_name) and (engine is None or k[1] == str(engine))}


def test_reader_objects_built_by_hand():
    from vllm.v1.metrics.reader import Counter, Gauge, Vector

    labels = {"model_name": "m", "engine": "0"}
    metrics = [
        Gauge(name="vllm:num_requests_running", labels=labels, value=3.0),
        Counter(name="vllm:spec_decode_num_drafts", labels=labels, value=10),
        Counter(name="vllm:spec_decode_num_draft_tokens", labels=labels, value=30),
        Counter(name="vllm:spec_decode_num_accepted_tokens", labels=labels, value=12),
        Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=labels, values=[7, 4, 1]),
    ]
    s = stats_from_vllm_metrics(metrics)
    assert counters(s) == (10, 30, 12, [7, 4, 1])
    assert s.mean_acceptance_length == 2.2
    assert s.acceptance_length_counts() == [3, 3, 3, 1]


def test_our_exposition_is_vllms_exposition(vllm_text):
    """prometheus_text writes the same samples, HELP and TYPE lines that vLLM's server writes."""
    ours = prometheus_text(_series())

    def samples(text):
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value)
                      for f in text_string_to_metric_families(text) for s in f.samples if not s.name.endswith("_created"))

    def headers(text):
        return sorted(line for line in text.splitlines() if line.startswith("#") and "_created" not in line)

    assert samples(ours) == samples(vllm_text)
    assert headers(ours) == headers(vllm_text)


def test_lab_stats_survive_a_round_trip():
    s = lab_stats([0, 1, 4, 4, 3])
    back = stats_from_prometheus_text(prometheus_text(s, model_name="tiny", engine=0))
    assert counters(back) == counters(s)
    assert back.acceptance_length_counts() == s.acceptance_length_counts() == [1, 1, 0, 1, 2]


def test_samples_without_type_lines_are_read_too():
    """Lines grepped out of a scrape lose their # TYPE headers; the _total names still count."""
    text = "\n".join([
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 4.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 8.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 3.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0',
        "",
    ])
    assert counters(stats_from_prometheus_text(text)) == (4, 8, 5, [3, 2])


def test_a_scrape_before_the_run_can_be_subtracted():
    before, after = lab_stats([1, 2]), lab_stats([1, 2, 4, 0])
    run = stats_from_prometheus_text(prometheus_text(after)) - stats_from_prometheus_text(prometheus_text(before))
    assert counters(run) == counters(lab_stats([4, 0]))
    with pytest.raises(ValueError, match="counters went down"):
        before - after


def test_the_example_file_is_a_vllm_page_with_two_engines():
    text = EXAMPLE.read_text()
    stats = stats_from_prometheus_text(text)
    assert stats.num_speculative_tokens == 15
    assert stats.num_draft_tokens == 15 * stats.num_drafts
    assert 1 < stats.mean_acceptance_length < 16
    rates = stats.per_position_acceptance_rate
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    e0, e1 = (stats_from_prometheus_text(text, engine=e) for e in (0, 1))
    assert counters(e0 + e1) == counters(stats)
    assert "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position." in text


# ---------------------------------------------------------------------------
# Bad /metrics input: the message names the metric, label or line
# ---------------------------------------------------------------------------


def test_missing_counter_is_named(vllm_text):
    without = "\n".join(line for line in vllm_text.splitlines() if "num_draft_tokens" not in line) + "\n"
    with pytest.raises(MetricsError, match=r"no vllm:spec_decode_num_draft_tokens_total counter"):
        stats_from_prometheus_text(without)
    with pytest.raises(MetricsError, match=r"no vllm:spec_decode_num_drafts_total counter"):
        stats_from_prometheus_text("# nothing here\n")


def test_non_numeric_value_names_the_line():
    text = prometheus_text(lab_stats([1])).replace("} 1.0\n", "} one\n", 1)
    with pytest.raises(MetricsError, match=r"not valid Prometheus exposition: line \d+ 'vllm:spec_decode_num_drafts_total.*one'"):
        stats_from_prometheus_text(text)


@pytest.mark.parametrize("value", ["-1.0", "2.5", "NaN", "+Inf"])
def test_impossible_counter_values_are_rejected(value):
    text = prometheus_text(lab_stats([1])).replace("_drafts_total{engine=\"0\",model_name=\"laguna\"} 1.0",
                                                   f"_drafts_total{{engine=\"0\",model_name=\"laguna\"}} {value}")
    with pytest.raises(MetricsError, match=r'vllm:spec_decode_num_drafts\{engine="0",model_name="laguna"\} is .*non-negative integer'):
        stats_from_prometheus_text(text)


def test_labels_that_match_nothing_list_what_is_there(vllm_text):
    with pytest.raises(MetricsError, match=r"no vllm:spec_decode_num_drafts series has labels \{'engine': '7'\}; "
                                           r"series present: .*'engine': '1'"):
        stats_from_prometheus_text(vllm_text, engine=7)


def test_a_position_label_that_is_not_an_integer_is_rejected():
    text = prometheus_text(lab_stats([2])).replace('position="1"', 'position="second"')
    with pytest.raises(MetricsError, match=r"position='second'"):
        stats_from_prometheus_text(text)


def test_wrong_input_types_are_rejected():
    with pytest.raises(TypeError, match=r"text must be the /metrics exposition as str, got dict"):
        stats_from_prometheus_text({"vllm:spec_decode_num_drafts": 3})
    with pytest.raises(TypeError, match=r"metrics must be vLLM metric objects with name and labels, got int"):
        stats_from_vllm_metrics([3])
