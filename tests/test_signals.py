"""Process signals joined to a trace's window (exporter/signals.py), with controlled samples: the event-loop
lag a request reports is the stall it lived through, not a neighbour's."""

from __future__ import annotations

import pytest

from stagetrace.exporter.signals import LagSeries, flatten, max_loop_lag_ms

MS = 1_000_000


def series(*samples: tuple[float, float]) -> LagSeries:
    """(wake-up time in ms, lag in ms) pairs."""
    s = LagSeries()
    s.extend_flat(flatten((int(t * MS), lag) for t, lag in samples))
    return s


def test_a_stall_that_ended_before_the_request_began_is_not_its_lag():
    # the loop stalled 149 ms, from 1000 to 1149; a 12 ms request from 1160 to 1172
    s = series((1149, 149.0), (1200, 0.2))
    assert max_loop_lag_ms(s, 1160 * MS, 1172 * MS) == 0.0  # the next sample, at 1200, says 0.2 ms: after it


def test_only_the_part_of_a_stall_inside_the_request_counts():
    # stalled from 1000 to 1149; the request ran 1100-1300: it lived 49 ms of the stall
    s = series((1149, 149.0), (1200, 0.1))
    assert max_loop_lag_ms(s, 1100 * MS, 1300 * MS) == 49.0


def test_a_stall_reported_after_the_request_ended_still_counts_for_it():
    # the request 1000-1050 was held from 1020 to its end; the monitor woke at 1080, after the stall
    s = series((990, 0.1), (1080, 60.0))
    assert max_loop_lag_ms(s, 1000 * MS, 1050 * MS) == 30.0


def test_a_stall_after_the_request_is_not_its_lag_and_no_sample_means_not_measured():
    s = series((1100, 20.0), (1300, 0.5))  # the stall 1080-1100, after the request 1000-1050
    assert max_loop_lag_ms(s, 1000 * MS, 1050 * MS) == 0.0
    assert max_loop_lag_ms(s, 1400 * MS, 1410 * MS) is None


def test_the_worst_stall_in_the_window_is_reported():
    s = series((1010, 5.0), (1100, 40.0), (1150, 1.0), (1300, 2.0))
    assert max_loop_lag_ms(s, 1000 * MS, 1200 * MS) == 40.0


def test_gil_pressure_is_the_mean_within_the_requests_own_window_and_needs_three_wake_ups():
    from stagetrace.exporter.signals import gil_pressure_ms

    # a neighbour's contention (5 ms lags) before the request; the request 1000-1050 saw the GIL free
    s = series(*[(900 + 10 * i, 5.0) for i in range(10)], (1010, 0.1), (1020, 0.2), (1030, 0.1), (1040, 0.2))
    assert gil_pressure_ms(s, 1000 * MS, 1050 * MS, period_s=0.010) == 0.15
    assert gil_pressure_ms(s, 1000 * MS, 1015 * MS, period_s=0.010) is None  # two wake-ups: not measured
    # the wake-up one period after the end still reports on the window
    assert gil_pressure_ms(s, 1005 * MS, 1030 * MS, period_s=0.010) == pytest.approx(0.15)
