"""The contract's metrics, recorded for every request whether or not its trace was sampled or kept: the
instruments (``INSTRUMENTS``, one table), which attributes each event gives them (``ContractMetrics``; values
stay low-cardinality: stage names are capped, the overflow counted), and the SDK's instruments as one way
of aggregating them (``exporter/aggregation.py`` is the other, used wherever stagetrace built the readers).

Every call takes plain values (the exemplar as trace and span ids), so that the same calls can be replayed
in the application for metric readers that live there (``MetricsRecorder``)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry.context import Context
from opentelemetry.metrics import Meter
from opentelemetry.trace import INVALID_SPAN, NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from stagetrace import conventions as c
from stagetrace.analysis import Verdict
from stagetrace.analysis.offload import OffloadedCall
from stagetrace.analysis.streams import GapHistogram, StreamSummary
from stagetrace.conventions import BYTE_BUCKETS, MS_BUCKETS

OVERFLOW_STAGE = "_other"
# A context whose span is the invalid one, so that the SDK's exemplar filter finds no span at once. Not an
# empty Context: that is falsy, and the SDK's instruments then read the thread's current context instead
# (``context or get_current()``), where a span of the application may be current.
_NO_SPAN = set_span_in_context(INVALID_SPAN)


SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FILL_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)

Exemplar = tuple[int, int]  # (trace id, span id) of a kept trace's root
Key = tuple[tuple[str, Any], ...]  # a point's attributes as (name, value) pairs, hashable
_HEALTHY: Key = ((c.SLOW, False),)  # a trace's duration point when it was not slow (a slow one says why)
# (bound once, read for every trace: compiled, ``c.NAME`` is a lookup through the module object at each read)
_SLOW_TOTAL, _UNTRACKED, _STAGE, _DIAGNOSIS_CODE = c.SLOW_TOTAL, c.UNTRACKED, c.STAGE, c.DIAGNOSIS_CODE


@dataclass(frozen=True, eq=False)
class Instrument:
    """One metric of the contract: the single description that both ways of aggregating it read. Each is one
    constant, compared and hashed by identity: a store finds its points by the instrument at every observation
    (the generated hash of five fields would run Python code there)."""

    name: str
    kind: str  # "histogram", "counter" or "gauge"
    unit: str
    description: str
    buckets: tuple[float, ...] = ()


Observation = tuple[Instrument, Key, float, "Exemplar | None"]  # a histogram's value, with its exemplar
Addition = tuple[Instrument, Key, float]  # a counter's increment (an int where it counts traces one by one)
Merge = tuple[Instrument, Key, GapHistogram]  # many values at once, counted on the instrument's own buckets


STAGE_DURATION = Instrument(
    c.METRIC_STAGE_DURATION,
    "histogram",
    "ms",
    "Time charged to a pipeline stage per request (exclusive wall, or GPU)",
    MS_BUCKETS,
)
TRACE_DURATION = Instrument(c.METRIC_TRACE_DURATION, "histogram", "ms", "Duration of a trace's local root", MS_BUCKETS)
BOTTLENECK = Instrument(c.METRIC_BOTTLENECK, "counter", "{trace}", "Traces whose bottleneck was this stage")
DIAGNOSIS = Instrument(
    c.METRIC_DIAGNOSIS,
    "counter",
    "{trace}",
    "Traces on which a diagnosis rule fired (each diagnosed trace adds what it stands for: 1 / its chance of "
    "being diagnosed)",
)
TRACES_DIAGNOSED = Instrument(
    c.METRIC_TRACES_DIAGNOSED, "counter", "{trace}", "Traces the diagnosis rules ran on (all of them within budget)"
)
DROPPED = Instrument(c.METRIC_DROPPED, "counter", "{item}", "Items stagetrace dropped to stay within its bounds")
GPU_UTILIZATION = Instrument(c.METRIC_GPU_UTILIZATION, "gauge", "1", "GPU utilisation sampled through NVML")
BATCH_SIZE = Instrument(
    c.METRIC_BATCH_SIZE,
    "histogram",
    "{request}",
    "Requests served by one execution of a dynamic batcher",
    SIZE_BUCKETS,
)
BATCH_FILL = Instrument(
    c.METRIC_BATCH_FILL, "histogram", "1", "Items in a batch over the batcher's max size", FILL_BUCKETS
)
STREAM_FIRST_CHUNK = Instrument(
    c.METRIC_STREAM_FIRST_CHUNK, "histogram", "ms", "A streamed response's time to its first chunk", MS_BUCKETS
)
STREAM_CHUNK_GAP = Instrument(
    c.METRIC_STREAM_CHUNK_GAP, "histogram", "ms", "Time between consecutive chunks of a streamed response", MS_BUCKETS
)
OFFLOAD_QUEUE = Instrument(
    c.METRIC_OFFLOAD_QUEUE,
    "histogram",
    "ms",
    "A call handed to a process pool: its wait for a worker (offload.queue)",
    MS_BUCKETS,
)
OFFLOAD_TRANSFER = Instrument(
    c.METRIC_OFFLOAD_TRANSFER,
    "histogram",
    "By",
    "A call handed to a process pool: its arguments' (send) or result's (return) pickled size",
    BYTE_BUCKETS,
)
GEN_AI_TTFT = Instrument(
    c.METRIC_GEN_AI_TTFT,
    "histogram",
    "s",
    "Time to generate first token for successful responses",
    c.GEN_AI_TTFT_BUCKETS,
)
GEN_AI_TPOT = Instrument(
    c.METRIC_GEN_AI_TPOT,
    "histogram",
    "s",
    "Time per output token generated after the first token for successful responses",
    c.GEN_AI_TPOT_BUCKETS,
)
GEN_AI_REQUEST_DURATION = Instrument(
    c.METRIC_GEN_AI_REQUEST_DURATION,
    "histogram",
    "s",
    "Generative AI server request duration such as time-to-last byte or last output token",
    c.GEN_AI_DURATION_BUCKETS,
)
INSTRUMENTS = (
    STAGE_DURATION,
    TRACE_DURATION,
    BOTTLENECK,
    DIAGNOSIS,
    TRACES_DIAGNOSED,
    DROPPED,
    GPU_UTILIZATION,
    BATCH_SIZE,
    BATCH_FILL,
    STREAM_FIRST_CHUNK,
    STREAM_CHUNK_GAP,
    OFFLOAD_QUEUE,
    OFFLOAD_TRANSFER,
    GEN_AI_TTFT,
    GEN_AI_TPOT,
    GEN_AI_REQUEST_DURATION,
)


def exemplar_context(exemplar: Exemplar | None) -> Context | None:
    """A context carrying the trace's span so that histogram exemplars link to it (Grafana -> Jaeger)."""
    if exemplar is None:
        return None
    span_context = SpanContext(exemplar[0], exemplar[1], False, TraceFlags(TraceFlags.SAMPLED))
    if not span_context.is_valid:
        return None
    return set_span_in_context(NonRecordingSpan(span_context))


