"""The exporter's figures at their edges, each computed by hand: the export budget's first trace of a minute
after the first, the diagnosis share's hash boundary and the share each window sets (to the last bit where a
nanosecond of CPU moves it), the verdict's 4-digit attributes, and what the ``OTEL_*`` variables select where
``none`` or a protocol without ``otlp`` is named. (The wider behaviour: test_diagnosis_budget, test_budget_values,
test_spans, test_export_selection.)"""

from __future__ import annotations

import os

import pytest

from stagetrace import conventions as c
from stagetrace.analysis import Verdict
from stagetrace.destinations.env import (
    DISTRO_DEFAULTS_VARIABLE,
    EXPORT_VARIABLES,
    Selection,
    metric_selection,
    remember_distro_defaults,
    span_selection,
)
from stagetrace.exporter import spans as sp
from stagetrace.exporter.budget import BudgetLimits, ExportBudget
from stagetrace.exporter.diagnosis_budget import CpuClocks, DiagnosisBudget, diagnosis_hash, in_diagnosis_share
from stagetrace.exporter.keep import Keep

A = ("/a", "decode", ())
KIND = ("/x", "work")
MS = 1_000_000


# --- the export budget: the first trace of a signature in a minute other than minute 0 ---------------------


def test_a_signatures_first_trace_in_minute_one_is_its_slowest_however_fast():
    """A signature never seen before has seen no minute yet: its first trace is the slowest of whatever minute
    it arrives in, minute 1 included (a state that started at minute 1 would take it for a repeat). With 1
    token, under a slow trace's reserve (1 + 0.25 x 1), only the slowest of its minute gets through: a trace of
    no slowness at t=60 s is kept and takes the global bucket's last token."""
    budget = ExportBudget(BudgetLimits(per_s=1.0, burst=1.0), now=0.0)
    assert budget.admit(Keep.SLOW, A, 0.0, now=60.0) is Keep.SLOW
    assert budget.global_bucket.tokens == 0.0
    assert budget.admit(Keep.SLOW, A, 0.0, now=60.0) is Keep.BUDGET  # now a repeat of the minute: no token


# --- the diagnosis share's hash: its boundary to the last value -------------------------------------------

AT_HALF = 0xCE256BA94D67D15A  # a trace id whose diagnosis hash is exactly 2**63


