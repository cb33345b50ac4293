"""The exporter's work on each shipped trace: analysis, diagnosis, the verdict, the keep decision, metrics,
span building and export. The same object runs in the exporter process and, with
``STAGETRACE_EXPORT_PROCESS=off``, on a background thread of the application.

``handle`` takes one message (``common.wire``); a message that does not have the shape of its kind raises
``MalformedRecord`` and changes nothing, so the caller can count it and go on.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from opentelemetry.trace import StatusCode

from stagetrace import conventions as c
from stagetrace._safety import RateLimitedLog, report_internal_error
from stagetrace.analysis import Diagnosis, TraceSignals, Verdict, analyse_trace, build_verdict, diagnose
from stagetrace.analysis.loopwait import blocker_entry, loop_waits, request_arrival
from stagetrace.analysis.model import CompressedInfo
from stagetrace.analysis.offload import offload_calls
from stagetrace.analysis.streams import summarise_stream
from stagetrace.analysis.verdict import judge
from stagetrace.common import wire
from stagetrace.common.cpus import usable_cpus
from stagetrace.common.decimals import round_to
from stagetrace.common.wire import unpack_trace  # (bound: compiled, `wire.name` is a module lookup a trace)
from stagetrace.exporter import signals as sig
from stagetrace.exporter import spans as sp
from stagetrace.exporter.budget import AdjustedCounts, BudgetLimits, ExportBudget, kind_of, own_weight, signature_of
from stagetrace.exporter.diagnosis_budget import CpuClocks, DiagnosisBudget
from stagetrace.exporter.foreign import as_stage_span, foreign_kind, link_enclosing_stages, split_foreign_stages
from stagetrace.exporter.keep import (
    Keep,
    PendingBatches,
    RecentDecisions,
    decide,
    decide_before_diagnosis,
    in_healthy_share,
)
from stagetrace.exporter.metrics import MetricsSink, replay
from stagetrace.exporter.offload import place_offloads
from stagetrace.settings import (
    ARRIVAL_ADJACENT_NS,
    ARRIVAL_LOOKBACK_NS,
    ARRIVAL_UNEXPLAINED_MIN_NS,
    ARRIVAL_WAIT_MIN_NS,
    KEEP_REPEATS,
    LOOP_WAIT_MIN_NS,
    MAX_BLOCKED_BY,
    Settings,
)

# Read for every trace, so bound once: compiled, ``c.NAME`` is a lookup through the module object at each read
# (several hundred instructions) and ``Keep.MEMBER`` one through the enum's metaclass, where a global of this
# module is a cached read.
_BATCH_ID, _HTTP_ROUTE, _GEN_AI_OPERATION, _GEN_AI_REQUEST_MODEL, _DELAYED_REQUESTS = (
    c.BATCH_ID, c.HTTP_ROUTE, c.GEN_AI_OPERATION, c.GEN_AI_REQUEST_MODEL, c.DELAYED_REQUESTS
)  # fmt: skip
_DIAGNOSED, _BUDGET = Keep.DIAGNOSED, Keep.BUDGET


def format_trace_id(trace_id: int) -> str:
    """OpenTelemetry's ``format_trace_id`` (32 lowercase hex digits, for any int as it gives them) through
    ``%``: its ``format(trace_id, "032x")`` parses the spec anew on every call, in interpreted code, once a
    verdict (tests/test_core.py holds the two to each other)."""
    return "%032x" % trace_id  # noqa: UP031 - the point: one C formatting call, no spec parsed in Python


def _errored(root: wire.WireSpan, stages: Sequence[Any], others: Sequence[wire.WireSpan]) -> bool:
    """Did the request fail: its root, a stage or another span of it (loops: compiled, a generator in
    ``any()`` is an object and a resumption an item, on every trace)."""
    if root.status_code == _ERROR:
        return True
    for st in stages:
        if st.error:
            return True
    for span in others:  # noqa: SIM110 - a loop, as above
        if span.status_code == _ERROR:
            return True
    return False


def _delayed_requests(stages: Sequence[Any]) -> int | None:
    """The most other requests any of the trace's own stages held its event loop from (on the stages)."""
    most = None
    for st in stages:  # (a loop: compiled, a stage's fields are C members here, core.pxd)
        attributes = st.attributes
        if attributes:
            n = attributes.get(_DELAYED_REQUESTS)
            if isinstance(n, int) and (most is None or n > most):
                most = n
    return most


