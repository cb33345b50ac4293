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
# while the stage ran, the on-CPU time of the process's other threads: with their run-queue wait, the most of
# blocked_ms that waits for the GIL can explain (only a thread on a CPU or queued for one holds the GIL)
OTHERS_CPU_MS = "stagetrace.blocked.others_cpu_ms"
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
# work handed to another process (a process pool): on the offload stage, and on the stages that ran in a worker
OFFLOAD_EXECUTOR = "stagetrace.offload.executor"
OFFLOAD_MAX_WORKERS = "stagetrace.offload.max_workers"
OFFLOAD_IN_FLIGHT = "stagetrace.offload.in_flight"
OFFLOAD_ARGS_BYTES = "stagetrace.offload.args_bytes"
OFFLOAD_RESULT_BYTES = "stagetrace.offload.result_bytes"
OFFLOAD_START_METHOD = "stagetrace.offload.start_method"
OFFLOAD_WORKER_PID = "stagetrace.offload.worker_pid"
OFFLOAD_WORKER_TASK_SEQ = "stagetrace.offload.worker_task_seq"
WORKER_PID = "stagetrace.worker.pid"  # on a stage that ran in a pool's worker (offload.run and the worker's own)
# An offload stage's children, in the order they happen: the wait for a worker, the arguments' way there, the
# worker's run (its own stages under it), the result's way back.
OFFLOAD_QUEUE_STAGE, OFFLOAD_SEND_STAGE = "offload.queue", "offload.send"
OFFLOAD_RUN_STAGE, OFFLOAD_RETURN_STAGE = "offload.run", "offload.return"

# --- verdict attributes, on the trace's local root span --------------------------------------------------
TOTAL_MS = "stagetrace.total_ms"
BOTTLENECK_STAGE = "stagetrace.bottleneck.stage"
BOTTLENECK_RATIO = "stagetrace.bottleneck.ratio"
SLOW = "stagetrace.slow"
SLOW_THRESHOLD_MS = "stagetrace.slow_threshold_ms"
SLOW_REASON = "stagetrace.slow.reason"  # on a slow root: total, first_chunk or gap (conventions.SLOW_REASONS)
STREAM_FIRST_CHUNK_THRESHOLD_MS = "stagetrace.stream.first_chunk_threshold_ms"  # on a streamed root
STREAM_GAP_THRESHOLD_MS = "stagetrace.stream.gap_threshold_ms"  # on a streamed root: for its gap p99
# Why a trace is slow: a response by its total; a streamed one by its first chunk, else by its gaps' p99.
SLOW_TOTAL, SLOW_FIRST_CHUNK, SLOW_GAP = "total", "first_chunk", "gap"
SLOW_REASONS = (SLOW_TOTAL, SLOW_FIRST_CHUNK, SLOW_GAP)
UNTRACKED_MS = "stagetrace.untracked_ms"
STAGES = "stagetrace.stages"
STAGES_MS = "stagetrace.stages_ms"
DIAGNOSIS = "stagetrace.diagnosis"
# GPU_UTILIZATION is reused on the root for the mean over the trace.
# Extensions beyond the contract: the process signals the diagnosis was judged on.
GIL_PRESSURE_MS = "stagetrace.gil.pressure_ms"
CPU_PRESSURE_MS = "stagetrace.cpu.pressure_ms"  # mean run-queue wait of the GIL monitor's wake-ups
LOOP_LAG_MS = "stagetrace.loop.lag_ms"
LOOP_HELD_MS = "stagetrace.loop.held_ms"  # the part of the worst stall that work on the loop's thread explains
PROCESS_CPUS = "stagetrace.process.cpus"  # the CPUs the process may use (affinity, cgroup quota)
PROCESS_CPUS_USED = "stagetrace.process.cpus_used"  # over the trace's window
PROCESS_RUNNABLE = "stagetrace.process.runnable_threads"  # running or waiting for a CPU, on average
REQUESTS_IN_FLIGHT = "stagetrace.process.requests_in_flight"  # traces in flight, on average
# how many traces a kept root stands for (the healthy share's 1/p, and the traces of its signature the export
# budget left out since the previous kept one): stagetrace report weights counts and percentiles by it
SAMPLING_ADJUSTED_COUNT = "stagetrace.sampling.adjusted_count"
# the share of traces the exporter was diagnosing when this one was kept (below 1 past its CPU budget:
# exporter/diagnosis_budget.py); the diagnosis counter's sums are then estimates
DIAGNOSIS_SAMPLE_RATE = "stagetrace.diagnosis.sample_rate"