class ContractMetrics:
    """The exporter's metric events as observations of the contract's instruments: which instrument, which
    attributes (stage names capped, the overflow counted). How an observation is aggregated is the
    subclass's: the SDK's instruments (``SdkInstruments``) or stagetrace's own (``AggregatedMetrics``)."""

    def __init__(self, max_stage_names: int = 256) -> None:
        self._max_stage_names = max_stage_names
        self._stage_names: set[str] = set()
        self._stage_keys: dict[tuple[str, str, str | None], Key] = {}
        self._trace_keys: dict[tuple[str | None, str | None], Key] = {}  # (slow reason, route) -> key
        self._names_lock = threading.Lock()

    # --- how a subclass aggregates ---------------------------------------------------------------------
    def _observe(self, instrument: Instrument, key: Key, value: float, exemplar: Exemplar | None) -> None:
        raise NotImplementedError

    def _add(self, instrument: Instrument, key: Key, amount: float) -> None:
        raise NotImplementedError

    def _set(self, instrument: Instrument, key: Key, value: float) -> None:
        raise NotImplementedError

    def _record_all(self, observations: list[Observation], additions: list[Addition], merges: list[Merge]) -> None:
        """A trace's observations and counts together: a subclass that can take them in one go (one lock,
        one pass per store) overrides this. Without a way to add bucket counts (the SDK's instruments), a
        merge is recorded as its buckets' upper edges, at most ``MERGE_RECORDS`` a trace."""
        for instrument, key, value, exemplar in observations:
            self._observe(instrument, key, value, exemplar)
        for instrument, key, amount in additions:
            self._add(instrument, key, amount)
        for instrument, key, histogram in merges:
            for value in representative_values(instrument.buckets, histogram, MERGE_RECORDS):
                self._observe(instrument, key, value, None)

    # --- attributes --------------------------------------------------------------------------------------
    def _stage_label(self, name: str) -> str:
        if name in self._stage_names:
            return name
        with self._names_lock:
            if len(self._stage_names) < self._max_stage_names:
                self._stage_names.add(name)
                return name
        self.dropped("stage_name_cardinality")
        return OVERFLOW_STAGE

    def _phase_label(self, name: str | None) -> str:
        """A stream phase's bottleneck as a metric attribute: a stage label, or untracked when none."""
        return c.UNTRACKED if name is None or name == c.UNTRACKED else self._stage_label(name)

    def _stage_key(self, name: str, kind: str, route: str | None) -> Key:
        cache_key = (name, kind, route)
        key = self._stage_keys.get(cache_key)
        if key is None:
            key = ((c.STAGE, self._stage_label(name)), (c.STAGE_KIND, kind))
            if route:
                key += ((c.HTTP_ROUTE, route),)
            if len(self._stage_keys) < 4 * self._max_stage_names:
                self._stage_keys[cache_key] = key
        return key

    def _trace_key(self, reason: str | None, route: str | None) -> Key:
        """A trace duration's attributes: slow and why (``reason`` None: it was not), and its route."""
        key = ((c.SLOW, True), (c.SLOW_REASON, reason)) if reason is not None else _HEALTHY
        if route:
            key += ((c.HTTP_ROUTE, route),)
        if len(self._trace_keys) < 4 * self._max_stage_names:  # routes are templates; a bound all the same
            self._trace_keys[(reason, route)] = key
        return key

    # --- the events (MetricsSink) ------------------------------------------------------------------------
    def record_stage(self, name: str, kind: str, ms: float, route: str | None) -> None:
        self._observe(STAGE_DURATION, self._stage_key(name, kind, route), ms, None)

    def record_trace(self, verdict: Verdict, exemplar: Exemplar | None) -> None:
        """One stage observation per stage name per request (its share of the breakdown, occurrences
        summed), so a stage's percentiles are per request like the trace's. The exemplar, which links a
        latency panel to the trace in Jaeger, goes on the trace duration and on the bottleneck stage: the
        traces worth opening from a stage panel are the ones that stage slowed down. ``exemplar`` is given
        only for traces that were kept, so an exemplar never points at a trace that was not exported."""
        route = verdict.route
        kinds = verdict.stage_kinds
        bottleneck = verdict.bottleneck
        known_keys = self._stage_keys  # (the cache's own lookup here: a call a stage saved, nearly always a hit)
        observations: list[Observation] = []
        for name, ms in verdict.breakdown.items():
            kind = kinds.get(name, "cpu")
            key = known_keys.get((name, kind, route))
            if key is None:
                key = self._stage_key(name, kind, route)
            observations.append((STAGE_DURATION, key, ms, exemplar if name == bottleneck else None))
        reason = (verdict.slow_reason or _SLOW_TOTAL) if verdict.slow else None
        trace_key = self._trace_keys.get((reason, route))  # (a key made once: no tuples built a trace)
        if trace_key is None:
            trace_key = self._trace_key(reason, route)
        observations.append((TRACE_DURATION, trace_key, verdict.total_ms, exemplar))
        additions: list[Addition] = []
        if verdict.diagnosed:
            weight = verdict.diagnosis_weight
            stands_for = 1 if weight == 1.0 else weight  # an int while every trace is diagnosed
            additions = [(DIAGNOSIS, ((_DIAGNOSIS_CODE, d.code),), stands_for) for d in verdict.diagnoses]
            additions.append((TRACES_DIAGNOSED, (), 1))
        if bottleneck is not None:
            label = bottleneck if bottleneck == _UNTRACKED else self._stage_label(bottleneck)
            additions.append((BOTTLENECK, ((_STAGE, label),), 1))
        merges: list[Merge] = []
        stream = verdict.stream
        if stream is not None:
            route_key: Key = ((c.HTTP_ROUTE, route),) if route else ()
            first_key = (
                *route_key,
                (c.STREAM_FIRST_CHUNK_BOTTLENECK, self._phase_label(stream.first_chunk_bottleneck)),
            )
            observations.append((STREAM_FIRST_CHUNK, first_key, stream.first_chunk_ms, exemplar))
            if stream.gaps is not None:
                gap_key = (*route_key, (c.STREAM_GAP_BOTTLENECK, self._phase_label(stream.gap_bottleneck)))
                merges.append((STREAM_CHUNK_GAP, gap_key, stream.gaps))
            if verdict.gen_ai:
                observations.extend(gen_ai_observations(verdict, stream))
        for call in verdict.offloads:
            observations.extend(self._offload_observations(call))
        self._record_all(observations, additions, merges)

    def _offload_observations(self, call: OffloadedCall) -> list[Observation]:
        """A call's wait for a worker and its payloads' sizes, where they were measured (a call whose worker
        never reported has no queue time, one whose result did not come back no result size)."""
        key: Key = ((c.OFFLOAD_EXECUTOR, call.info.executor), (c.STAGE, self._stage_label(call.name)))
        out: list[Observation] = [(OFFLOAD_QUEUE, key, call.queue_ms, None)] if call.reported else []
        for direction, size in (("send", call.info.args_bytes), ("return", call.info.result_bytes)):
            if size is not None:
                out.append((OFFLOAD_TRANSFER, (*key, (c.DIRECTION, direction)), float(size), None))
        return out

    def record_batch(self, name: str, size: int, fill: float | None) -> None:
        key = ((c.STAGE, self._stage_label(name)),)
        self._observe(BATCH_SIZE, key, size, None)
        if fill is not None:
            self._observe(BATCH_FILL, key, fill, None)

    def dropped(self, reason: str, count: int = 1) -> None:
        if count:
            self._add(DROPPED, ((c.DROP_REASON, reason),), count)

    def gpu_utilization(self, value: float, hw_id: str) -> None:
        self._set(GPU_UTILIZATION, ((c.HW_ID, hw_id),), value)


