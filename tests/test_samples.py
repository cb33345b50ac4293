"""Samples read as samples: each kept trace carries how many traces it stands for (its adjusted count), and
``stagetrace report`` weights its counts and percentiles by it, says how many it kept of how many, and
takes the exact request and slow counts from the metrics the embedded default writes beside the traces."""

from __future__ import annotations

import io
import json
import random
import time
from collections import defaultdict

import pytest

import stagetrace
from otlp_lines import kv
from stagetrace import conventions as c
from stagetrace.cli.report import run_report
from stagetrace.exporter.budget import AdjustedCounts, BudgetLimits, ExportBudget, own_weight, signature_of
from stagetrace.exporter.keep import Keep, in_healthy_share
from stagetrace.report.aggregate import Aggregator
from stagetrace.report.collect import aggregate_files
from stagetrace.report.metric_totals import TraceCounts
from stagetrace.report.render import counts_line
from stagetrace.report.sketch import QuantileSketch
from stagetrace.settings import Settings


def test_a_healthy_sample_stands_for_the_share_it_was_kept_in():
    assert own_weight(Keep.HEALTHY_SAMPLE, 0.1) == pytest.approx(10.0)
    assert own_weight(Keep.HEALTHY_SAMPLE, 0.25) == 4.0
    assert own_weight(Keep.HEALTHY_SAMPLE, 1.0) == 1.0  # every healthy trace kept
    assert own_weight(Keep.SLOW, 0.1) == own_weight(Keep.ERROR, 0.1) == 1.0


def test_what_the_budget_leaves_out_is_carried_by_the_next_kept_trace_of_its_stratum():
    """Over a run the kept traces' adjusted counts add up to every trace worth keeping, less the last
    stretch of each stratum (signature and reason to keep) the budget left out after its last kept trace;
    and within each reason too (a wrong stratum would move weight from slow traces to healthy ones)."""
    rng = random.Random(7)
    budget = ExportBudget(BudgetLimits(per_s=20.0, burst=40.0, signature_per_s=5.0, signature_burst=10.0), 0.0)
    adjusted = AdjustedCounts()
    sigs = [signature_of("GET /", "/", stage, ()) for stage in ("a", "b", "c")]
    offered: dict[tuple, float] = defaultdict(float)  # up to and including each stratum's last kept trace
    pending: dict[tuple, float] = defaultdict(float)
    kept_total: dict[Keep, float] = defaultdict(float)
    for i in range(5000):
        sig = rng.choice(sigs)
        keep = rng.choice([Keep.SLOW, Keep.DIAGNOSED, Keep.HEALTHY_SAMPLE])
        weight = own_weight(keep, 0.1)
        pending[sig, keep] += weight
        if budget.admit(keep, sig, 100.0, i * 0.002) is Keep.BUDGET:
            adjusted.left_out((sig, keep), weight)
        else:
            kept_total[keep] += adjusted.kept((sig, keep), weight)
            offered[sig, keep] += pending.pop((sig, keep))
    for reason in (Keep.SLOW, Keep.DIAGNOSED, Keep.HEALTHY_SAMPLE):
        assert kept_total[reason] == pytest.approx(sum(w for (_, r), w in offered.items() if r is reason))
    everything = sum(kept_total.values()) + sum(pending.values())
    assert sum(pending.values()) < 0.05 * everything  # the trailing stretches


def test_a_forgotten_stratum_takes_its_carried_weight_with_it():
    adjusted = AdjustedCounts(max_signatures=2)
    for sig in ("a", "b", "c"):  # "a" is forgotten when "c" comes
        adjusted.left_out(((sig, "", ()), Keep.SLOW), 3.0)
    assert adjusted.kept((("a", "", ()), Keep.SLOW), 1.0) == 1.0
    assert adjusted.kept((("c", "", ()), Keep.SLOW), 1.0) == 4.0
    assert adjusted.kept((("b", "", ()), Keep.HEALTHY_SAMPLE), 10.0) == 10.0  # a slow trace's weight stays slow
    assert adjusted.kept((("b", "", ()), Keep.SLOW), 1.0) == 4.0