# --- span events -----------------------------------------------------------------------------------------
DIAGNOSIS_EVENT = "stagetrace.diagnosis"
DIAGNOSIS_EVENT_CODE = "stagetrace.diagnosis.code"
DIAGNOSIS_EVENT_MESSAGE = "stagetrace.diagnosis.message"
DIAGNOSIS_EVENT_ADVICE = "stagetrace.diagnosis.advice"
DIAGNOSIS_EVENT_STAGE = "stagetrace.diagnosis.stage"
DIAGNOSIS_EVENT_EVIDENCE = "stagetrace.diagnosis.evidence"

# --- metrics (OpenTelemetry names; Prometheus adds unit and _total suffixes) -----------------------------
METRIC_STAGE_DURATION = "stagetrace.stage.duration"
METRIC_TRACE_DURATION = "stagetrace.trace.duration"
METRIC_BOTTLENECK = "stagetrace.bottleneck"
METRIC_DIAGNOSIS = "stagetrace.diagnosis"
METRIC_TRACES_DIAGNOSED = "stagetrace.traces.diagnosed"
METRIC_GPU_UTILIZATION = "stagetrace.gpu.utilization"
METRIC_DROPPED = "stagetrace.dropped"
METRIC_BATCH_SIZE = "stagetrace.batch.size"
METRIC_BATCH_FILL = "stagetrace.batch.fill"
METRIC_STREAM_FIRST_CHUNK = "stagetrace.stream.first_chunk.duration"
METRIC_STREAM_CHUNK_GAP = "stagetrace.stream.chunk_gap"
METRIC_OFFLOAD_QUEUE = "stagetrace.offload.queue.duration"
METRIC_OFFLOAD_TRANSFER = "stagetrace.offload.transfer.size"
# OpenTelemetry's GenAI server metrics (seconds), for requests that say they serve a generative model
METRIC_GEN_AI_TTFT = "gen_ai.server.time_to_first_token"
METRIC_GEN_AI_TPOT = "gen_ai.server.time_per_output_token"
METRIC_GEN_AI_REQUEST_DURATION = "gen_ai.server.request.duration"

# metric attribute keys beyond the span ones
HTTP_ROUTE = "http.route"
DIAGNOSIS_CODE = "code"
DROP_REASON = "reason"
HW_ID = "hw.id"
DIRECTION = "direction"  # an offload's transfer: send (the arguments) or return (the result)

# --- one table per fact: what each record field becomes on a span, read back by `stagetrace report` ------

# Signals measured per stage: (field of the stage record / StageSample, span attribute, value type). The
# exporter writes those that were measured; the report reads them back into StageSample by the same table.
# Bucket edges in ms for the latency histograms: request pipelines live between ~0.1 ms stages and
# multi-second slow traces. A stream's gaps are counted on them where they happen (capture/streams.py).
MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 200, 300, 500, 750, 1000, 1500, 2500, 5000, 10000)
# An offload's pickled arguments or result: 1 KiB to 1 GiB by fours (IPC_BOUND's megabyte mark is an edge).
BYTE_BUCKETS = tuple(float(4**k * 1024) for k in range(11))

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
    ("others_cpu_ms", OTHERS_CPU_MS, float),
    ("gpu_ms", GPU_DURATION_MS, float),
    ("h2d_bytes", H2D_BYTES, int),
    ("h2d_pinned", H2D_PINNED, bool),
    ("gpu_utilization", GPU_UTILIZATION, float),
    ("queue_saturated", QUEUE_SATURATED, bool),
    ("worker_pid", WORKER_PID, int),
)

