"""The application's helper thread: takes finished traces from request threads, waits (without ever
synchronising) for their CUDA events, packs them into wire records and hands them to the exporter in one
batch per poll interval.

Request threads only append to a deque: appends are atomic and wake nobody. The helper drains it every
poll interval while busy and sleeps when idle, so a request never pays for a thread hand-off; only the
first submission after an idle spell sets the wake-up event. The deque is bounded: a full one drops the
trace and counts it, it never blocks a request.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from opentelemetry.sdk.trace import ReadableSpan

from stagetrace._safety import at_fork_in_child, report_internal_error
from stagetrace.capture.light_spans import LightSpan
from stagetrace.capture.records import StageRecord, TraceRecord, pack_stage_record, pack_stages
from stagetrace.common import wire
from stagetrace.common.wire import flatten
from stagetrace.exporter.metrics import MetricsRecorder
from stagetrace.handoff import fanout
from stagetrace.settings import FLUSH_POLL_S, SIGNALS_WAIT_S, Settings

DATA_KINDS = frozenset({wire.TRACE, wire.LONE_STAGE, wire.LONE_SPAN})


class Transport(Protocol):
    """Carries batches of wire messages to the exporter and brings its results back."""

    def send(self, messages: list[tuple[Any, ...]]) -> None: ...
    def poll(self) -> None: ...
    def close(self, timeout_s: float) -> bool: ...


class SampleSource(Protocol):
    def drain(self) -> list[tuple[int, float]]: ...


class BlockSource(Protocol):
    def drain(self) -> list[tuple[int, int, int, int, str]]: ...


class GpuHooks(Protocol):
    """The helper thread's side of GPU support (``gpu.GpuSupport``): readiness of CUDA events (a query,
    never a wait), turning them into numbers, discarding those never read, and periodic work."""

    @property
    def in_use(self) -> bool: ...  # CUDA events recorded at least once: else nothing to do for any trace

    def ready(self, stages: Any, end_epoch_ns: int | None) -> bool: ...
    def apply(self, rec: Any, perf_to_epoch_ns: int, not_after_ns: int | None = None) -> None: ...
    def forget(self, rec: Any) -> None: ...
    def tick(self) -> None: ...
    def trace_utilization(self, start_epoch_ns: int, end_epoch_ns: int) -> float | None: ...


class _FlushMarker:
    __slots__ = ("done", "ok", "seq", "timeout_s")

    def __init__(self, seq: int, timeout_s: float) -> None:
        self.seq = seq
        self.timeout_s = timeout_s
        self.done = threading.Event()
        self.ok = False


class _LoneSpan:
    __slots__ = ("span",)

    def __init__(self, span: ReadableSpan) -> None:
        self.span = span


def pack_any_span(span: Any) -> tuple[Any, ...]:
    """An SDK span or a light span (``capture/light_spans.py``) as its wire tuple."""
    return span.wire_tuple() if type(span) is LightSpan else wire.pack_span(span)


def resolve_gpu_once(gpu: GpuHooks, rec: Any, offset: int, not_after_ns: int | None = None) -> None:
    """Turn a stage's CUDA events and NVML window into numbers, once: a batch's stage is shipped with its
    own trace and with every member's (as views, resolved on their source with the batch's clock offset)."""
    if type(rec) is fanout.MemberView:
        rec, offset, not_after_ns = rec.source, rec.source_offset, None
    if type(rec) is StageRecord and not rec.gpu_resolved:
        rec.gpu_resolved = True
        gpu.apply(rec, offset, not_after_ns)


class Shipper:
    """``gpu`` (optional, set by GPU support) says whether a stage's CUDA events completed (``ready``,
    never blocking), turns them into numbers (``apply``) and does periodic work on this thread (``tick``)."""

    def __init__(
        self,
        *,
        settings: Settings,
        transport_factory: Callable[[Shipper], Transport],
        app_metrics: MetricsRecorder,
        registry: Any,
        signal_sources: Mapping[str, SampleSource] = {},
        loop_blocks: BlockSource | None = None,
        before_signals: Callable[[], None] | None = None,
        signals_cover: Callable[[int], bool] | None = None,
    ) -> None:
        self.settings = settings
        # Called before the signals are drained in a cycle that ships traces: a sampler's reading taken then
        # is later than every one of their stages (``GilPressureMonitor.note_process_totals``).
        self.before_signals = before_signals
        # Whether the samplers' readings reach an epoch time (``GilPressureMonitor.covers``): a trace whose end
        # they do not reach yet waits for them, up to SIGNALS_WAIT_S, with everything submitted after it.
        self.signals_cover = signals_cover
        self._transport_factory = transport_factory
        self.app_metrics = app_metrics
        self.registry = registry
        self.signal_sources = dict(signal_sources)
        self.loop_blocks = loop_blocks
        self.gpu: GpuHooks | None = None
        self.on_thread_start: list[Callable[[], None]] = []  # samplers to (re)start with this thread
        self._seq = itertools.count(1)
        self._init_state()
        at_fork_in_child(self, "_after_fork")

    def _init_state(self) -> None:
        self._items: deque[Any] = deque()
        self._parked: list[tuple[float, Any]] = []  # traces waiting for their CUDA events
        self._gate: deque[tuple[float, Any]] = deque()  # items behind a trace waiting for the samplers' readings
        self._flushes: list[_FlushMarker] = []  # flush requests waiting for the parked traces before them
        self._sent_flushes: dict[int, _FlushMarker] = {}
        # every flush not answered yet, wherever it is (the hand-off queue, the gate, behind parked traces, sent):
        # while one waits the thread looks often, so a flush costs no poll interval (a set: any thread adds)
        self._awaited: set[_FlushMarker] = set()
        self._wake = threading.Event()
        self._sleeping = False
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stopped = False
        self._last_sweep = time.monotonic()
        self.transport: Transport | None = None

    def _after_fork(self) -> None:
        # The parent's traces in flight mean nothing here, its thread did not survive the fork, and its
        # exporter belongs to the parent: this process gets its own on first use.
        self._init_state()
        self.registry.clear()

    # --- submission (request threads) ----------------------------------------------------------------
    def start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._stopped:
                if self.transport is None:
                    self.transport = self._transport_factory(self)
                self._thread = threading.Thread(target=self._run, name="stagetrace-shipper", daemon=True)
                self._thread.start()
                for start in self.on_thread_start:
                    try:
                        start()
                    except Exception:
                        report_internal_error("sampler start")

    def _submit(self, item: Any) -> bool:
        if self._thread is None and not self._stopped:  # not started yet, or forked (the at-fork hook reset it)
            self.start()
        if self._stopped:
            self.forget_gpu(item)
            return False
        if len(self._items) >= self.settings.queue_size:
            self.app_metrics.dropped("handoff_queue_full")
            self.forget_gpu(item)
            return False
        self._items.append(item)
        if self._sleeping:
            self._wake.set()
        return True

    def submit_trace(self, trace: TraceRecord, root: ReadableSpan) -> bool:
        return self._submit((trace, root))

    def submit_lone_stage(self, rec: StageRecord) -> None:
        self._submit(rec)

    def submit_lone_span(self, span: ReadableSpan) -> None:
        self._submit(_LoneSpan(span))

    # --- flush / shutdown ----------------------------------------------------------------------------
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Everything submitted before the call analysed, exported and its results delivered."""
        if self._thread is None or self._stopped:
            return True
        marker = _FlushMarker(next(self._seq), timeout_s)
        self._awaited.add(marker)
        self._items.append(marker)
        self._wake.set()
        answered = marker.done.wait(timeout_s)
        self._awaited.discard(marker)
        return answered and marker.ok

    def flushed(self, seq: int, *, ok: bool) -> None:
        """The transport's answer to a flush marker."""
        marker = self._sent_flushes.pop(seq, None)
        if marker is not None:
            marker.ok = ok
            marker.done.set()

    def abandon_flushes(self) -> None:
        """The exporter died with flushes unanswered: they fail now rather than at their timeout."""
        for seq in list(self._sent_flushes):
            self.flushed(seq, ok=False)

    def stand_down(self) -> None:
        """Ship nothing from now on, without closing anything: this process is a pool worker forked from the
        configured one, whose exporter and pipes are not its own."""
        self._stopped = True
        self._items.clear()

    def shutdown(self, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        ok = self.flush(timeout_s)
        self._stopped = True
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._wake.set()
            thread.join(timeout=max(0.1, deadline - time.monotonic()))
        transport = self.transport
        if transport is not None:
            ok = transport.close(max(0.5, deadline - time.monotonic())) and ok
        return ok

    # --- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        poll = self.settings.poll_interval_s
        while True:
            if self._awaited:
                self._wake.wait(FLUSH_POLL_S)  # someone waits for a flush: look for what holds it up often
            elif self._items or self._parked or self._gate:
                self._wake.wait(poll)
            else:
                self._sleeping = True
                if not self._items:  # re-check: a submit may have raced the flag
                    self._wake.wait(min(poll * 10, self.settings.sweep_interval_s))
                self._sleeping = False
            self._wake.clear()
            try:
                self._cycle(final=self._stopped)
            except Exception:
                report_internal_error("shipper")
            if self._stopped and not self._items:
                return

    def _cycle(self, *, final: bool = False) -> None:
        # Take the submitted items first, then drain the signals: whatever a trace was judged against (a
        # sample, a stage that held its loop) happened before its root ended, so it is in this drain and
        # goes ahead of the trace in the same send.
        items = self._items
        taken = []
        while items:
            taken.append(items.popleft())
        if self.signals_cover is not None:
            taken = self._through_gate(taken, final)
        messages: list[tuple[Any, ...]] = []
        if taken and self.before_signals is not None:
            try:
                self.before_signals()
            except Exception:
                report_internal_error("a sampler's reading before shipping")
        for name, source in self.signal_sources.items():
            samples = source.drain()
            if samples:
                messages.append((wire.SIGNAL, name, flatten(samples)))
        if self.loop_blocks is not None:
            blocks = self.loop_blocks.drain()
            if blocks:
                messages.append((wire.LOOP_BLOCKS, tuple(blocks)))
        self._pack_taken(taken, messages)  # (it empties the list: nothing of a record outlives its packing here)
        if self._parked:
            self._drain_parked(messages, force=final)
        calls = self.app_metrics.take()
        if calls:
            messages.append((wire.METRIC, tuple(calls)))
        if self._flushes and not self._parked and not self._gate:
            for marker in self._flushes:
                self._sent_flushes[marker.seq] = marker
                messages.append((wire.FLUSH, marker.seq, marker.timeout_s))
            self._flushes = []
        transport = self.transport
        if transport is not None:
            if messages:
                transport.send(messages)
            transport.poll()
        self._periodic()

    def _pack_taken(self, taken: list[Any], messages: list[tuple[Any, ...]]) -> None:
        """Packs ``taken``, emptying it as it goes: each trace's records are freed as soon as it is packed."""
        taken.reverse()
        while taken:
            item = taken.pop()
            if isinstance(item, _FlushMarker):
                self._flushes.append(item)
            elif not self._gpu_ready(item):
                self._parked.append((time.monotonic(), item))
            else:
                self._pack_into(messages, item)

    def _periodic(self) -> None:
        if self.gpu is not None:
            try:
                self.gpu.tick()
            except Exception:
                report_internal_error("GPU tick")
        now = time.monotonic()
        if now - self._last_sweep >= self.settings.sweep_interval_s:
            self._last_sweep = now
            try:
                for trace in self.registry.evict_expired():
                    self.forget_gpu((trace, None))
            except Exception:
                report_internal_error("registry sweep")

    # --- waiting for the samplers ------------------------------------------------------------------------
    def _through_gate(self, taken: list[Any], final: bool) -> list[Any]:
        """The items that may go now, in the order they came: all of them, up to the first trace whose end the
        samplers' readings do not reach yet (it and what follows wait, each at most SIGNALS_WAIT_S, and no more
        of them than the hand-off queue holds)."""
        gate = self._gate
        if not gate and not taken:
            return taken
        now = time.monotonic()
        gate.extend((now, item) for item in taken)
        out = []
        cover: Any = self.signals_cover
        full = self.settings.queue_size
        while gate:
            since, item = gate[0]
            waits = not final and len(gate) <= full and now - since < SIGNALS_WAIT_S
            if waits and type(item) is tuple and not cover(item[1].end_time):
                break
            gate.popleft()
            out.append(item)
        return out

    # --- GPU readiness ---------------------------------------------------------------------------------
    def _gpu_ready(self, item: Any) -> bool:
        gpu = self.gpu
        if gpu is None or not gpu.in_use or isinstance(item, _LoneSpan):
            return True
        if isinstance(item, StageRecord):
            return gpu.ready((item,), None)
        trace = item[0]
        stages = tuple(trace.stages)
        if trace.memberships:
            stages += tuple(fanout.gpu_sources(trace))
        return gpu.ready(stages, item[1].end_time)

    def _drain_parked(self, messages: list[tuple[Any, ...]], *, force: bool) -> None:
        """Ship the parked traces whose events completed. One that waited past ``gpu_wait_timeout_s``, or the
        oldest ones past ``max_parked`` waiting, go as they are (their unread events are discarded and their
        GPU stages keep wall time), counted."""
        now = time.monotonic()
        still: list[tuple[float, Any]] = []
        overflow = len(self._parked) - self.settings.max_parked
        for since, item in self._parked:
            if force or self._gpu_ready(item):
                self._pack_into(messages, item)
            elif now - since > self.settings.gpu_wait_timeout_s or overflow > 0:
                self.app_metrics.dropped("gpu_event_timeout" if overflow <= 0 else "gpu_parked_full")
                overflow -= 1
                self._pack_into(messages, item)
            else:
                still.append((since, item))
        self._parked = still

    def forget_gpu(self, item: Any) -> None:
        """Discard the CUDA events of what is dropped before it was shipped, so that the pool stays whole."""
        gpu = self.gpu
        if gpu is None or not gpu.in_use or isinstance(item, (_LoneSpan, _FlushMarker)):
            return
        try:
            stages = [item] if isinstance(item, StageRecord) else list(item[0].stages)
            for rec in stages:
                gpu.forget(rec)
        except Exception:
            report_internal_error("discarding CUDA events")

    # --- packing ---------------------------------------------------------------------------------------
    def _pack_into(self, messages: list[tuple[Any, ...]], item: Any) -> None:
        try:
            if type(item) is tuple:  # a trace and its root, nearly every item (isinstance of a span is an ABC's)
                messages.append(self._pack_trace(*item))
            elif isinstance(item, StageRecord):
                messages.append(self._pack_lone_stage(item))
            elif isinstance(item, _LoneSpan):
                messages.append((wire.LONE_SPAN, pack_any_span(item.span)))
            else:
                raise TypeError(f"nothing to pack in a {type(item).__name__}")
        except Exception:
            report_internal_error("packing a trace")
            if isinstance(item, tuple):  # the root alone, unchanged, rather than nothing
                try:
                    messages.append((wire.LONE_SPAN, pack_any_span(item[1])))
                    return
                except Exception:
                    report_internal_error("packing a root")
            self.app_metrics.dropped("unpackable")

    def _pack_trace(self, trace: TraceRecord, root: ReadableSpan) -> tuple[Any, ...]:
        with trace.lock:
            trace.closed = True  # from here on nothing adds to its lists: they are read without a copy
        stages = trace.stages
        tickets = trace.memberships
        offset = trace.perf_to_epoch_ns
        if tickets:
            stages = [*stages, *fanout.member_stages(tickets, (root.end_time or 0) - offset, self._ticket_unused)]
        gpu_utilization = None
        gpu = self.gpu
        if gpu is not None and gpu.in_use:
            root_end_perf = (root.end_time or 0) - offset
            for rec in stages:
                resolve_gpu_once(gpu, rec, offset, root_end_perf)
            gpu_utilization = gpu.trace_utilization(root.start_time or 0, root.end_time or 0)
        if type(root) is LightSpan:  # its flags and state as they are, no SpanContext made for them
            flags, state = root.trace_flags, root.trace_state
        else:
            ctx = root.context
            flags, state = ctx.trace_flags, ctx.trace_state
        packed_root = pack_any_span(root)
        if trace.batch is not None:
            packed_root = wire.with_links(packed_root, tuple(wire.member_link(*m) for m in trace.batch.members))
        task_created_ns, received_ms_ago = trace.arrival or (0, -1)
        pack = fanout.pack_member_stage if tickets else pack_stage_record
        worker_runs = trace.worker_runs
        message = wire.trace_message(
            trace_id=trace.trace_id,
            flags=flags & wire.FLAGS_MASK,
            state=wire.trace_state_header(state),
            offset=offset,
            dropped_stages=trace.dropped_stages,
            gpu_utilization=gpu_utilization,
            root=packed_root,
            stages=pack_stages(stages, pack),
            others=tuple(map(pack_any_span, trace.others)),
            loop_thread=trace.loop_thread,
            worker_runs=tuple(worker_runs) if worker_runs else (),
            task_created_ns=task_created_ns,
            received_ms_ago=received_ms_ago,
            stream=trace.stream.packed() if trace.stream is not None else None,
            gen_ai=trace.gen_ai,
        )
        if trace.batch is None:  # (a batch's own trace: the traces it served read its stages when they ship)
            # Its records point back at it (a stage's and a span's ``trace``): held in its lists, they form a
            # cycle that only the garbage collector frees, in passes over every record of the traces in flight.
            # Closed, the lists are read by nobody: emptied, the records go as soon as nothing else holds them.
            trace.stages.clear()
            trace.others.clear()
        return message

    def _ticket_unused(self) -> None:
        self.app_metrics.dropped("batch_ticket_unused")

    def _pack_lone_stage(self, rec: StageRecord) -> tuple[Any, ...]:
        trace = rec.trace
        offset = trace.perf_to_epoch_ns if trace is not None else rec.perf_to_epoch_ns
        if self.gpu is not None and self.gpu.in_use:
            resolve_gpu_once(self.gpu, rec, offset)
        source: Any = trace if trace is not None else rec  # untracked trace: flags were taken at stage entry
        flags = source.trace_flags
        return (
            wire.LONE_STAGE,
            rec.trace_id,
            flags & wire.FLAGS_MASK if flags is not None else 0,
            wire.trace_state_header(source.trace_state),
            offset,
            trace is not None,
            pack_stage_record(rec),
        )
