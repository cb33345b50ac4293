"""The exporter's CPU budget (``exporter/diagnosis_budget.py``): every trace diagnosed within it, a share past
it chosen per kind of trace with every kept trace among them, and the diagnosis counter's sums unbiased."""

from __future__ import annotations

import html
import math
import random
from collections import Counter
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from stagetrace import conventions as c
from stagetrace.analysis.verdict import EVERY_TRACE, DiagnosisChoice
from stagetrace.common import wire
from stagetrace.exporter import diagnosis_budget as db
from stagetrace.exporter.aggregation import AggregatedMetrics
from stagetrace.exporter.budget import BudgetLimits, ExportBudget
from stagetrace.exporter.core import ExporterCore
from stagetrace.exporter.diagnosis_budget import CpuClocks, DiagnosisBudget, in_diagnosis_share
from stagetrace.exporter.keep import Keep, in_healthy_share
from stagetrace.settings import Settings

MS = 1_000_000
T0 = 10_000 * MS
KIND = ("/x", "work")


def clocks(exporter_s: float = 0.0, application_s: float = 0.0) -> CpuClocks:
    return CpuClocks(exporter_s, application_s)


def budget_after_one_window(
    *, traces: int, diagnosed: int, diagnosis_ms: float, exporter_s: float, application_s: float, share: float = 0.05
) -> DiagnosisBudget:
    """A budget of ``share`` of the application's CPU after one window of one second: ``traces`` offered,
    ``diagnosed`` of them diagnosed at ``diagnosis_ms`` each, the exporter and the application having used
    ``exporter_s`` and ``application_s`` of CPU."""
    b = DiagnosisBudget(share, 0.0, clocks())
    for i in range(traces):
        b.choose(KIND, i, kept=False)
    for _ in range(diagnosed):
        b.spent(int(diagnosis_ms * MS))
    b.tick(1.0, clocks(exporter_s, application_s))
    return b


def test_within_its_budget_every_trace_is_diagnosed_and_counts_once():
    # 100 diagnoses of 1 ms (0.1 CPU) and 0.1 CPU of other work, against 5 % of an application using 10 CPUs
    b = budget_after_one_window(traces=100, diagnosed=100, diagnosis_ms=1.0, exporter_s=0.2, application_s=10.0)
    assert b.share == 1.0
    assert b.choose(KIND, 7, kept=False) is EVERY_TRACE


def test_past_it_the_share_is_what_the_rest_of_the_exporters_work_leaves_of_the_budget():
    # budget 0.05 x 4 CPUs = 0.2 CPU; the rest of the work 0.1 CPU leaves 0.1 for diagnoses that want 0.5
    b = budget_after_one_window(traces=500, diagnosed=500, diagnosis_ms=1.0, exporter_s=0.6, application_s=4.0)
    assert b.share == pytest.approx(0.2)
    # at exactly the budget: every trace; just past it, a share
    at = budget_after_one_window(traces=100, diagnosed=100, diagnosis_ms=1.0, exporter_s=0.2, application_s=4.0)
    assert at.share == 1.0
    past = budget_after_one_window(traces=101, diagnosed=100, diagnosis_ms=1.0, exporter_s=0.2, application_s=4.0)
    assert past.share == pytest.approx(0.1 / 0.101)


def test_the_share_never_falls_under_its_minimum_nor_the_budget_under_its_floor():
    # the rest of the exporter's work alone is past the budget: no room, the minimum share
    b = budget_after_one_window(traces=100, diagnosed=100, diagnosis_ms=1.0, exporter_s=1.0, application_s=4.0)
    assert b.share == db.MIN_SHARE
    # an application that used no CPU this window: the budget is MIN_CPU (0.01 CPU), for 0.05 CPU of diagnoses
    idle = budget_after_one_window(traces=50, diagnosed=50, diagnosis_ms=1.0, exporter_s=0.05, application_s=0.0)
    assert idle.share == pytest.approx(db.MIN_CPU / 0.05)


def test_the_share_falls_at_once_and_rises_half_way_a_window():
    b = budget_after_one_window(traces=500, diagnosed=500, diagnosis_ms=1.0, exporter_s=0.6, application_s=4.0)
    assert b.share == pytest.approx(0.2)
    # the next window has room for everything: half way back up, then half the rest
    for i in range(10):
        b.choose(KIND, i, kept=False)
    b.spent(MS)
    b.tick(2.0, clocks(0.6 + 0.002, 4.0 + 4.0))
    assert b.share == pytest.approx(0.6)
    b.spent(MS)
    b.tick(3.0, clocks(0.604, 12.0))
    assert b.share == pytest.approx(0.8)


