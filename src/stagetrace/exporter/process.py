"""The exporter process: ``python -m stagetrace.exporter IN_FD OUT_FD``, started by the application.

It reads framed batches of wire messages from ``IN_FD`` (the first one is its configuration), does all of
the work after capture (``ExporterCore``) and writes results back on ``OUT_FD``: acknowledgements, flush
answers, log records, and, for consumers that live in the application (exporter objects, metric readers,
``on_verdict``), the kept spans, the metric events and the verdicts.

It ends when the application does: end of file on ``IN_FD`` (the application exited, crashed or shut
stagetrace down), or its parent process changed. It then flushes within the shutdown deadline and exits.
Ctrl-C in a terminal reaches the whole process group: the exporter ignores it and ends with its parent.
"""

from __future__ import annotations

import ctypes
import logging
import marshal
import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import SpanProcessor, SynchronousMultiSpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from stagetrace._compat import otlp_http_sender
from stagetrace._safety import logger
from stagetrace.analysis import Verdict
from stagetrace.common import wire
from stagetrace.common.channel import FrameReader, encode_frame
from stagetrace.destinations.env import Selection, metric_readers, span_exporters
from stagetrace.destinations.shutdown import shutdown_within
from stagetrace.exporter.aggregation import AggregatedMetrics
from stagetrace.exporter.core import ExporterCore
from stagetrace.exporter.diagnosis_budget import CpuClocks
from stagetrace.exporter.metrics import MetricsRecorder, MetricsSink, TeeMetrics
from stagetrace.exporter.otlp_encoding import TraceRequestEncoder
from stagetrace.exporter.otlp_sink import WireBatchSink
from stagetrace.exporter.outputs import LocalOutputs, NoMetrics, SpanForwarder, SpanSink, fan_out
from stagetrace.settings import ACK_INTERVAL_S, Settings

_PR_SET_PDEATHSIG = 1


