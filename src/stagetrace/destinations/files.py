"""The embedded default exporters: OTLP JSON lines on local disk, traces and metrics, read by ``stagetrace
report``.

Bounded: each file rotates at ``max_bytes`` keeping one previous file, so a forgotten service cannot fill
the disk. One file per process, so workers never interleave partial lines; named after the application's
process (``<kind>-<service>-<pid>.jsonl``), whichever process writes it.

Both exporters take no required argument, so that OpenTelemetry's own configurator can build them from
``OTEL_TRACES_EXPORTER=file`` / ``OTEL_METRICS_EXPORTER=file`` (the ``opentelemetry_*_exporter`` entry
points); stagetrace then moves them to its exporter process (``configuration.attach``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from stagetrace._safety import report_internal_error
from stagetrace.destinations.otlp_json import metrics_to_otlp_json_line, spans_to_otlp_json_line
from stagetrace.settings import output_dir_from_env

MAX_FILE_BYTES = 256 * 2**20


def default_path(kind: str, service_name: str | None = None, pid: int | None = None) -> Path:
    """``<STAGETRACE_OUTPUT_DIR>/<kind>-<service>-<pid>.jsonl``; ``service_name`` defaults to
    ``OTEL_SERVICE_NAME``, ``pid`` to this process's."""
    base = Path(output_dir_from_env())
    name = service_name or os.environ.get("OTEL_SERVICE_NAME") or "service"
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    return base / f"{kind}-{safe}-{os.getpid() if pid is None else pid}.jsonl"


def default_traces_path(service_name: str | None = None) -> Path:
    return default_path("traces", service_name)


def default_metrics_path(service_name: str | None = None) -> Path:
    return default_path("metrics", service_name)


def metrics_beside(traces_path: Path) -> Path:
    """The metrics file next to a traces file given by path: ``traces-x.jsonl`` -> ``metrics-x.jsonl``,
    ``t.jsonl`` -> ``t.metrics.jsonl``."""
    name = traces_path.name
    if name.startswith("traces"):
        return traces_path.with_name("metrics" + name[len("traces") :])
    return traces_path.with_suffix(".metrics" + (traces_path.suffix or ".jsonl"))


class RotatingLines:
    """Appends whole lines to one file, rotating it at ``max_bytes`` (one previous file kept). ``path``
    None: the default path of ``kind``, asked again in a forked child (gunicorn --preload,
    multiprocessing), so that each process writes its own file; a path given explicitly is kept as it is
    unless ``path_factory`` says otherwise."""

    def __init__(
        self,
        kind: str,
        path: str | os.PathLike[str] | None,
        max_bytes: int,
        path_factory: Callable[[], Path] | None,
    ) -> None:
        if path_factory is None and path is None:
            path_factory = lambda: default_path(kind)  # noqa: E731
        self.path = Path(path) if path is not None else default_path(kind)
        self.max_bytes = max_bytes
        self._path_factory = path_factory
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def write(self, line: bytes) -> None:
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._lock = threading.Lock()
            if self._path_factory is not None:
                self.path = self._path_factory()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            if size and size + len(line) > self.max_bytes:
                os.replace(self.path, self.path.with_suffix(self.path.suffix + ".1"))
            with open(self.path, "ab") as fh:
                fh.write(line)


class JsonLinesSpanExporter(SpanExporter):
    """Spans as OTLP JSON lines (one ``ExportTraceServiceRequest`` a line)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        max_bytes: int = MAX_FILE_BYTES,
        path_factory: Callable[[], Path] | None = None,
    ) -> None:
        self._lines = RotatingLines("traces", path, max_bytes, path_factory)
        self._closed = False

    @property
    def path(self) -> Path:
        return self._lines.path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed:
            return SpanExportResult.FAILURE
        try:
            self._lines.write(spans_to_otlp_json_line(spans).encode())
            return SpanExportResult.SUCCESS
        except Exception:
            report_internal_error("JSON lines exporter")
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._closed = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class JsonLinesMetricExporter(MetricExporter):
    """Metrics as OTLP JSON lines (one ``ExportMetricsServiceRequest`` a line), cumulative: the last line a
    process wrote holds its totals since it started, which is what ``stagetrace report`` reads."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        max_bytes: int = MAX_FILE_BYTES,
        path_factory: Callable[[], Path] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)  # no preferred temporality: the SDK's default, cumulative
        self._lines = RotatingLines("metrics", path, max_bytes, path_factory)
        self._closed = False

    @property
    def path(self) -> Path:
        return self._lines.path

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if self._closed:
            return MetricExportResult.FAILURE
        try:
            self._lines.write(metrics_to_otlp_json_line(metrics_data).encode())
            return MetricExportResult.SUCCESS
        except Exception:
            report_internal_error("JSON lines metric exporter")
            return MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._closed = True
