"""Every tunable number in one place, with the bounds that keep memory flat (principle 4)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from stagetrace.analysis import DiagnosisThresholds

DEFAULT_SLOW_THRESHOLD_MS = 200.0


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Settings:
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS
    route_slow_thresholds_ms: dict[str, float] = field(default_factory=dict)
    thresholds: DiagnosisThresholds = field(default_factory=DiagnosisThresholds)
    max_traces_in_flight: int = 20_000
    trace_ttl_s: float = 300.0
    max_stages_per_trace: int = 512
    max_stage_names: int = 256
    queue_size: int = 10_000
    sweep_interval_s: float = 1.0
    poll_interval_s: float = 0.01  # how often a busy finalizer drains its queue
    gpu_wait_timeout_s: float = 30.0
    slow_log_per_minute: int = 60
    shutdown_timeout_s: float = 5.0
    record_query_strings: bool = field(default_factory=lambda: env_flag("STAGETRACE_RECORD_QUERY_STRINGS"))
    cpu_signals: bool = True  # per-stage on-CPU / run-queue / blocked time (two schedstat reads per stage)
    gil_sampler_period_s: float = 0.010  # 0 turns the GIL-pressure sampler off
    loop_lag_interval_s: float = 0.050

    def threshold_for(self, route: str | None) -> float:
        if route and route in self.route_slow_thresholds_ms:
            return self.route_slow_thresholds_ms[route]
        return self.slow_threshold_ms

    def validate(self) -> Settings:
        if not self.slow_threshold_ms > 0:
            raise ValueError(f"slow_threshold_ms must be > 0, got {self.slow_threshold_ms!r}")
        for route, ms in self.route_slow_thresholds_ms.items():
            if not isinstance(route, str) or not ms > 0:
                raise ValueError(f"route_slow_thresholds_ms needs str routes and values > 0, got {route!r}: {ms!r}")
        for name in ("max_traces_in_flight", "max_stages_per_trace", "max_stage_names", "queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        return self


def slow_threshold_from_env(default: float = DEFAULT_SLOW_THRESHOLD_MS) -> float:
    raw = os.environ.get("STAGETRACE_SLOW_THRESHOLD_MS")
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"STAGETRACE_SLOW_THRESHOLD_MS must be a number of milliseconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"STAGETRACE_SLOW_THRESHOLD_MS must be > 0, got {raw!r}")
    return value
