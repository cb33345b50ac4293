"""Diagnosis rules (the README's table): a trace's analysis and signals in, codes with a message
and advice out. Each rule is a small pure function so that it can be tested, tuned and explained alone."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

from stagetrace.analysis.breakdown import TraceAnalysis
from stagetrace.analysis.loopwait import split_blocker
from stagetrace.analysis.model import StageLike, occurrences_ms
from stagetrace.analysis.streams import StreamSummary
from stagetrace.conventions import EVENT_LOOP_WAIT, GPU_KINDS


@dataclass(frozen=True, slots=True)
class Diagnosis:
    code: str
    message: str
    advice: str
    stage: str | None = None


@dataclass(frozen=True, slots=True)
class DiagnosisThresholds:
    """Every number a rule compares against; override any of them through ``configure(thresholds=...)``."""

    min_stage_ms: float = 5.0  # stages shorter than this never trigger a per-stage rule
    gpu_starved_utilization: float = 0.30
    gpu_starved_cpu_share: float = 0.50
    pageable_min_bytes: int = 64 * 1024
    blocked_share: float = 0.25  # of a CPU stage's wall time
    blocked_min_ms: float = 5.0  # and at least this much: a few ms lost to other threads is normal
    # Sampler wake-up lag (mean over the request): from gil_pressure_ms the GIL was contended, below gil_free_ms it
    # was free; in between a GIL wait and a lock wait look alike (``blocked_cause``).
    gil_pressure_ms: float = 1.0
    gil_free_ms: float = 0.5
    # Where the blocked time's cause can be told (``blocked_cause``). A host with CPUs to spare: the stage's
    # run-queue time under quiet_share of its time off the CPU, and the GIL sampler's wake-ups waiting under
    # quiet_cpu_pressure_ms for a CPU. A host out of CPUs: the stage's share at least queued_share, or the
    # sampler's wait at least cpu_pressure_ms. A GIL wait of gil_held_ms (a whole 5 ms switch interval), and
    # gil_over_cpu times the sampler's wait for a CPU, is holders running Python through their interval.
    quiet_share: float = 0.10
    quiet_cpu_pressure_ms: float = 1.0
    queued_share: float = 0.25
    queued_min_ms: float = 1.0
    cpu_pressure_ms: float = 2.0
    gil_held_ms: float = 5.0
    gil_over_cpu: float = 2.0
    runqueue_share: float = 0.30
    runqueue_min_ms: float = 5.0  # a few ms waiting for a CPU on a busy host is not actionable
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

    @classmethod
    def silent(cls) -> DiagnosisThresholds:
        """Thresholds no trace reaches: every rule is evaluated and none fires. For measuring what the
        analysis costs a healthy service on a host that would rightly diagnose it (a benchmark under
        valgrind, a test beside a CPU hog)."""
        return cls(
            min_stage_ms=math.inf,
            gpu_starved_utilization=-1.0,
            pageable_min_bytes=1 << 62,
            blocked_min_ms=math.inf,
            runqueue_min_ms=math.inf,
            event_loop_stage_ms=math.inf,
            event_loop_lag_ms=math.inf,
            event_loop_wait_ms=math.inf,
            queueing_ms=math.inf,
            untracked_min_ms=math.inf,
            batch_wait_min_ms=math.inf,
            batch_underfilled_fill=-1.0,
            stream_min_chunks=1 << 62,
        )


class TraceSignals(NamedTuple):
    """Process-level signals over the trace's time window, joined in by the exporter (None: not measured).
    A named tuple, not a frozen dataclass: one is made for every trace, and a tuple is made in a third of
    the time."""

    gpu_utilization: float | None = None
    gil_pressure_ms: float | None = None
    cpu_pressure_ms: float | None = None  # how long the GIL sampler's wake-ups waited for a CPU (mean)
    loop_lag_ms: float | None = None
    loop_held_ms: float | None = None  # of the worst loop stall, what work on the loop's own thread explains
    blocked_by: tuple[str, ...] = ()  # the stages that held the loop while the request waited ("<stage>@<trace id>")
    stream: StreamSummary | None = None  # its response streamed: chunks, gaps, phases


NO_SIGNALS = TraceSignals()

Stages = Sequence[StageLike]
Finding = Optional[Diagnosis]  # noqa: UP045 - a runtime alias, so no `|` on a class
Rule = Callable[[TraceAnalysis, Stages, TraceSignals, DiagnosisThresholds], Finding]

CPU_SIDE_KINDS = frozenset({"cpu", "io", "wait"})

ADVICE = {
    "GPU_STARVED": (
        "The GPU waits for the CPU side. Move decode/resize to the GPU (nvJPEG, torchvision.io.decode_jpeg "
        "on cuda, DALI), prefetch on a worker pool, and batch requests so each launch does more work."
    ),
    "PAGEABLE_H2D": (
        "Copy from pinned memory: tensor.pin_memory() or a reusable pinned staging buffer, then "
        ".to(device, non_blocking=True). A pageable source makes the copy synchronous and slower."
    ),
    "GIL_CONTENTION": (
        "Another Python thread holds the GIL. Move CPU-heavy Python to processes (ProcessPoolExecutor, "
        "separate workers) or to libraries that release the GIL; avoid pure-Python loops beside the server."
    ),
    "LOCK_OR_IO_WAIT": (
        "The stage was off-CPU while the GIL was free: it waited on a lock, a queue or I/O. Find what it "
        "blocks on (py-spy dump during a slow request) and shorten the critical section or make it async."
    ),
    "OFF_CPU_WAIT": (
        "The stage waited off the CPU, for the GIL or for a lock or I/O, and the signals could not tell which. "
        "`py-spy dump --pid <pid>` during a slow request shows what it waits on (`py-spy record --gil` whether "
        "it holds the GIL); a stage that spans several GIL-sampler periods gets a cause named."
    ),
    "CPU_OVERSUBSCRIBED": (
        "Runnable threads outnumber cores. Use fewer threads than cores: cap torch.set_num_threads, "
        "OMP_NUM_THREADS / MKL_NUM_THREADS, the worker count and the thread pool."
    ),
    "EVENT_LOOP_BLOCKED": (
        "Blocking work ran on the asyncio event loop and stalled every other request. Declare the endpoint "
        "with `def`, or offload with `await asyncio.to_thread(...)` / `run_in_threadpool`."
    ),
    "QUEUEING": (
        "The request waited for a worker thread or a batch slot. Raise the limit (anyio thread limiter, "
        "batch size), scale out, or shed load earlier."
    ),
    "BATCH_UNDERFILLED": (
        "Requests queued while batches ran far below their max size and the GPU did little of the batch's "
        "time: the batcher, not the GPU, is the limit. Let batches fill (a longer max wait, a larger max "
        "size), run fewer batcher replicas per GPU, and move per-batch CPU work out of the batch loop."
    ),
    "BATCH_WAIT": (
        "The request spent most of its time waiting for its batch to form. Shorten the batcher's max wait "
        "(or make it adaptive to the arrival rate): at this load a batch does not fill before it expires."
    ),
    "STREAM_CPU_BOUND": (
        "A CPU stage runs for every chunk and outweighs the model's own step. Detokenize incrementally (only "
        "the new tokens, not the whole sequence again), build each chunk's payload once and small, send "
        "several tokens a chunk, and move per-chunk work off the request's path."
    ),
    "SLOW_CONSUMER": (
        "The client (or a proxy between) reads slower than the stream is produced: the server's send buffer "
        "fills and the stream waits on it. Check client and proxy buffering (nginx proxy_buffering, a client "
        "that renders every token), send fewer, larger chunks, or pace the stream to its reader."
    ),
    "STREAM_STALL": (
        "Something stopped the stream once, far beyond its usual gap: a blocked event loop (see its "
        "event_loop.wait), a garbage-collection pause, a lock or a queue. Open the slowest occurrence of the "
        "repeated stages (stagetrace.compressed.slowest) and what ran around that moment."
    ),
    "UNTRACKED_TIME": (
        "Most of the request's time is in no stage. Add stages (@stagetrace.stage) around the code between "
        "the ones you have, or enable automatic stages for PIL, tokenizers and torch."
    ),
}


def _make(code: str, message: str, stage: str | None = None) -> Diagnosis:
    return Diagnosis(code=code, message=message, advice=ADVICE[code], stage=stage)


def _cpu_stages(stages: Sequence[StageLike], th: DiagnosisThresholds) -> list[StageLike]:
    return [s for s in stages if s.kind == "cpu" and s.wall_ms >= th.min_stage_ms]


def gpu_starved(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    if sig.gpu_utilization is None or a.total_ms <= 0 or sig.gpu_utilization >= th.gpu_starved_utilization:
        return None
    cpu_ms = sum(ms for name, ms in a.breakdown.items() if a.stage_kinds.get(name) in CPU_SIDE_KINDS)
    share = cpu_ms / a.total_ms
    if share <= th.gpu_starved_cpu_share:
        return None
    return _make(
        "GPU_STARVED",
        f"GPU utilisation was {sig.gpu_utilization:.0%} while CPU-side stages held {share:.0%} of the "
        f"{a.total_ms:.1f} ms request",
        a.bottleneck if a.stage_kinds.get(a.bottleneck or "") in CPU_SIDE_KINDS else None,
    )


def pageable_h2d(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    # Only real device copies count (CUDA-timed): on a CPU-only run "pinned" has no consequence.
    if "h2d" not in a.stage_kinds.values():
        return None
    hits = [
        s
        for s in stages
        if s.kind == "h2d"
        and s.h2d_pinned is False
        and s.gpu_ms is not None
        and (s.h2d_bytes or 0) >= th.pageable_min_bytes
    ]
    if not hits:
        return None
    worst = max(hits, key=lambda s: s.h2d_bytes or 0)
    return _make(
        "PAGEABLE_H2D",
        f"{len(hits)} host-to-device cop{'y' if len(hits) == 1 else 'ies'} from pageable memory "
        f"({(worst.h2d_bytes or 0) / 2**20:.1f} MiB in '{worst.name}')",
        worst.name,
    )


def _at_least(ms: float | None, floor_ms: float, share: float, s: StageLike) -> bool:
    return ms is not None and ms >= max(floor_ms, share * s.wall_ms)


def _waited_for_cpu(s: StageLike, th: DiagnosisThresholds) -> bool:
    return _at_least(s.runqueue_ms, th.runqueue_min_ms, th.runqueue_share, s)


def _host_out_of_cpus(sig: TraceSignals, th: DiagnosisThresholds) -> bool:
    return sig.cpu_pressure_ms is not None and sig.cpu_pressure_ms >= th.cpu_pressure_ms


def _queued_share(s: StageLike) -> float:
    """The share of the stage's time off the CPU that it spent in the run queue."""
    rq = s.runqueue_ms or 0.0
    off_cpu = rq + (s.blocked_ms or 0.0)
    return rq / off_cpu if off_cpu > 0 else 0.0


