"""The finalizer: one background thread per process that turns finished traces into verdicts and spans.

Everything expensive happens here, off the request thread: waiting (without synchronising) for GPU events,
joining NVML samples, analysis, diagnosis, span materialisation, metrics, the slow-trace log line and the
``on_verdict`` callbacks. Its queue is bounded; when it is full the trace's root is exported unchanged and
the drop is counted, so nothing is lost but the verdict.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.trace import format_trace_id

from stagetrace import conventions as c
from stagetrace._safety import RateLimitedLog, logger, report_internal_error
from stagetrace.analysis import (
    TraceSignals,
    Verdict,
    analyse_trace,
    build_verdict,
    diagnose,
)
from stagetrace.capture.cpu import CpuSignals
from stagetrace.capture.records import StageRecord, TraceRecord
from stagetrace.finalize import materialize as mat
from stagetrace.finalize.metrics import StagetraceMetrics, exemplar_context
from stagetrace.settings import Settings

MIN_CPU_ACCOUNTED_NS = 1_000_000


def _resolve_cpu(stages: Sequence[StageRecord]) -> None:
    """CPU attributes for stages of at least 1 ms: below that the on-CPU / run-queue split is scheduler
    noise, no rule looks at it (they need 5 ms), and each attribute costs encoding on every span."""
    for rec in stages:
        if rec.cpu_end is not None and rec.end_ns - rec.start_ns >= MIN_CPU_ACCOUNTED_NS:
            CpuSignals.resolve(rec)


class Finalizer:
    """``gpu`` (optional, set by GPU support) says whether a trace's CUDA events completed and NVML samples
    arrived (``ready``, never blocking), resolves each stage's GPU fields (``resolve``) and does periodic
    work on this thread (``tick``). ``signal_sources`` return partial ``TraceSignals`` fields for a trace."""

    def __init__(
        self,
        *,
        downstream: SpanProcessor,
        metrics: StagetraceMetrics,
        settings: Settings,
        resource: Any,
        registry: Any,
        on_verdict: Sequence[Callable[[Verdict], Any]] = (),
    ) -> None:
        self.downstream = downstream
        self.metrics = metrics
        self.settings = settings
        self.resource = resource
        self.registry = registry
        self.on_verdict = list(on_verdict)
        self.gpu: Any = None
        self.on_thread_start: list[Callable[[], None]] = []  # samplers to (re)start with this thread
        self.signal_sources: dict[str, Callable[[TraceRecord, ReadableSpan], dict[str, Any]]] = {}
        self._slow_log = RateLimitedLog(per_interval=settings.slow_log_per_minute, interval_s=60.0)
        self._init_state()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (lambda f: f and f._after_fork())(ref()))

    def _init_state(self) -> None:
        # A deque, not queue.Queue: appends are atomic and wake nobody. The finalizer drains in batches
        # every poll interval while busy, so a request never pays for a thread handoff; only the first
        # submission after an idle spell sets the wake-up event.
        self._items: deque[Any] = deque()
        self._parked: list[tuple[float, Any]] = []  # items waiting for GPU events to complete
        self._wake = threading.Event()
        self._sleeping = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._pid = os.getpid()
        self._stopped = False
        self._last_sweep = time.monotonic()

    def _after_fork(self) -> None:
        # In-flight traces of the parent mean nothing in the child; its thread did not survive the fork.
        self._init_state()
        self.registry.clear()

    # --- submission (request threads) ----------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._pid != os.getpid():
            self._after_fork()
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stagetrace-finalizer", daemon=True)
                self._thread.start()
                for start in self.on_thread_start:
                    try:
                        start()
                    except Exception:
                        report_internal_error("sampler start")

    def _submit(self, item: Any) -> bool:
        if self._thread is None or self._pid != os.getpid():
            if self._stopped:
                return False
            self._ensure_thread()
        if self._stopped:
            return False
        if len(self._items) >= self.settings.queue_size:
            self.metrics.dropped("finalizer_queue_full")
            return False
        self._items.append(item)
        if self._sleeping:
            self._wake.set()
        return True

    def submit_trace(self, trace: TraceRecord, root: ReadableSpan) -> bool:
        """False: not accepted (queue full or stopped); the caller exports the root unchanged."""
        return self._submit((trace, root))

    def submit_lone_stage(self, rec: StageRecord) -> None:
        if not self._submit(rec):
            self.metrics.dropped("lone_stage")

    # --- flush / shutdown ----------------------------------------------------------------------------
    def _idle(self) -> bool:
        return not self._items and not self._busy and not self._parked

    def flush(self, timeout_s: float = 30.0) -> bool:
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout_s
        while not self._idle():
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            self._wake.set()
            time.sleep(0.001)
        return True

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        ok = self.flush(timeout_s)
        self._stopped = True
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._wake.set()
            thread.join(timeout=max(0.1, timeout_s))
        return ok

    # --- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        poll = self.settings.poll_interval_s
        while True:
            if self._items or self._parked:
                self._wake.wait(poll)
            else:
                self._sleeping = True
                if not self._items:  # re-check: a submit may have raced the flag
                    self._wake.wait(self.settings.sweep_interval_s)
                self._sleeping = False
            self._wake.clear()
            self._busy = True
            try:
                items = self._items
                while items:
                    self._handle(items.popleft())
                if self._parked:
                    self._drain_parked(force=self._stopped)
            finally:
                self._busy = False
            if self._stopped and not self._items:
                self._drain_parked(force=True)
                return
            if self.gpu is not None:
                try:
                    self.gpu.tick()
                except Exception:
                    report_internal_error("GPU tick")
            now = time.monotonic()
            if now - self._last_sweep >= self.settings.sweep_interval_s:
                self._last_sweep = now
                self._sweep()

    def _sweep(self) -> None:
        try:
            self.registry.evict_expired()
        except Exception:
            report_internal_error("finalizer sweep")

    def _handle(self, item: Any, force: bool = False) -> None:
        try:
            if not force and not self._gpu_ready(item):
                self._parked.append((time.monotonic(), item))
                return
            if isinstance(item, StageRecord):
                self._process_lone(item)
            else:
                self._process_trace(*item)
        except Exception:
            report_internal_error("finalizer")
            if not isinstance(item, StageRecord):
                self._forward(item[1])

    def _gpu_ready(self, item: Any) -> bool:
        if self.gpu is None:
            return True
        if isinstance(item, StageRecord):
            return self.gpu.ready((item,), None)
        return self.gpu.ready(tuple(item[0].stages), item[1].end_time)

    def _drain_parked(self, force: bool) -> None:
        now = time.monotonic()
        still: list[tuple[float, Any]] = []
        parked, self._parked = self._parked, []
        for since, item in parked:
            expired = now - since > self.settings.gpu_wait_timeout_s
            if force or expired or self._gpu_ready(item):
                if expired and not force:
                    self.metrics.dropped("gpu_event_timeout")
                self._handle(item, force=True)  # forced: never re-parks
            else:
                still.append((since, item))
        self._parked = still

    def _forward(self, span: ReadableSpan) -> None:
        try:
            if self._export_queue_full():
                self.metrics.dropped("export_queue_full")  # the SDK drops it too, with a log line
            self.downstream.on_end(span)
        except Exception:
            report_internal_error("export processor")

    def _forward_stage(
        self, rec: StageRecord, offset: int, flags: Any, state: Any, resource: Any, extra: Any = None
    ) -> None:
        self._forward(
            mat.stage_span(
                rec,
                offset,
                trace_flags=flags,
                trace_state=state,
                resource=resource,
                attributes=mat.stage_attributes(rec, extra),
            )
        )

    def _export_queue_full(self) -> bool:
        """Reads the BatchSpanProcessor's queue (its internals, so guarded): a collector that is down or
        slow fills it, and the spans it then drops should show in stagetrace.dropped."""
        batch = getattr(self.downstream, "_batch_processor", None)
        queue, limit = getattr(batch, "_queue", None), getattr(batch, "_max_queue_size", None)
        return queue is not None and limit is not None and len(queue) >= limit

    def _resolve_gpu(self, stages: list[StageRecord], perf_to_epoch_ns: int) -> None:
        gpu = self.gpu
        if gpu is not None:
            for rec in stages:
                mat.apply_gpu_fields(rec, gpu.resolve(rec, perf_to_epoch_ns))

    def _signals(self, trace: TraceRecord, root: ReadableSpan) -> TraceSignals:
        if not self.signal_sources:
            return TraceSignals()
        fields: dict[str, Any] = {}
        for source in self.signal_sources.values():
            try:
                fields.update(source(trace, root))
            except Exception:
                report_internal_error("trace signals")
        return TraceSignals(**fields)

    def _process_trace(self, trace: TraceRecord, root: ReadableSpan) -> None:
        with trace.lock:
            trace.closed = True
            stages = list(trace.stages)
        offset = trace.perf_to_epoch_ns
        _resolve_cpu(stages)
        self._resolve_gpu(stages, offset)
        attrs = root.attributes or {}
        route = attrs.get(c.HTTP_ROUTE)
        route = route if isinstance(route, str) else None
        # The records are analysed as they are, in perf-counter time: the root moves to that clock.
        root_start, root_end = (root.start_time or 0) - offset, (root.end_time or 0) - offset
        analysis = analyse_trace(root_start, root_end, stages, self.settings.threshold_for(route))
        signals = self._signals(trace, root)
        verdict = build_verdict(
            trace_id=format_trace_id(trace.trace_id),
            root_name=root.name,
            analysis=analysis,
            diagnoses=diagnose(analysis, stages, signals, self.settings.thresholds),
            route=route,
            signals=signals,
            sampled=bool(root.context and root.context.trace_flags.sampled),
        )
        if verdict.sampled:
            flags, state = root.context.trace_flags, root.context.trace_state
            for rec in stages:
                self._forward_stage(rec, offset, flags, state, root.resource)
        self._forward(mat.root_with_verdict(root, verdict, self.settings.record_query_strings))
        self.metrics.record_trace(verdict, exemplar_context(root.context))
        if trace.dropped_stages:
            self.metrics.dropped("stages_per_trace", trace.dropped_stages)
        if verdict.slow:
            self._log_slow(verdict)
        self._notify(verdict)

    def _process_lone(self, rec: StageRecord) -> None:
        """A stage that ended after its trace's root (background work) or in a trace stagetrace does not
        track: exported on its own, counted in the stage metric, not part of any verdict."""
        trace = rec.trace
        offset = trace.perf_to_epoch_ns if trace is not None else rec.perf_to_epoch_ns
        _resolve_cpu((rec,))
        self._resolve_gpu([rec], offset)
        ms = rec.gpu_ms if (rec.kind in c.GPU_KINDS and rec.gpu_ms is not None) else rec.wall_ms
        source = trace if trace is not None else rec  # untracked trace: flags were taken at stage entry
        flags, state = source.trace_flags, source.trace_state
        if flags is not None and flags.sampled:
            self._forward_stage(rec, offset, flags, state, self.resource, {c.LATE: True} if trace else None)
        self.metrics.record_stage(rec.name, rec.kind, ms, None)

    def _log_slow(self, v: Verdict) -> None:
        where = f" {v.route}" if v.route else ""
        bottleneck = (
            f"bottleneck {v.bottleneck} {v.ratio:.0%} ({v.breakdown[v.bottleneck]:.1f} ms)"
            if v.bottleneck
            else "no stages recorded"
        )
        codes = f"; diagnosis {', '.join(v.diagnosis_codes)}" if v.diagnoses else ""
        self._slow_log.log(
            logging.WARNING,
            "slow",
            "stagetrace: slow trace %s%s %.1f ms > %.0f ms; %s%s; trace_id=%s",
            v.root_name,
            where,
            v.total_ms,
            v.slow_threshold_ms,
            bottleneck,
            codes,
            v.trace_id,
        )

    def _notify(self, verdict: Verdict) -> None:
        for callback in self.on_verdict:
            try:
                callback(verdict)
            except Exception:
                report_internal_error(f"on_verdict callback {getattr(callback, '__qualname__', callback)!r}")


__all__ = ["Finalizer", "logger"]
