"""Bounded memory and bad input (clear error or contained, never a crash later)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import pytest

import stagetrace
from conftest import both_modes
from stagetrace import conventions as c
from stagetrace.capture.registry import TraceRegistry
from stagetrace.settings import Settings

export_mode = both_modes  # every test here runs with the exporter in a process and on a thread


def dropped(h, reason):
    return sum(p.value for p in h.metric_points(c.METRIC_DROPPED) if p.attributes[c.DROP_REASON] == reason)


@pytest.mark.slow
def test_hundred_thousand_open_roots_are_capped_and_counted(make_harness, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "200000")  # the SDK's own export queue is not under test
    # the hand-off queue and the channel are not under test here: room for the whole burst
    h = make_harness(settings=Settings(max_traces_in_flight=1000, queue_size=200_000, channel_buffer_bytes=2**28))
    tracer = h.tracer
    spans = [tracer.start_span(f"r{i}") for i in range(100_000)]
    registry = h.handle.runtime.registry
    assert len(registry) == 1000
    assert dropped(h, "traces_in_flight") == 99_000
    for s in spans:
        s.end()
    assert len(registry) == 0
    h.flush()
    assert len(h.verdicts) == 1000  # the tracked ones got verdicts; the rest exported unchanged
    assert len(h.spans()) == 100_000


def test_roots_that_never_end_are_evicted_after_the_ttl():
    drops = []
    reg = TraceRegistry(max_traces=10, ttl_s=5.0, on_drop=lambda reason, n: drops.append((reason, n)))
    reg.open(1, 11, time.time_ns())
    reg.open(2, 22, time.time_ns())
    assert reg.evict_expired(now=time.monotonic() + 1) == []
    evicted = reg.evict_expired(now=time.monotonic() + 10)
    assert {r.trace_id for r in evicted} == {1, 2}
    assert drops == [("trace_timeout", 2)]
    assert len(reg) == 0


def test_leaked_roots_are_evicted_on_the_helpers_sweep(make_harness):
    h = make_harness(settings=Settings(trace_ttl_s=0.05, sweep_interval_s=0.02))
    leaked = h.tracer.start_span("leaked")  # never ended
    with stagetrace.pipeline("p"):  # the helper thread sweeps
        pass
    deadline = time.monotonic() + 5
    while len(h.handle.runtime.registry) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(h.handle.runtime.registry) == 0
    assert dropped(h, "trace_timeout") >= 1
    del leaked


def test_stages_per_trace_are_capped(make_harness):
    """Past the cap a stage is dropped and counted; a name that repeats folds into its composite, so 50
    occurrences of one name take four records and stay under it."""
    h = make_harness(settings=Settings(max_stages_per_trace=10))
    with stagetrace.pipeline("p"):
        for i in range(50):
            with stagetrace.stage(f"tok{i}"):
                pass
    assert len([s for s in h.spans() if s.name.startswith("tok")]) == 10
    assert dropped(h, "stages_per_trace") == 40
    with stagetrace.pipeline("p"):
        for _ in range(50):
            with stagetrace.stage("again"):
                pass
    assert dropped(h, "stages_per_trace") == 40
    assert (
        sum(
            s.attributes.get(c.COMPRESSED_COUNT, 1)
            for s in h.by_name("again")
            if "stagetrace.compressed.slowest" not in s.attributes
        )
        == 50
    )


def test_a_full_hand_off_queue_drops_and_counts_and_never_blocks(make_harness):
    import threading

    h = make_harness(settings=Settings(queue_size=1))
    shipper = h.handle.runtime.shipper
    gate = threading.Event()
    original = shipper._pack_trace

    def stalled(*a):
        gate.wait(5)  # the helper thread is stuck: the queue fills
        return original(*a)

    shipper._pack_trace = stalled
    t0 = time.monotonic()
    for _ in range(5):
        with stagetrace.pipeline("p"), stagetrace.stage("s"):
            pass
    assert time.monotonic() - t0 < 1  # the requests did not wait for the stuck helper
    gate.set()
    roots = [s for s in h.spans() if s.name == "p"]
    lost = dropped(h, "handoff_queue_full")
    assert lost >= 3
    assert len(roots) == len(h.verdicts) == 5 - lost  # every trace not dropped is whole, with its verdict


def test_the_helper_frees_each_trace_once_it_is_packed_not_at_the_end_of_its_batch():
    """At saturation a cycle packs hundreds of traces: each one's records go as soon as it is packed, so that the
    batch never holds them all (memory, and the garbage collector's passes over them)."""
    import weakref
    from types import SimpleNamespace

    from stagetrace.handoff.shipper import Shipper

    class Trace:
        pass

    shipper = Shipper(
        settings=Settings(),
        transport_factory=lambda s: None,  # never started here
        app_metrics=None,
        registry=SimpleNamespace(clear=lambda: None),
    )
    packed: list[weakref.ref[Trace]] = []
    earlier_alive = []

    def pack_into(messages: list, item: tuple) -> None:
        earlier_alive.append(sum(ref() is not None for ref in packed))
        packed.append(weakref.ref(item[0]))
        messages.append(("T", len(packed)))

    shipper._pack_into = pack_into  # type: ignore[method-assign]
    taken = [(Trace(), None) for _ in range(5)]
    messages: list = []
    shipper._pack_taken(taken, messages)
    assert messages == [("T", n) for n in range(1, 6)]  # in the order they came
    assert taken == [] and earlier_alive == [0] * 5
    assert all(ref() is None for ref in packed)


def test_a_shipped_traces_records_are_freed_without_the_garbage_collector(make_harness):
    """A stage's record and another instrumentation's span point at their trace, which holds them in its lists: a
    cycle that only the garbage collector frees, in passes over every record of the traces in flight. Once the
    trace is packed its lists let go, and its records go by reference counting alone (the collector off here)."""
    import weakref

    from opentelemetry import trace as trace_api

    h = make_harness()
    gc.disable()
    try:
        with stagetrace.pipeline("p"):
            with stagetrace.stage("s"):
                stage_record = weakref.ref(trace_api.get_current_span())
            with h.tracer.start_as_current_span("foreign") as span:
                foreign = weakref.ref(span)
            del span
        h.wait_verdicts(1)
        assert stage_record() is None and foreign() is None
    finally:
        gc.enable()


def test_stage_name_cardinality_is_capped_in_metrics(make_harness):
    h = make_harness(settings=Settings(max_stage_names=20))
    for i in range(200):
        with stagetrace.pipeline("p"), stagetrace.stage(f"user-{i}"):
            pass
    labels = {p.attributes[c.STAGE] for p in h.metric_points(c.METRIC_STAGE_DURATION)}
    assert len(labels) == 21 and "_other" in labels
    assert dropped(h, "stage_name_cardinality") >= 180
    assert len(h.by_name("user-150")) == 1  # spans keep the real name


@pytest.mark.parametrize("bad", [None, 3, b"bytes", ["x"]])
def test_non_string_names_are_a_type_error(bad):
    with pytest.raises(TypeError, match="stage name must be a str"):
        stagetrace.stage(bad if bad is not None else 0)
    with pytest.raises(TypeError):
        stagetrace.pipeline(bad)


@pytest.mark.parametrize("bad", ["", "   ", "\n\t"])
def test_empty_names_are_a_value_error(bad):
    with pytest.raises(ValueError, match="non-empty"):
        stagetrace.stage(bad)


def test_control_characters_and_huge_names_are_sanitised(harness):
    with stagetrace.pipeline("p"):
        with stagetrace.stage("dec\x00ode\n"):
            pass
        with stagetrace.stage("x" * 10_000):
            pass
    names = {s.name for s in harness.spans()}
    assert "dec?ode" in names
    assert "x" * 128 in names


def test_bad_kind_and_generators_are_rejected_at_the_call():
    with pytest.raises(ValueError, match="kind"):
        stagetrace.stage("a", kind="gpu-ish")

    with pytest.raises(TypeError, match="generator"):

        @stagetrace.stage("gen")
        def gen():
            yield 1

    with pytest.raises(ValueError, match="needs a name"), stagetrace.stage():
        pass


def test_bad_configuration_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="slow_threshold_ms"):
        stagetrace.configure(slow_threshold_ms=-1, span_exporter=[], set_global=False)
    with pytest.raises(TypeError, match="on_verdict"):
        stagetrace.configure(on_verdict=42, set_global=False)
    monkeypatch.setenv("STAGETRACE_SLOW_THRESHOLD_MS", "fast")
    with pytest.raises(ValueError, match="STAGETRACE_SLOW_THRESHOLD_MS"):
        stagetrace.configure(set_global=False)