def _short_of_cpus(stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds) -> bool:
    """The process's threads waited for CPUs during the request (the sampler's wake-ups did, or a stage's)."""
    return (sig.cpu_pressure_ms or 0.0) >= th.quiet_cpu_pressure_ms or any(
        (s.runqueue_ms or 0.0) >= th.queued_min_ms and _queued_share(s) >= th.quiet_share
        for s in _cpu_stages(stages, th)
    )


def _gil_explainable_ms(s: StageLike) -> float:
    """The part of a stage's blocked time that waits for the GIL could account for."""
    return (s.blocked_ms or 0.0) - (s.not_gil_ms or 0.0)


def _proven_not_gil(s: StageLike, th: DiagnosisThresholds) -> bool:
    return _at_least(s.not_gil_ms, th.blocked_min_ms, th.blocked_share, s)


def _blocked_ms(s: StageLike) -> float:
    return s.blocked_ms or 0.0


# Why a CPU stage was blocked (off-CPU, not waiting for a CPU), as far as the signals can tell.
GIL, LOCK, PREEMPTED_HOLDERS, UNDETERMINED = "gil", "lock", "preempted holders", "undetermined"


def _cause_not_preemption(s: StageLike, sig: TraceSignals, th: DiagnosisThresholds, preempted_ms: float) -> str:
    """The cause of blocked time that preempted holders do not explain (all but ``preempted_ms`` of it):

    - LOCK: the stage's own scheduler counts prove that much of it was in waits longer than any wait for the
      GIL (``not_gil_ms``), or the GIL sampler found the GIL free;
    - GIL: waits as short as GIL waits, beyond ``preempted_ms``, while the sampler found the GIL contended;
    - UNDETERMINED: GIL pressure not measured, or between free and contended.
    """
    if _proven_not_gil(s, th):
        return LOCK
    pressure = sig.gil_pressure_ms
    gil_like = _at_least(_gil_explainable_ms(s) - preempted_ms, th.blocked_min_ms, th.blocked_share, s)
    if gil_like and pressure is not None and pressure >= th.gil_pressure_ms:
        return GIL
    if pressure is not None and pressure < th.gil_free_ms:
        return LOCK
    return UNDETERMINED


