"""Attribute, metric and event names: the contract that dashboards, collector configs and users' queries
rely on (the README's attribute and metric reference). Change a name here only with a deprecation path."""

from __future__ import annotations

# --- stage span attributes -------------------------------------------------------------------------------
STAGE = "stagetrace.stage"
STAGE_KIND = "stagetrace.stage.kind"
CPU_MS = "stagetrace.cpu_ms"
BLOCKED_MS = "stagetrace.blocked_ms"
RUNQUEUE_MS = "stagetrace.runqueue_ms"
NOT_GIL_MS = "stagetrace.blocked.not_gil_ms"  # of blocked_ms, at least this much in waits longer than a GIL wait
# while the stage ran, the run-queue wait of the process's other threads: the most of blocked_ms that preempted GIL
# holders (or the GIL handed to a thread still queued for a CPU) can explain
OTHERS_RUNQUEUE_MS = "stagetrace.blocked.others_runqueue_ms"
ON_EVENT_LOOP = "stagetrace.on_event_loop"
GPU_DURATION_MS = "stagetrace.gpu.duration_ms"
GPU_UTILIZATION = "stagetrace.gpu.utilization"
GPU_UTILIZATION_MIN = "stagetrace.gpu.utilization.min"
GPU_UTILIZATION_MAX = "stagetrace.gpu.utilization.max"
GPU_MEMORY_USED = "stagetrace.gpu.memory.used_bytes"
H2D_BYTES = "stagetrace.h2d.bytes"
H2D_PINNED = "stagetrace.h2d.pinned"
HOST_DURATION_MS = "stagetrace.host.duration_ms"
GPU_PLACEMENT_ERROR_US = "stagetrace.gpu.placement_error_us"  # the clock anchor's error bar
GPU_PLACEMENT_CLAMPED = "stagetrace.gpu.placement_clamped"  # moved back inside the trace
LATE = "stagetrace.late"
QUEUE_SATURATED = "stagetrace.queue.saturated"
D2H_BYTES = "stagetrace.d2h.bytes"
# on stages run by a dynamic batch (stagetrace.batch()), in each member's trace, and on the batch span
BATCH_ID = "stagetrace.batch.id"
BATCH_SIZE = "stagetrace.batch.size"
BATCH_ITEMS = "stagetrace.batch.items"
BATCH_INDEX = "stagetrace.batch.index"
BATCH_SHARE_MS = "stagetrace.batch.share_ms"
BATCH_MAX_SIZE = "stagetrace.batch.max_size"
BATCH_FILL = "stagetrace.batch.fill"
BATCH_FORMATION_MS = "stagetrace.batch.formation_ms"
BATCH_BUSY_MS = "stagetrace.batch.busy_ms"
BATCH_ABANDONED = "stagetrace.batch.abandoned"
# the event-loop wait (a `wait` stage stagetrace adds) and the blocking stages on the other side of it
BLOCKED_BY = "stagetrace.blocked_by"  # on the wait span and the victim's root: "<stage>@<trace id>", longest first
DELAYED_REQUESTS = "stagetrace.delayed_requests"  # on a blocking stage and its root: other requests on its loop
# the wait before the server span (capture/arrival.py), on the local root whose start moved back to the arrival
ROOT_SHIFTED_MS = "stagetrace.root.shifted_ms"  # how far the root's start moved back
ROOT_FRAMEWORK_START_NS = "stagetrace.root.framework_start_ns"  # the framework's own start (epoch ns), kept
LOOP_ARRIVAL_BOUND_MS = "stagetrace.loop.arrival_bound_ms"  # at most this much earlier its bytes may have come

# --- verdict attributes, on the trace's local root span --------------------------------------------------
TOTAL_MS = "stagetrace.total_ms"
BOTTLENECK_STAGE = "stagetrace.bottleneck.stage"
BOTTLENECK_RATIO = "stagetrace.bottleneck.ratio"
SLOW = "stagetrace.slow"
SLOW_THRESHOLD_MS = "stagetrace.slow_threshold_ms"
UNTRACKED_MS = "stagetrace.untracked_ms"
STAGES = "stagetrace.stages"
STAGES_MS = "stagetrace.stages_ms"
DIAGNOSIS = "stagetrace.diagnosis"
# GPU_UTILIZATION is reused on the root for the mean over the trace.
# Extensions beyond the contract: the process signals the diagnosis was judged on.
GIL_PRESSURE_MS = "stagetrace.gil.pressure_ms"
CPU_PRESSURE_MS = "stagetrace.cpu.pressure_ms"  # mean run-queue wait of the GIL sampler's wake-ups
LOOP_LAG_MS = "stagetrace.loop.lag_ms"
LOOP_HELD_MS = "stagetrace.loop.held_ms"  # the part of the worst stall that work on the loop's thread explains

