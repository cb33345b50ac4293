"""The export budget's decisions at their edges, each computed by hand: the debt a minute's slowest traces may
run up, a signature's last token, the margin that makes a trace the slowest of its minute, the minute's turn,
which signature and which carried weight are forgotten first. (A kept trace's own weight: test_export_values.)"""

from __future__ import annotations

import pytest

from stagetrace.exporter.budget import SLOWEST_MARGIN, AdjustedCounts, BudgetLimits, ExportBudget
from stagetrace.exporter.keep import Keep

A, B, C = (("/a", "decode", ()), ("/b", "decode", ()), ("/c", "decode", ()))


def drained(per_s: float = 1.0, burst: float = 4.0, **limits) -> ExportBudget:
    """A budget whose global bucket holds 1 token at t=0: under a slow trace's reserve (1 + 0.25 x 4 = 2), so
    that only a trace that is the slowest of its signature's minute gets through."""
    budget = ExportBudget(BudgetLimits(per_s=per_s, burst=burst, **limits), now=0.0)
    budget.global_bucket.tokens = 1.0
    return budget


def test_the_slowest_of_each_minute_may_run_the_global_bucket_into_one_burst_of_debt_and_no_further():
    budget = ExportBudget(BudgetLimits(per_s=1.0, burst=2.0), now=0.0)
    # 2 tokens; each first-of-its-minute trace (a new signature) takes one whatever is left: 2 -> 1 -> 0 -> -1 -> -2
    signatures = [(f"/r{i}", "decode", ()) for i in range(5)]
    decisions = [budget.admit(Keep.SLOW, sig, 1.0, now=0.0) for sig in signatures]
    # at -2 (= -burst) the fifth is left out: the debt stops at one burst
    assert decisions == [Keep.SLOW] * 4 + [Keep.BUDGET]
    assert budget.global_bucket.tokens == -2.0


def test_a_signature_spends_its_last_whole_token():
    budget = ExportBudget(BudgetLimits(per_s=100.0, burst=100.0, signature_per_s=0.001, signature_burst=2.0), now=0.0)
    # the first trace is the minute's slowest (no signature token); the next two, no slower, spend the
    # signature's 2 tokens (2 -> 1 -> 0; at exactly 1.0 it still has a whole one); the fourth finds 0
    decisions = [budget.admit(Keep.SLOW, A, 1.0, now=0.0) for _ in range(4)]
    assert decisions == [Keep.SLOW, Keep.SLOW, Keep.SLOW, Keep.BUDGET]


@pytest.mark.parametrize(
    ("first", "second", "kept"),
    [
        (1.0, SLOWEST_MARGIN, True),  # exactly the margin slower: the minute's new slowest
        (1.0, 1.1, False),  # slower, within the margin: a copy of what was kept
        (1.0, 0.5, False),  # faster
        (0.0, 0.0, False),  # as slow as the first (0 x margin is 0): not slower at all
        (0.0, 0.1, True),  # anything past a first of no slowness
    ],
)
def test_a_later_trace_is_the_minutes_slowest_only_past_the_margin(first, second, kept):
    budget = drained()
    assert budget.admit(Keep.SLOW, A, first, now=0.0) is Keep.SLOW  # the first of the minute
    assert budget.admit(Keep.SLOW, A, second, now=1.0) is (Keep.SLOW if kept else Keep.BUDGET)


def test_the_next_minute_keeps_its_first_trace_however_fast():
    budget = drained(per_s=0.001)  # no refill worth a token over two minutes
    assert budget.admit(Keep.SLOW, A, 10.0, now=59.0) is Keep.SLOW  # minute 0
    assert budget.admit(Keep.SLOW, A, 0.1, now=59.5) is Keep.BUDGET  # minute 0 again, faster
    assert budget.admit(Keep.SLOW, A, 0.1, now=60.0) is Keep.SLOW  # minute 1: its first
    assert budget.admit(Keep.SLOW, A, 0.1, now=61.0) is Keep.BUDGET


def test_the_least_recently_seen_signature_is_forgotten_first():
    budget = drained(per_s=0.001, max_signatures=2)
    for sig in (A, B, A):  # A seen again after B: B is the least recently seen
        budget.admit(Keep.SLOW, sig, 1.0, now=0.0)
    budget.admit(Keep.SLOW, C, 1.0, now=0.0)  # a third: B forgotten
    assert len(budget) == 2
    # C and A are remembered (not their minute's first again); B, forgotten, is a first once more
    assert budget.admit(Keep.SLOW, C, 1.0, now=1.0) is Keep.BUDGET
    assert budget.admit(Keep.SLOW, A, 1.0, now=1.0) is Keep.BUDGET
    assert budget.admit(Keep.SLOW, B, 1.0, now=1.0) is Keep.SLOW


def test_the_least_recently_carried_weight_is_forgotten_first():
    counts = AdjustedCounts(max_signatures=2)
    slow_a, slow_b, slow_c = ((("/a", ""), Keep.SLOW), (("/b", ""), Keep.SLOW), (("/c", ""), Keep.SLOW))
    counts.left_out(slow_a, 1.0)
    counts.left_out(slow_b, 2.0)
    counts.left_out(slow_a, 4.0)  # a again: b is now the least recently left out
    counts.left_out(slow_c, 8.0)  # a third stratum: b's 2 forgotten
    assert counts.kept(slow_a, 1.0) == 1.0 + 1.0 + 4.0
    assert counts.kept(slow_b, 1.0) == 1.0
    assert counts.kept(slow_c, 1.0) == 1.0 + 8.0
    assert counts.kept(slow_c, 1.0) == 1.0  # handed over once


@pytest.mark.parametrize(
    ("keep", "tokens", "kept"),
    [
        (Keep.ERROR, 1.0, True),  # errors may spend the last token
        (Keep.SLOW, 1.0 + 0.25 * 40, True),  # slow: a quarter of the burst (40) held back
        (Keep.SLOW, 1.0 + 0.25 * 40 - 0.01, False),
        (Keep.HEALTHY_SAMPLE, 1.0 + 0.5 * 40, True),  # a healthy sample: half held back
        (Keep.HEALTHY_SAMPLE, 1.0 + 0.5 * 40 - 0.01, False),
    ],
)
def test_may_admit_asks_for_a_token_above_the_priority_reserve(keep, tokens, kept):
    budget = ExportBudget(BudgetLimits(per_s=1.0, burst=40.0), now=0.0)
    budget.global_bucket.tokens = tokens
    assert budget.may_admit(keep, now=0.0) is kept
    # and admit agrees for a trace that is not its minute's slowest
    budget.admit(keep, A, 1.0, now=0.0)  # the minute's first, through the debt path
    budget.global_bucket.tokens = tokens
    assert (budget.admit(keep, A, 1.0, now=0.0) is keep) is kept


def test_may_admit_without_a_budget_or_a_reason():
    assert ExportBudget(BudgetLimits(per_s=None), now=0.0).may_admit(Keep.SLOW, now=0.0)
    assert not ExportBudget(BudgetLimits(per_s=1.0), now=0.0).may_admit(Keep.DROPPED, now=0.0)