def test_the_weighted_sketch_reads_quantiles_as_if_each_value_were_repeated():
    weighted, repeated = QuantileSketch(), QuantileSketch()
    for value, weight in ((1.0, 9), (100.0, 1), (10.0, 3)):
        weighted.add(value, weight)
        for _ in range(weight):
            repeated.add(value)
    for q in (0.0, 0.5, 0.69, 0.7, 0.9, 0.99, 1.0):
        assert weighted.quantile(q) == repeated.quantile(q), q
    assert weighted.count == repeated.count == 13 and weighted.mean == pytest.approx(repeated.mean)


def test_the_aggregator_weighs_counts_shares_and_percentiles():
    from stagetrace.analysis import Diagnosis, Verdict

    def verdict(total, slow, code=None):
        diagnoses = (Diagnosis(code, "m", "a"),) if code else ()
        return Verdict(
            trace_id="t", root_name="r", total_ms=total, breakdown={"s": total}, bottleneck="s", ratio=1.0,
            slow=slow, slow_threshold_ms=50.0, untracked_ms=0.0, diagnoses=diagnoses,
        )  # fmt: skip

    agg = Aggregator()
    agg.add(verdict(100.0, True, "X"), weight=1)
    agg.add(verdict(1.0, False), weight=9)
    summary = agg.summary()
    assert (summary["traces"], summary["requests"], summary["slow_traces"], summary["slow_requests"]) == (2, 10, 1, 1)
    assert summary["sampled"] and summary["diagnoses"] == {"X": 1}
    assert summary["total_ms"]["p50"] == pytest.approx(1.0, rel=0.02)  # unweighted, the median would be 100
    assert summary["stages"]["s"]["bottleneck_traces"] == 10
    # with no metrics to count them, the line says the requests are an estimate from the kept traces
    assert counts_line(summary) == (
        "2 kept of about 10 requests, about 1 slow (10%); every figure below weighted by each kept trace's "
        "adjusted count"
    )
    summary["counted"] = {"requests": 12, "slow": 3}  # the metrics saw every request: exact, no "about"
    assert counts_line(summary) == (
        "2 kept of 12 requests, 3 slow (25%) (counted by the metrics); every figure below weighted by each kept "
        "trace's adjusted count"
    )


def _histogram_line(points, temporality=2, resource=(("service.name", "svc"), ("process.pid", 1))):
    return {
        "resourceMetrics": [
            {
                "resource": {"attributes": [kv(k, v) for k, v in resource]},
                "scopeMetrics": [
                    {
                        "scope": {"name": "stagetrace"},
                        "metrics": [
                            {
                                "name": c.METRIC_TRACE_DURATION,
                                "histogram": {"aggregationTemporality": temporality, "dataPoints": points},
                            },
                            {"name": c.METRIC_STAGE_DURATION, "histogram": {"dataPoints": [{"count": "999"}]}},
                        ],
                    }
                ],
            }
        ]
    }


def _point(count, slow, at, route="/p", start="1"):
    attrs = [kv(c.SLOW, slow)] + ([kv(c.HTTP_ROUTE, route)] if route else [])
    return {"attributes": attrs, "count": str(count), "startTimeUnixNano": start, "timeUnixNano": str(at)}