def _queued_for_cpu(s: StageLike, th: DiagnosisThresholds) -> bool:
    return (s.runqueue_ms or 0.0) >= th.queued_min_ms and _queued_share(s) >= th.queued_share


def _cpus_to_spare(s: StageLike, sig: TraceSignals, th: DiagnosisThresholds) -> bool:
    return _queued_share(s) < th.quiet_share and (sig.cpu_pressure_ms or 0.0) < th.quiet_cpu_pressure_ms


def blocked_cause(s: StageLike, sig: TraceSignals, th: DiagnosisThresholds) -> str | None:
    """None when the stage was not blocked enough to matter; else what its blocked time was.

    With CPUs to spare (the stage's wake-ups barely queued for a CPU, nor did the sampler's):

    - LOCK: its own scheduler counts prove that much of it was in waits longer than any wait for the GIL
      (``not_gil_ms``), or the GIL sampler found the GIL free.
    - GIL: waits as short as GIL waits while the sampler found the GIL contended.

    On a host out of CPUs a thread holding the GIL is preempted as often as it runs, every other thread waits
    on it, and the one made to drop the GIL waits, untimed, for a successor stuck in the run queue:

    - PREEMPTED_HOLDERS: waits as short as GIL waits; CPU_OVERSUBSCRIBED's cause and remedy, not GIL
      contention's. Always when the stage's own wake-ups queued for a CPU (the GIL sampler, a sleeper the
      scheduler favours, queues less than the threads beside it); when only the sampler's did, unless its
      GIL waits were a whole switch interval and far longer than its waits for a CPU (holders running
      Python through their interval): then GIL, as it is on a host a little short of CPUs.

    - LOCK: the GIL sampler found the GIL free: a holder the scheduler preempted keeps the GIL and would have
      held the sampler's wake-ups back too (the stage's own wait for a CPU is its run-queue time, named
      CPU_OVERSUBSCRIBED on its own when it is long).

    Unless preemption cannot account for it: every wait on a preempted holder, or on the GIL handed to a
    thread still queued for a CPU, is run-queue time of another thread of the process, so when the blocked
    time less all of theirs meanwhile (``others_runqueue_ms``) still matters, the host's shortage does not
    explain it and the cause is judged as with CPUs to spare, on that remainder.

    UNDETERMINED otherwise: GIL pressure not measured or between free and contended, long waits on a host
    short of CPUs (a lock, or the GIL handed to a thread stuck in the run queue), short ones on a host a little
    short of CPUs. Naming a cause there would be a guess.
    """
    if not _at_least(s.blocked_ms, th.blocked_min_ms, th.blocked_share, s):
        return None
    if _cpus_to_spare(s, sig, th):
        return _cause_not_preemption(s, sig, th, 0.0)
    preempted_at_most = s.others_runqueue_ms
    if preempted_at_most is not None and _at_least(
        _blocked_ms(s) - preempted_at_most, th.blocked_min_ms, th.blocked_share, s
    ):
        return _cause_not_preemption(s, sig, th, preempted_at_most)
    proven = _proven_not_gil(s, th)
    gil_like = _at_least(_gil_explainable_ms(s), th.blocked_min_ms, th.blocked_share, s)
    pressure = sig.gil_pressure_ms
    # A GIL the sampler found free was neither held nor with a holder the scheduler had preempted.
    free = pressure is not None and pressure < th.gil_free_ms
    if free:
        return LOCK
    if proven or not gil_like:
        return UNDETERMINED
    if _queued_for_cpu(s, th):
        return PREEMPTED_HOLDERS
    held = (
        pressure is not None and pressure >= th.gil_held_ms and pressure >= th.gil_over_cpu * (sig.cpu_pressure_ms or 0)
    )
    if held:
        return GIL
    return PREEMPTED_HOLDERS if _host_out_of_cpus(sig, th) else UNDETERMINED