def test_a_window_not_yet_over_or_with_nothing_diagnosed_keeps_the_share():
    b = budget_after_one_window(traces=500, diagnosed=500, diagnosis_ms=1.0, exporter_s=0.6, application_s=4.0)
    b.spent(100 * MS)
    b.tick(1.999, clocks(100.0, 4.0))  # under a window since the last tick: nothing changes
    assert b.share == pytest.approx(0.2)
    b = budget_after_one_window(traces=500, diagnosed=0, diagnosis_ms=1.0, exporter_s=0.6, application_s=4.0)
    assert b.share == 1.0  # no diagnosis to measure: no cost known
    off = budget_after_one_window(
        traces=500, diagnosed=500, diagnosis_ms=1.0, exporter_s=5.0, application_s=4.0, share=None
    )  # no budget
    assert off.share == 1.0


def test_past_it_each_kind_has_its_floor_every_window_and_a_kept_trace_is_always_diagnosed():
    b = budget_after_one_window(traces=500, diagnosed=500, diagnosis_ms=1.0, exporter_s=0.6, application_s=4.0)
    outside = next(i for i in range(1000) if not in_diagnosis_share(i, b.share))
    inside = next(i for i in range(1000) if in_diagnosis_share(i, b.share))
    rare = ("/rare", "decode")
    assert [b.choose(rare, outside, kept=False) for _ in range(3)] == [
        DiagnosisChoice(1.0, b.share),  # the kind's first two of the window, whatever their ids
        DiagnosisChoice(1.0, b.share),
        DiagnosisChoice(0.0, b.share),  # then by its id: outside the share, not diagnosed
    ]
    assert b.choose(rare, inside, kept=False) == DiagnosisChoice(1.0 / b.share, b.share)  # chosen, counts 5 times
    assert b.choose(rare, outside, kept=True) == DiagnosisChoice(1.0, b.share)  # the budget may keep it
    b.tick(2.0, clocks(0.6, 8.0))  # the next window: the floor again
    assert b.choose(rare, outside, kept=False).diagnosed


def test_the_kinds_floors_are_bounded_and_the_least_recent_forgotten():
    b = DiagnosisBudget(0.05, 0.0, clocks(), max_kinds=2)
    b.share = 0.2
    for kind in (("a", ""), ("b", ""), ("c", "")):
        for _ in range(db.FLOOR_PER_KIND):
            b.choose(kind, 0, kept=False)
    assert len(b._floors) == 2 and ("a", "") not in b._floors


def test_the_diagnosis_hash_is_independent_of_the_healthy_share_and_a_head_samplers():
    """A trace in the healthy share (kept, so always diagnosed) must not be likelier to be in the diagnosis
    share too: its chance would then not be the share, and the weights would be biased."""
    rng = random.Random(5)
    ids = [rng.getrandbits(128) for _ in range(40_000)]
    healthy = [i for i in ids if in_healthy_share(i, 0.3)]
    head = [i for i in ids if (i & ((1 << 64) - 1)) < int(0.3 * (1 << 64))]  # TraceIdRatioBased's comparison
    for subset in (ids, healthy, head):
        rate = sum(in_diagnosis_share(i, 0.2) for i in subset) / len(subset)
        assert rate == pytest.approx(0.2, abs=4 * math.sqrt(0.2 * 0.8 / len(subset)))


def test_the_export_budget_says_whether_it_could_keep_a_trace_before_its_codes_are_known():
    budget = ExportBudget(BudgetLimits(per_s=1.0, burst=4.0), 0.0)
    assert budget.may_admit(Keep.SLOW, 0.0) and budget.may_admit(Keep.ERROR, 0.0)
    assert not budget.may_admit(Keep.DROPPED, 0.0)
    budget.global_bucket.tokens = 1.5  # under a slow trace's reserve (1 + a quarter of the burst), not an error's
    assert not budget.may_admit(Keep.SLOW, 0.0) and budget.may_admit(Keep.ERROR, 0.0)
    assert ExportBudget(BudgetLimits(per_s=None), 0.0).may_admit(Keep.HEALTHY_SAMPLE, 0.0)  # no budget


# --- the exporter past its budget, with a known mix of causes ------------------------------------------------

CAUSES = {"healthy": (), "untracked": ("UNTRACKED_TIME",), "loop": ("EVENT_LOOP_BLOCKED",), "queue": ("QUEUEING",)}


def _stage(name: str, kind: str, start_ms: int, end_ms: int, span_id: int, **fields: Any) -> tuple[Any, ...]:
    st = wire.ShippedStage.added(name, kind, span_id, 1, T0 + start_ms * MS, T0 + end_ms * MS)
    for key, value in fields.items():
        setattr(st, key, value)
    return tuple(wire.pack_stage(st))