# --- span events -----------------------------------------------------------------------------------------
DIAGNOSIS_EVENT = "stagetrace.diagnosis"
DIAGNOSIS_EVENT_CODE = "stagetrace.diagnosis.code"
DIAGNOSIS_EVENT_MESSAGE = "stagetrace.diagnosis.message"
DIAGNOSIS_EVENT_ADVICE = "stagetrace.diagnosis.advice"
DIAGNOSIS_EVENT_STAGE = "stagetrace.diagnosis.stage"

# --- metrics (OpenTelemetry names; Prometheus adds unit and _total suffixes) -----------------------------
METRIC_STAGE_DURATION = "stagetrace.stage.duration"
METRIC_TRACE_DURATION = "stagetrace.trace.duration"
METRIC_BOTTLENECK = "stagetrace.bottleneck"
METRIC_DIAGNOSIS = "stagetrace.diagnosis"
METRIC_GPU_UTILIZATION = "stagetrace.gpu.utilization"
METRIC_DROPPED = "stagetrace.dropped"
METRIC_BATCH_SIZE = "stagetrace.batch.size"
METRIC_BATCH_FILL = "stagetrace.batch.fill"
METRIC_STREAM_FIRST_CHUNK = "stagetrace.stream.first_chunk.duration"
METRIC_STREAM_CHUNK_GAP = "stagetrace.stream.chunk_gap"
# OpenTelemetry's GenAI server metrics (seconds), for requests that say they serve a generative model
METRIC_GEN_AI_TTFT = "gen_ai.server.time_to_first_token"
METRIC_GEN_AI_TPOT = "gen_ai.server.time_per_output_token"
METRIC_GEN_AI_REQUEST_DURATION = "gen_ai.server.request.duration"

# metric attribute keys beyond the span ones
HTTP_ROUTE = "http.route"
DIAGNOSIS_CODE = "code"
DROP_REASON = "reason"
HW_ID = "hw.id"

# --- one table per fact: what each record field becomes on a span, read back by `stagetrace report` ------

# Signals measured per stage: (field of the stage record / StageSample, span attribute, value type). The
# exporter writes those that were measured; the report reads them back into StageSample by the same table.
# Bucket edges in ms for the latency histograms: request pipelines live between ~0.1 ms stages and
# multi-second slow traces. A stream's gaps are counted on them where they happen (capture/streams.py).
MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 200, 300, 500, 750, 1000, 1500, 2500, 5000, 10000)

# A composite stage: the occurrences of a repeated stage folded into one span (after the first few, which
# stay spans of their own), and the slowest of them kept whole as a span marked as the example.
COMPRESSED_COUNT = "stagetrace.compressed.count"
COMPRESSED_SUM_MS = "stagetrace.compressed.sum_ms"
COMPRESSED_MIN_MS = "stagetrace.compressed.min_ms"
COMPRESSED_MAX_MS = "stagetrace.compressed.max_ms"
COMPRESSED_SLOWEST = "stagetrace.compressed.slowest"

STAGE_SIGNALS: tuple[tuple[str, str, type], ...] = (
    ("cpu_ms", CPU_MS, float),
    ("blocked_ms", BLOCKED_MS, float),
    ("runqueue_ms", RUNQUEUE_MS, float),
    ("not_gil_ms", NOT_GIL_MS, float),
    ("others_runqueue_ms", OTHERS_RUNQUEUE_MS, float),
    ("gpu_ms", GPU_DURATION_MS, float),
    ("h2d_bytes", H2D_BYTES, int),
    ("h2d_pinned", H2D_PINNED, bool),
    ("gpu_utilization", GPU_UTILIZATION, float),
    ("queue_saturated", QUEUE_SATURATED, bool),
)

