"""Every tunable number in one place, with the bounds that keep memory flat."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stagetrace._compat import gil_wait_stretch_bound_s
from stagetrace.analysis import DiagnosisThresholds
from stagetrace.analysis.streams import StreamThresholds

DEFAULT_SLOW_THRESHOLD_MS = 200.0
# The gaps' p99 past which a stream is slow: 10 chunks a second at its slowest 1 %, where a reader starts to
# see a token stream stall (the streaming SLOs vLLM's and SGLang's benchmarks use put time per output token at
# 50-100 ms; a chunk may carry several tokens, so a gap is at least one token's time)
DEFAULT_GAP_THRESHOLD_MS = 100.0

# --- fixed bounds and thresholds (module constants: the hot path reads them as globals) --------------------
MAX_STAGE_NAME_LENGTH = 128  # longer names are cut (names become span names and metric attributes)
CPU_ACCOUNTING_MIN_MS = 0.5  # stage names that recently ran this long also get schedstat's run-queue split
MAX_TRACKED_STAGE_NAMES = 1024  # names whose recent duration is remembered for that choice
MAX_STAGE_ATTRIBUTES = 64  # attributes a user may set on one stage
MAX_ATTRIBUTE_VALUE_LENGTH = 4096  # characters of a string attribute value
MAX_OTHER_SPANS_PER_TRACE = 512  # other instrumentations' spans held with a trace; past it they go on their own
MAX_TRACKED_BATCHERS = 256  # batcher names whose previous run is remembered (the wait split)
MIN_WAIT_NS = 500_000  # a wait for a worker shorter than this is dispatch noise, not a queue: no wait stage
MIN_CPU_ACCOUNTED_NS = 1_000_000  # stages shorter than this get no CPU figures (clock granularity)
LOOP_BLOCK_MIN_NS = 1_000_000  # a sync stage on the event loop shorter than this is not recorded as holding it
LOOP_WAIT_MIN_NS = 100_000  # stretches of an event-loop wait shorter than this are scheduling noise
# A request's wait between its arrival and its server span shorter than this is the server's own
# scheduling (the task's first step), not a wait: the root keeps the framework's start.
ARRIVAL_WAIT_MIN_NS = 1_000_000
# ... and one that no other request's blocking stage explains, shorter than this, is the server's own work
# for its other connections: left out too, rather than an event_loop.wait on every request under load.
ARRIVAL_UNEXPLAINED_MIN_NS = 5_000_000
ARRIVAL_ADJACENT_NS = 2_000_000  # blocks this close to each other (or to the task's creation) bound an arrival
ARRIVAL_LOOKBACK_NS = 1_000_000_000  # how far before an arrival the exporter looks for such blocks
GIL_MIN_SAMPLES = 3  # GIL-pressure wake-ups a trace's window needs before the pressure counts as measured
SIGNALS_WAIT_S = 0.3  # how long the helper thread holds a trace for the GIL monitor's first wake-up after its end
MAX_WORKER_RUNS = 256  # runs of a request's code on worker threads kept per trace (own time, not loop wait)
MAX_OFFLOADS_IN_FLIGHT = 4096  # calls handed to process pools awaiting their worker's report (the oldest give way)
MAX_BLOCKED_BY = 8  # blocking stages named in stagetrace.blocked_by
# Occurrences of one stage name under one parent kept as stages of their own; the rest fold into a composite.
KEEP_REPEATS = 3
MAX_LINKS_PER_SPAN = 128  # the SDK's default span link limit (OTEL_SPAN_LINK_COUNT_LIMIT), which backends share
RECORDS_PER_FRAME = 32  # traces per channel frame, so that a burst is accepted or refused in pieces
MAX_FRAME_BYTES = 64 * 2**20  # a frame claiming more is malformed
FLUSH_POLL_S = 0.002  # how often the helper thread looks for a flush's answer while one waits
ACK_INTERVAL_S = 0.25  # how often the exporter acknowledges what it handled (and looks for its parent)
DEFAULT_OUTPUT_DIR = "stagetrace-out"  # the embedded default's JSON lines, unless STAGETRACE_OUTPUT_DIR


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _switch_from_env(name: str) -> bool:
    """An on/off variable that defaults to on; anything else is an error, not a silent default."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be on or off, got {raw!r}")