def message(trace_id: int, cause: str, *, slow: bool = False) -> tuple[Any, ...]:
    """A trace whose cause the rules find whatever the process's signals: a stage covering the root, one
    covering a tenth of it, one on the event loop's thread, a long wait for a worker thread."""
    end = 300 if slow else 100
    root = wire.WireSpan(
        "GET /x", trace_id, 1, 0, False, 2, T0, T0 + end * MS, {c.HTTP_ROUTE: "/x"}, (), (), 0, "", "s", "", 1, "",
        0, 0, 0,
    )  # fmt: skip
    stages = {
        "healthy": [_stage("work", "cpu", 0, end, 2)],
        "untracked": [_stage("work", "cpu", 0, 10, 2)],
        "loop": [_stage("render", "cpu", 0, end, 2, on_event_loop=True)],
        "queue": [_stage("threadpool.wait", "wait", 0, 80, 2), _stage("work", "cpu", 80, end, 3)],
    }[cause]
    return wire.trace_message(
        trace_id=trace_id, flags=1, state="", offset=0, dropped_stages=0, gpu_utilization=None, root=tuple(root),
        stages=tuple(stages), others=(), loop_thread=0, worker_runs=(), task_created_ns=0, received_ms_ago=-1,
        stream=None, gen_ai=None,
    )  # fmt: skip


class Outputs:
    """The exporter's outputs: stagetrace's own metric aggregation behind an SDK reader, the verdicts and the
    kept traces."""

    wants_verdicts = True

    def __init__(self) -> None:
        resource = Resource.create({"service.name": "budget"})
        self.metrics = AggregatedMetrics(resource, 256)
        self.reader = InMemoryMetricReader()
        MeterProvider(metric_readers=[self.reader], resource=resource, shutdown_on_exit=False)
        self.metrics.attach_readers([self.reader])
        self.verdicts: list[Any] = []
        self.kept: list[Any] = []

    def export(self, spans: Any) -> None:
        self.kept.append(spans)

    def verdict(self, verdict: Any) -> None:
        self.verdicts.append(verdict)

    def flush(self, timeout_s: float) -> bool:
        return True

    def sums(self, name: str, key: str | None = None) -> dict[Any, float]:
        out: dict[Any, float] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name:
                        for p in m.data.data_points:
                            out[p.attributes.get(key) if key else None] = p.value
        return out


class FakeClocks:
    """The exporter's and the application's CPU as the test sets them, and a diagnosis that takes 0.5 ms."""

    def __init__(self) -> None:
        self.exporter_s = self.application_s = 0.0
        self.ns = 0

    def __call__(self) -> CpuClocks:
        return CpuClocks(self.exporter_s, self.application_s)

    def diagnosis_ns(self) -> int:
        self.ns += MS // 2  # read before and after each diagnosis: 0.5 ms a diagnosis
        return self.ns


def test_past_its_budget_the_exporter_diagnoses_a_share_and_the_counter_estimates_every_trace():
    """600 traces in a first window of 1.5 s, each diagnosis taking 0.5 ms (0.2 CPU in all), the exporter at
    0.66 CPU against a budget of 5 % of an application using 10 CPUs: the other work (0.46) leaves 0.04 CPU of
    the 0.2 every diagnosis would take, and the share falls to 0.2. Then 6,000 traces, 1,500 of each
    cause: every trace has its verdict and metrics, a share is diagnosed, the diagnosis counter's sums are
    within four standard errors of the truth, and what was kept was diagnosed."""
    fake = FakeClocks()
    settings = Settings(healthy_sample=0.0, export_budget_per_s=None, exporter_cpu_budget=0.05)
    out = Outputs()
    core = ExporterCore(settings, out, clocks=fake, diagnosis_clock_ns=fake.diagnosis_ns)
    start = core.diagnosis_budget._window_start
    rng = random.Random(11)
    for _ in range(600):
        core.handle(message(rng.getrandbits(128), "healthy"))
    fake.exporter_s, fake.application_s = 0.99, 15.0
    core.tick(start + 1.5)
    assert core.diagnosis_budget.share == pytest.approx(0.2)

    mix = [cause for cause in CAUSES for _ in range(1500)]
    rng.shuffle(mix)
    before = len(out.verdicts)
    for cause in mix:
        core.handle(message(rng.getrandbits(128), cause))
    verdicts = out.verdicts[before:]
    assert len(verdicts) == 6000  # every trace its verdict
    kinds = Counter(v.bottleneck for v in verdicts)
    assert kinds == {"work": 1500, c.UNTRACKED: 1500, "render": 1500, "threadpool.wait": 1500}
    diagnosed = [v for v in verdicts if v.diagnosed]
    floors = db.FLOOR_PER_KIND * len(kinds)  # one window
    assert len(diagnosed) == pytest.approx(0.2 * 6000, abs=4 * math.sqrt(6000 * 0.2 * 0.8) + floors)
    assert all(not v.diagnoses for v in verdicts if not v.diagnosed)
    assert all(v.diagnosis_sample_rate == pytest.approx(0.2) for v in verdicts)

    estimated = out.sums(c.METRIC_DIAGNOSIS, c.DIAGNOSIS_CODE)
    for codes in CAUSES.values():
        for code in codes:
            sd = math.sqrt(1500 * 0.8 / 0.2)  # Horvitz-Thompson: n (1 - p) / p
            assert estimated[code] == pytest.approx(1500, abs=4 * sd), (code, estimated)
    assert out.sums(c.METRIC_TRACES_DIAGNOSED)[None] == 600 + len(diagnosed)
    count = sum(
        p.count
        for rm in out.reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == c.METRIC_TRACE_DURATION
        for p in m.data.data_points
    )
    assert count == 6600  # every trace in the metrics
    assert out.kept and all(  # kept for their diagnoses: each carries them and its share
        any(s.attributes.get(c.DIAGNOSIS_SAMPLE_RATE) == pytest.approx(0.2) for s in spans) for spans in out.kept
    )