# The offload stage's facts of the call: (analysis.offload.OffloadInfo field, span attribute, value type).
OFFLOAD_FIELDS: tuple[tuple[str, str, type], ...] = (
    ("executor", OFFLOAD_EXECUTOR, str),
    ("max_workers", OFFLOAD_MAX_WORKERS, int),
    ("in_flight", OFFLOAD_IN_FLIGHT, int),
    ("args_bytes", OFFLOAD_ARGS_BYTES, int),
    ("result_bytes", OFFLOAD_RESULT_BYTES, int),
    ("start_method", OFFLOAD_START_METHOD, str),
    ("worker_pid", OFFLOAD_WORKER_PID, int),
    ("worker_task_seq", OFFLOAD_WORKER_TASK_SEQ, int),
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
    ("slow_reason", SLOW_REASON, str, None),
    ("first_chunk_threshold_ms", STREAM_FIRST_CHUNK_THRESHOLD_MS, float, None),
    ("gap_threshold_ms", STREAM_GAP_THRESHOLD_MS, float, None),
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
    ("process_cpus", PROCESS_CPUS, int, None),
    ("process_cpus_used", PROCESS_CPUS_USED, float, 3),
    ("process_runnable", PROCESS_RUNNABLE, float, 3),
    ("requests_in_flight", REQUESTS_IN_FLIGHT, float, 2),
    ("diagnosis_sample_rate", DIAGNOSIS_SAMPLE_RATE, float, 4),
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
STAGE_KINDS = ("cpu", "io", "wait", "h2d", "gpu", "d2h", "offload")
GPU_KINDS = frozenset({"h2d", "gpu", "d2h"})

INSTRUMENTATION_NAME = "stagetrace"

# --- the reference: what each name means (docs/reference/, generated from these tables when the site is built;
# nothing reads them at run time). A name written in the code above and missing here, or a row naming nothing
# above, fails the docs build. Places: "stage" (stage spans), "batch" (a dynamic batch's own span), "root" (the
# trace's local root: the verdict), "event" (the stagetrace.diagnosis event on the root).
_STREAM_ATTRIBUTE = {field: attribute for field, attribute, _, _ in STREAM_FIELDS}

ATTRIBUTE_REFERENCE: tuple[tuple[str, str, tuple[str, ...], str], ...] = (
    # (attribute, value type, places, meaning)
    (STAGE, "string", ("stage",), "the stage's name (the span's name too)"),
    (STAGE_KIND, "string", ("stage",), "`cpu`, `io`, `wait`, `h2d`, `gpu` or `d2h`"),
    (CPU_MS, "double", ("stage",), "on-CPU time of the thread during the stage (sync stages of at least 1 ms)"),
    (BLOCKED_MS, "double", ("stage",), "wall time less on-CPU and run-queue time: waiting for the GIL, a lock, I/O"),
    (
        RUNQUEUE_MS,
        "double",
        ("stage",),
        "waiting for a CPU (Linux schedstat; stage names that recently ran for at least 0.5 ms)",
    ),
    (
        OTHERS_RUNQUEUE_MS,
        "double",
        ("stage",),
        "the run-queue wait of the process's other threads from the GIL monitor's wake-up before the stage to its "
        "first after it, less the stage's own: the most of `blocked_ms` that preempted GIL holders (or the GIL "
        "handed to a thread still queued for a CPU) can explain; on the CPU stages the GIL and lock rules look at "
        "(at least `min_stage_ms` long, blocked at least `blocked_min_ms` and `blocked_share` of it)",
    ),
    (
        OTHERS_CPU_MS,
        "double",
        ("stage",),
        "the on-CPU time of the process's other threads over the same window as `others_runqueue_ms`: with it, the "
        "most of `blocked_ms` that waits for the GIL can explain (only a thread on a CPU or queued for one holds "
        "the GIL); on the same stages",
    ),
    (
        NOT_GIL_MS,
        "double",
        ("stage",),
        "of `blocked_ms`, at least this much was not a wait for the GIL (blocked beyond one switch interval per "
        "time the thread was scheduled in; CPython on Linux)",
    ),
    (ON_EVENT_LOOP, "boolean", ("stage",), "a sync stage that ran on the asyncio event-loop thread"),
    (
        DELAYED_REQUESTS,
        "int",
        ("stage",),
        "on the outermost sync stage on an event loop (at least 1 ms): the other requests in flight on that loop, "
        "each held back while it ran",
    ),
    (
        BLOCKED_BY,
        "string[]",
        ("stage",),
        "on an `event_loop.wait` stage: `<stage>@<trace id>` of the stages that held the loop meanwhile, longest "
        "first (at most 8)",
    ),
    (GPU_DURATION_MS, "double", ("stage",), "GPU time from CUDA events"),
    (GPU_UTILIZATION, "double", ("stage",), "NVML utilisation over the stage's window, mean (0..1)"),
    (GPU_UTILIZATION_MIN, "double", ("stage",), "NVML utilisation over the stage's window, least sample (0..1)"),
    (GPU_UTILIZATION_MAX, "double", ("stage",), "NVML utilisation over the stage's window, greatest sample (0..1)"),
    (GPU_MEMORY_USED, "int", ("stage",), "device memory in use, bytes"),
    (H2D_BYTES, "int", ("stage",), "size of a host-to-device copy, bytes"),
    (H2D_PINNED, "boolean", ("stage",), "whether a host-to-device copy's source was pinned memory"),
    (D2H_BYTES, "int", ("stage",), "size of a device-to-host copy, bytes"),
    (HOST_DURATION_MS, "double", ("stage",), "host-side duration of a GPU stage placed on the GPU timeline"),
    (GPU_PLACEMENT_ERROR_US, "double", ("stage",), "the clock anchor's error bar for a GPU stage's placement, µs"),
    (GPU_PLACEMENT_CLAMPED, "boolean", ("stage",), "the GPU stage's placement was moved back inside the trace"),
    (QUEUE_SATURATED, "boolean", ("stage",), "on a wait stage: every worker was busy when the request queued"),
    (LATE, "boolean", ("stage",), "the stage ended after the trace's root (left out of the verdict)"),
    (
        OFFLOAD_EXECUTOR,
        "string",
        ("stage",),
        "on an offload stage: the pool (`ProcessPoolExecutor`, `multiprocessing.Pool`)",
    ),
    (OFFLOAD_MAX_WORKERS, "int", ("stage",), "on an offload stage: the pool's worker processes"),
    (OFFLOAD_IN_FLIGHT, "int", ("stage",), "on an offload stage: calls in the pool at submission, this one included"),
    (
        OFFLOAD_ARGS_BYTES,
        "int",
        ("stage",),
        "on an offload stage: the arguments' size (their arrays' and tensors' `nbytes` where larger, the pickled "
        "size otherwise)",
    ),
    (OFFLOAD_RESULT_BYTES, "int", ("stage",), "on an offload stage: the result's pickled size"),
    (
        OFFLOAD_START_METHOD,
        "string",
        ("stage",),
        "on an offload stage: how the pool starts workers (fork, spawn, forkserver)",
    ),
    (OFFLOAD_WORKER_PID, "int", ("stage",), "on an offload stage: the worker process that ran the call"),
    (
        OFFLOAD_WORKER_TASK_SEQ,
        "int",
        ("stage",),
        "on an offload stage: the call's place among the worker's tasks (1: its first)",
    ),
    (
        WORKER_PID,
        "int",
        ("stage",),
        "on a stage that ran in a pool's worker process (`offload.run` and the worker's own stages)",
    ),
    (BATCH_ID, "string", ("stage", "batch"), "on stages run by a dynamic batch, and on its span: which batch"),
    (BATCH_SIZE, "int", ("stage", "batch"), "the batch's member requests"),
    (BATCH_ITEMS, "int", ("stage", "batch"), "the batch's items (a request may bring several)"),
    (BATCH_INDEX, "int", ("stage",), "this member's place in the batch"),
    (
        BATCH_SHARE_MS,
        "double",
        ("stage",),
        "this member's amortised share of the batch stage's time: that time by its items over the batch's",
    ),
    (BATCH_MAX_SIZE, "int", ("stage", "batch"), "the batcher's max size (on each member's batch stage too)"),
    (BATCH_FILL, "double", ("stage", "batch"), "items / max size (on each member's batch stage too)"),
    (BATCH_FORMATION_MS, "double", ("stage",), "on a batch wait: the time spent waiting for the batch to form"),
    (
        BATCH_BUSY_MS,
        "double",
        ("stage",),
        "on a batch wait: the time spent waiting for the batcher's previous batch to finish",
    ),
    (BATCH_ABANDONED, "boolean", ("stage",), "on a batch wait: no batch took the ticket before the request ended"),
    (COMPRESSED_COUNT, "int", ("stage",), "on a composite stage: the occurrences folded into it"),
    (COMPRESSED_SUM_MS, "double", ("stage",), "on a composite stage: the folded occurrences' summed time"),
    (COMPRESSED_MIN_MS, "double", ("stage",), "on a composite stage: the shortest folded occurrence"),
    (COMPRESSED_MAX_MS, "double", ("stage",), "on a composite stage: the longest folded occurrence"),
    (
        COMPRESSED_SLOWEST,
        "boolean",
        ("stage",),
        "the slowest folded occurrence, exported beside its composite (counted in it, not again)",
    ),
    (TOTAL_MS, "double", ("root",), "the local root's duration"),
    (
        BOTTLENECK_STAGE,
        "string",
        ("root",),
        "the stage with the largest share, or `untracked` when the time in no stage is larger",
    ),
    (BOTTLENECK_RATIO, "double", ("root",), "the bottleneck's share of `stagetrace.total_ms` (0..1)"),
    (
        SLOW,
        "boolean",
        ("root",),
        "a response: `stagetrace.total_ms` over the slow threshold; a streamed one: its time to the first chunk "
        "over its threshold, or its gaps' p99 over theirs (not its length)",
    ),
    (SLOW_THRESHOLD_MS, "double", ("root",), "the slow threshold that applied (global or the route's)"),
    (
        SLOW_REASON,
        "string",
        ("root",),
        "on a slow root, what made it slow: `total` (a response's duration), `first_chunk` or `gap` (a streamed "
        "response's time to the first chunk, else its gaps' p99)",
    ),
    (
        STREAM_FIRST_CHUNK_THRESHOLD_MS,
        "double",
        ("root",),
        "on a streamed root: the time to the first chunk past which it is slow (the route's, else the global)",
    ),
    (
        STREAM_GAP_THRESHOLD_MS,
        "double",
        ("root",),
        "on a streamed root: the gaps' p99 past which it is slow (the route's, else the global)",
    ),
    (UNTRACKED_MS, "double", ("root",), "root time covered by no stage"),
    (STAGES, "string[]", ("root",), "the breakdown's stage names, in pipeline order"),
    (STAGES_MS, "double[]", ("root",), "the breakdown's milliseconds, in the order of `stagetrace.stages`"),
    (
        DIAGNOSIS,
        "string[]",
        ("root",),
        "the codes of the rules that fired; each also an event `stagetrace.diagnosis` on the root",
    ),
    (GPU_UTILIZATION, "double", ("root",), "NVML utilisation, mean over the trace (0..1)"),
    (GIL_PRESSURE_MS, "double", ("root",), "the GIL monitor's mean wake-up lag within the trace's window"),
    (
        CPU_PRESSURE_MS,
        "double",
        ("root",),
        "the mean run-queue wait of the GIL monitor's wake-ups within the trace's window",
    ),
    (LOOP_LAG_MS, "double", ("root",), "the worst event-loop stall the request lived through"),
    (
        LOOP_HELD_MS,
        "double",
        ("root",),
        "the part of that stall that work on the loop's own thread explains (running or in a blocking call)",
    ),
    (
        BLOCKED_BY,
        "string[]",
        ("root",),
        "what held the event loop while this request waited for it, longest first (at most 8)",
    ),
    (
        DELAYED_REQUESTS,
        "int",
        ("root",),
        "the most other requests any of this request's sync stages held back on its loop",
    ),
    (PROCESS_CPUS, "int", ("root",), "the CPUs the process may use: its affinity, less a cgroup's CPU quota"),
    (
        PROCESS_CPUS_USED,
        "double",
        ("root",),
        "the CPUs the process's threads used over the trace's window (between the GIL monitor's readings that "
        "stand for its start and its end)",
    ),
    (
        PROCESS_RUNNABLE,
        "double",
        ("root",),
        "the process's threads running or waiting for a CPU over the same window, on average: more than "
        "`stagetrace.process.cpus` is the process oversubscribing its CPUs",
    ),
    (
        REQUESTS_IN_FLIGHT,
        "double",
        ("root",),
        "the traces in flight at those readings, on average: with the two above, whether the requests themselves "
        "(SERVICE_AT_CAPACITY) or threads beside them (CPU_OVERSUBSCRIBED) outnumbered the CPUs",
    ),
    (
        SAMPLING_ADJUSTED_COUNT,
        "double",
        ("root",),
        "how many traces this kept trace stands for: 1 / the healthy share for a healthy sample (else 1), plus "
        "the adjusted counts of the traces of its kind (route, bottleneck) kept for the same reason that the "
        "export budget left out since the previous one kept; `stagetrace report` weights its counts and "
        "percentiles by it",
    ),
    (
        DIAGNOSIS_SAMPLE_RATE,
        "double",
        ("root",),
        "the share of traces the exporter was diagnosing when this one was kept: 1 within its CPU budget "
        "(`Settings.exporter_cpu_budget`), less past it, when the `stagetrace.diagnosis` counter's sums are "
        "estimates (each diagnosed trace adds 1 / its chance of being diagnosed); a kept trace is always "
        "diagnosed",
    ),
    (
        ROOT_SHIFTED_MS,
        "double",
        ("root",),
        "how far the root's start moved back, from the framework's start to the request's arrival",
    ),
    (
        ROOT_FRAMEWORK_START_NS,
        "int",
        ("root",),
        "the framework's own start of the server span (epoch ns), kept when the start moved",
    ),
    (
        LOOP_ARRIVAL_BOUND_MS,
        "double",
        ("root",),
        "where the bytes' arrival cannot be read: at most this much before its task was created they may have "
        "come (the loop was held up to then)",
    ),
    (STREAM_CHUNKS, "int", ("root",), "a streamed response's body chunks"),
    (STREAM_FIRST_CHUNK_MS, "double", ("root",), "the root's start to the first body chunk handed to the server"),
    (_STREAM_ATTRIBUTE["streaming_ms"], "double", ("root",), "the first body chunk to the last"),
    (_STREAM_ATTRIBUTE["gap_p50_ms"], "double", ("root",), "median gap between consecutive chunks"),
    (_STREAM_ATTRIBUTE["gap_p99_ms"], "double", ("root",), "99th percentile gap between consecutive chunks"),
    (_STREAM_ATTRIBUTE["gap_max_ms"], "double", ("root",), "longest gap between consecutive chunks (exact)"),
    (
        _STREAM_ATTRIBUTE["send_wait_ms"],
        "double",
        ("root",),
        "time spent awaiting the server's `send`: a client that does not read fast enough",
    ),
    (STREAM_FIRST_CHUNK_BOTTLENECK, "string", ("root",), "the stage with the most time before the first chunk"),
    (
        STREAM_GAP_BOTTLENECK,
        "string",
        ("root",),
        "the stage with the most time between the first chunk and the last",
    ),
    (
        ERROR_TYPE,
        "string",
        ("root",),
        "`ConnectionError`: the client went away mid-stream (the root's status is then an error)",
    ),
    (GEN_AI_REQUEST_MODEL, "string", ("root",), "the model `stagetrace.generation(model)` named"),
    (GEN_AI_OPERATION, "string", ("root",), "its `operation` (default `text_completion`)"),
    (GEN_AI_PROVIDER, "string", ("root",), "its `provider`, when given"),
    (GEN_AI_RESPONSE_MODEL, "string", ("root",), "its `response_model`, when given"),
    (GEN_AI_OUTPUT_TOKENS, "int", ("root",), "its `output_tokens`, when given"),
    (GEN_AI_LATENCY_TTFT, "double", ("root",), "a generative stream's time to its first chunk, seconds"),
    (GEN_AI_LATENCY_E2E, "double", ("root",), "the generative request's whole duration, seconds"),
    (GEN_AI_LATENCY_QUEUE, "double", ("root",), "wait stages before the first chunk, seconds"),
    (GEN_AI_LATENCY_PREFILL, "double", ("root",), "GPU stages before the first chunk, seconds"),
    (GEN_AI_LATENCY_DECODE, "double", ("root",), "GPU stages after the first chunk, seconds"),
    (DIAGNOSIS_EVENT_CODE, "string", ("event",), "the rule's code"),
    (DIAGNOSIS_EVENT_MESSAGE, "string", ("event",), "what was measured, in words"),
    (DIAGNOSIS_EVENT_ADVICE, "string", ("event",), "what to do about it"),
    (DIAGNOSIS_EVENT_STAGE, "string", ("event",), "the stage the rule names, when it names one"),
    (
        DIAGNOSIS_EVENT_EVIDENCE,
        "string",
        ("event",),
        "the measurements that decided the cause, where the rule has more to say than its finding",
    ),
)

# Each metric's attributes (the metrics' names, kinds, units and descriptions are exporter/metrics.py's
# INSTRUMENTS), and the attribute keys only metrics carry.
METRIC_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    METRIC_STAGE_DURATION: (STAGE, STAGE_KIND, HTTP_ROUTE),
    METRIC_TRACE_DURATION: (HTTP_ROUTE, SLOW, SLOW_REASON),
    METRIC_BOTTLENECK: (STAGE,),
    METRIC_DIAGNOSIS: (DIAGNOSIS_CODE,),
    METRIC_TRACES_DIAGNOSED: (),
    METRIC_GPU_UTILIZATION: (HW_ID,),
    METRIC_DROPPED: (DROP_REASON,),
    METRIC_BATCH_SIZE: (STAGE,),
    METRIC_BATCH_FILL: (STAGE,),
    METRIC_STREAM_FIRST_CHUNK: (HTTP_ROUTE, STREAM_FIRST_CHUNK_BOTTLENECK),
    METRIC_STREAM_CHUNK_GAP: (HTTP_ROUTE, STREAM_GAP_BOTTLENECK),
    METRIC_OFFLOAD_QUEUE: (OFFLOAD_EXECUTOR, STAGE),
    METRIC_OFFLOAD_TRANSFER: (OFFLOAD_EXECUTOR, STAGE, DIRECTION),
    METRIC_GEN_AI_TTFT: GEN_AI_METRIC_ATTRIBUTES,
    METRIC_GEN_AI_TPOT: GEN_AI_METRIC_ATTRIBUTES,
    METRIC_GEN_AI_REQUEST_DURATION: (*GEN_AI_METRIC_ATTRIBUTES, ERROR_TYPE),
}
METRIC_ATTRIBUTE_REFERENCE: tuple[tuple[str, str], ...] = (
    (HTTP_ROUTE, "the request's route, where the framework names one"),
    (DIAGNOSIS_CODE, "a rule's code"),
    (DROP_REASON, "why stagetrace dropped something (the reasons below)"),
    (HW_ID, "the GPU's UUID, as NVML knows it"),
    (DIRECTION, "an offload's transfer: `send` (the arguments) or `return` (the result)"),
)

