"""NVML sample matching (pure) and the sampler's clock-domain detection."""

from __future__ import annotations

import time

import pytest

from fakes import FakeNvml, fake_uuid
from stagetrace.gpu.nvml import NvmlSampler, utilization_over_window


def test_window_weights_samples_by_overlap():
    # samples cover (0,100] at 20% and (100,200] at 80%; a window 50..150 overlaps each by 50
    stats = utilization_over_window([(100, 0.2), (200, 0.8)], period_us=100, start_us=50, end_us=150)
    assert stats.mean == pytest.approx(0.5)
    assert (stats.min, stats.max) == (0.2, 0.8)
    assert stats.coverage == pytest.approx(1.0)


def test_short_window_gets_the_enclosing_sample_and_its_coverage():
    stats = utilization_over_window([(100, 0.3), (200, 0.9)], period_us=100, start_us=120, end_us=121)
    assert stats.mean == pytest.approx(0.9) and stats.coverage == pytest.approx(1.0)


def test_partly_covered_window_reports_coverage():
    stats = utilization_over_window([(100, 0.4)], period_us=100, start_us=50, end_us=250)
    assert stats.mean == pytest.approx(0.4)
    assert stats.coverage == pytest.approx(0.25)


def test_no_overlapping_sample_gives_none():
    assert utilization_over_window([(100, 0.4)], period_us=10, start_us=500, end_us=600) is None
    assert utilization_over_window([], period_us=10, start_us=0, end_us=10) is None


@pytest.mark.parametrize("clock", ["epoch", "monotonic"])
def test_sample_timestamps_are_mapped_to_epoch(clock):
    nvml = FakeNvml(utilization=0.7, period_ms=10, clock=clock)
    time.sleep(0.05)
    sampler = NvmlSampler("GPU-" + fake_uuid(0), nvml=nvml, poll_interval_s=0.02)
    assert sampler.start()
    try:
        assert sampler.clock == clock
        now = time.time_ns()
        stats = sampler.window(now - 40_000_000, now - 10_000_000)
        assert stats is not None and stats.mean == pytest.approx(0.7)
        assert sampler.period_us == pytest.approx(10_000, rel=0.01)
    finally:
        sampler.stop()


def test_idle_gpu_with_an_empty_sample_buffer_is_not_an_error():
    nvml = FakeNvml(period_ms=10_000)  # no sample in the buffer yet: NVML_ERROR_NOT_FOUND
    sampler = NvmlSampler("GPU-" + fake_uuid(0), nvml=nvml, poll_interval_s=0.01)
    assert sampler.start()
    time.sleep(0.05)
    assert sampler.enabled
    sampler.stop()