def test_exact_counts_are_each_cumulative_streams_latest_point_summed_over_processes_and_deltas_added():
    totals = TraceCounts()
    assert totals.counted() is None
    totals.add(_histogram_line([_point(5, False, 10), _point(2, True, 10)]))
    totals.add(_histogram_line([_point(9, False, 20), _point(3, True, 20)]))  # later: replaces, not adds
    totals.add(_histogram_line([_point(7, False, 15)]))  # an older point of the same stream: ignored
    totals.add(_histogram_line([_point(4, True, 5)], resource=(("service.name", "svc"), ("process.pid", 2))))
    totals.add(_histogram_line([_point(1, False, 5, route=None)], temporality=1))
    totals.add(_histogram_line([_point(1, False, 6, route=None)], temporality=1))
    assert totals.counted() == (9 + 3 + 4 + 2, 3 + 4)
    assert totals.counted("/p") == (16, 7)
    restarted = TraceCounts()  # a process restarted: a new stream (start time), counted beside the old one
    restarted.add(_histogram_line([_point(5, False, 10, start="1")]))
    restarted.add(_histogram_line([_point(2, False, 30, start="25")]))
    assert restarted.counted() == (7, 0)


def test_points_as_proto3_json_writes_them_fields_at_zero_left_out():
    """OTLP JSON leaves out a field at its default: a point of no requests has no ``count``, a histogram may
    lack its temporality (read as cumulative), a point its time; and of two points of one stream at one time
    the later line stands. A route that is not a string is no route."""
    totals = TraceCounts()
    empty = {k: v for k, v in _point(0, False, 10).items() if k != "count"}
    doc = _histogram_line([empty])
    del doc["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]["histogram"]["aggregationTemporality"]
    totals.add(doc)
    assert totals.counted() == (0, 0)  # seen: the metrics counted no request, which is not "no metrics"
    totals.add(_histogram_line([_point(6, False, 10)]))  # the same stream, the same time: the later line
    assert totals.counted() == (6, 0)
    timeless = TraceCounts()
    timeless.add(_histogram_line([{k: v for k, v in _point(3, True, 10).items() if k != "timeUnixNano"}]))
    timeless.add(_histogram_line([_point(4, True, 1)]))  # at 1 ns: after a point with no time (read as 0)
    assert timeless.counted() == (4, 4)
    odd_route = TraceCounts()
    point = _point(2, False, 5, route=None)
    point["attributes"].append(kv(c.HTTP_ROUTE, 7))
    odd_route.add(_histogram_line([point], temporality=1))
    assert odd_route.counted() == (2, 0) and odd_route.counted("/p") == (0, 0)


@pytest.fixture
def seeded_trace_ids():
    """The SDK's RandomIdGenerator draws from ``random``: seeded, a run's trace ids (and so which of them fall in
    a hashed share) are the same every time; the generator's state before the test is put back after it."""
    state = random.getstate()
    random.seed(1205)
    yield
    random.setstate(state)


def test_a_run_whose_truth_is_known_is_reported_as_a_sample_of_it(tmp_path, seeded_trace_ids):
    """300 requests, 60 slow, the default healthy share and export budget: the report says how many traces
    it kept of the 300 the metrics counted, its estimate of all requests is what the adjusted counts'
    definition gives, and its percentiles are those of every request, not of the slow-biased sample."""
    out = tmp_path / "out"
    verdicts = []
    # Seeded trace ids (``seeded_trace_ids``): which healthy traces fall in the 10 % share is fixed. Unseeded,
    # 240 healthy traces put 24 +- 4.6 in it (binomial), and with 18 or fewer (reckoned about one run in ten)
    # the weighted 60 slow ones are past a quarter of the estimate: the report's p75 rightly reads slow, and
    # the last assertion below failed on chance, not on the code (seen once in a full suite run).
    # slow: 12 ms against a 6 ms threshold; the rest well under it even on a loaded host
    settings = Settings(healthy_sample=0.1, slow_threshold_ms=6.0)
    handle = stagetrace.configure(
        "known", traces_path=out / "traces-known-1.jsonl", on_verdict=verdicts.append, set_global=False,
        settings=settings,
    )  # fmt: skip
    for i in range(300):
        with stagetrace.pipeline("predict"), stagetrace.stage("work"):
            if i % 10 < 2:
                time.sleep(0.012)
    assert handle.force_flush(10)
    handle.shutdown()
    assert len(verdicts) == 300 and handle.metrics_path == out / "metrics-known-1.jsonl"
    slow = sum(v.slow for v in verdicts)
    agg, counts = aggregate_files([str(out)], err=io.StringIO())
    summary = agg.summary()
    assert counts["metric_lines"] >= 1 and summary["counted"] == {"requests": 300, "slow": slow}
    assert summary["traces"] < 300 and summary["sampled"]

    # The estimate, from the definition: per stratum (signature and reason to keep), every trace worth keeping
    # (1, or 1/share for a healthy one in the share) up to its last kept trace.
    kept = {
        root["traceId"]
        for line in (out / "traces-known-1.jsonl").read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for root in ss["spans"]
        if any(a["key"] == c.SAMPLING_ADJUSTED_COUNT for a in root["attributes"])
    }
    assert len(kept) == summary["traces"]
    offered: dict[tuple, float] = defaultdict(float)
    estimate = 0.0
    for v in verdicts:
        healthy = not v.slow and not v.diagnoses
        if healthy and not in_healthy_share(int(v.trace_id, 16), 0.1):
            continue
        sig = signature_of(v.root_name, v.route, v.bottleneck, v.diagnosis_codes)
        stratum = (sig, Keep.HEALTHY_SAMPLE if healthy else Keep.SLOW if v.slow else Keep.DIAGNOSED)
        offered[stratum] += 10.0 if healthy else 1.0
        if v.trace_id in kept:
            estimate += offered.pop(stratum)
    assert summary["requests"] == pytest.approx(estimate, abs=0.05)

    in_share = sum(not v.slow and not v.diagnoses and in_healthy_share(int(v.trace_id, 16), 0.1) for v in verdicts)
    assert in_share >= 20  # the seed's share: healthy weight past three times the slow traces'
    truth = sorted(v.total_ms for v in verdicts)
    sample = sorted(v.total_ms for v in verdicts if v.trace_id in kept)
    p75 = truth[int(0.75 * 299)]
    assert p75 < settings.slow_threshold_ms < sample[int(0.75 * (len(sample) - 1))]  # the sample is biased
    assert agg.total.quantile(0.75) < settings.slow_threshold_ms  # the weighted report is not

    text = io.StringIO()
    assert run_report([str(out)], out=text, err=io.StringIO()) == 0
    assert f"{summary['traces']} kept of 300 requests, {slow} slow ({slow / 300:.0%}) (counted by the metrics)" in (
        text.getvalue()
    )


def test_since_and_until_keep_the_traces_that_started_in_the_window_and_leave_the_metrics_counts_out(tmp_path):
    from otlp_lines import line, span
    from stagetrace.report.fleet import parse_time

    base_s = 1_700_000_000  # otlp_lines' epoch
    spans = [
        span(f"{i:032x}", f"{i:016x}", "", "GET /", start_ms=i * 1000, end_ms=i * 1000 + 5, attrs={c.TOTAL_MS: 5.0})
        for i in range(1, 6)
    ]
    (tmp_path / "traces-x-1.jsonl").write_text("\n".join(line("x", [s]) for s in spans) + "\n")
    (tmp_path / "metrics-x-1.jsonl").write_text(json.dumps(_histogram_line([_point(5, False, 10)])) + "\n")
    report = io.StringIO()
    rc = run_report([str(tmp_path)], as_json=True, since=str(base_s + 2), until=str(base_s + 4), out=report)
    summary = json.loads(report.getvalue())
    assert rc == 0 and summary["traces"] == 2 and summary["counted"] is None  # roots at 2 s and 3 s
    everything = io.StringIO()
    assert run_report([str(tmp_path)], as_json=True, out=everything) == 0
    assert json.loads(everything.getvalue())["counted"] == {"requests": 5, "slow": 0}
    err = io.StringIO()
    assert run_report([str(tmp_path)], since="yesterday", out=io.StringIO(), err=err) == 2
    assert "cannot read time 'yesterday'" in err.getvalue()
    assert parse_time(str(base_s + 2)) == (base_s + 2) * 10**9
