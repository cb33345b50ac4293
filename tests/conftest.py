from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import stagetrace
from stagetrace.analysis import Verdict


class Harness:
    """A configured stagetrace with in-memory export, plus helpers to read what it produced."""

    def __init__(self, **kwargs: Any) -> None:
        self.exporter = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()
        self.verdicts: list[Verdict] = []
        kwargs.setdefault("on_verdict", self.verdicts.append)
        self.handle = stagetrace.configure(
            "test-service", span_exporter=self.exporter, metric_reader=self.reader, set_global=False, **kwargs
        )

    @property
    def tracer(self) -> Any:
        return self.handle.tracer_provider.get_tracer("test")

    def flush(self) -> None:
        assert self.handle.force_flush(10)

    def spans(self) -> list[Any]:
        self.flush()
        return list(self.exporter.get_finished_spans())

    def by_name(self, name: str) -> list[Any]:
        return [s for s in self.spans() if s.name == name]

    def roots(self) -> list[Any]:
        return [s for s in self.spans() if s.parent is None or s.parent.is_remote]

    def metric_points(self, name: str, *, flush: bool = True) -> list[Any]:
        """``flush=False``: read what the reader has now (when a flush cannot succeed, or would collect)."""
        if flush:
            self.flush()
        data = self.reader.get_metrics_data()
        points = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name:
                        points.extend(m.data.data_points)
        return points

    def wait_verdicts(self, n: int, timeout: float = 10.0) -> list[Verdict]:
        deadline = time.monotonic() + timeout
        while len(self.verdicts) < n and time.monotonic() < deadline:
            self.handle.force_flush(1)
            time.sleep(0.01)
        return self.verdicts


@pytest.fixture
def export_mode() -> str:
    """Where the exporter's work runs: "process" (the default) or "thread". Test modules that must hold in
    both modes override this fixture with a parametrized one (``both_modes`` below)."""
    return "process"


@pytest.fixture(autouse=True)
def stagetrace_env(monkeypatch: pytest.MonkeyPatch, export_mode: str) -> None:
    """Every test keeps all traces (``STAGETRACE_HEALTHY_SAMPLE=1``; the sampling tests lower it) and runs
    the exporter where ``export_mode`` says."""
    monkeypatch.setenv("STAGETRACE_HEALTHY_SAMPLE", "1.0")
    monkeypatch.setenv("STAGETRACE_EXPORT_PROCESS", "on" if export_mode == "process" else "off")


@pytest.fixture(params=["process", "thread"], name="export_mode")
def both_modes(request: pytest.FixtureRequest) -> str:
    """Import into a test module as ``export_mode = both_modes`` to run its tests in both modes."""
    return request.param


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.handle.shutdown()


@pytest.fixture
def make_harness() -> Iterator[Any]:
    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        h = Harness(**kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.handle.shutdown()


@pytest.fixture
def otlp_receiver() -> Iterator[Any]:
    from stagetrace.testing import OtlpReceiver

    r = OtlpReceiver().start()
    yield r
    r.stop()


class _InternalErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "stagetrace internal error" in message:
            self.records.append(message + ("\n" + self.format(record) if record.exc_info else ""))


@pytest.fixture(autouse=True)
def no_internal_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    """A swallowed bug fails the test: stagetrace contains its own errors (the application never sees them)
    and logs them, from every thread and from the exporter process (whose log records come back to this
    process). Tests that cause one on purpose are marked ``internal_errors_expected``."""
    handler = _InternalErrors()
    handler.setFormatter(logging.Formatter())
    log = logging.getLogger("stagetrace")
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
    if handler.records and request.node.get_closest_marker("internal_errors_expected") is None:
        pytest.fail("stagetrace logged internal errors:\n" + "\n".join(handler.records[:3]), pytrace=False)


@pytest.fixture(autouse=True)
def restore_global_patches() -> Iterator[None]:
    """Integrations patch classes (executor submit, starlette, fastapi): undo them after every test."""
    yield
    from stagetrace.integrations import auto_stages
    from stagetrace.integrations.asgi import uninstall_request_signals
    from stagetrace.integrations.threads import stop_propagating_context

    uninstall_request_signals()
    stop_propagating_context()
    auto_stages.uninstrument()