def splitmix64_finalizer(z: int) -> int:
    """splitmix64's output function (Steele, Lea and Flood 2014; Vigna's reference C), written out anew with
    64-bit wrap-around as ``% 2**64``."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def test_the_hash_of_the_boundary_id_is_splitmix64s_exactly_half_way():
    """The boundary case below rests on this id's hash being 2**63: checked against splitmix64's definition,
    not the module's function (a 64-bit id has no high half to fold in, so the hash is the finalizer's)."""
    assert splitmix64_finalizer(AT_HALF) == 2**63
    assert diagnosis_hash(AT_HALF) == 2**63
    assert diagnosis_hash(AT_HALF | (AT_HALF << 64)) == splitmix64_finalizer(0)  # both halves folded: 0


def test_a_trace_hashing_exactly_to_the_share_is_outside_it():
    """The share is the half-open range of hashes [0, share x 2**64): a share of 0.5 takes exactly 2**63 of
    the 2**64 hashes, so the hash 2**63 itself is outside it (taking it too would diagnose 2**-64 more than the
    share, and count it 1 / share times). The next share up (0.5 + 2**-53) takes it."""
    assert in_diagnosis_share(AT_HALF, 0.5) is False
    assert in_diagnosis_share(AT_HALF, 0.5 + 2**-53) is True


# --- the diagnosis share each window sets -----------------------------------------------------------------


def test_a_window_after_one_with_nothing_diagnosed_starts_from_nothing():
    """The counters restart at 0 each window: a window that offered and diagnosed nothing is no measurement,
    and keeps the share (1.0) even where the exporter used all of a CPU, far past its budget of 0.1. A window
    that started with one trace and one nanosecond already counted would set the share to its minimum."""
    b = DiagnosisBudget(0.1, 0.0, CpuClocks(0.0, 0.0))
    b.tick(1.0, CpuClocks(0.0, 0.0))
    b.tick(2.0, CpuClocks(1.0, 1.0))
    assert b.share == 1.0


def test_the_budget_is_a_share_of_the_applications_cpu_in_the_window_not_since_its_start():
    """The application had used 10 s of CPU before the window and 1 s in it: the budget is 0.5 x 1 CPU = 0.5
    (not 0.5 x 21). Two traces, one diagnosed in 0.2 s: every trace diagnosed wants 0.4 CPU, the exporter's
    other work (0.5 - 0.2 = 0.3 CPU) leaves 0.2, so half of them. Compared exactly: room / wanted is
    double(0.2) / (2 x double(0.2)), exactly 0.5, where a budget off by 1e-9 would not be."""
    b = DiagnosisBudget(0.5, 0.0, CpuClocks(0.0, 10.0))
    b.choose(KIND, 1, kept=False)
    b.choose(KIND, 2, kept=False)
    b.spent(200 * MS)
    b.tick(1.0, CpuClocks(0.5, 11.0))
    assert b.share == 0.5


def test_the_diagnoses_cpu_is_read_to_the_nanosecond():
    """One diagnosis of exactly 1 s (10**9 ns) of two traces; the exporter used 1.5 CPU, the application 2: the
    budget 1.0, the other work 0.5, room 0.5 for diagnoses that want 2.0, a share of exactly 0.25. One
    nanosecond more or less in the diagnoses' count (or a second of 10**9 + 1 ns) moves the share by about
    2.5e-10, which ``pytest.approx`` (relative 1e-6) would not see: hence ``==`` on the value computed by hand,
    exact in binary."""
    b = DiagnosisBudget(0.5, 0.0, CpuClocks(0.0, 0.0))
    b.choose(KIND, 1, kept=False)
    b.choose(KIND, 2, kept=False)
    b.spent(1_000_000_000)
    b.tick(1.0, CpuClocks(1.5, 2.0))
    assert b.share == 0.25


@pytest.mark.parametrize(
    "exporter_s",
    [
        0.5,  # exactly at the budget: no room left, and none wanted
        0.6,  # past the budget by 0.1 CPU: less than no room, and none wanted
    ],
)
def test_zero_cpu_diagnoses_keep_every_trace_diagnosed(exporter_s):
    """Diagnoses the CPU clock saw take 0 ns cost nothing: every trace diagnosed wants 0 CPU, which fits
    however little room the rest of the exporter's work leaves, so the share stays 1.0 (it once divided by
    the 0 wanted: ZeroDivisionError at each tick of such a window). Budget 0.5 x 1 CPU."""
    b = DiagnosisBudget(0.5, 0.0, CpuClocks(0.0, 0.0))
    b.choose(KIND, 1, kept=False)
    b.spent(0)
    b.tick(1.0, CpuClocks(exporter_s, 1.0))
    assert b.share == 1.0


# --- the verdict's rounded attributes ---------------------------------------------------------------------


def test_the_verdicts_ratios_and_rates_keep_four_digits_and_requests_in_flight_two():
    """Each field keeps the digits ``conventions.VERDICT_FIELDS`` gives it, not a default: a ratio, a GPU
    utilisation and a diagnosis sample rate to 1e-4 (2/3 -> 0.6667, not 0.667), requests in flight to 1e-2,
    the milliseconds to the microsecond."""
    verdict = Verdict(
        trace_id="t",
        root_name="GET /x",
        total_ms=100.1234,
        breakdown={"infer": 66.7},
        bottleneck="gpu",
        ratio=2 / 3,
        slow=False,
        slow_threshold_ms=200.0,
        untracked_ms=33.4234,
        gpu_utilization=0.12345,
        requests_in_flight=1.23456,
        diagnosis_sample_rate=1 / 3,
    )
    attrs = sp.verdict_attributes(verdict)
    assert attrs[c.BOTTLENECK_RATIO] == 0.6667
    assert attrs[c.GPU_UTILIZATION] == 0.1235
    assert attrs[c.DIAGNOSIS_SAMPLE_RATE] == 0.3333
    assert attrs[c.REQUESTS_IN_FLIGHT] == 1.23
    assert attrs[c.TOTAL_MS] == 100.123 and attrs[c.UNTRACKED_MS] == 33.423


# --- what the OTEL_* variables select ---------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["bogus", "grpc"])
def test_the_protocol_is_read_only_where_otlp_is_selected(protocol):
    """Without ``otlp`` among the exporters no OTLP exporter is built, so its protocol variable is not read:
    not checked (a bad value is no error) and not reported (the selection says the default)."""
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_PROTOCOL": protocol}
    assert span_selection(env) == Selection(("console",), "http/protobuf")


@pytest.mark.parametrize("select", [span_selection, metric_selection])
def test_none_alone_selects_no_exporter(select):
    """``none`` is the specification's name for no exporter: the selection is empty (nothing exported, and
    not the embedded default, which None would mean), and ``none`` is not among the names."""
    env = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    assert select(env) == Selection((), "http/protobuf")


def test_a_plain_start_with_no_distro_defaults_records_none(monkeypatch):
    """The usual start: no export variable set since the start and no record inherited. Nothing to record,
    and no record to remove (it is not there): an empty result, not an error (``zero_code`` would report
    one on every plain start)."""
    for var in EXPORT_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(DISTRO_DEFAULTS_VARIABLE, "x")  # so that teardown puts back whatever the call leaves
    monkeypatch.delenv(DISTRO_DEFAULTS_VARIABLE)
    assert remember_distro_defaults(dict(os.environ)) == {}
    assert DISTRO_DEFAULTS_VARIABLE not in os.environ