def generative(declared: dict[str, Any] | None, root_attributes: dict[str, Any]) -> dict[str, Any] | None:
    """What a request said of the generative model it served: through ``stagetrace.generation()`` or
    ``gen_ai.*`` attributes on its local root (which win); None unless it names an operation or a model."""
    if not declared and _GEN_AI_OPERATION not in root_attributes and _GEN_AI_REQUEST_MODEL not in root_attributes:
        return None  # (nearly every trace of a service that serves no generative model: no scan of its root)
    found = {k: v for k, v in root_attributes.items() if k.startswith("gen_ai.")}
    if declared:
        found = {**declared, **found}
    if c.GEN_AI_OPERATION in found or c.GEN_AI_REQUEST_MODEL in found:
        return found
    return None


def fold_repeated(stages: list[wire.ShippedStage], new_span_id: Callable[[], int]) -> list[wire.ShippedStage]:
    """Stages the exporter adds itself, of one name under one parent (a request's ``event_loop.wait``
    stretches), as the application folds repeated stages: the first ``KEEP_REPEATS`` as they are, the rest
    into a composite (its ``blocked_by`` the union of theirs, bounded) with the slowest kept as the
    example. Many stretches in one request stay one span and count in full."""
    if len(stages) <= KEEP_REPEATS:
        return stages
    kept, rest = stages[:KEEP_REPEATS], stages[KEEP_REPEATS:]
    walls = [st.end_ns - st.start_ns for st in rest]
    first = rest[0]
    composite = wire.ShippedStage.added(
        first.name, first.kind, new_span_id(), first.parent_span_id, first.start_ns, max(st.end_ns for st in rest)
    )
    composite.fold(CompressedInfo(len(rest), sum(walls), min(walls), max(walls)))
    names = [n for st in rest for n in (st.attributes or {}).get(c.BLOCKED_BY, ())]
    composite.attributes = {c.BLOCKED_BY: tuple(dict.fromkeys(names))[:MAX_BLOCKED_BY]}
    slowest = rest[walls.index(max(walls))]
    slowest.example = True
    return [*kept, composite, slowest]


class MalformedRecord(ValueError):
    """A message from the channel that cannot be what its kind says."""


class Outputs(Protocol):
    """Where results go. ``wants_verdicts``: someone listens (``on_verdict``), so build them for it."""

    metrics: MetricsSink
    wants_verdicts: bool

    def export(self, spans: Sequence[wire.WireSpan]) -> None: ...
    def verdict(self, verdict: Verdict) -> None: ...
    def flush(self, timeout_s: float) -> bool: ...


_ERROR = StatusCode.ERROR.value


def thread_clocks() -> CpuClocks:
    """The exporter on a thread of the application (``STAGETRACE_EXPORT_PROCESS=off``): its thread's CPU, and
    the application process's."""
    return CpuClocks(time.thread_time(), time.process_time())