MERGE_RECORDS = 4096  # values a merged histogram may become where only one value at a time can be recorded


def representative_values(buckets: tuple[float, ...], histogram: GapHistogram, limit: int) -> list[float]:
    """Each counted value as its bucket's upper edge (the largest, its own maximum), scaled down to at most
    ``limit`` values in all."""
    total = sum(histogram.counts)
    if not total:
        return []
    scale = min(1.0, limit / total)
    out: list[float] = []
    for index, count in enumerate(histogram.counts):
        edge = buckets[index] if index < len(buckets) else histogram.max_ms
        out.extend([min(edge, histogram.max_ms)] * round(count * scale))
    return out


def gen_ai_observations(verdict: Verdict, stream: StreamSummary) -> list[Observation]:
    """OpenTelemetry's GenAI server metrics for a request that said it serves a generative model: the
    duration of every request, time to first token and time per output token of the successful ones."""
    gen_ai = verdict.gen_ai or {}
    key: Key = tuple((k, gen_ai[k]) for k in c.GEN_AI_METRIC_ATTRIBUTES if isinstance(gen_ai.get(k), (str, int)))
    failed = stream.disconnected
    duration_key = (*key, (c.ERROR_TYPE, c.CLIENT_DISCONNECTED)) if failed else key
    out: list[Observation] = [(GEN_AI_REQUEST_DURATION, duration_key, verdict.total_ms / 1e3, None)]
    if failed:
        return out
    out.append((GEN_AI_TTFT, key, stream.first_chunk_ms / 1e3, None))
    tokens = gen_ai.get(c.GEN_AI_OUTPUT_TOKENS)
    tokens = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 else stream.chunks
    if tokens > 1:
        out.append((GEN_AI_TPOT, key, (verdict.total_ms - stream.first_chunk_ms) / 1e3 / (tokens - 1), None))
    return out


