"""Every number a diagnosis rule compares against, in one record that users override
(``configure(thresholds=DiagnosisThresholds(...))``); each rule declares which of them it reads."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DiagnosisThresholds:
    """Every number a rule compares against; override any of them through ``configure(thresholds=...)``."""

    min_stage_ms: float = 5.0  # stages shorter than this never trigger a per-stage rule
    gpu_starved_utilization: float = 0.30
    gpu_starved_cpu_share: float = 0.50
    pageable_min_bytes: int = 64 * 1024
    blocked_share: float = 0.25  # of a CPU stage's wall time
    blocked_min_ms: float = 5.0  # and at least this much: a few ms lost to other threads is normal
    # GIL monitor wake-up lag (mean over the request): from gil_pressure_ms the GIL was contended, below gil_free_ms it
    # was free; in between a GIL wait and a lock wait look alike (``blocked_cause``).
    gil_pressure_ms: float = 1.0
    gil_free_ms: float = 0.5
    # Where the blocked time's cause can be told (``blocked_cause``). A host with CPUs to spare: the stage's
    # run-queue time under quiet_share of its time off the CPU, and the GIL monitor's wake-ups waiting under
    # quiet_cpu_pressure_ms for a CPU. A host out of CPUs: the stage's share at least queued_share, or the
    # GIL monitor's wait at least cpu_pressure_ms. A GIL wait of gil_held_ms (a whole 5 ms switch interval), and
    # gil_over_cpu times the GIL monitor's wait for a CPU, is holders running Python through their interval.
    quiet_share: float = 0.10
    quiet_cpu_pressure_ms: float = 1.0
    queued_share: float = 0.25
    queued_min_ms: float = 1.0
    cpu_pressure_ms: float = 2.0
    gil_held_ms: float = 5.0
    gil_over_cpu: float = 2.0
    # From this share of their time in the run queue, the process's other threads (the GIL's would-be holders)
    # count as preempted while holding it: short GIL-like waits may be theirs, whatever the GIL monitor read.
    holders_queued_share: float = 0.5
    runqueue_share: float = 0.30
    runqueue_min_ms: float = 5.0  # a few ms waiting for a CPU on a busy host is not actionable
    # A wait for a CPU is the service at capacity (SERVICE_AT_CAPACITY) when more requests were in flight
    # than there are CPUs and they were at least this share of the process's threads running or queued for a
    # CPU; more threads beside them than that is oversubscription by threads (CPU_OVERSUBSCRIBED).
    capacity_requests_share: float = 0.5
    event_loop_stage_ms: float = 20.0
    event_loop_lag_ms: float = 50.0
    event_loop_wait_ms: float = 20.0  # a request waiting this long for its loop while others' stages held it ...
    event_loop_wait_share: float = 0.20  # ... and this share of the request
    queueing_ms: float = 10.0
    queueing_share: float = 0.20
    untracked_share: float = 0.50
    untracked_min_ms: float = 10.0
    batch_wait_share: float = 0.40  # of the request spent waiting for its batch to form
    batch_wait_min_ms: float = 10.0
    batch_underfilled_fill: float = 0.50  # batches below this share of their max size ...
    batch_underfilled_gpu_share: float = 0.50  # ... while GPU stages hold less than this of the batch's run
    stream_min_chunks: int = 8  # the stream rules read streams of at least this many chunks
    stream_cpu_share: float = 0.40  # a CPU stage's share of the time between chunks (STREAM_CPU_BOUND)
    slow_consumer_share: float = 0.25  # awaiting send() as a share of the time between chunks ...
    slow_consumer_min_ms: float = 20.0  # ... and at least this long (SLOW_CONSUMER)
    stream_stall_factor: float = 10.0  # the longest gap at least this many times the median ...
    stream_stall_min_ms: float = 100.0  # ... and at least this long (STREAM_STALL)
    # Calls handed to a process pool (the offload rules): a wait for a worker with every worker busy, of at least
    # pool_saturated_min_ms and pool_saturated_share of the request (POOL_SATURATED); the arguments' and
    # result's way there and back of at least ipc_min_ms and ipc_share, or a call moving ipc_payload_bytes or more
    # (IPC_BOUND); a worker's first task waiting at least cold_start_min_ms and cold_start_share for it to start
    # (WORKER_COLD_START). The worker's own wait for a CPU reads runqueue_share and runqueue_min_ms.
    pool_saturated_share: float = 0.25
    pool_saturated_min_ms: float = 10.0
    ipc_share: float = 0.25
    ipc_min_ms: float = 5.0
    ipc_payload_bytes: int = 1 << 20
    cold_start_share: float = 0.25
    cold_start_min_ms: float = 50.0

    @classmethod
    def silent(cls) -> DiagnosisThresholds:
        """Thresholds no trace reaches: none fires, and every rule is evaluated but the four per-stage CPU
        rules, which only judge stages of at least ``min_stage_ms`` and so are skipped as on a trace of short
        stages (their own minimums need no value here), and BATCH_UNDERFILLED, which needs a queue of at least
        ``queueing_ms`` behind the batcher. For measuring what the analysis costs a healthy
        service on a host that would rightly diagnose it (a benchmark under valgrind, a test beside a CPU hog)."""
        return cls(
            min_stage_ms=math.inf,
            gpu_starved_utilization=-math.inf,
            pageable_min_bytes=sys.maxsize,
            event_loop_stage_ms=math.inf,
            event_loop_lag_ms=math.inf,
            event_loop_wait_ms=math.inf,
            queueing_ms=math.inf,
            untracked_min_ms=math.inf,
            batch_wait_min_ms=math.inf,
            stream_min_chunks=sys.maxsize,
            pool_saturated_min_ms=math.inf,
            ipc_min_ms=math.inf,
            cold_start_min_ms=math.inf,
        )
