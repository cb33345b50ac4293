"""What a distro's configurator built that stagetrace runs itself, when it attaches to the SDK the
configurator set up (zero code: ``opentelemetry-instrument`` with ``opentelemetry-distro``).

Two kinds of exporter move to stagetrace's exporter process:

- its own JSON lines exporters (``OTEL_TRACES_EXPORTER=file`` / ``OTEL_METRICS_EXPORTER=file``, built by
  the configurator through stagetrace's entry points): the exporter process writes the files, named after
  the application's pid, and the application does not encode a line;
- the OTLP exporters a distro built from its own defaults, not the user's choice (OpenTelemetry's distro
  sets ``OTEL_TRACES_EXPORTER`` and ``OTEL_METRICS_EXPORTER`` to ``otlp``, which with no endpoint set sends
  to a collector on localhost that is usually not there): they are shut down, and stagetrace writes its
  embedded default files, as it does with no distro.

Everything else the provider holds (the user's chosen exporters, any other processor) stays as it was.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from stagetrace._compat import metric_exporter_of, span_exporter_of
from stagetrace.destinations.env import (
    EMBEDDED_DEFAULT,
    EXPORT_VARIABLES,
    files_for_metrics,
    metric_selection,
    span_selection,
)
from stagetrace.destinations.files import JsonLinesMetricExporter, JsonLinesSpanExporter


class Takeover(NamedTuple):
    kept_processors: tuple[Any, ...]
    taken_processors: tuple[Any, ...]
    taken_readers: tuple[Any, ...]
    spans_file: bool  # stagetrace writes the traces file
    metrics_file: bool
    traces_path: Path | None  # where a JSON lines exporter taken over was to write (None: the default)
    metrics_path: Path | None


_OTLP_EXPORTERS = {
    "traces": ("grpc.trace_exporter", "http.trace_exporter"),
    "metrics": ("grpc.metric_exporter", "http.metric_exporter"),
}


def _otlp_types(signal: str) -> tuple[type, ...]:
    """The SDK's own OTLP exporter classes (exactly: a subclass is someone's own exporter)."""
    name = "OTLPSpanExporter" if signal == "traces" else "OTLPMetricExporter"
    found = []
    for module in _OTLP_EXPORTERS[signal]:
        try:
            found.append(getattr(importlib.import_module(f"opentelemetry.exporter.otlp.proto.{module}"), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def distro_defaults(users: Mapping[str, str], current: Mapping[str, str]) -> frozenset[str]:
    """The export variables set in ``current`` (``os.environ``) but not in ``users``: a distro's."""
    return frozenset(v for v in EXPORT_VARIABLES if v in current and v not in users)


def plan_takeover(
    processors: Sequence[Any], readers: Sequence[Any], users: Mapping[str, str], current: Mapping[str, str]
) -> Takeover:
    """``processors``: the tracer provider's; ``readers``: the meter provider's; ``users``: the user's
    environment (``env.users_environment``); ``current``: ``os.environ``."""
    defaults = distro_defaults(users, current)
    spans_default = "OTEL_TRACES_EXPORTER" in defaults and span_selection(users) is None
    metrics_default = "OTEL_METRICS_EXPORTER" in defaults and metric_selection(users) is None
    otlp_spans, otlp_metrics = _otlp_types("traces"), _otlp_types("metrics")
    kept, taken = [], []
    traces_path = metrics_path = None
    for processor in processors:
        exporter = span_exporter_of(processor)
        if isinstance(exporter, JsonLinesSpanExporter):
            traces_path = exporter.path
            taken.append(processor)
        elif spans_default and type(exporter) in otlp_spans:
            taken.append(processor)
        else:
            kept.append(processor)
    taken_readers = []
    for reader in readers:
        exporter = metric_exporter_of(reader)
        if isinstance(exporter, JsonLinesMetricExporter):
            metrics_path = exporter.path
            taken_readers.append(reader)
        elif metrics_default and type(exporter) in otlp_metrics:
            taken_readers.append(reader)
    user_spans, user_metrics = span_selection(users), metric_selection(users)
    spans_file = spans_default or traces_path is not None or (user_spans is not None and user_spans.writes_file)
    if user_metrics is None:  # as without a distro: beside a traces file, or nowhere
        metrics_file = files_for_metrics(EMBEDDED_DEFAULT if spans_file else user_spans)
    else:
        metrics_file = user_metrics.writes_file
    return Takeover(
        kept_processors=tuple(kept),
        taken_processors=tuple(taken),
        taken_readers=tuple(taken_readers),
        spans_file=spans_file,
        metrics_file=metrics_file,
        traces_path=traces_path,
        metrics_path=metrics_path,
    )