class SdkInstruments(ContractMetrics):
    """The contract's metrics as the SDK's instruments on a meter: for meter providers stagetrace did not
    build (``attach()``), whose readers it cannot reach."""

    def __init__(self, meter: Meter, max_stage_names: int = 256) -> None:
        super().__init__(max_stage_names)
        # Buckets as the instrument's advisory, so they apply on providers stagetrace did not build too.
        self._instruments: dict[str, Any] = {}
        for inst in INSTRUMENTS:
            if inst.kind == "histogram":
                made: Any = meter.create_histogram(
                    inst.name,
                    unit=inst.unit,
                    description=inst.description,
                    explicit_bucket_boundaries_advisory=inst.buckets,
                )
            elif inst.kind == "counter":
                made = meter.create_counter(inst.name, unit=inst.unit, description=inst.description)
            else:
                made = meter.create_gauge(inst.name, unit=inst.unit, description=inst.description)
            self._instruments[inst.name] = made
        self._attributes: dict[Key, dict[str, Any]] = {}
        self._last_exemplar: tuple[Exemplar | None, Context] = (None, _NO_SPAN)

    def _attrs(self, key: Key) -> dict[str, Any]:
        attrs = self._attributes.get(key)
        if attrs is None:
            attrs = dict(key)
            if len(self._attributes) < 8 * self._max_stage_names:
                self._attributes[key] = attrs
        return attrs

    def _observe(self, instrument: Instrument, key: Key, value: float, exemplar: Exemplar | None) -> None:
        # Always an explicit context: without an exemplar (or with ids that are not valid) one with no span,
        # never the thread's current context.
        ctx = _NO_SPAN
        if exemplar is not None:
            last, last_ctx = self._last_exemplar
            if last == exemplar:
                ctx = last_ctx
            else:
                ctx = exemplar_context(exemplar) or _NO_SPAN
                self._last_exemplar = (exemplar, ctx)
        self._instruments[instrument.name].record(value, self._attrs(key), context=ctx)

    def _add(self, instrument: Instrument, key: Key, amount: float) -> None:
        self._instruments[instrument.name].add(amount, self._attrs(key))

    def _set(self, instrument: Instrument, key: Key, value: float) -> None:
        self._instruments[instrument.name].set(value, self._attrs(key))


