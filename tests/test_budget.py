"""The export budget: what leaves the process is bounded by it at any load, errors and each kind of trace's
slowest first; metrics still see every trace."""

from __future__ import annotations

import random

import pytest

import stagetrace
from stagetrace import conventions as c
from stagetrace.exporter.budget import SLOWEST_MARGIN, BudgetLimits, ExportBudget, signature_of
from stagetrace.exporter.keep import Keep
from stagetrace.settings import Settings, export_budget_from_env

LIMITS = BudgetLimits(per_s=20.0, burst=40.0, signature_per_s=5.0, signature_burst=10.0)


def offer(budget: ExportBudget, n: int, rate_per_s: float, start: float, kinds, rng: random.Random):
    """``n`` traces at ``rate_per_s``; each a random (keep reason, signature, duration) from ``kinds``."""
    out = []
    for i in range(n):
        now = start + i / rate_per_s
        keep, sig, ms = rng.choice(kinds)
        out.append((now, keep, sig, ms, budget.admit(keep, sig, ms * rng.uniform(0.5, 1.5), now)))
    return out


SIGS = [
    signature_of("POST /predict", "/predict", stage, codes)
    for stage in ("decode", "infer")
    for codes in ((), ("GIL_CONTENTION",))
]


@pytest.mark.parametrize("load_per_s", [10, 100, 1000, 10_000])
def test_exported_traces_stay_under_the_budget_at_any_load(load_per_s):
    rng = random.Random(load_per_s)
    budget = ExportBudget(LIMITS, now=0.0)
    kinds = [(Keep.SLOW, s, 300.0) for s in SIGS] + [(Keep.DIAGNOSED, s, 50.0) for s in SIGS]
    seconds = 120 if load_per_s <= 1000 else 20
    decided = offer(budget, load_per_s * seconds, load_per_s, 0.0, kinds, rng)
    kept = sum(1 for *_, final in decided if final.kept)
    assert kept <= LIMITS.per_s * seconds + 2 * LIMITS.burst
    if load_per_s >= 100:  # a saturating load spends the budget (it is a bound, not a quota left unused)
        assert kept >= 0.8 * LIMITS.per_s * seconds
    else:
        assert kept == len(decided)  # under the budget nothing is dropped


def test_errors_get_through_when_slow_traces_spent_the_budget():
    budget = ExportBudget(LIMITS, now=0.0)
    slow = [budget.admit(Keep.SLOW, SIGS[i % 4], 300.0, 0.001 * i) for i in range(1000)]
    assert slow.count(Keep.BUDGET) > 900  # the burst, less its reserve, then nothing
    errors = [budget.admit(Keep.ERROR, SIGS[0], 10.0, 1.0 + 0.001 * i) for i in range(5)]
    assert errors == [Keep.ERROR] * 5


def test_each_priority_stops_at_its_reserve_of_the_burst():
    """No refill, a burst of 40: the minute's first takes one token; healthy samples stop with half the
    burst left, slow and diagnosed traces with a quarter, errors spend the rest."""
    budget = ExportBudget(BudgetLimits(per_s=1e-9, burst=40.0, signature_per_s=1e-9, signature_burst=1000.0), 0.0)
    sig = SIGS[0]
    assert budget.admit(Keep.HEALTHY_SAMPLE, sig, 1.0, 0.0) is Keep.HEALTHY_SAMPLE  # first of the minute
    admitted = {
        keep: sum(budget.admit(keep, sig, 1.0, 0.0).kept for _ in range(100))
        for keep in (Keep.HEALTHY_SAMPLE, Keep.SLOW, Keep.DIAGNOSED, Keep.ERROR)
    }
    assert admitted == {Keep.HEALTHY_SAMPLE: 19, Keep.SLOW: 10, Keep.DIAGNOSED: 0, Keep.ERROR: 10}


def test_a_frequent_kind_of_trace_cannot_starve_a_rare_one():
    budget = ExportBudget(LIMITS, now=0.0)
    frequent, rare = SIGS[0], SIGS[3]
    rare_kept = 0
    for i in range(60_000):  # 1,000 a second for a minute, one in a thousand of the rare kind
        now = i / 1000
        if i % 1000 == 500:
            rare_kept += budget.admit(Keep.DIAGNOSED, rare, 10.0, now).kept
        else:
            budget.admit(Keep.SLOW, frequent, 300.0, now)
    assert rare_kept == 60