class ExporterCore:
    """``clocks``: the exporter's CPU and the application's so far, for the exporter's CPU budget (the exporter
    process passes its own and its parent's); ``diagnosis_clock_ns``: the CPU clock a diagnosis is timed on."""

    def __init__(
        self,
        settings: Settings,
        outputs: Outputs,
        clocks: Callable[[], CpuClocks] = thread_clocks,
        diagnosis_clock_ns: Callable[[], int] = time.thread_time_ns,
    ) -> None:
        self.settings = settings
        self.outputs = outputs
        self._clocks = clocks
        self._diagnosis_clock_ns = diagnosis_clock_ns
        self.metrics = outputs.metrics
        self.series = {name: sig.LagSeries() for name in sig.SERIES}
        self.loop_blocks = sig.LoopBlockSeries()
        self._gil_wait_bound_ms = None if settings.gil_wait_bound_s is None else settings.gil_wait_bound_s * 1e3
        self.decisions = RecentDecisions()
        self.batches = PendingBatches(self.decisions, settings.batch_keep_wait_s, settings.max_pending_batches)
        self.budget = ExportBudget(BudgetLimits.from_settings(settings), time.monotonic())
        self.adjusted = AdjustedCounts(settings.max_budget_signatures)
        self.diagnosis_budget = DiagnosisBudget(
            settings.exporter_cpu_budget, time.monotonic(), clocks(), max_kinds=settings.max_budget_signatures
        )
        self._new_span_id = random.Random().getrandbits  # ids for spans the exporter adds (link chunks)
        self.handled = 0  # traces, stages and spans handled (acknowledged to the application)
        self._slow_log = RateLimitedLog(per_interval=settings.slow_log_per_minute, interval_s=60.0)
        self._malformed_log = RateLimitedLog(per_interval=5, interval_s=60.0)
        self._last_tick = time.monotonic()
        self.cpus = usable_cpus()  # the application's: the exporter inherits its affinity and cgroup
        self._handlers = {
            wire.TRACE: self._trace,
            wire.LONE_STAGE: self._lone_stage,
            wire.LONE_SPAN: self._lone_span,
            wire.SIGNAL: self._signal,
            wire.LOOP_BLOCKS: self._loop_blocks,
            wire.METRIC: self._metric,
        }

    # --- dispatch -------------------------------------------------------------------------------------
    def handle(self, msg: Any) -> None:
        if not isinstance(msg, tuple) or not msg:
            raise MalformedRecord("a message is a non-empty tuple")
        handler = self._handlers.get(msg[0])
        if handler is None:
            raise MalformedRecord(f"unknown message kind {msg[0]!r}")
        try:
            handler(msg)
        except MalformedRecord:
            raise
        except (ValueError, TypeError, IndexError, KeyError, AttributeError) as e:
            raise MalformedRecord(f"malformed {msg[0]!r} message: {e}") from e

    def handle_or_count(self, msg: Any) -> None:
        """``handle``, with a malformed message skipped, counted and logged (rate-limited)."""
        try:
            self.handle(msg)
        except MalformedRecord as e:
            self.skipped(str(e))

    def skipped(self, reason: str, count: int = 1) -> None:
        self.metrics.dropped("malformed_record", count)
        self._malformed_log.log(
            logging.WARNING, "malformed-record", "stagetrace: skipped a malformed record: %s", reason
        )

    def flush(self, timeout_s: float) -> bool:
        self._export(self.batches.expire(time.monotonic()))
        return self.outputs.flush(timeout_s)

    def finish(self) -> None:
        """Before shutdown: batch traces still waiting for members are decided on what is known, and what the
        rate-limited logs left out is said."""
        self._export(self.batches.expire(time.monotonic(), everything=True))
        self._slow_log.report_suppressed(final=True)
        self._malformed_log.report_suppressed(final=True)

    def tick(self, now: float) -> None:
        """Called often by whoever runs the core (at most once a second does anything): a rate-limited log's
        window that closed with records left out says how many, and the diagnosis budget sets its share for the
        next second."""
        if now - self._last_tick >= 1.0:
            self._last_tick = now
            self._slow_log.report_suppressed()
            self._malformed_log.report_suppressed()
            self.diagnosis_budget.tick(now, self._clocks())

    def _export(self, spans: Sequence[wire.WireSpan]) -> None:
        if spans:
            self.outputs.export(spans)

    # --- traces ---------------------------------------------------------------------------------------
    def _trace(self, msg: tuple[Any, ...]) -> None:
        try:
            t = unpack_trace(msg)
        except ValueError as e:
            raise MalformedRecord(str(e)) from e
        self.handled += 1
        try:
            if len(self.batches):
                self._export(self.batches.expire(time.monotonic()))
            if _BATCH_ID in t.root.attributes:
                self._batch_trace(t)
            else:
                self._analyse_and_export(t)
        except Exception:
            report_internal_error("exporter trace")

    def _analyse_and_export(self, t: wire.ShippedTrace) -> None:
        trace_id, offset, root = t.trace_id, t.offset, t.root
        stages = place_offloads(t.stages, self._new_span_id_nonzero)
        self._resolve_cpu(stages, offset)
        foreign, others = split_foreign_stages(t.others, offset)
        if foreign:
            link_enclosing_stages([*stages, *[st for st, _ in foreign]], [*others, *[span for _, span in foreign]])
        # A composite's slowest occurrence is exported as an example; its time is the composite's already.
        analysed = [st for st in stages if not st.example] + [st for st, _ in foreign]
        attrs = root.attributes
        route = attrs.get(_HTTP_ROUTE)
        route = route if isinstance(route, str) else None
        blocked_by: tuple[str, ...] = ()
        if t.loop_thread and len(self.loop_blocks):
            # A composite's extent runs from its first folded occurrence to its last, gaps included: not time
            # the request was busy (its kept occurrences and its runs on worker threads still are).
            own = [(st.start_ns, st.end_ns) for st in analysed if st.compressed is None]
            own += zip(t.worker_runs[::2], t.worker_runs[1::2])  # the request's code on worker threads
            waits, blocked_by = self._loop_waits(trace_id, t.loop_thread, root, offset, own)
            stages = stages + waits
            analysed = analysed + [w for w in waits if not w.example]  # a folded stretch's example: counted once
        if t.task_created_ns and t.loop_thread:
            root, before = self._wait_before_root(t, root)
            if before is not None:
                stages = [*stages, before]
                analysed = [*analysed, before]
                first = before.attributes.get(c.BLOCKED_BY, ()) if before.attributes else ()
                blocked_by = tuple(dict.fromkeys((*first, *blocked_by)))[:MAX_BLOCKED_BY]
        root_start, root_end = root.start_ns, root.end_ns
        # The stages are in perf-counter time: the root moves to that clock for the analysis.
        analysis = analyse_trace(root_start - offset, root_end - offset, analysed, self.settings.threshold_for(route))
        signals = self._signals(root_start, root_end, t.gpu_utilization, blocked_by)
        if t.stream is not None:
            stream = summarise_stream(root_start - offset, t.stream, analysed, analysis.charged_ms)
            signals = signals._replace(stream=stream)
        judged = judge(analysis, signals.stream, self.settings.stream_thresholds_for(route) if t.stream else None)
        errored = _errored(root, analysed, others)
        share, sampled, now = self.settings.healthy_sample, bool(t.flags & 1), time.monotonic()
        # Diagnosed within the exporter's CPU budget; past it, a share (every trace the budget may keep among it).
        undiagnosed = decide_before_diagnosis(
            sampled=sampled, errored=errored, slow=judged.slow, healthy_share=share, trace_id=trace_id
        )
        kind = kind_of(root.name, route, judged.bottleneck)
        choice = self.diagnosis_budget.choose(kind, trace_id, kept=self.budget.may_admit(undiagnosed, now))
        diagnoses: tuple[Diagnosis, ...] = ()
        diagnosed = choice.diagnosed
        if diagnosed:
            started = self._diagnosis_clock_ns()
            diagnoses = diagnose(analysis, analysed, signals, self.settings.thresholds)
            self.diagnosis_budget.spent(self._diagnosis_clock_ns() - started)
        verdict = build_verdict(
            trace_id=format_trace_id(trace_id),
            root_name=root.name,
            analysis=analysis,
            diagnoses=diagnoses,
            route=route,
            signals=signals,
            sampled=sampled,
            delayed_requests=_delayed_requests(analysed),
            gen_ai=generative(t.gen_ai, attrs),
            offloads=tuple(offload_calls(analysed)),
            judged=judged,
            diagnosis=choice,
        )
        keep = decide(verdict, errored=errored, healthy_share=share, trace_id=trace_id)
        adjusted_count = 1.0
        if keep.kept:
            signature = signature_of(verdict.root_name, route, verdict.bottleneck, verdict.diagnosis_codes)
            # kept for its diagnoses, it stands for the traces its chance of being diagnosed stood for too
            weight = own_weight(keep, share) * (choice.weight if keep is _DIAGNOSED else 1.0)
            stratum = (kind, keep)
            # a trace left undiagnosed is never kept: it was one the budget had no token for
            keep = self.budget.admit(keep, signature, judged.slowness, now) if diagnosed else _BUDGET
            if keep is _BUDGET:
                self.metrics.dropped("budget")
                self.adjusted.left_out(stratum, weight)
            else:
                adjusted_count = self.adjusted.kept(stratum, weight)
        kept = keep.kept
        self.decisions.remember(trace_id, kept=kept)
        self._export(self.batches.member_decided(trace_id, kept=kept))
        self.metrics.record_trace(verdict, (trace_id, root.span_id) if kept else None)
        if t.dropped_stages:
            self.metrics.dropped("stages_per_trace", t.dropped_stages)
        if kept:
            # Stages that started after the root ended (work after the response) are marked late.
            late = {id(st) for st, charged in zip(analysed, analysis.charged_ms) if charged is None}
            marks = {c.LATE: True}
            out = [
                sp.stage_span(st, trace_id, offset, t.flags, t.state, marks if id(st) in late else None)
                for st in stages
            ]
            out.extend([as_stage_span(span, st.kind, marks if id(st) in late else None) for st, span in foreign])
            out.extend(others)
            out.append(
                sp.root_with_verdict(
                    root,
                    verdict,
                    keep_query_strings=self.settings.record_query_strings,
                    extra={c.SAMPLING_ADJUSTED_COUNT: round_to(adjusted_count, 6)},
                )
            )
            self.outputs.export(out)
        if verdict.slow:
            self._log_slow(verdict)
        if self.outputs.wants_verdicts:
            self.outputs.verdict(verdict)

    def _batch_trace(self, t: wire.ShippedTrace) -> None:
        """A batch's own trace: the batch span (linked to every member) and the stages run once. Its
        metrics are the batch's size and fill; the stages' time is charged in the members' traces, and
        it gets no verdict of its own. Exported when any member's trace is."""
        trace_id, root = t.trace_id, t.root
        attrs = root.attributes
        size = attrs.get(c.BATCH_SIZE)
        fill = attrs.get(c.BATCH_FILL)
        self.metrics.record_batch(
            root.name,
            size if isinstance(size, int) else 0,
            float(fill) if isinstance(fill, (int, float)) else None,
        )
        if not t.flags & 1:
            self.decisions.remember(trace_id, kept=False)
            return
        stages = place_offloads(t.stages, self._new_span_id_nonzero)
        self._resolve_cpu(stages, t.offset)
        out = [sp.stage_span(st, trace_id, t.offset, t.flags, t.state) for st in stages]
        out.extend(t.others)
        out.extend(sp.batch_spans(root, self._new_span_id_nonzero))
        errored = root.status_code == _ERROR or any(st.error for st in t.stages)
        if errored:
            self.decisions.remember(trace_id, kept=True)
            self._export(out)
            return
        members = [link[0] for link in root.links]
        fallback = in_healthy_share(trace_id, self.settings.healthy_sample)
        self._export(self.batches.offer(trace_id, members, out, time.monotonic(), fallback=fallback))

    def _new_span_id_nonzero(self) -> int:
        return self._new_span_id(64) or 1

    def _loop_waits(
        self, trace_id: int, thread: int, root: wire.WireSpan, offset: int, own: list[tuple[int, int]]
    ) -> tuple[list[wire.ShippedStage], tuple[str, ...]]:
        """The request's ``event_loop.wait`` stages (perf-counter time, children of the root), and the
        stages that held its loop meanwhile, longest first: ``"<stage> <trace id>"``. ``own``: the
        intervals the request was busy itself (its stages, its runs on worker threads)."""
        window = (root.start_ns - offset, root.end_ns - offset)
        blocks = self.loop_blocks.overlapping(thread, window[0], window[1])
        waits = loop_waits(window, own, blocks, trace_id, min_ns=LOOP_WAIT_MIN_NS)
        held: dict[str, int] = {}
        out = []
        for w in waits:
            names = []
            for name, blocker, ns in w.blockers:
                key = blocker_entry(name, format_trace_id(blocker))
                held[key] = held.get(key, 0) + ns
                names.append(key)
            wait = wire.ShippedStage.added(
                c.EVENT_LOOP_WAIT, "wait", self._new_span_id_nonzero(), root.span_id, w.start_ns, w.end_ns
            )
            wait.attributes = {c.BLOCKED_BY: tuple(names[:MAX_BLOCKED_BY])}
            out.append(wait)
        ranked = sorted(held, key=lambda k: -held[k])
        return fold_repeated(out, self._new_span_id_nonzero), tuple(ranked[:MAX_BLOCKED_BY])

    def _wait_before_root(
        self, t: wire.ShippedTrace, root: wire.WireSpan
    ) -> tuple[wire.WireSpan, wire.ShippedStage | None]:
        """The wait between the request's arrival and its server span, as an ``event_loop.wait`` stage, and
        the root moved back to the arrival (the framework's start and the shift kept as attributes); or the
        root unchanged, with the bound of an arrival that cannot be placed."""
        offset = t.offset
        framework_start = root.start_ns - offset
        # The blocks that can matter: from the bytes' arrival (or the task's creation) on, and those that
        # ended up to a second before it, which may bound an arrival that cannot be read.
        earliest = t.task_created_ns - max(t.received_ms_ago, 0) * 1_000_000 - ARRIVAL_LOOKBACK_NS
        blocks = self.loop_blocks.overlapping(t.loop_thread, earliest, framework_start)
        arrival = request_arrival(
            t.task_created_ns, t.received_ms_ago, blocks, t.trace_id, adjacent_ns=ARRIVAL_ADJACENT_NS
        )
        # (the root's attributes copied only where something is added: most traces keep their root as it is)
        attributes, bound = root.attributes, arrival.bound_ns
        if bound is not None:
            attributes = {**attributes, c.LOOP_ARRIVAL_BOUND_MS: round_to(bound / 1e6, 3)}
        unchanged = root if bound is None else wire.replace_span(root, attributes=attributes)
        if framework_start - arrival.start_ns < ARRIVAL_WAIT_MIN_NS:
            return unchanged, None
        waits = loop_waits((arrival.start_ns, framework_start), (), blocks, t.trace_id)
        held: dict[str, int] = {}
        for w in waits:
            for name, blocker, ns in w.blockers:
                key = blocker_entry(name, format_trace_id(blocker))
                held[key] = held.get(key, 0) + ns
        names = tuple(sorted(held, key=lambda k: -held[k])[:MAX_BLOCKED_BY])
        if not names and framework_start - arrival.start_ns < ARRIVAL_UNEXPLAINED_MIN_NS:
            return unchanged, None
        before = wire.ShippedStage.added(
            c.EVENT_LOOP_WAIT,
            "wait",
            self._new_span_id_nonzero(),
            root.span_id,
            arrival.start_ns,
            framework_start,
        )
        before.attributes = {c.BLOCKED_BY: names} if names else None
        attributes = {
            **attributes,
            c.ROOT_SHIFTED_MS: round_to((framework_start - arrival.start_ns) / 1e6, 3),
            c.ROOT_FRAMEWORK_START_NS: root.start_ns,
        }
        return wire.replace_span(root, start_ns=arrival.start_ns + offset, attributes=attributes), before

    def _resolve_cpu(self, stages: Sequence[wire.ShippedStage], offset: int) -> None:
        sig.resolve_stages(stages, self.series, offset, self._gil_wait_bound_ms, self.settings.thresholds)

    def _signals(
        self, start_ns: int, end_ns: int, gpu_utilization: float | None, blocked_by: tuple[str, ...] = ()
    ) -> TraceSignals:
        period_s = self.settings.gil_sampler_period_s or 0.01
        return sig.trace_signals(
            self.series, start_ns, end_ns, period_s, self._gil_wait_bound_ms, self.cpus, gpu_utilization, blocked_by
        )

    # --- stages and spans outside a held trace --------------------------------------------------------
    def _lone_stage(self, msg: tuple[Any, ...]) -> None:
        """A stage that ended after its trace's root (work after the response) or in a trace whose root
        stagetrace does not hold: counted in the stage metric, exported if its trace is kept, in no verdict."""
        _, trace_id, flags, state, offset, late, fields = msg
        st = wire.ShippedStage(fields)
        if not isinstance(trace_id, int) or not isinstance(offset, int) or not isinstance(flags, int):
            raise MalformedRecord("malformed stage header")
        self.handled += 1
        self._resolve_cpu([st], offset)
        # Started after its trace's root ended here (the trace was decided): work after the response.
        late = late or self.decisions.known(trace_id) is not None
        ms = st.gpu_ms if st.kind in c.GPU_KINDS and st.gpu_ms is not None else st.wall_ms
        self.metrics.record_stage(st.name, st.kind, ms, None)
        if flags & 1 and self.decisions.kept(trace_id):
            self.outputs.export([sp.stage_span(st, trace_id, offset, flags, state, {c.LATE: True} if late else None)])

    def _lone_span(self, msg: tuple[Any, ...]) -> None:
        """A span of a trace whose local root stagetrace is not holding (it ended, or is elsewhere); one read
        as a stage (FastAPI's background task, after the response) is a late stage: counted in the stage
        metric, exported marked ``stagetrace.late``, in no verdict."""
        span = wire.check_span(msg[1])
        self.handled += 1
        kind = foreign_kind(span)
        if kind is not None:
            self.metrics.record_stage(span.name, kind, (span.end_ns - span.start_ns) / 1e6, None)
            span = as_stage_span(span, kind, {c.LATE: True})
        if self.decisions.kept(span.trace_id):
            self.outputs.export([span])

    # --- application-side measurements ------------------------------------------------------------------
    def _signal(self, msg: tuple[Any, ...]) -> None:
        _, name, flat = msg
        series = self.series.get(name)
        if series is None or not isinstance(flat, tuple):
            raise MalformedRecord(f"unknown signal series {name!r}")
        series.extend_flat(flat)

    def _loop_blocks(self, msg: tuple[Any, ...]) -> None:
        _, blocks = msg
        if not isinstance(blocks, tuple):
            raise MalformedRecord("loop blocks are a tuple")
        self.loop_blocks.extend(blocks)

    def _metric(self, msg: tuple[Any, ...]) -> None:
        _, calls = msg
        replay(self.metrics, [(str(m), tuple(a)) for m, a in calls])

    def _log_slow(self, v: Verdict) -> None:
        """One line a slow trace: what made it slow (its duration, or a stream's first chunk or gaps), its
        headline and its diagnoses."""
        where = f" {v.route}" if v.route else ""
        stream = v.stream
        if v.slow_reason == c.SLOW_FIRST_CHUNK and stream is not None:
            what = f"slow stream %s%s: first chunk {stream.first_chunk_ms:.1f} ms > {v.first_chunk_threshold_ms:.0f} ms"
            headline_ms = stream.first_chunk_breakdown.get(v.bottleneck or "", 0.0)
        elif v.slow_reason == c.SLOW_GAP and stream is not None:
            what = f"slow stream %s%s: gaps p99 {stream.gap_p99_ms or 0.0:.1f} ms > {v.gap_threshold_ms:.0f} ms"
            headline_ms = stream.gap_breakdown.get(v.bottleneck or "", 0.0)
        else:
            what = f"slow trace %s%s {v.total_ms:.1f} ms > {v.slow_threshold_ms:.0f} ms"
            headline_ms = v.bottleneck_ms
        bottleneck = (
            f"bottleneck {v.bottleneck} {v.ratio:.0%} ({headline_ms:.1f} ms)" if v.bottleneck else "no stages recorded"
        )
        codes = f"; diagnosis {', '.join(v.diagnosis_codes)}" if v.diagnoses else ""
        self._slow_log.log(
            logging.WARNING,
            "slow-trace",
            f"stagetrace: {what}; %s%s; trace_id=%s",
            v.root_name,
            where,
            bottleneck,
            codes,
            v.trace_id,
        )
