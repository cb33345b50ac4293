"""Exporters from the standard ``OTEL_*`` variables, in two steps: the application reads what they select
(``span_selection`` / ``metric_selection``: names and protocol, checked, a clear error for a bad value, at
``configure()``), and whichever process exports builds the exporters from that selection. A selection of
None means nothing is configured, so that stagetrace falls back to its embedded default instead of
retrying a collector that is not there.

Where a distro ran first (``opentelemetry-instrument`` with ``opentelemetry-distro``), some of these
variables hold its defaults, not the user's choice: ``users_environment`` leaves those out. A process tells
them by the environment it started with; its children (``uvicorn --workers``, gunicorn's exec'd workers)
start with the distro's values already in theirs, so the first process records them
(``remember_distro_defaults``) in a variable the children inherit."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter

_TRACE_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_METRIC_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")
PROTOCOLS = ("grpc", "http/protobuf")
SPAN_EXPORTERS = ("otlp", "console", "file", "stagetrace_file", "none")  # stagetrace_file: file's other name
METRIC_EXPORTERS = ("otlp", "console", "file", "none")
FILE_NAMES = frozenset({"file", "stagetrace_file"})

# The variables a distro may set as defaults before stagetrace is loaded (OpenTelemetry's distro sets the
# three exporters to otlp and the protocol to grpc).
EXPORT_VARIABLES = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_LOGS_EXPORTER",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
)


class Selection(NamedTuple):
    """What the variables select for one signal: exporter names in order (``none`` left out, so an empty
    tuple exports nothing) and the OTLP protocol (read where ``otlp`` is among them)."""

    names: tuple[str, ...]
    protocol: str = "http/protobuf"

    @property
    def writes_file(self) -> bool:
        return bool(FILE_NAMES.intersection(self.names))


EMBEDDED_DEFAULT = Selection(("file",))


def files_for_metrics(spans: Selection | None) -> bool:
    """Where the user chose no metric exporter: the metrics go to a JSON lines file beside the traces' when
    the traces go to one (the embedded default, or ``file``), and nowhere otherwise (trace export to a
    collector, or ``none``: as OpenTelemetry without stagetrace)."""
    return spans is not None and spans.writes_file


def _protocol(env: Mapping[str, str], signal: str) -> str:
    raw = (
        env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip() or "http/protobuf"  # the specification's default
    if raw not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(PROTOCOLS)}; got {raw!r}")
    return raw


def _selection(
    env: Mapping[str, str], var: str, endpoint_vars: tuple[str, ...], known: tuple[str, ...], signal: str
) -> Selection | None:
    raw = env.get(var)
    if raw is None or not raw.strip():
        if not any(env.get(v) for v in endpoint_vars):
            return None
        names = ["otlp"]
    else:
        names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    for name in names:
        if name not in known:
            raise ValueError(
                f"{var}: unknown exporter {name!r} (use {', '.join(k for k in known if k != 'stagetrace_file')})"
            )
    protocol = _protocol(env, signal) if "otlp" in names else "http/protobuf"
    return Selection(tuple(n for n in names if n != "none"), protocol)


def span_selection(env: Mapping[str, str] | None = None) -> Selection | None:
    """What ``OTEL_TRACES_EXPORTER`` and the OTLP variables select for traces (default: ``os.environ``)."""
    return _selection(os.environ if env is None else env, "OTEL_TRACES_EXPORTER", _TRACE_ENDPOINT_VARS,
                      SPAN_EXPORTERS, "TRACES")  # fmt: skip


def metric_selection(env: Mapping[str, str] | None = None) -> Selection | None:
    return _selection(os.environ if env is None else env, "OTEL_METRICS_EXPORTER", _METRIC_ENDPOINT_VARS,
                      METRIC_EXPORTERS, "METRICS")  # fmt: skip


def span_exporters(
    selection: Selection, file_path: Path, path_factory: Callable[[], Path] | None = None
) -> list[SpanExporter]:
    """``file_path``: where ``file`` writes, computed in the application (named after its pid);
    ``path_factory``: the path again in a forked child, where the application builds the exporter itself."""
    exporters: list[SpanExporter] = []
    for name in selection.names:
        if name == "otlp":
            if selection.protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpans

                exporters.append(GrpcSpans())
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpans

                exporters.append(HttpSpans())
        elif name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name in FILE_NAMES:
            from stagetrace.destinations.files import JsonLinesSpanExporter

            exporters.append(JsonLinesSpanExporter(file_path, path_factory=path_factory))
    return exporters


def metric_readers(
    selection: Selection, file_path: Path, path_factory: Callable[[], Path] | None = None
) -> list[MetricReader]:
    readers: list[MetricReader] = []
    for name in selection.names:
        if name == "otlp":
            if selection.protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcMetrics

                readers.append(PeriodicExportingMetricReader(GrpcMetrics()))
            else:
                from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpMetrics

                readers.append(PeriodicExportingMetricReader(HttpMetrics()))
        elif name == "console":
            from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif name == "file":
            from stagetrace.destinations.files import JsonLinesMetricExporter

            readers.append(PeriodicExportingMetricReader(JsonLinesMetricExporter(file_path, path_factory=path_factory)))
    return readers


def starting_environment() -> dict[str, str] | None:
    """The environment this process was started with (Linux: ``/proc/self/environ``, which changes to
    ``os.environ`` do not reach), or None where it cannot be read."""
    try:
        with open("/proc/self/environ", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    return parse_environ(raw)


def parse_environ(raw: bytes) -> dict[str, str]:
    """``/proc/PID/environ``'s ``KEY=VALUE`` entries, each ended by a NUL; a value may hold ``=``, an entry
    without one (written by a process that edited its own memory) is skipped."""
    env = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if sep:
            env[os.fsdecode(key)] = os.fsdecode(value)
    return env


def set_since_start(start: Mapping[str, str] | None = None) -> frozenset[str]:
    """The export variables ``os.environ`` holds that the process did not start with: defaults a distro set
    before stagetrace was loaded (``start``: the starting environment, read when not given). Empty where
    the starting environment cannot be read: every variable is then taken as the user's."""
    start = starting_environment() if start is None else start
    if start is None:
        return frozenset()
    return frozenset(v for v in EXPORT_VARIABLES if v in os.environ and v not in start)