def test_slow_threshold_from_environment(monkeypatch, make_harness):
    monkeypatch.setenv("STAGETRACE_SLOW_THRESHOLD_MS", "1")
    h = make_harness()
    with stagetrace.pipeline("p"), stagetrace.stage("s"):
        time.sleep(0.005)
    h.flush()
    assert h.verdicts[0].slow and h.verdicts[0].slow_threshold_ms == 1


@pytest.mark.internal_errors_expected
def test_internal_errors_never_reach_the_application(harness, monkeypatch):
    runtime = harness.handle.runtime

    def broken(*a, **k):
        raise RuntimeError("stagetrace bug")

    monkeypatch.setattr(runtime, "lookup_trace", broken)
    with stagetrace.pipeline("p"), stagetrace.stage("still-works"):
        value = 42
    assert value == 42
    monkeypatch.undo()
    monkeypatch.setattr(runtime.shipper, "_pack_trace", broken)
    with stagetrace.pipeline("p2"), stagetrace.stage("s"):
        pass
    assert [s.name for s in harness.spans() if s.name == "p2"] == ["p2"]  # exported unchanged


def test_unconfigured_stages_are_plain_calls():
    from stagetrace import _state

    assert _state.runtime is None

    @stagetrace.stage("x")
    def f(a):
        return a * 2

    with stagetrace.stage("y") as s:
        s.set_attribute("k", 1)
    assert f(21) == 42


