"""The process-level signals a trace is judged on, beside its stages: joined in by the exporter over the
trace's window (``exporter.signals``), read by the rules (``diagnosis.py``, ``causes.py``). Apart from the
stage records (``model.py``) so that the stream summary they carry (``streams.py``, which reads stages)
imports no circle."""

from __future__ import annotations

from typing import NamedTuple

from stagetrace.analysis.streams import StreamSummary


class ProcessLoad(NamedTuple):
    """What the process asked of the host's CPUs over a trace's window (``exporter.signals.process_load``):
    the CPUs it may use, how many of them its threads used, how many threads were running or waiting for a
    CPU on average, and how many requests were in flight meanwhile (None: not read)."""

    cpus: int
    cpus_used: float
    runnable: float
    requests: float | None


class TraceSignals(NamedTuple):
    """Process-level signals over the trace's time window, joined in by the exporter (None: not measured).
    A named tuple, not a frozen dataclass: one is made for every trace, and a tuple is made in a third of
    the time."""

    gpu_utilization: float | None = None
    gil_pressure_ms: float | None = None
    cpu_pressure_ms: float | None = None  # how long the GIL monitor's wake-ups waited for a CPU (mean)
    loop_lag_ms: float | None = None
    loop_held_ms: float | None = None  # of the worst loop stall, what work on the loop's own thread explains
    blocked_by: tuple[str, ...] = ()  # the stages that held the loop while the request waited ("<stage>@<trace id>")
    stream: StreamSummary | None = None  # its response streamed: chunks, gaps, phases
    load: ProcessLoad | None = None  # the process's CPU use, runnable threads and requests over the window


NO_SIGNALS = TraceSignals()
