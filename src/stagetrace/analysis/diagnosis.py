"""Diagnosis rules (the README's table): a trace's analysis and signals in, codes with a message
and advice out. Each rule is a small pure function so that it can be tested, tuned and explained alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from stagetrace.analysis.breakdown import TraceAnalysis
from stagetrace.analysis.loopwait import split_blocker
from stagetrace.analysis.model import StageLike
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
    blocked_share: float = 0.30  # of a CPU stage's wall time
    blocked_min_ms: float = 5.0  # and at least this much: a few ms lost to other threads is normal
    # Sampler wake-up lag (mean over the request): from gil_pressure_ms the GIL was contended, below gil_free_ms
    # it was free. In between the signal cannot tell a GIL wait from a lock wait, and neither rule fires.
    gil_pressure_ms: float = 1.5
    gil_free_ms: float = 1.0
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


@dataclass(frozen=True, slots=True)
class TraceSignals:
    """Process-level signals over the trace's time window, joined in by the exporter (None: not measured)."""

    gpu_utilization: float | None = None
    gil_pressure_ms: float | None = None
    loop_lag_ms: float | None = None
    blocked_by: tuple[str, ...] = ()  # the stages that held the loop while the request waited ("<stage>@<trace id>")


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


def _blocked_stage(stages: Sequence[StageLike], th: DiagnosisThresholds) -> StageLike | None:
    candidates = [
        s
        for s in _cpu_stages(stages, th)
        if s.blocked_ms is not None and s.blocked_ms >= max(th.blocked_min_ms, th.blocked_share * s.wall_ms)
    ]
    return max(candidates, key=lambda s: s.blocked_ms or 0.0) if candidates else None


def gil_contention(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    s = _blocked_stage(stages, th)
    if s is None or sig.gil_pressure_ms is None or sig.gil_pressure_ms < th.gil_pressure_ms:
        return None
    return _make(
        "GIL_CONTENTION",
        f"'{s.name}' was blocked {s.blocked_ms:.1f} ms of its {s.wall_ms:.1f} ms while the GIL was contended "
        f"(sampler wake-up lag {sig.gil_pressure_ms:.1f} ms)",
        s.name,
    )


def lock_or_io_wait(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    # Needs a GIL pressure measured low: without one, or with one in the band where GIL contention and a lock
    # wait look alike, "blocked" is not called a lock wait.
    s = _blocked_stage(stages, th)
    if s is None or sig.gil_pressure_ms is None or sig.gil_pressure_ms >= th.gil_free_ms:
        return None
    return _make(
        "LOCK_OR_IO_WAIT",
        f"'{s.name}' was off-CPU {s.blocked_ms:.1f} ms of its {s.wall_ms:.1f} ms with the GIL free: "
        "a lock, queue or I/O wait",
        s.name,
    )


def cpu_oversubscribed(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    hits = [
        s
        for s in _cpu_stages(stages, th)
        if s.runqueue_ms is not None and s.runqueue_ms >= max(th.runqueue_min_ms, th.runqueue_share * s.wall_ms)
    ]
    if not hits:
        return None
    s = max(hits, key=lambda s: s.runqueue_ms or 0.0)
    return _make(
        "CPU_OVERSUBSCRIBED",
        f"'{s.name}' waited {s.runqueue_ms:.1f} ms of its {s.wall_ms:.1f} ms for a CPU (run queue)",
        s.name,
    )


def event_loop_blocked(
    a: TraceAnalysis, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> Diagnosis | None:
    """The request held its loop (a long sync stage of its own), or waited for it while other requests'
    sync stages held it (the ``event_loop.wait`` stage), whichever took longer; else a stall of the loop
    measured within the request."""
    on_loop = [s for s in stages if s.on_event_loop and s.kind not in GPU_KINDS and s.wall_ms >= th.event_loop_stage_ms]
    own = max(on_loop, key=lambda s: s.wall_ms) if on_loop else None
    wait_ms = sum(s.wall_ms for s in stages if s.name == EVENT_LOOP_WAIT and s.kind == "wait")
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
    if sig.loop_lag_ms is not None and sig.loop_lag_ms >= th.event_loop_lag_ms:
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
    return s.wall_ms


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
    return _make("UNTRACKED_TIME", f"{a.untracked_ms:.1f} ms ({share:.0%}) of the request is in no stage")


RULES: tuple[tuple[str, Rule], ...] = (
    ("GPU_STARVED", gpu_starved),
    ("PAGEABLE_H2D", pageable_h2d),
    ("GIL_CONTENTION", gil_contention),
    ("LOCK_OR_IO_WAIT", lock_or_io_wait),
    ("CPU_OVERSUBSCRIBED", cpu_oversubscribed),
    ("EVENT_LOOP_BLOCKED", event_loop_blocked),
    ("QUEUEING", queueing),
    ("BATCH_WAIT", batch_wait),
    ("BATCH_UNDERFILLED", batch_underfilled),
    ("UNTRACKED_TIME", untracked_time),
)
RULE_CODES = tuple(code for code, _ in RULES)
_NEEDS_CPU_SIGNALS = frozenset({"GIL_CONTENTION", "LOCK_OR_IO_WAIT", "CPU_OVERSUBSCRIBED"})


def diagnose(
    analysis: TraceAnalysis,
    stages: Sequence[StageLike],
    signals: TraceSignals = TraceSignals(),
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