def test_past_its_budget_a_trace_the_export_budget_may_keep_is_diagnosed_and_one_it_cannot_is_not_kept():
    fake = FakeClocks()
    settings = Settings(healthy_sample=0.0, export_budget_per_s=20.0, exporter_cpu_budget=0.05, slow_threshold_ms=200.0)
    out = Outputs()
    core = ExporterCore(settings, out, clocks=fake, diagnosis_clock_ns=fake.diagnosis_ns)
    core.diagnosis_budget.share = 0.01
    core.diagnosis_budget._floors[("/x", "render")] = (0, db.FLOOR_PER_KIND)  # the kind's floor spent
    outside = next(i for i in range(1, 10_000) if not in_diagnosis_share(i, 0.01))
    core.handle(message(outside, "loop", slow=True))  # slow, with tokens: the budget may keep it
    (v,) = out.verdicts
    assert v.diagnosed and v.diagnosis_codes == ("EVENT_LOOP_BLOCKED",) and v.diagnosis_weight == 1.0
    assert len(out.kept) == 1
    core.budget.global_bucket.tokens = 0.0  # no token for a slow trace now
    core.handle(message(outside + 1 if not in_diagnosis_share(outside + 1, 0.01) else outside, "loop", slow=True))
    assert not out.verdicts[-1].diagnosed and len(out.kept) == 1  # neither diagnosed nor kept


def test_the_report_says_when_its_diagnosis_counts_are_estimates():
    from stagetrace.analysis import Diagnosis, Verdict
    from stagetrace.report.aggregate import Aggregator
    from stagetrace.report.render import html_report, text_report

    def verdict(rate: float) -> Verdict:
        return Verdict(
            trace_id="t", root_name="r", total_ms=10.0, breakdown={"s": 10.0}, bottleneck="s", ratio=1.0, slow=False,
            slow_threshold_ms=200.0, untracked_ms=0.0, diagnoses=(Diagnosis("QUEUEING", "m", "a"),),
            diagnosis_weight=1.0, diagnosis_sample_rate=rate,
        )  # fmt: skip

    within, past = Aggregator(), Aggregator()
    within.add(verdict(1.0))
    past.add(verdict(1.0))
    past.add(verdict(0.2))
    assert "estimates" not in text_report(within.summary())
    note = "past the exporter's CPU budget the rules ran on as few as 20% of the traces: the diagnosis counts are"
    assert note in text_report(past.summary())
    assert html.escape(note) in html_report(past.summary(), [], "t")
    merged = Aggregator()
    merged.merge(within)
    merged.merge(past)
    assert merged.summary()["diagnosis_sample_rate"] == 0.2


def test_the_diagnosis_hash_is_splitmix64s_finalizer_over_both_halves_of_the_id():
    # splitmix64 seeded with 0 yields 0xE220A8397B1DCDAF then 0x6E789E6AA1B965F4 (Vigna's reference
    # splitmix64.c): its finalizer over the state after one and two steps of its constant, 0x9E3779B97F4A7C15
    gamma = 0x9E3779B97F4A7C15
    assert db.diagnosis_hash(gamma) == 0xE220A8397B1DCDAF
    assert db.diagnosis_hash((2 * gamma) & ((1 << 64) - 1)) == 0x6E789E6AA1B965F4
    # the high 64 bits are folded in by xor: the same state from either half, or from both
    assert db.diagnosis_hash(gamma << 64) == 0xE220A8397B1DCDAF
    assert db.diagnosis_hash((gamma << 64) | gamma) == db.diagnosis_hash(0)