def export_process_from_env() -> bool:
    """``STAGETRACE_EXPORT_PROCESS``: ``on`` (default) runs the exporter in its own process; ``off`` on a
    thread of the application, for environments that forbid subprocesses."""
    return _switch_from_env("STAGETRACE_EXPORT_PROCESS")


def light_spans_from_env() -> bool:
    """``STAGETRACE_LIGHT_SPANS``: ``on`` (default) records other instrumentations' spans inside a held trace
    as light spans, built as SDK spans in the exporter process; ``off`` builds SDK spans in the application."""
    return _switch_from_env("STAGETRACE_LIGHT_SPANS")


def _number_from_env(name: str, default: float, describe: str, valid: Callable[[float], bool]) -> float:
    """A number from the environment, or a clear error naming the variable and what it must be."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be {describe}, got {raw!r}") from None
    if not valid(value):
        raise ValueError(f"{name} must be {describe}, got {raw!r}")
    return value


# The exporter's CPU budget's default share of the application's CPU (benchmarks/saturation.py; docs/performance.md).
DEFAULT_EXPORTER_CPU_BUDGET = 0.05


def healthy_sample_from_env(default: float = 0.1) -> float:
    """``STAGETRACE_HEALTHY_SAMPLE``: the share of healthy traces exported in full (0..1)."""
    return _number_from_env("STAGETRACE_HEALTHY_SAMPLE", default, "a number between 0 and 1", lambda v: 0 <= v <= 1)


def export_budget_from_env(default: float | None = 20.0) -> float | None:
    """``STAGETRACE_EXPORT_BUDGET``: full traces exported a second at most (a number > 0), or ``off`` for no
    budget (every slow, diagnosed, errored and sampled trace is exported, e.g. for a Collector's own tail
    sampling)."""
    raw = os.environ.get("STAGETRACE_EXPORT_BUDGET", "").strip().lower()
    if raw in ("off", "none", "unlimited"):
        return None
    if not raw:
        return default
    return _number_from_env("STAGETRACE_EXPORT_BUDGET", 0.0, "a number of traces a second > 0, or off", _positive)


def exporter_cpu_budget_from_env(default: float | None = DEFAULT_EXPORTER_CPU_BUDGET) -> float | None:
    """``STAGETRACE_EXPORTER_CPU_BUDGET``: the exporter's CPU, at most this share of the application's (a number
    > 0; the diagnosis rules run on a share of traces past it), or ``off`` to diagnose every trace."""
    raw = os.environ.get("STAGETRACE_EXPORTER_CPU_BUDGET", "").strip().lower()
    if raw in ("off", "none", "unlimited"):
        return None
    if not raw:
        return default
    return _number_from_env(
        "STAGETRACE_EXPORTER_CPU_BUDGET", 0.0, "a share of the application's CPU > 0, or off", _positive
    )


def _positive(value: float) -> bool:
    return value > 0


@dataclass
class Settings:
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS
    route_slow_thresholds_ms: dict[str, float] = field(default_factory=dict)
    # A streamed response is slow by its phases, not its length (which grows with the answer): its time to the
    # first chunk over the first-chunk threshold (None: the slow threshold of its route, the same budget as a
    # whole response's), or its gaps' p99 over the gap threshold; per route over the global ones.
    stream_first_chunk_threshold_ms: float | None = field(
        default_factory=lambda: _stream_threshold_from_env("STAGETRACE_STREAM_FIRST_CHUNK_MS")
    )
    stream_gap_threshold_ms: float = field(
        default_factory=lambda: _stream_threshold_from_env("STAGETRACE_STREAM_GAP_MS") or DEFAULT_GAP_THRESHOLD_MS
    )
    route_first_chunk_thresholds_ms: dict[str, float] = field(default_factory=dict)
    route_gap_thresholds_ms: dict[str, float] = field(default_factory=dict)
    thresholds: DiagnosisThresholds = field(default_factory=DiagnosisThresholds)
    max_traces_in_flight: int = 20_000
    trace_ttl_s: float = 300.0
    max_stages_per_trace: int = 512
    max_stage_names: int = 256
    queue_size: int = 10_000
    sweep_interval_s: float = 1.0
    # How often the helper thread ships finished traces while busy: each wake-up costs the application and
    # the exporter a fixed amount, and an exporter woken 20 times a second worked with its caches cold
    # (benchmarks/e2e.py: its CPU a request fell by about a quarter from 0.05 s to 0.25 s), so fewer, larger
    # batches are cheaper; verdicts arrive up to this late.
    poll_interval_s: float = 0.2
    gpu_wait_timeout_s: float = 30.0
    max_parked: int = 10_000  # finished traces waiting for their CUDA events; past it the oldest go as they are
    slow_log_per_minute: int = 60
    shutdown_timeout_s: float = 5.0
    record_query_strings: bool = field(default_factory=lambda: env_flag("STAGETRACE_RECORD_QUERY_STRINGS"))
    cpu_signals: bool = True  # per-stage on-CPU / run-queue / blocked time (two schedstat reads per stage)
    # Calls a traced request hands to a process pool as offload stages, the worker's stages under them
    # (integrations/processes.py: ProcessPoolExecutor, multiprocessing.Pool, patched at class level).
    process_pools: bool = field(default_factory=lambda: not env_flag("STAGETRACE_NO_PROCESS_POOLS"))
    gil_sampler_period_s: float = 0.010  # 0 turns the GIL-pressure monitor off
    # The longest a thread waiting for the GIL sleeps at a stretch (the application's switch interval; 0 without
    # a GIL, None where unknown), for ``common.schedstat.not_gil_ms``; read when stagetrace is configured.
    gil_wait_bound_s: float | None = field(default_factory=gil_wait_stretch_bound_s)
    loop_lag_interval_s: float = 0.050
    # Where the work after capture runs: an exporter process (True) or a thread of the application.
    export_process: bool = field(default_factory=export_process_from_env)
    # Spans other instrumentations open inside a held trace recorded at stage cost (capture/light_spans.py)
    # and built as SDK spans by the exporter; False: SDK spans in the application.
    light_spans: bool = field(default_factory=light_spans_from_env)
    # Share of healthy traces (not slow, not diagnosed, no error) exported in full; metrics see them all.
    healthy_sample: float = field(default_factory=healthy_sample_from_env)
    channel_buffer_bytes: int = 8 * 2**20  # application-side bytes waiting for the pipe, at most
    exporter_restarts_per_minute: int = 5
    # The export budget (``exporter/budget.py``): full traces a second at most, and the burst allowed (None:
    # no budget); per signature (route or root name, bottleneck, diagnosis codes) a share of it, so one kind
    # of trace cannot take it all; signatures remembered at most.
    export_budget_per_s: float | None = field(default_factory=export_budget_from_env)
    export_budget_burst: float = 40.0
    signature_budget_per_s: float = 5.0
    signature_budget_burst: float = 10.0
    max_budget_signatures: int = 1024
    # The exporter's CPU budget (``exporter/diagnosis_budget.py``): at most this share of the CPU the application
    # process uses (and at least 1 % of a CPU); every trace is diagnosed within it, a share of them past it,
    # the diagnosis counter weighted so its sums stay unbiased. None: every trace diagnosed, whatever it costs.
    exporter_cpu_budget: float | None = field(default_factory=exporter_cpu_budget_from_env)
    # A batch span waits in the exporter for its members' keep decisions (it is exported when any member
    # is), at most this long and this many at once.
    batch_keep_wait_s: float = 30.0
    max_pending_batches: int = 1024

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the exporter process (``from_dict`` rebuilds it there)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Settings:
        fields = dict(data)
        fields["thresholds"] = DiagnosisThresholds(**fields.get("thresholds", {}))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})

    def threshold_for(self, route: str | None) -> float:
        if route and route in self.route_slow_thresholds_ms:
            return self.route_slow_thresholds_ms[route]
        return self.slow_threshold_ms

    def stream_thresholds_for(self, route: str | None) -> StreamThresholds:
        first, gap = self.stream_first_chunk_threshold_ms, self.stream_gap_threshold_ms
        if route is not None:
            first = self.route_first_chunk_thresholds_ms.get(route, first)
            gap = self.route_gap_thresholds_ms.get(route, gap)
        return StreamThresholds(self.threshold_for(route) if first is None else first, gap)

    def validate(self) -> Settings:
        if not self.slow_threshold_ms > 0:
            raise ValueError(f"slow_threshold_ms must be > 0, got {self.slow_threshold_ms!r}")
        for name in ("route_slow_thresholds_ms", "route_first_chunk_thresholds_ms", "route_gap_thresholds_ms"):
            for route, ms in getattr(self, name).items():
                if not isinstance(route, str) or not isinstance(ms, (int, float)) or not ms > 0:
                    raise ValueError(f"{name} needs str routes and values > 0, got {route!r}: {ms!r}")
        first = self.stream_first_chunk_threshold_ms
        if first is not None and not first > 0:
            raise ValueError(f"stream_first_chunk_threshold_ms must be > 0 or None, got {first!r}")
        if not self.stream_gap_threshold_ms > 0:
            raise ValueError(f"stream_gap_threshold_ms must be > 0, got {self.stream_gap_threshold_ms!r}")
        if not 0.0 <= self.healthy_sample <= 1.0:
            raise ValueError(f"healthy_sample must be between 0 and 1, got {self.healthy_sample!r}")
        if self.exporter_cpu_budget is not None and not self.exporter_cpu_budget > 0:
            raise ValueError(f"exporter_cpu_budget must be > 0 or None (no budget), got {self.exporter_cpu_budget!r}")
        if self.export_budget_per_s is not None and not self.export_budget_per_s > 0:
            raise ValueError(f"export_budget_per_s must be > 0 or None (no budget), got {self.export_budget_per_s!r}")
        for name in ("export_budget_burst", "signature_budget_per_s", "signature_budget_burst"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in (
            "max_traces_in_flight",
            "max_stages_per_trace",
            "max_stage_names",
            "queue_size",
            "max_budget_signatures",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        return self


def disabled_from_env() -> bool:
    """``STAGETRACE_DISABLED=true`` (or OpenTelemetry's ``OTEL_SDK_DISABLED=true``): every call a no-op."""
    return env_flag("STAGETRACE_DISABLED") or env_flag("OTEL_SDK_DISABLED")


def auto_stages_from_env() -> bool:
    """``STAGETRACE_AUTO_STAGES=true``: automatic stages in zero-code runs."""
    return env_flag("STAGETRACE_AUTO_STAGES")


def output_dir_from_env() -> str:
    """``STAGETRACE_OUTPUT_DIR``: where the embedded default writes its JSON lines."""
    return os.environ.get("STAGETRACE_OUTPUT_DIR") or DEFAULT_OUTPUT_DIR


def _stream_threshold_from_env(var: str) -> float | None:
    """``STAGETRACE_STREAM_FIRST_CHUNK_MS`` / ``STAGETRACE_STREAM_GAP_MS``: None when unset."""
    if not os.environ.get(var, "").strip():
        return None
    return _number_from_env(var, 0.0, "a number of milliseconds > 0", _positive)


def slow_threshold_from_env(default: float = DEFAULT_SLOW_THRESHOLD_MS) -> float:
    return _number_from_env("STAGETRACE_SLOW_THRESHOLD_MS", default, "a number of milliseconds > 0", lambda v: v > 0)


# --- the configuration reference (docs/reference/configuration.md is generated from these two tables and from
# Settings itself; nothing reads them at run time). A STAGETRACE_* variable the package reads and missing here,
# or a Settings field without a line below, fails the docs build.
ENVIRONMENT_REFERENCE: tuple[tuple[str, str, str], ...] = (
    # (variable, values and default, effect)
    (
        "STAGETRACE_SLOW_THRESHOLD_MS",
        "milliseconds > 0; default 200",
        "the slow threshold; `configure(slow_threshold_ms=...)` wins over it, it wins over `Settings`",
    ),
    (
        "STAGETRACE_STREAM_FIRST_CHUNK_MS",
        "milliseconds > 0; default: the slow threshold",
        "a streamed response is slow when its first chunk comes later than this "
        "(`Settings.stream_first_chunk_threshold_ms`)",
    ),
    (
        "STAGETRACE_STREAM_GAP_MS",
        "milliseconds > 0; default 100",
        "... or when the p99 of its gaps between chunks is longer than this (`Settings.stream_gap_threshold_ms`)",
    ),
    (
        "STAGETRACE_DISABLED",
        "`true` (also `1`, `yes`, `on`); default off",
        "every stagetrace call becomes a no-op; OpenTelemetry's `OTEL_SDK_DISABLED=true` does the same",
    ),
    (
        "STAGETRACE_NO_PROCESS_POOLS",
        "`true` (also `1`, `yes`, `on`); default off",
        "calls handed to process pools are not traced as offload stages (`Settings.process_pools`)",
    ),
    (
        "STAGETRACE_OUTPUT_DIR",
        "a directory; default `./stagetrace-out`",
        "where the embedded default (nothing configured) writes its OTLP JSON lines",
    ),
    (
        "STAGETRACE_AUTO_STAGES",
        "`true` (also `1`, `yes`, `on`); default off",
        "automatic stages in zero-code runs: PIL, torchvision, tokenizers, torch copies and forward, serialisation",
    ),
    (
        "STAGETRACE_EXPORT_PROCESS",
        "`on` (default) or `off`",
        "where the work after capture runs: an exporter process, or a thread of the application "
        "(`Settings.export_process`)",
    ),
    (
        "STAGETRACE_LIGHT_SPANS",
        "`on` (default) or `off`",
        "other instrumentations' spans inside a held trace recorded as light spans and built in the exporter, or "
        "SDK spans in the application (`Settings.light_spans`)",
    ),
    (
        "STAGETRACE_HEALTHY_SAMPLE",
        "0..1; default 0.1",
        "the share of healthy traces exported in full; slow, diagnosed and errored ones are, within the export "
        "budget (`Settings.healthy_sample`)",
    ),
    (
        "STAGETRACE_EXPORT_BUDGET",
        "traces a second > 0, default 20; or `off`",
        "at most this many full traces exported a second; `off`: every trace worth keeping is exported "
        "(`Settings.export_budget_per_s`)",
    ),
    (
        "STAGETRACE_EXPORTER_CPU_BUDGET",
        f"a share > 0, default {DEFAULT_EXPORTER_CPU_BUDGET}; or `off`",
        "the exporter's CPU, at most this share of the application process's (and at least 1 % of a CPU): past "
        "it the diagnosis rules run on a share of traces, every kept trace among them, and the diagnosis "
        "counter is weighted to stay unbiased; `off`: every trace diagnosed (`Settings.exporter_cpu_budget`)",
    ),
    (
        "STAGETRACE_PURE_PYTHON",
        "`1` (also `true`, `yes`, `on`); default off",
        "the exporter process imports the sources of its compiled modules too (the application always does; "
        "at install, nothing is compiled)",
    ),
    (
        "STAGETRACE_RECORD_QUERY_STRINGS",
        "`true` (also `1`, `yes`, `on`); default off",
        "keep query strings in the local root's `http.target`, `http.url`, `url.full` and `url.query`, which are "
        "otherwise cut off before export (`Settings.record_query_strings`)",
    ),
)

SETTINGS_REFERENCE: dict[str, str] = {
    "slow_threshold_ms": "a trace is slow when its local root lasts longer than this",
    "route_slow_thresholds_ms": "slow thresholds per route (`http.route`), over the global one",
    "stream_first_chunk_threshold_ms": "a streamed response is slow when its first chunk comes later than this "
    "(None: the slow threshold of its route)",
    "stream_gap_threshold_ms": "... or when the p99 of its gaps between chunks is longer than this",
    "route_first_chunk_thresholds_ms": "first-chunk thresholds per route, over the global one",
    "route_gap_thresholds_ms": "gap thresholds per route, over the global one",
    "thresholds": "every number the diagnosis rules compare against (`DiagnosisThresholds`)",
    "max_traces_in_flight": "traces held at once; a trace started past it is not tracked (`traces_in_flight`)",
    "trace_ttl_s": "a root that has not ended after this long is evicted (`trace_timeout`)",
    "max_stages_per_trace": "stages kept per trace; the rest are counted (`stages_per_trace`)",
    "max_stage_names": "distinct stage names in metric attributes; the rest become `_other`",
    "queue_size": "finished traces waiting for the helper thread (`handoff_queue_full` past it)",
    "sweep_interval_s": "how often traces in flight are checked against `trace_ttl_s`",
    "poll_interval_s": "how often the helper thread ships finished traces while busy (verdicts arrive this late)",
    "gpu_wait_timeout_s": "how long a trace waits for its CUDA events to complete (`gpu_event_timeout`)",
    "max_parked": "finished traces waiting for their CUDA events; past it the oldest go as they are",
    "slow_log_per_minute": "slow-trace log lines a minute, at most",
    "shutdown_timeout_s": "the deadline for flushing at shutdown",
    "record_query_strings": "keep query strings on the local root (`STAGETRACE_RECORD_QUERY_STRINGS`)",
    "cpu_signals": "per-stage on-CPU, run-queue and blocked time (two schedstat reads a stage)",
    "process_pools": "calls handed to process pools traced as offload stages (off: `STAGETRACE_NO_PROCESS_POOLS=1`)",
    "gil_sampler_period_s": "the GIL monitor's period while a trace is in flight; 0 turns it off",
    "gil_wait_bound_s": "the longest a thread waiting for the GIL sleeps at a stretch (the switch interval)",
    "loop_lag_interval_s": "the event-loop lag monitor's period",
    "export_process": "run the exporter in its own process (`STAGETRACE_EXPORT_PROCESS`)",
    "light_spans": "record other instrumentations' spans as light spans (`STAGETRACE_LIGHT_SPANS`)",
    "healthy_sample": "share of healthy traces exported in full (`STAGETRACE_HEALTHY_SAMPLE`)",
    "channel_buffer_bytes": "bytes waiting for the pipe to the exporter, at most (`channel_full` past it)",
    "exporter_restarts_per_minute": "exporter process restarts a minute before it is given up",
    "export_budget_per_s": "full traces exported a second at most; None: no budget (`STAGETRACE_EXPORT_BUDGET`)",
    "export_budget_burst": "the export budget's burst",
    "signature_budget_per_s": "full traces a second per signature (route or root name, bottleneck, codes)",
    "signature_budget_burst": "the per-signature burst",
    "max_budget_signatures": "signatures the budget remembers at most",
    "exporter_cpu_budget": "the exporter's CPU at most this share of the application's, diagnosing a share of "
    "traces past it; None: every trace diagnosed (`STAGETRACE_EXPORTER_CPU_BUDGET`)",
    "batch_keep_wait_s": "how long a batch span waits for its members' keep decisions",
    "max_pending_batches": "batch spans waiting for those decisions at most",
}