# Where a process records the distro's defaults for its children: a JSON object, variable -> value. Internal
# (a handoff between stagetrace's own processes, not a setting), hence the leading underscore.
DISTRO_DEFAULTS_VARIABLE = "_STAGETRACE_DISTRO_DEFAULTS"


def inherited_defaults(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The distro's defaults an ancestor process recorded (``remember_distro_defaults``); empty where there
    is no record, or it is not one (anything but a JSON object of export variables and string values)."""
    raw = (os.environ if env is None else env).get(DISTRO_DEFAULTS_VARIABLE)
    if not raw:
        return {}
    try:
        record = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(record, dict):
        return {}
    return {k: v for k, v in record.items() if k in EXPORT_VARIABLES and isinstance(v, str)}


def distro_defaults_here(start: Mapping[str, str] | None = None) -> dict[str, str]:
    """The export variables in ``os.environ`` that hold a distro's default rather than the user's choice,
    with their values: set after this process started (``set_since_start``), or recorded by an ancestor
    with the value they still hold. A recorded variable whose value differs (the user set another one, in
    the environment of this process or in code before starting it) is the user's; so is one the record
    does not name (a variable the user set before the first process started is never recorded)."""
    added = set_since_start(start)
    inherited = inherited_defaults()
    return {
        v: os.environ[v]
        for v in EXPORT_VARIABLES
        if v in os.environ and (v in added or inherited.get(v) == os.environ[v])
    }


def remember_distro_defaults(start: Mapping[str, str] | None = None) -> dict[str, str]:
    """Record this process's distro defaults (``distro_defaults_here``) in ``os.environ`` for the processes it
    starts, which inherit it; no record where there are none. Returns what was recorded."""
    defaults = distro_defaults_here(start)
    if defaults:
        os.environ[DISTRO_DEFAULTS_VARIABLE] = json.dumps(defaults, sort_keys=True, separators=(",", ":"))
    else:
        os.environ.pop(DISTRO_DEFAULTS_VARIABLE, None)
    return defaults


def users_environment(start: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` less the export variables that hold a distro's defaults (``distro_defaults_here``):
    what the user chose (in the environment, or with ``opentelemetry-instrument``'s options, which become
    variables before the program starts)."""
    defaults = distro_defaults_here(start)
    return {k: v for k, v in os.environ.items() if k not in defaults and k != DISTRO_DEFAULTS_VARIABLE}