# The reasons `stagetrace.dropped` counts under (its `reason` attribute). The docs build finds every reason the
# code counts (the first argument of each dropped / on_drop call) and fails on one missing here.
DROP_REASONS: dict[str, str] = {
    "traces_in_flight": "a trace started while `Settings.max_traces_in_flight` traces were held (not tracked)",
    "trace_timeout": "a root that never ended, evicted after `Settings.trace_ttl_s`",
    "stages_per_trace": "stages past `Settings.max_stages_per_trace` in one trace",
    "handoff_queue_full": "a finished trace with the hand-off queue full (`Settings.queue_size`)",
    "channel_full": "traces the pipe to the exporter could not take, past `Settings.channel_buffer_bytes`",
    "exporter_restart": "traces the exporter process had not acknowledged when it died",
    "exporter_unavailable": "traces sent after the exporter process was given up (restarted too often)",
    "malformed_record": "a record the exporter could not read (bad checksum, truncated), skipped",
    "unencodable": "a trace or span that could not be encoded for the channel or for OTLP",
    "unpackable": "a finished trace the helper thread could not pack (its root goes alone where it can)",
    "export_queue_full": "spans the export queue could not take (`OTEL_BSP_MAX_QUEUE_SIZE`)",
    "stage_name_cardinality": "stage names past `Settings.max_stage_names` in metric attributes (become `_other`)",
    "gpu_events": "a GPU stage that found the CUDA event pool empty (it keeps its host time)",
    "gpu_event_timeout": "a trace whose CUDA events did not complete within `Settings.gpu_wait_timeout_s`",
    "gpu_parked_full": "a trace past `Settings.max_parked` waiting for its CUDA events, shipped without them",
    "nvml_samples": "NVML samples past the sampler's buffer (the oldest give way)",
    "budget": "a trace over the export budget (`STAGETRACE_EXPORT_BUDGET`): its metrics are kept, not its spans",
    "batch_ticket_unused": "a batch ticket never taken by a batch (the request ended while queued)",
    "batch_ticket_reused": "a batch ticket used a second time, left out of the batch",
    "batch_ticket_late": "a batch reaching a request that had already ended",
    "batch_not_a_ticket": "something passed to `batch()` that is not a ticket from `enqueue()`",
    "offload_late": "a worker's report of an offloaded call that came after its request ended",
    "offload_unknown": "a worker's report of a call this process did not submit (a pool shared across a fork)",
    "offload_in_flight": "offloaded calls past `MAX_OFFLOADS_IN_FLIGHT` awaiting their worker (the oldest give way)",
    "offload_malformed": "a worker's report of a shape this version does not read",
}
