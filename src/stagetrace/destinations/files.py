"""The embedded default exporter: OTLP JSON lines on local disk, read by ``stagetrace report``.

Bounded: the file rotates at ``max_bytes`` keeping one previous file, so a forgotten service cannot fill
the disk. One file per process, so workers never interleave partial lines.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from stagetrace._safety import report_internal_error
from stagetrace.destinations.otlp_json import spans_to_otlp_json_line
from stagetrace.settings import output_dir_from_env


def default_traces_path(service_name: str | None = None) -> Path:
    base = Path(output_dir_from_env())
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in (service_name or "service"))
    return base / f"traces-{safe}-{os.getpid()}.jsonl"


class JsonLinesSpanExporter(SpanExporter):
    """``path_factory``: called again in a forked child (gunicorn --preload, multiprocessing), so each
    process writes its own file instead of interleaving lines with its siblings."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_bytes: int = 256 * 2**20,
        path_factory: Callable[[], Path] | None = None,
    ) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._path_factory = path_factory
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._closed:
            return SpanExportResult.FAILURE
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._lock = threading.Lock()
            if self._path_factory is not None:
                self.path = self._path_factory()
        try:
            line = spans_to_otlp_json_line(spans).encode()
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
            return SpanExportResult.SUCCESS
        except Exception:
            report_internal_error("JSON lines exporter")
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._closed = True

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