class ResultSender:
    """Batches result messages and writes them, one frame per batch, on the results pipe (blocking: the
    application's helper thread always drains it, and it never waits on this process)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._queued: list[tuple[Any, ...]] = []
        self.broken = False

    def queue(self, msg: tuple[Any, ...]) -> None:
        self._queued.append(msg)

    def send(self) -> None:
        if not self._queued or self.broken:
            self._queued.clear()
            return
        batch, self._queued = self._queued, []
        try:
            frame = encode_frame(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:
            logger.error("stagetrace exporter: a result could not be encoded", exc_info=True)
            return
        view = memoryview(frame)
        while view:
            try:
                n = os.write(self.fd, view)
            except OSError:
                self.broken = True  # the application is gone
                return
            view = view[n:]


class ForwardingLogHandler(logging.Handler):
    """Log records of this process go to the application's logging (its handlers, its format), so that a
    slow-trace line or an export error reads the same in both modes."""

    def __init__(self, sender: ResultSender) -> None:
        super().__init__(logging.INFO)
        self.sender = sender

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self.sender.queue((wire.LOG, record.levelno, record.name, text))
        except Exception:
            self.handleError(record)


class ReturningOutputs:
    """This process's own outputs, plus what the application's consumers asked to get back."""

    def __init__(self, own: LocalOutputs, sender: ResultSender, *, spans: bool, verdicts: bool, metrics: bool) -> None:
        self.own = own
        self.sender = sender
        self.return_spans = spans
        self.wants_verdicts = verdicts
        self.recorder = MetricsRecorder() if metrics else None
        self.metrics: MetricsSink = TeeMetrics(own.metrics, self.recorder) if self.recorder else own.metrics

    def export(self, spans: Sequence[wire.WireSpan]) -> None:
        self.own.export(spans)
        if self.return_spans:
            self.sender.queue((wire.SPANS, tuple(spans)))

    def verdict(self, verdict: Verdict) -> None:
        self.sender.queue((wire.VERDICT, verdict))

    def flush(self, timeout_s: float) -> bool:
        return self.own.flush(timeout_s)

    def send_metric_events(self) -> None:
        if self.recorder is not None:
            calls = self.recorder.take()
            if calls:
                self.sender.queue((wire.METRIC, calls))


class Exporter:
    """What one configuration builds in this process: span processors, metrics and the core."""

    def __init__(self, config: dict[str, Any], sender: ResultSender) -> None:
        self.settings = Settings.from_dict(config["settings"])
        self.resource = wire.StableResource(dict(config["resource"]))
        spans, metrics = _selection(config["spans"]), _selection(config["metrics"])
        self.exporters: list[SpanExporter] = span_exporters(spans, Path(config["traces_path"])) if spans else []
        # The SDK's OTLP/HTTP exporter gets bytes encoded from the wire spans (otlp_encoding), through its own
        # client; any other exporter gets SDK spans through a BatchSpanProcessor.
        self.wire_sinks: list[WireBatchSink] = []
        processors: list[SpanProcessor] = []
        for exporter in self.exporters:
            send = otlp_http_sender(exporter)
            if send is None:
                processors.append(BatchSpanProcessor(exporter))
                continue
            encoder = TraceRequestEncoder(self.resource.attributes, self.resource.schema_url)
            self.wire_sinks.append(WireBatchSink(send, encoder, self._dropped, abandon=exporter.shutdown))
        self.processor: SpanProcessor | None = None
        if len(processors) == 1:
            self.processor = processors[0]
        elif processors:
            multi = SynchronousMultiSpanProcessor()
            for p in processors:
                multi.add_span_processor(p)
            self.processor = multi
        readers = metric_readers(metrics, Path(config["metrics_path"])) if metrics else []
        self.meter_provider = MeterProvider(metric_readers=readers, resource=self.resource, shutdown_on_exit=False)
        own_metrics: MetricsSink = NoMetrics()
        if readers:
            aggregated = AggregatedMetrics(self.resource, self.settings.max_stage_names)
            aggregated.attach_readers(readers)
            own_metrics = aggregated
        sinks: list[SpanSink] = list(self.wire_sinks)
        if self.processor is not None:
            sinks.append(SpanForwarder(self.processor, self.resource, self._dropped))
        own = LocalOutputs(spans=fan_out(sinks), metrics=own_metrics, flush_metrics=self._flush_metrics)
        self.outputs = ReturningOutputs(
            own,
            sender,
            spans=bool(config["return_spans"]),
            verdicts=bool(config["return_verdicts"]),
            metrics=bool(config["return_metrics"]),
        )
        self.core = ExporterCore(self.settings, self.outputs, clocks=ProcessClocks(os.getppid()))

    def _dropped(self, reason: str, count: int) -> None:
        self.outputs.metrics.dropped(reason, count)  # here and, when asked, in the application

    def _flush_metrics(self, timeout_s: float) -> bool:
        return bool(self.meter_provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        deadline_s = self.settings.shutdown_timeout_s
        steps: list[Any] = [lambda sink=sink: sink.shutdown(deadline_s) for sink in self.wire_sinks]
        if self.processor is not None:
            steps.append(self.processor.shutdown)
        steps.append(lambda: self.meter_provider.shutdown(timeout_millis=int(deadline_s * 1000)))
        abandon = [sink.abandon for sink in self.wire_sinks] + [e.shutdown for e in self.exporters]
        shutdown_within(deadline_s, steps, abandon)


def _selection(raw: Any) -> Selection | None:
    """The application's selection as it travels in the configuration: ``[names, protocol]`` or None."""
    if raw is None:
        return None
    names, protocol = raw
    return Selection(tuple(str(n) for n in names), str(protocol))