def test_the_slowest_trace_of_each_signature_in_each_minute_is_kept():
    rng = random.Random(3)
    budget = ExportBudget(LIMITS, now=0.0)
    kinds = [(Keep.SLOW, s, 300.0) for s in SIGS]
    decided = offer(budget, 1000 * 180, 1000, 0.0, kinds, rng)  # three minutes, far over the budget
    for minute in range(3):
        for sig in SIGS:
            lived = [(ms, final) for now, _, s, ms, final in decided if s == sig and int(now // 60) == minute]
            slowest = max(ms for ms, _ in lived)
            kept_max = max(ms for ms, final in lived if final.kept)
            assert kept_max * SLOWEST_MARGIN >= slowest


def test_no_budget_keeps_every_trace_worth_keeping():
    budget = ExportBudget(BudgetLimits(per_s=None), now=0.0)
    assert all(budget.admit(Keep.SLOW, SIGS[0], 1.0, 0.0) is Keep.SLOW for _ in range(10_000))
    assert budget.admit(Keep.DROPPED, SIGS[0], 1.0, 0.0) is Keep.DROPPED


def test_the_signatures_remembered_are_bounded():
    budget = ExportBudget(BudgetLimits(max_signatures=16), now=0.0)
    for i in range(1000):
        budget.admit(Keep.SLOW, signature_of(f"root-{i}", None, "decode", ()), 1.0, 0.0)
    assert len(budget) == 16


def test_the_signature_sorts_codes_and_prefers_the_route():
    assert signature_of("GET /a/7", "/a/{id}", "decode", ("B", "A")) == ("/a/{id}", "decode", ("A", "B"))
    assert signature_of("job", None, None, ()) == ("job", "", ())


def test_the_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv("STAGETRACE_EXPORT_BUDGET")
    assert export_budget_from_env() == 20.0 and Settings().export_budget_per_s == 20.0
    for raw, value in (("off", None), ("5", 5.0), ("0.5", 0.5)):
        monkeypatch.setenv("STAGETRACE_EXPORT_BUDGET", raw)
        assert export_budget_from_env() == value
    for raw in ("0", "-1", "lots"):
        monkeypatch.setenv("STAGETRACE_EXPORT_BUDGET", raw)
        with pytest.raises(
            ValueError, match="STAGETRACE_EXPORT_BUDGET must be a number of traces a second > 0, or off"
        ):
            export_budget_from_env()
    with pytest.raises(ValueError, match="export_budget_per_s"):
        Settings(export_budget_per_s=0).validate()


@pytest.mark.parametrize("export_mode", ["process", "thread"])
def test_over_the_budget_traces_are_counted_and_metrics_see_them_all(make_harness):
    settings = Settings(export_budget_per_s=1.0, export_budget_burst=4.0, healthy_sample=1.0)
    h = make_harness(slow_threshold_ms=0.001, settings=settings)  # every trace is slow
    n = 60
    for _ in range(n):
        with stagetrace.pipeline("job"), stagetrace.stage("work"):
            pass
    h.flush()
    exported = len(h.roots())
    dropped = sum(p.value for p in h.metric_points(c.METRIC_DROPPED) if p.attributes.get("reason") == "budget")
    assert 1 <= exported < n and exported + dropped == n
    assert len(h.by_name("work")) == exported  # a dropped trace's spans are not built
    assert sum(p.count for p in h.metric_points(c.METRIC_TRACE_DURATION)) == n


def test_an_errored_trace_is_an_error_first_whatever_else_it_is():
    from stagetrace.analysis import Verdict
    from stagetrace.exporter.keep import decide

    slow = Verdict(
        trace_id="ab" * 16,
        root_name="r",
        total_ms=500.0,
        breakdown={},
        bottleneck=None,
        ratio=0.0,
        slow=True,
        slow_threshold_ms=200.0,
        untracked_ms=500.0,
    )
    assert decide(slow, errored=True, healthy_share=0.0, trace_id=1) is Keep.ERROR
    assert decide(slow, errored=False, healthy_share=0.0, trace_id=1) is Keep.SLOW