# A streamed response on its local root: (StreamSummary field, span attribute, value type, digits kept).
STREAM_CHUNKS = "stagetrace.stream.chunks"
STREAM_FIRST_CHUNK_MS = "stagetrace.stream.first_chunk_ms"
STREAM_FIRST_CHUNK_BOTTLENECK = "stagetrace.stream.first_chunk.bottleneck"  # also on the stream metrics
STREAM_GAP_BOTTLENECK = "stagetrace.stream.gap.bottleneck"
STREAM_FIELDS: tuple[tuple[str, str, type, int | None], ...] = (
    ("chunks", STREAM_CHUNKS, int, None),
    ("first_chunk_ms", STREAM_FIRST_CHUNK_MS, float, 3),
    ("streaming_ms", "stagetrace.stream.duration_ms", float, 3),  # the first chunk to the last
    ("gap_p50_ms", "stagetrace.stream.gap_p50_ms", float, 3),
    ("gap_p99_ms", "stagetrace.stream.gap_p99_ms", float, 3),
    ("gap_max_ms", "stagetrace.stream.gap_max_ms", float, 3),
    ("send_wait_ms", "stagetrace.stream.send_wait_ms", float, 3),
    ("first_chunk_bottleneck", STREAM_FIRST_CHUNK_BOTTLENECK, str, None),
    ("gap_bottleneck", STREAM_GAP_BOTTLENECK, str, None),
)
ERROR_TYPE = "error.type"  # a client that went away mid-stream: "ConnectionError", as FastAPI's telemetry says
CLIENT_DISCONNECTED = "ConnectionError"

# What a request says of the generative model it serves (stagetrace.generation), and the latencies vLLM and
# SGLang put on their request spans, in seconds, which stagetrace writes on such a request's local root.
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_METRIC_ATTRIBUTES = (GEN_AI_OPERATION, GEN_AI_PROVIDER, GEN_AI_REQUEST_MODEL, GEN_AI_RESPONSE_MODEL)
GEN_AI_LATENCY_TTFT = "gen_ai.latency.time_to_first_token"
GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
GEN_AI_LATENCY_QUEUE = "gen_ai.latency.time_in_queue"
GEN_AI_LATENCY_PREFILL = "gen_ai.latency.time_in_model_prefill"
GEN_AI_LATENCY_DECODE = "gen_ai.latency.time_in_model_decode"
# The GenAI server metrics' bucket boundaries (seconds), as the convention specifies them.
GEN_AI_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
GEN_AI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GEN_AI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)

# The verdict's scalar fields on the local root: (Verdict field, span attribute, value type, digits kept;
# None: not rounded). Optional fields (None in the Verdict) are left off the span.
VERDICT_FIELDS: tuple[tuple[str, str, type, int | None], ...] = (
    ("total_ms", TOTAL_MS, float, 3),
    ("slow", SLOW, bool, None),
    ("slow_threshold_ms", SLOW_THRESHOLD_MS, float, None),
    ("untracked_ms", UNTRACKED_MS, float, 3),
    ("bottleneck", BOTTLENECK_STAGE, str, None),
    ("ratio", BOTTLENECK_RATIO, float, 4),
    ("gpu_utilization", GPU_UTILIZATION, float, 4),
    ("gil_pressure_ms", GIL_PRESSURE_MS, float, None),
    ("cpu_pressure_ms", CPU_PRESSURE_MS, float, None),
    ("loop_lag_ms", LOOP_LAG_MS, float, None),
    ("loop_held_ms", LOOP_HELD_MS, float, None),
    ("blocked_by", BLOCKED_BY, tuple, None),
    ("delayed_requests", DELAYED_REQUESTS, int, None),
)

# The headline's name for time in no stage, when it exceeds every stage (stagetrace.bottleneck.stage and the
# bottleneck metric's stage label); a stage may not take this name.
UNTRACKED = "untracked"
# The stage stagetrace adds for time a request spent ready while other requests' sync stages held its event
# loop; reserved like UNTRACKED.
EVENT_LOOP_WAIT = "event_loop.wait"
RESERVED_STAGE_NAMES = frozenset({UNTRACKED, EVENT_LOOP_WAIT})

# Spans of other instrumentations read as stages: (instrumentation scope, span name) -> stage kind. FastAPI's
# own telemetry (0.142+) times dependency resolution, serialization and background tasks; its
# `fastapi.endpoint` span is left a plain span: it envelops the user's own code and stages, and as a stage
# it would turn every unexplained millisecond of the endpoint into "endpoint time".
FOREIGN_STAGES: dict[tuple[str, str], str] = {
    ("fastapi", "fastapi.dependencies"): "cpu",
    ("fastapi", "fastapi.serialization"): "cpu",
    ("fastapi", "fastapi.background_task"): "cpu",
}

# Stage kinds, in pipeline order.
STAGE_KINDS = ("cpu", "io", "wait", "h2d", "gpu", "d2h")
GPU_KINDS = frozenset({"h2d", "gpu", "d2h"})

INSTRUMENTATION_NAME = "stagetrace"