def _die_with_parent() -> None:
    """Linux: SIGTERM when the parent dies, in case end of file on the pipe is held up by a forked sibling
    that inherited the write end."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)  # unwinds through serve()'s finally: flush, then exit


def _read_config(fd: int, reader: FrameReader) -> dict[str, Any]:
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            raise SystemExit(0)  # the application went away before configuring us
        payloads = reader.feed(data)
        if payloads:
            kind, config = marshal.loads(payloads[0])
            if kind != wire.CONFIG:
                raise SystemExit("stagetrace exporter: the first message must be the configuration")
            config["_early_batches"] = payloads[1:]  # batches that arrived with the configuration
            return config


class ProcessClocks:
    """The exporter process's CPU and its application's (the parent's ``/proc/<pid>/stat``, in clock ticks: to
    10 ms, read once a second for the exporter's CPU budget). 0 for the application where it cannot be read:
    the budget then holds at its floor."""

    _TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01

    def __init__(self, application_pid: int) -> None:
        self._stat = f"/proc/{application_pid}/stat"

    def __call__(self) -> CpuClocks:
        try:
            with open(self._stat, "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            application_s = (int(fields[11]) + int(fields[12])) * self._TICK_S  # utime, stime
        except (OSError, ValueError, IndexError):
            application_s = 0.0
        return CpuClocks(time.process_time(), application_s)


def serve(in_fd: int, out_fd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _die_with_parent()
    parent = os.getppid()
    reader = FrameReader()
    sender = ResultSender(out_fd)
    config = _read_config(in_fd, reader)
    handler = ForwardingLogHandler(sender)
    root_logger = logging.getLogger()
    root_logger.addHandler(handler)
    root_logger.setLevel(logging.WARNING)
    logger.setLevel(logging.INFO)
    exporter = Exporter(config, sender)
    core = exporter.core
    for payload in config.pop("_early_batches", ()):
        _handle_payload(payload, exporter, sender)
    malformed_seen = 0
    last_ack, acked = 0.0, -1
    try:
        while True:
            ready, _, _ = select.select([in_fd], [], [], ACK_INTERVAL_S)
            if ready:
                data = os.read(in_fd, 1 << 20)
                if not data:
                    break
                for payload in reader.feed(data):
                    _handle_payload(payload, exporter, sender)
            if reader.malformed != malformed_seen:
                core.skipped("bad frame", reader.malformed - malformed_seen)
                malformed_seen = reader.malformed
            now = time.monotonic()
            core.tick(now)
            if core.handled != acked and now - last_ack >= ACK_INTERVAL_S:
                last_ack, acked = now, core.handled
                sender.queue((wire.ACK, acked))
            exporter.outputs.send_metric_events()
            sender.send()
            if os.getppid() != parent:
                break
    finally:
        if reader.close() != malformed_seen:
            core.skipped("truncated frame at end of input", reader.malformed - malformed_seen)
        core.finish()
        exporter.shutdown()
        sender.queue((wire.ACK, core.handled))
        exporter.outputs.send_metric_events()
        sender.send()
        root_logger.removeHandler(handler)
    return 0


def _handle_payload(payload: bytes, exporter: Exporter, sender: ResultSender) -> None:
    core = exporter.core
    try:
        batch = marshal.loads(payload)
        if not isinstance(batch, list):
            raise ValueError("a batch is a list")
    except (ValueError, EOFError, TypeError) as e:
        core.skipped(f"undecodable batch ({e})")
        return
    for msg in batch:
        if isinstance(msg, tuple) and len(msg) == 3 and msg[0] == wire.FLUSH:
            # Results first: verdicts and metric events do not wait for a slow collector.
            exporter.outputs.send_metric_events()
            sender.queue((wire.ACK, core.handled))
            sender.send()
            ok = core.flush(float(msg[2]))
            exporter.outputs.send_metric_events()
            sender.queue((wire.FLUSH, msg[1], ok))
            sender.send()
            continue
        core.handle_or_count(msg)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m stagetrace.exporter IN_FD OUT_FD (started by stagetrace, not by hand)", file=sys.stderr)
        return 2
    return serve(int(args[0]), int(args[1]))