def test_disabled_by_environment_is_a_no_op():
    code = (
        "import stagetrace\n"
        "h = stagetrace.configure('svc')\n"
        "assert not h.enabled and h.traces_path is None\n"
        "@stagetrace.stage('a')\n"
        "def f(): return 7\n"
        "with stagetrace.pipeline('p'):\n"
        "    assert f() == 7\n"
        "h.force_flush(); h.shutdown(); print('ok')\n"
    )
    env = dict(os.environ, STAGETRACE_DISABLED="true", STAGETRACE_OUTPUT_DIR="/nonexistent/should-not-be-created")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def live_stage_records() -> int:
    # type(o), not isinstance(o, ...): isinstance reads ``__class__`` from every foreign object, and some of
    # torch's deprecated module attributes warn when read.
    from stagetrace.capture.records import StageRecord

    return sum(issubclass(type(o), StageRecord) for o in gc.get_objects())


def test_stage_records_do_not_leak(harness):
    with stagetrace.pipeline("warm"), stagetrace.stage("s"):
        pass
    harness.flush()
    gc.collect()
    before = live_stage_records()
    for _ in range(2000):
        with stagetrace.pipeline("p"), stagetrace.stage("s"):
            pass
    harness.flush()
    harness.exporter.clear()
    gc.collect()
    after = live_stage_records()
    assert after - before < 50


def test_what_a_rate_limited_log_left_out_is_said_when_its_window_closes_and_at_shutdown(monkeypatch, caplog):
    """The slow-trace log stopped at its cap with no word of the rest: the count is now logged when the
    window closes with nothing more to log, and at shutdown for the window still open."""
    import logging

    import stagetrace._safety as safety

    clock = [1000.0]
    monkeypatch.setattr(safety.time, "monotonic", lambda: clock[0])
    log = safety.RateLimitedLog(per_interval=2, interval_s=60.0)
    with caplog.at_level(logging.INFO, logger="stagetrace"):
        for _ in range(5):
            log.log(logging.WARNING, "slow-trace", "slow %s", "x")
        assert log.report_suppressed() == 0  # the window is still open
        clock[0] += 60.0
        assert log.report_suppressed() == 3
        assert log.report_suppressed() == 0  # said once
        for _ in range(4):
            log.log(logging.WARNING, "slow-trace", "slow %s", "y")
        assert log.report_suppressed(final=True) == 2
    said = [r for r in caplog.records if "were not logged" in r.getMessage()]
    assert [r.getMessage() for r in said] == [
        "stagetrace: 3 more slow-trace records were not logged in the last 60 s (at most 2 per 60 s)",
        "stagetrace: 2 more slow-trace records were not logged in the last 0 s (at most 2 per 60 s)",
    ]
    assert all(r.levelno == logging.WARNING for r in said)
    assert [r.getMessage() for r in caplog.records].count("slow x") == 2 and "slow y" in caplog.text


def test_the_exporters_slow_trace_log_counts_what_it_left_out_at_shutdown(make_harness, caplog):
    import logging

    h = make_harness(settings=Settings(slow_threshold_ms=0.001, slow_log_per_minute=3))
    with caplog.at_level(logging.WARNING, logger="stagetrace"):
        for _ in range(10):
            with stagetrace.pipeline("p"), stagetrace.stage("s"):
                pass
        h.flush()
        h.handle.shutdown()
    assert sum("slow trace p" in r.getMessage() for r in caplog.records) == 3
    assert any("7 more slow-trace records were not logged" in r.getMessage() for r in caplog.records), caplog.text