# The part of a blocked stage's time each cause accounts for (what ranks the stages of one cause).
_EXPLAINED_BY: dict[str, Callable[[StageLike], float]] = {
    LOCK: _blocked_ms,
    GIL: _gil_explainable_ms,
    PREEMPTED_HOLDERS: _gil_explainable_ms,
    UNDETERMINED: _blocked_ms,
}


def _blocked_for(
    cause: str, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> StageLike | None:
    """The stage blocked longest for ``cause`` (by the part of its blocked time that cause explains)."""
    hits = [s for s in _cpu_stages(stages, th) if blocked_cause(s, sig, th) == cause]
    return max(hits, key=_EXPLAINED_BY[cause]) if hits else None


def gil_contention(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    s = _blocked_for(GIL, stages, sig, th)
    if s is None:
        return None
    return _make(
        "GIL_CONTENTION",
        f"'{s.name}' was blocked {_gil_explainable_ms(s):.1f} ms of its {s.wall_ms:.1f} ms while the GIL was "
        f"contended (sampler wake-up lag {sig.gil_pressure_ms:.1f} ms)",
        s.name,
    )


def lock_or_io_wait(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    s = _blocked_for(LOCK, stages, sig, th)
    if s is None:
        return None
    if _proven_not_gil(s, th):
        evidence = f", at least {s.not_gil_ms:.1f} ms of it in waits longer than a wait for the GIL lasts"
    else:
        evidence = " with the GIL free"
    return _make(
        "LOCK_OR_IO_WAIT",
        f"'{s.name}' was off-CPU {s.blocked_ms:.1f} ms of its {s.wall_ms:.1f} ms{evidence}: a lock, queue or I/O wait",
        s.name,
    )


def off_cpu_wait(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    """A blocked stage whose cause the signals cannot tell: what was measured, and why no cause is named."""
    s = _blocked_for(UNDETERMINED, stages, sig, th)
    if s is None:
        return None
    pressure = sig.gil_pressure_ms
    if not _cpus_to_spare(s, sig, th):
        cpu_wait = f", woken threads {sig.cpu_pressure_ms:.1f} ms" if sig.cpu_pressure_ms is not None else ""
        why = (
            f"the host was short of CPUs meanwhile (its own run-queue wait {s.runqueue_ms or 0.0:.1f} ms{cpu_wait}), "
            "and there a wait can be for a GIL holder the scheduler preempted"
        )
    elif pressure is None:
        why = "the request spanned too few GIL-sampler wake-ups to measure GIL pressure"
    else:
        why = (
            f"GIL pressure {pressure:.1f} ms lies between a free GIL (< {th.gil_free_ms:g} ms) and a contended "
            f"one (>= {th.gil_pressure_ms:g} ms)"
        )
    return _make(
        "OFF_CPU_WAIT",
        f"'{s.name}' was off-CPU {s.blocked_ms:.1f} ms of its {s.wall_ms:.1f} ms, for the GIL or for a lock or "
        f"I/O, and the signals cannot tell which: {why}",
        s.name,
    )


def cpu_oversubscribed(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    """A stage waited for a CPU (its run-queue time), or waited on GIL holders that the scheduler had
    preempted (``PREEMPTED_HOLDERS``); the stage that lost the most of the two is named."""
    hits = [
        (s, preempted)
        for s in _cpu_stages(stages, th)
        if (preempted := blocked_cause(s, sig, th) == PREEMPTED_HOLDERS) or _waited_for_cpu(s, th)
    ]
    if not hits:
        return None
    s, preempted = max(hits, key=lambda h: (h[0].runqueue_ms or 0.0) + (_gil_explainable_ms(h[0]) if h[1] else 0.0))
    message = f"'{s.name}' waited {s.runqueue_ms or 0.0:.1f} ms of its {s.wall_ms:.1f} ms for a CPU (run queue)"
    if preempted:
        message += (
            f", and {_gil_explainable_ms(s):.1f} ms more off-CPU in waits as short as GIL handoffs (a GIL holder "
            "preempted by the scheduler keeps the other threads waiting)"
        )
    if _host_out_of_cpus(sig, th):
        message += f"; the process's woken threads waited {sig.cpu_pressure_ms:.1f} ms on average for a CPU"
    return _make("CPU_OVERSUBSCRIBED", message, s.name)


def event_loop_blocked(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    """The request held its loop (a long sync stage of its own), or waited for it while other requests'
    sync stages held it (the ``event_loop.wait`` stage), whichever took longer; else a stall of the loop
    measured within the request while the process was not starved of the GIL or of CPUs."""
    on_loop = [s for s in stages if s.on_event_loop and s.kind not in GPU_KINDS and s.wall_ms >= th.event_loop_stage_ms]
    own = max(on_loop, key=lambda s: s.wall_ms) if on_loop else None
    wait_ms = sum(occurrences_ms(s) for s in stages if s.name == EVENT_LOOP_WAIT and s.kind == "wait")
    waited = (
        a.total_ms > 0
        and wait_ms >= th.event_loop_wait_ms
        and wait_ms >= th.event_loop_wait_share * a.total_ms
        and (own is None or wait_ms > own.wall_ms)
    )
    if waited:
        return _make(
            "EVENT_LOOP_BLOCKED",
            f"the request waited {wait_ms:.1f} ms ({wait_ms / a.total_ms:.0%}) for the event loop while other "
            f"requests' sync stages held it{_blockers(sig.blocked_by)}",
            EVENT_LOOP_WAIT,
        )
    if own is not None:
        return _make(
            "EVENT_LOOP_BLOCKED",
            f"sync stage '{own.name}' ran {own.wall_ms:.1f} ms on the event-loop thread",
            own.name,
        )
    # A stall while the loop's thread waited (for the GIL, for a CPU) is the process starving the loop, not work
    # on it: only the part work on the thread explains counts (loop_held_ms). Where that is not measured, a
    # stall on a host short of CPUs is not blamed on the loop either. The lag stays on the verdict.
    if sig.loop_held_ms is not None:
        if sig.loop_held_ms >= th.event_loop_lag_ms:
            return _make(
                "EVENT_LOOP_BLOCKED",
                f"work on the event-loop thread held the loop {sig.loop_held_ms:.1f} ms during the request"
                f" (lag {sig.loop_lag_ms or 0.0:.1f} ms)",
            )
        return None
    if sig.loop_lag_ms is not None and sig.loop_lag_ms >= th.event_loop_lag_ms and not _short_of_cpus(stages, sig, th):
        return _make("EVENT_LOOP_BLOCKED", f"event-loop lag reached {sig.loop_lag_ms:.1f} ms during the request")
    return None


def _blockers(blocked_by: tuple[str, ...]) -> str:
    if not blocked_by:
        return ""
    name, trace_id = split_blocker(blocked_by[0])
    more = f" and {len(blocked_by) - 1} more" if len(blocked_by) > 1 else ""
    return f": '{name}' of trace {trace_id}{more}"


def _queued_ms(s: StageLike) -> float:
    """A wait's time spent in a queue: all of it, except that a batch wait counts only the time its
    batcher's previous batch was still running (forming the batch is BATCH_WAIT's business)."""
    if s.batch is not None and s.batch.formation_ms is not None:
        return s.batch.busy_ms or 0.0
    return occurrences_ms(s)


def queueing(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    # A wait measured while its pool had free capacity is dispatch latency (often GIL contention), not a
    # queue: only waits not known to be unsaturated count.
    # The event-loop wait is EVENT_LOOP_BLOCKED's: no worker pool to grow there.
    waits = [
        s
        for s in stages
        if s.kind == "wait" and s.queue_saturated is not False and s.name != EVENT_LOOP_WAIT and _queued_ms(s) > 0
    ]
    wait_ms = sum(_queued_ms(s) for s in waits)
    if wait_ms < th.queueing_ms or a.total_ms <= 0 or wait_ms < th.queueing_share * a.total_ms:
        return None
    names = list(dict.fromkeys(s.name for s in waits))
    return _make(
        "QUEUEING",
        f"the request queued {wait_ms:.1f} ms ({wait_ms / a.total_ms:.0%}) in {', '.join(names)}",
        max(names, key=lambda n: a.breakdown.get(n, 0.0)) if names else None,
    )


def _batch_waits(stages: Sequence[StageLike]) -> list[StageLike]:
    return [s for s in stages if s.kind == "wait" and s.batch is not None and s.batch.formation_ms is not None]


def batch_wait(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    waits = _batch_waits(stages)
    formation = sum(s.batch.formation_ms or 0.0 for s in waits if s.batch is not None)
    if not waits or a.total_ms <= 0 or formation < max(th.batch_wait_min_ms, th.batch_wait_share * a.total_ms):
        return None
    worst = max(waits, key=lambda s: (s.batch.formation_ms or 0.0) if s.batch is not None else 0.0)
    b = worst.batch
    assert b is not None
    of_max = f" of {b.max_size}" if b.max_size else ""
    return _make(
        "BATCH_WAIT",
        f"the request waited {formation:.1f} ms ({formation / a.total_ms:.0%}) in '{worst.name}' for its batch to "
        f"form (it ran with {b.items}{of_max} items)",
        worst.name,
    )


def batch_underfilled(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    heads = [s for s in stages if s.batch is not None and s.batch.is_member_batch_stage and s.batch.max_size]
    if not heads:
        return None
    queued = sum(s.batch.busy_ms or 0.0 for s in _batch_waits(stages) if s.batch is not None)
    if queued < th.queueing_ms:
        return None  # no queue behind the batcher: small batches are all the load there is
    for head in heads:
        b = head.batch
        assert b is not None
        fill = b.fill or 0.0
        if fill >= th.batch_underfilled_fill:
            continue
        gpu_ms = sum(
            (s.gpu_ms if s.gpu_ms is not None else s.wall_ms)
            for s in stages
            if s.batch is not None and s.batch.id == b.id and s.kind in GPU_KINDS
        )
        gpu_share = gpu_ms / head.wall_ms if head.wall_ms > 0 else 0.0
        low_utilization = sig.gpu_utilization is not None and sig.gpu_utilization < th.gpu_starved_utilization
        if gpu_share >= th.batch_underfilled_gpu_share and not low_utilization:
            continue
        gpu_said = (
            f"GPU utilisation {sig.gpu_utilization:.0%}"
            if low_utilization and sig.gpu_utilization is not None
            else f"GPU stages {gpu_share:.0%} of its run"
        )
        return _make(
            "BATCH_UNDERFILLED",
            f"batch '{head.name}' ran {b.items} of {b.max_size} items ({fill:.0%}) while the request queued "
            f"{queued:.1f} ms behind the previous batch; {gpu_said}",
            head.name,
        )
    return None


def untracked_time(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    if not a.breakdown or a.total_ms <= 0:
        return None
    share = a.untracked_ms / a.total_ms
    if share < th.untracked_share or a.untracked_ms < th.untracked_min_ms:
        return None
    # On a host short of CPUs the server's own code (in no stage) waits for one like the stages do: said, so
    # that more stages are not the only remedy read into it.
    starved = (
        "; the host was short of CPUs meanwhile, and code in no stage waits for one too"
        if _short_of_cpus(stages, sig, th)
        else ""
    )
    return _make("UNTRACKED_TIME", f"{a.untracked_ms:.1f} ms ({share:.0%}) of the request is in no stage{starved}")


def stream_cpu_bound(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    s = sig.stream
    if s is None or s.chunks < th.stream_min_chunks or s.streaming_ms <= 0:
        return None
    cpu = {n: ms for n, ms in s.gap_breakdown.items() if a.stage_kinds.get(n) == "cpu"}
    if not cpu:
        return None
    name = max(cpu, key=cpu.__getitem__)
    ms = cpu[name]
    gpu_ms = sum(ms for n, ms in s.gap_breakdown.items() if a.stage_kinds.get(n) in GPU_KINDS)
    share = ms / s.streaming_ms
    if share < th.stream_cpu_share or ms <= gpu_ms:
        return None
    gaps = s.chunks - 1
    model = f", more than the model's own step ({gpu_ms / gaps:.2f} ms a chunk)" if gpu_ms else ""
    return _make(
        "STREAM_CPU_BOUND",
        f"{name} took {share:.0%} of the time between chunks ({ms / gaps:.2f} ms a chunk){model}",
        name,
    )


def slow_consumer(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    s = sig.stream
    if s is None or s.chunks < th.stream_min_chunks or s.streaming_ms <= 0:
        return None
    if s.send_wait_ms < th.slow_consumer_min_ms or s.send_wait_ms < th.slow_consumer_share * s.streaming_ms:
        return None
    return _make(
        "SLOW_CONSUMER",
        f"the stream waited {s.send_wait_ms:.1f} ms ({s.send_wait_ms / s.streaming_ms:.0%} of its "
        f"{s.streaming_ms:.1f} ms between first and last chunk) for its client to take the chunks",
    )


def stream_stall(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    s = sig.stream
    if s is None or s.chunks < th.stream_min_chunks or s.gap_max_ms is None or s.gap_p50_ms is None:
        return None
    if s.gap_max_ms < th.stream_stall_min_ms or s.gap_max_ms < th.stream_stall_factor * s.gap_p50_ms:
        return None
    return _make(
        "STREAM_STALL",
        f"one gap between chunks lasted {s.gap_max_ms:.1f} ms, {s.gap_max_ms / max(s.gap_p50_ms, 1e-3):.0f} "
        f"times the stream's median gap ({s.gap_p50_ms:.2f} ms)",
    )


RULES: tuple[tuple[str, Rule], ...] = (
    ("GPU_STARVED", gpu_starved),
    ("PAGEABLE_H2D", pageable_h2d),
    ("GIL_CONTENTION", gil_contention),
    ("LOCK_OR_IO_WAIT", lock_or_io_wait),
    ("OFF_CPU_WAIT", off_cpu_wait),
    ("CPU_OVERSUBSCRIBED", cpu_oversubscribed),
    ("EVENT_LOOP_BLOCKED", event_loop_blocked),
    ("QUEUEING", queueing),
    ("BATCH_WAIT", batch_wait),
    ("BATCH_UNDERFILLED", batch_underfilled),
    ("STREAM_CPU_BOUND", stream_cpu_bound),
    ("SLOW_CONSUMER", slow_consumer),
    ("STREAM_STALL", stream_stall),
    ("UNTRACKED_TIME", untracked_time),
)
RULE_CODES = tuple(code for code, _ in RULES)
# Codes that report a measurement without naming a cause, and the causes they could not tell apart.
UNDETERMINED_BETWEEN: dict[str, tuple[str, ...]] = {
    "OFF_CPU_WAIT": ("GIL_CONTENTION", "LOCK_OR_IO_WAIT", "CPU_OVERSUBSCRIBED")
}
_NEEDS_CPU_SIGNALS = frozenset({"GIL_CONTENTION", "LOCK_OR_IO_WAIT", "OFF_CPU_WAIT", "CPU_OVERSUBSCRIBED"})


def diagnose(
    analysis: TraceAnalysis,
    stages: Sequence[StageLike],
    signals: TraceSignals = NO_SIGNALS,
    thresholds: DiagnosisThresholds = DiagnosisThresholds(),
) -> tuple[Diagnosis, ...]:
    """Run every rule; at most one diagnosis per code, in the order of ``RULES``.

    Stages that started after the root ended (background work) are not the request's problem and are
    left out, matching the breakdown.
    """
    if len(analysis.charged_ms) == len(stages):
        in_request = [s for s, charged in zip(stages, analysis.charged_ms) if charged is not None]
    else:
        in_request = list(stages)
    # Most traces carry no CPU or GPU signals at all: skip the rules that would only find nothing.
    has_cpu_signals = any(s.blocked_ms is not None or s.runqueue_ms is not None for s in in_request)
    found = []
    for code, rule in RULES:
        if code in _NEEDS_CPU_SIGNALS and not has_cpu_signals:
            continue
        d = rule(analysis, in_request, signals, thresholds)
        if d is not None:
            found.append(d)
    return tuple(found)