class MetricsSink(Protocol):
    """Where the exporter's metric events go: stagetrace's own aggregation (``exporter/aggregation.py``) or
    the SDK's instruments (``SdkInstruments``), a recorder for replay in the application, or both."""

    def record_stage(self, name: str, kind: str, ms: float, route: str | None) -> None: ...
    def record_trace(self, verdict: Verdict, exemplar: Exemplar | None) -> None: ...
    def record_batch(self, name: str, size: int, fill: float | None) -> None: ...
    def dropped(self, reason: str, count: int = 1) -> None: ...
    def gpu_utilization(self, value: float, hw_id: str) -> None: ...


METRIC_METHODS = frozenset({"record_stage", "record_trace", "record_batch", "dropped", "gpu_utilization"})


class MetricsRecorder:
    """Keeps each call as ``(method, args)``, to be replayed on the application's own metrics."""

    def __init__(self) -> None:
        # A deque: request threads, samplers and the helper thread append while another thread takes.
        self.calls: deque[tuple[str, tuple[Any, ...]]] = deque()

    def record_stage(self, *args: Any) -> None:
        self.calls.append(("record_stage", args))

    def record_trace(self, *args: Any) -> None:
        self.calls.append(("record_trace", args))

    def record_batch(self, *args: Any) -> None:
        self.calls.append(("record_batch", args))

    def dropped(self, reason: str, count: int = 1) -> None:
        if count:
            self.calls.append(("dropped", (reason, count)))

    def gpu_utilization(self, *args: Any) -> None:
        self.calls.append(("gpu_utilization", args))

    def take(self) -> list[tuple[str, tuple[Any, ...]]]:
        """The calls so far, oldest first; a call appended by another thread meanwhile stays for the next take.

        Bounded by the length read once (never ``while self.calls``), so no edit of it can spin forever."""
        pop = self.calls.popleft
        return [pop() for _ in range(len(self.calls))]


def replay(sink: MetricsSink, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
    """Apply recorded calls; an unknown method name (a malformed message) is ignored."""
    for method, args in calls:
        if method in METRIC_METHODS:
            getattr(sink, method)(*args)


class TeeMetrics:
    """Every call to each of several sinks."""

    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def record_stage(self, *args: Any) -> None:
        for s in self.sinks:
            s.record_stage(*args)

    def record_trace(self, *args: Any) -> None:
        for s in self.sinks:
            s.record_trace(*args)

    def record_batch(self, *args: Any) -> None:
        for s in self.sinks:
            s.record_batch(*args)

    def dropped(self, reason: str, count: int = 1) -> None:
        for s in self.sinks:
            s.dropped(reason, count)

    def gpu_utilization(self, *args: Any) -> None:
        for s in self.sinks:
            s.gpu_utilization(*args)
