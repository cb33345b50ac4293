"""Diagnosis rules: a trace's analysis and signals in, codes with a message and advice out. A rule is one
``DiagnosisRule`` record: its code, its check (a small pure function, tested, tuned and explained alone),
its advice, the signals it cannot fire without, and the thresholds it reads (``DiagnosisThresholds``
fields: the docs list them per rule, and a test checks the list against what the check reads). Why a
blocked stage was blocked is ``causes.py``'s."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

from stagetrace.analysis.breakdown import TraceAnalysis
from stagetrace.analysis.causes import (
    CLASSIFIER_THRESHOLDS,
    EXPLAINED_BY,
    GIL,
    LOCK,
    PREEMPTED_HOLDERS,
    UNDETERMINED,
    BlockedCause,
    JudgedStages,
    Oversubscription,
    blocked_causes,
    cpus_to_spare,
    gil_explainable_ms,
    holders_preempted,
    host_out_of_cpus,
    others_too_idle_for_gil,
    oversubscription,
    proven_not_gil,
    short_of_cpus,
    waited_for_cpu,
)
from stagetrace.analysis.loopwait import split_blocker
from stagetrace.analysis.model import StageLike, occurrences_ms
from stagetrace.analysis.offload import QUEUE as OFFLOAD_QUEUE
from stagetrace.analysis.offload import RUN, offload_calls
from stagetrace.analysis.signals import NO_SIGNALS, TraceSignals
from stagetrace.analysis.thresholds import DiagnosisThresholds
from stagetrace.conventions import EVENT_LOOP_WAIT, GPU_KINDS


@dataclass(frozen=True)
class Diagnosis:
    """``message``: the finding, in a sentence; ``evidence``: the measurements that decided the cause, where
    a rule has more to say than its finding (kept apart so that neither reads as one long sentence).

    ``diagnose`` sets its fields as one dict (no slots, so that it can): a frozen dataclass's ``__init__``
    sets each through ``object.__setattr__`` in interpreted code, on every trace a rule fires for."""

    code: str
    message: str
    advice: str
    stage: str | None = None
    evidence: str | None = None


class Found(NamedTuple):
    """What a check found: the finding, the stage it names (if one), and its evidence (if any)."""

    message: str
    stage: str | None = None
    evidence: str | None = None


Stages = Sequence[StageLike]
Finding = Optional[Found]  # noqa: UP045 - a runtime alias, so no `|` on a class
Check = Callable[[TraceAnalysis, Stages, TraceSignals, DiagnosisThresholds], Finding]


class Signal(enum.Enum):
    """What a rule cannot fire without; ``diagnose`` skips the rule for a trace that lacks it."""

    STAGE_CPU = "per-stage CPU readings (schedstat or the thread's CPU clock) on a CPU stage of min_stage_ms or more"
    GPU_UTILIZATION = "NVML utilisation over the trace"
    STREAM = "a streamed response"
    # What a trace's stages hold: a rule about a kind of stage is not run on the many traces without one (each
    # run costs the exporter a call and its reads on every trace).
    H2D_STAGE = "a host-to-device copy stage"
    WAIT_STAGE = "a wait stage"
    BATCH = "a stage a batcher ran or formed (its batch fields)"
    OFFLOAD = "a call handed to a process pool"

    # A member is its own identity (Enum's equality): hashed by it in C, where Enum's ``__hash__`` is a Python
    # call (about a thousand instructions a set or dict operation on a member).
    __hash__ = object.__hash__


@dataclass(frozen=True, slots=True)
class DiagnosisRule:
    code: str
    check: Check
    advice: str
    requires: frozenset[Signal] = frozenset()
    thresholds: tuple[str, ...] = ()  # the DiagnosisThresholds fields its check reads
    undetermined_between: tuple[str, ...] = ()  # a code that names no cause: the causes it could not tell apart


CPU_SIDE_KINDS = frozenset({"cpu", "io", "wait"})
DEFAULT_THRESHOLDS = DiagnosisThresholds()


def gpu_starved(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    if sig.gpu_utilization is None or a.total_ms <= 0 or sig.gpu_utilization >= th.gpu_starved_utilization:
        return None
    cpu_ms = sum(ms for name, ms in a.breakdown.items() if a.stage_kinds.get(name) in CPU_SIDE_KINDS)
    share = cpu_ms / a.total_ms
    if share <= th.gpu_starved_cpu_share:
        return None
    return Found(
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
    return Found(
        f"{len(hits)} host-to-device cop{'y' if len(hits) == 1 else 'ies'} from pageable memory "
        f"({(worst.h2d_bytes or 0) / 2**20:.1f} MiB in '{worst.name}')",
        worst.name,
    )


def _blocked_for(
    cause: BlockedCause, stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds
) -> StageLike | None:
    """The stage blocked longest for ``cause`` (by the part of its blocked time that cause explains)."""
    hits = [s for s, its in blocked_causes(stages, sig, th) if its == cause]
    return max(hits, key=EXPLAINED_BY[cause]) if hits else None


def gil_contention(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    s = _blocked_for(GIL, stages, sig, th)
    if s is None:
        return None
    return Found(
        f"'{s.name}' was blocked {gil_explainable_ms(s):.1f} ms of its {s.wall_ms:.1f} ms while the GIL was "
        f"contended (GIL monitor wake-up lag {sig.gil_pressure_ms:.1f} ms)",
        s.name,
    )


def lock_or_io_wait(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    s = _blocked_for(LOCK, stages, sig, th)
    if s is None:
        return None
    if proven_not_gil(s, th):
        evidence = f"at least {s.not_gil_ms:.1f} ms of it in waits longer than a wait for the GIL lasts"
    else:
        lag = "" if sig.gil_pressure_ms is None else f" (GIL monitor wake-up lag {sig.gil_pressure_ms:.1f} ms)"
        evidence = f"the GIL was free meanwhile{lag}"
    return Found(
        f"'{s.name}' was off-CPU {s.blocked_ms:.1f} ms of its {s.wall_ms:.1f} ms: a lock, queue or I/O wait",
        s.name,
        evidence,
    )


def off_cpu_wait(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    """A blocked stage whose cause the signals cannot tell: what was measured, and why no cause is named."""
    s = _blocked_for(UNDETERMINED, stages, sig, th)
    if s is None:
        return None
    pressure = sig.gil_pressure_ms
    if others_too_idle_for_gil(s, th):
        why = (
            f"at most {gil_explainable_ms(s):.1f} ms of it was for the GIL (the process's other threads ran "
            f"{s.others_cpu_ms or 0.0:.1f} ms and waited {s.others_runqueue_ms or 0.0:.1f} ms for a CPU meanwhile, "
            "the only time one of them can hold it), and the rest was a lock or I/O, or the hypervisor of a "
            "virtual machine taking the CPU, which no run queue shows"
        )
    elif not cpus_to_spare(s, sig, th):
        cpu_wait = f", woken threads {sig.cpu_pressure_ms:.1f} ms" if sig.cpu_pressure_ms is not None else ""
        why = (
            f"the host was short of CPUs meanwhile (its own run-queue wait {s.runqueue_ms or 0.0:.1f} ms{cpu_wait}), "
            "and there a wait can be for a GIL holder the scheduler preempted"
        )
        if holders_preempted(s, th):
            why += (
                f": the process's other threads, the GIL's would-be holders, waited {s.others_runqueue_ms or 0.0:.1f} "
                f"ms for a CPU beside {s.others_cpu_ms or 0.0:.1f} ms on one"
            )
    elif pressure is None:
        why = "the request spanned too few GIL-monitor wake-ups to measure GIL pressure"
    else:
        why = (
            f"GIL pressure {pressure:.1f} ms lies between a free GIL (< {th.gil_free_ms:g} ms) and a contended "
            f"one (>= {th.gil_pressure_ms:g} ms)"
        )
    return Found(
        f"'{s.name}' was off-CPU {s.blocked_ms:.1f} ms of its {s.wall_ms:.1f} ms, for the GIL or for a lock or "
        "I/O; the signals cannot tell which",
        s.name,
        why,
    )


def _waited_for_cpu(stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> tuple[StageLike, bool] | None:
    """The stage that lost the most to waiting for a CPU (its run-queue time) or for GIL holders the
    scheduler preempted (``PREEMPTED_HOLDERS``), and whether it was the latter."""
    hits = [
        (s, preempted)
        for s, cause in blocked_causes(stages, sig, th)
        if s.worker_pid is None and ((preempted := cause == PREEMPTED_HOLDERS) or waited_for_cpu(s, th))
    ]
    if not hits:
        return None
    return max(hits, key=lambda h: (h[0].runqueue_ms or 0.0) + (gil_explainable_ms(h[0]) if h[1] else 0.0))


def _cpu_wait_finding(s: StageLike, preempted: bool) -> str:
    finding = f"'{s.name}' waited {s.runqueue_ms or 0.0:.1f} ms of its {s.wall_ms:.1f} ms for a CPU (run queue)"
    if preempted:
        finding += f", and {gil_explainable_ms(s):.1f} ms more for GIL holders the scheduler preempted"
    return finding


def cpu_oversubscribed(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    """A stage waited for a CPU, or on GIL holders that the scheduler had preempted; the stage that lost the
    most of the two is named. Where the process's load says the requests themselves outnumbered the CPUs,
    SERVICE_AT_CAPACITY says so instead; the evidence says whether threads beside the requests or other
    processes took the CPUs."""
    worst = _waited_for_cpu(stages, sig, th)
    shape = oversubscription(sig, th)
    if worst is None or shape is Oversubscription.CAPACITY:
        return None
    s, preempted = worst
    evidence = []
    if preempted:
        evidence.append(
            "its off-CPU waits were as short as GIL handoffs, and a GIL holder preempted by the scheduler keeps "
            "the other threads waiting"
        )
    if host_out_of_cpus(sig, th):
        evidence.append(f"the process's woken threads waited {sig.cpu_pressure_ms:.1f} ms on average for a CPU")
    load = sig.load
    if load is not None and shape is Oversubscription.THREADS:
        beside = "" if load.requests is None else f" for {load.requests:.1f} requests in flight"
        evidence.append(
            f"{load.runnable:.1f} of the process's threads were running or waiting for a CPU on average{beside}, "
            f"on {load.cpus} CPUs: threads beside the requests' own (intra-op pools of torch, BLAS or OpenMP, "
            "worker pools) outnumber the CPUs"
        )
    elif load is not None and shape is Oversubscription.HOST:
        evidence.append(
            f"the process used {load.cpus_used:.1f} of its {load.cpus} CPUs and its threads asked for "
            f"{load.runnable:.1f} on average: other processes on the host took the CPUs"
        )
    return Found(_cpu_wait_finding(s, preempted), s.name, "; ".join(evidence) or None)


def service_at_capacity(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    """A stage waited for a CPU while more requests were in flight than there are CPUs, and they were most of
    the threads that wanted one: the service at its capacity, which fewer intra-op threads do not change."""
    worst = _waited_for_cpu(stages, sig, th)
    load = sig.load
    if worst is None or load is None or oversubscription(sig, th) is not Oversubscription.CAPACITY:
        return None
    s, preempted = worst
    return Found(
        f"{_cpu_wait_finding(s, preempted)}, with {load.requests or 0.0:.1f} requests in flight on {load.cpus} CPUs",
        s.name,
        f"the process used {load.cpus_used:.1f} CPUs, and {load.runnable:.1f} of its threads were running or "
        "waiting for a CPU on average: about one a request, so the requests themselves, not threads beside them, "
        "outnumber the CPUs",
    )


def event_loop_blocked(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    """The request held its loop (a long sync stage of its own), or waited for it while other requests'
    sync stages held it (the ``event_loop.wait`` stage), whichever took longer; else a stall of the loop
    measured within the request while the process was not starved of the GIL or of CPUs."""
    # One pass (compiled, a stage's fields are C members here: diagnosis.pxd): the longest sync stage of its own
    # on the loop (the first of the longest, as max() gives it), and its waits for the loop.
    own = None
    wait_ms = 0.0
    stage_ms = th.event_loop_stage_ms
    for s in stages:
        on_loop = s.on_event_loop and s.kind not in GPU_KINDS and s.wall_ms >= stage_ms
        if on_loop and (own is None or s.wall_ms > own.wall_ms):
            own = s
        if s.kind == "wait" and s.name == EVENT_LOOP_WAIT:
            wait_ms += occurrences_ms(s)
    # A wait with no stage named as its holder is blamed on the loop only where work on the loop's own thread
    # could have held it (the loop monitor did not measure, or measured the thread working): a loop its thread
    # could not run because it waited for the GIL or a CPU was starved, which no `def` or offload would fix.
    held_by_work = bool(sig.blocked_by) or sig.loop_held_ms is None or sig.loop_held_ms >= th.event_loop_wait_ms
    waited = (
        held_by_work
        and a.total_ms > 0
        and wait_ms >= th.event_loop_wait_ms
        and wait_ms >= th.event_loop_wait_share * a.total_ms
        and (own is None or wait_ms > own.wall_ms)
    )
    if waited:
        return Found(
            f"the request waited {wait_ms:.1f} ms ({wait_ms / a.total_ms:.0%}) for the event loop while other "
            "requests' sync stages held it",
            EVENT_LOOP_WAIT,
            _blockers(sig.blocked_by),
        )
    if own is not None:
        return Found(
            f"sync stage '{own.name}' ran {own.wall_ms:.1f} ms on the event-loop thread",
            own.name,
        )
    # A stall while the loop's thread waited (for the GIL, for a CPU) is the process starving the loop, not work
    # on it: only the part work on the thread explains counts (loop_held_ms). Where that is not measured, a
    # stall on a host short of CPUs is not blamed on the loop either. The lag stays on the verdict.
    if sig.loop_held_ms is not None:
        if sig.loop_held_ms >= th.event_loop_lag_ms:
            return Found(
                f"work on the event-loop thread held the loop {sig.loop_held_ms:.1f} ms during the request"
                f" (lag {sig.loop_lag_ms or 0.0:.1f} ms)",
            )
        return None
    if sig.loop_lag_ms is not None and sig.loop_lag_ms >= th.event_loop_lag_ms and not short_of_cpus(stages, sig, th):
        return Found(f"event-loop lag reached {sig.loop_lag_ms:.1f} ms during the request")
    return None


def _blockers(blocked_by: tuple[str, ...]) -> str | None:
    if not blocked_by:
        return None
    name, trace_id = split_blocker(blocked_by[0])
    more = f" and {len(blocked_by) - 1} more" if len(blocked_by) > 1 else ""
    return f"held longest by '{name}' of trace {trace_id}{more}"


def _queued_ms(s: StageLike) -> float:
    """A wait's time spent in a queue: all of it, except that a batch wait counts only the time its
    batcher's previous batch was still running (forming the batch is BATCH_WAIT's business)."""
    if s.batch is not None and s.batch.formation_ms is not None:
        return s.batch.busy_ms or 0.0
    return occurrences_ms(s)


# The event-loop wait is EVENT_LOOP_BLOCKED's (no worker pool to grow there), a process pool's POOL_SATURATED's
# and WORKER_COLD_START's.
_NOT_QUEUES = frozenset({EVENT_LOOP_WAIT, OFFLOAD_QUEUE})


def queueing(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    # A wait measured while its pool had free capacity is dispatch latency (often GIL contention), not a
    # queue: only waits not known to be unsaturated count.
    # The event-loop wait is EVENT_LOOP_BLOCKED's: no worker pool to grow there.
    waits = [
        s
        for s in stages
        if s.kind == "wait" and s.queue_saturated is not False and s.name not in _NOT_QUEUES and _queued_ms(s) > 0
    ]
    wait_ms = sum(_queued_ms(s) for s in waits)
    if wait_ms < th.queueing_ms or a.total_ms <= 0 or wait_ms < th.queueing_share * a.total_ms:
        return None
    names = list(dict.fromkeys(s.name for s in waits))
    return Found(
        f"the request queued {wait_ms:.1f} ms ({wait_ms / a.total_ms:.0%}) in {', '.join(names)}",
        max(names, key=lambda n: a.breakdown.get(n, 0.0)) if names else None,
    )


def pool_saturated(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    """Calls handed to a process pool waited for a worker while every worker was busy."""
    calls = [call for call in offload_calls(stages) if call.saturated and call.queue_ms > 0]
    queued = sum(call.queue_ms for call in calls)
    if (
        not calls
        or a.total_ms <= 0
        or queued < th.pool_saturated_min_ms
        or queued < th.pool_saturated_share * a.total_ms
    ):
        return None
    worst = max(calls, key=lambda call: call.queue_ms)
    info = worst.info
    more = f" over {len(calls)} calls" if len(calls) > 1 else ""
    return Found(
        f"'{worst.name}' waited {queued:.1f} ms{more} ({queued / a.total_ms:.0%} of the request) for a worker of "
        f"its {info.executor}",
        worst.name,
        f"{info.in_flight} calls were in the pool for its {info.max_workers} workers when it was submitted",
    )


def ipc_bound(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    """Moving calls' arguments to a process pool's worker and their results back took much of the request, or a
    call moved megabytes."""
    calls = offload_calls(stages)
    if not calls or a.total_ms <= 0:
        return None
    transfer = sum(call.transfer_ms for call in calls)
    if transfer < th.ipc_min_ms:
        return None
    heavy = any(call.payload_bytes >= th.ipc_payload_bytes for call in calls)
    if transfer < th.ipc_share * a.total_ms and not heavy:
        return None
    worst = max(calls, key=lambda call: (call.transfer_ms, call.payload_bytes))
    info = worst.info
    sizes = []
    if info.args_bytes is not None:
        sizes.append(f"{_size(info.args_bytes)} there")
    if info.result_bytes is not None:
        sizes.append(f"{_size(info.result_bytes)} back")
    return Found(
        f"handing '{worst.name}' its arguments and taking its result back took {transfer:.1f} ms "
        f"({transfer / a.total_ms:.0%} of the request): {worst.send_ms:.1f} ms there, {worst.return_ms:.1f} ms back",
        worst.name,
        f"{' and '.join(sizes)} a call" if sizes else None,
    )


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def worker_oversubscribed(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    """A process pool's worker waited for a CPU while it ran a call (its own run queue, in its process)."""
    hits = [s for s in stages if s.worker_pid is not None and s.kind == "cpu" and s.wall_ms >= th.min_stage_ms]
    hits = [s for s in hits if waited_for_cpu(s, th)]
    if not hits:
        return None
    # The worker's own stages name the code that waited; its run (which holds them) only where none did.
    own = [s for s in hits if s.name != RUN] or hits
    worst = max(own, key=lambda s: s.runqueue_ms or 0.0)
    evidence = None
    load = sig.load
    calls = offload_calls(stages)
    workers = next((call.info.max_workers for call in calls if call.info.max_workers is not None), None)
    if load is not None and workers is not None:
        evidence = (
            f"{workers} workers beside the application's {load.runnable:.1f} threads running or waiting for a CPU, "
            f"on {load.cpus} CPUs"
        )
    return Found(
        f"'{worst.name}' in worker {worst.worker_pid} waited {worst.runqueue_ms or 0.0:.1f} ms of its "
        f"{worst.wall_ms:.1f} ms for a CPU (run queue)",
        worst.name,
        evidence,
    )


def worker_cold_start(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    """A call was its worker's first task, and waited for the worker to start (not for a busy pool)."""
    calls = [call for call in offload_calls(stages) if call.info.worker_task_seq == 1 and not call.saturated]
    if not calls or a.total_ms <= 0:
        return None
    worst = max(calls, key=lambda call: call.queue_ms)
    if worst.queue_ms < th.cold_start_min_ms or worst.queue_ms < th.cold_start_share * a.total_ms:
        return None
    info = worst.info
    method = f", started by {info.start_method}" if info.start_method else ""
    return Found(
        f"'{worst.name}' was the first task of worker {info.worker_pid}{method}, and waited {worst.queue_ms:.1f} ms "
        f"({worst.queue_ms / a.total_ms:.0%} of the request) for it to start",
        worst.name,
    )


def _batch_waits(stages: Sequence[StageLike]) -> list[StageLike]:
    return [s for s in stages if s.kind == "wait" and s.batch is not None and s.batch.formation_ms is not None]


def batch_wait(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    waits = _batch_waits(stages)
    formation = sum(s.batch.formation_ms or 0.0 for s in waits if s.batch is not None)
    if not waits or a.total_ms <= 0 or formation < max(th.batch_wait_min_ms, th.batch_wait_share * a.total_ms):
        return None
    worst = max(waits, key=lambda s: (s.batch.formation_ms or 0.0) if s.batch is not None else 0.0)
    b = worst.batch
    assert b is not None
    of_max = f" of {b.max_size}" if b.max_size else ""
    return Found(
        f"the request waited {formation:.1f} ms ({formation / a.total_ms:.0%}) in '{worst.name}' for its batch to "
        f"form (it ran with {b.items}{of_max} items)",
        worst.name,
    )


def batch_underfilled(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
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
        return Found(
            f"batch '{head.name}' ran {b.items} of {b.max_size} items ({fill:.0%}) while the request queued "
            f"{queued:.1f} ms behind the previous batch; {gpu_said}",
            head.name,
        )
    return None


def untracked_time(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    if not a.breakdown or a.total_ms <= 0:
        return None
    share = a.untracked_ms / a.total_ms
    if share < th.untracked_share or a.untracked_ms < th.untracked_min_ms:
        return None
    # On a host short of CPUs the server's own code (in no stage) waits for one like the stages do: said, so
    # that more stages are not the only remedy read into it.
    starved = (
        "the host was short of CPUs meanwhile, and code in no stage waits for one too"
        if short_of_cpus(stages, sig, th)
        else None
    )
    return Found(f"{a.untracked_ms:.1f} ms ({share:.0%}) of the request is in no stage", None, starved)


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
    return Found(
        f"{name} took {share:.0%} of the time between chunks ({ms / gaps:.2f} ms a chunk){model}",
        name,
    )


def slow_consumer(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    s = sig.stream
    if s is None or s.chunks < th.stream_min_chunks or s.streaming_ms <= 0:
        return None
    if s.send_wait_ms < th.slow_consumer_min_ms or s.send_wait_ms < th.slow_consumer_share * s.streaming_ms:
        return None
    return Found(
        f"the stream waited {s.send_wait_ms:.1f} ms ({s.send_wait_ms / s.streaming_ms:.0%} of its "
        f"{s.streaming_ms:.1f} ms between first and last chunk) for its client to take the chunks",
    )


def stream_stall(a: TraceAnalysis, stages: Stages, sig: TraceSignals, th: DiagnosisThresholds) -> Finding:
    s = sig.stream
    if s is None or s.chunks < th.stream_min_chunks or s.gap_max_ms is None or s.gap_p50_ms is None:
        return None
    if s.gap_max_ms < th.stream_stall_min_ms or s.gap_max_ms < th.stream_stall_factor * s.gap_p50_ms:
        return None
    return Found(
        f"one gap between chunks lasted {s.gap_max_ms:.1f} ms, {s.gap_max_ms / max(s.gap_p50_ms, 1e-3):.0f} "
        f"times the stream's median gap ({s.gap_p50_ms:.2f} ms)",
    )


RULES: tuple[DiagnosisRule, ...] = (
    DiagnosisRule(
        "GPU_STARVED",
        gpu_starved,
        advice=(
            "The GPU waits for the CPU side. Move decode/resize to the GPU (nvJPEG, torchvision.io.decode_jpeg "
            "on cuda, DALI), prefetch on a worker pool, and batch requests so each launch does more work."
        ),
        requires=frozenset({Signal.GPU_UTILIZATION}),
        thresholds=("gpu_starved_utilization", "gpu_starved_cpu_share"),
    ),
    DiagnosisRule(
        "PAGEABLE_H2D",
        pageable_h2d,
        advice=(
            "Copy from pinned memory: tensor.pin_memory() or a reusable pinned staging buffer, then "
            ".to(device, non_blocking=True). A pageable source makes the copy synchronous and slower."
        ),
        requires=frozenset({Signal.H2D_STAGE}),
        thresholds=("pageable_min_bytes",),
    ),
    DiagnosisRule(
        "GIL_CONTENTION",
        gil_contention,
        advice=(
            "Another Python thread holds the GIL. Move CPU-heavy Python to processes (ProcessPoolExecutor, "
            "separate workers) or to libraries that release the GIL; avoid pure-Python loops beside the server."
        ),
        requires=frozenset({Signal.STAGE_CPU}),
        thresholds=CLASSIFIER_THRESHOLDS,
    ),
    DiagnosisRule(
        "LOCK_OR_IO_WAIT",
        lock_or_io_wait,
        advice=(
            "The stage was off-CPU while the GIL was free: it waited on a lock, a queue or I/O. Find what it "
            "blocks on (py-spy dump during a slow request) and shorten the critical section or make it async."
        ),
        requires=frozenset({Signal.STAGE_CPU}),
        thresholds=CLASSIFIER_THRESHOLDS,
    ),
    DiagnosisRule(
        "OFF_CPU_WAIT",
        off_cpu_wait,
        advice=(
            "The stage waited off the CPU, for the GIL or for a lock or I/O, and the signals could not tell which. "
            "`py-spy dump --pid <pid>` during a slow request shows what it waits on (`py-spy record --gil` whether "
            "it holds the GIL); a stage that spans several GIL-monitor periods gets a cause named."
        ),
        requires=frozenset({Signal.STAGE_CPU}),
        thresholds=CLASSIFIER_THRESHOLDS,
        undetermined_between=("GIL_CONTENTION", "LOCK_OR_IO_WAIT", "CPU_OVERSUBSCRIBED", "SERVICE_AT_CAPACITY"),
    ),
    DiagnosisRule(
        "CPU_OVERSUBSCRIBED",
        cpu_oversubscribed,
        advice=(
            "Runnable threads outnumber cores. Use fewer threads than cores: cap torch.set_num_threads, "
            "OMP_NUM_THREADS / MKL_NUM_THREADS, the worker count and the thread pool. Where the evidence says "
            "other processes took the CPUs, give the service CPUs of its own (a CPU limit or affinity for the "
            "others, another host)."
        ),
        requires=frozenset({Signal.STAGE_CPU}),
        thresholds=(*CLASSIFIER_THRESHOLDS, "runqueue_share", "runqueue_min_ms", "capacity_requests_share"),
    ),
    DiagnosisRule(
        "SERVICE_AT_CAPACITY",
        service_at_capacity,
        advice=(
            "More requests ran at once than there are CPUs, and each waited for a CPU behind the others: the "
            "service is at its capacity, and capping intra-op threads will not change it. Limit concurrency to "
            "about the number of CPUs (uvicorn --limit-concurrency, the thread pool's size, a semaphore), so "
            "that the queue forms in front of the service where it is measured, and add replicas or CPUs for "
            "more throughput."
        ),
        requires=frozenset({Signal.STAGE_CPU}),
        thresholds=(*CLASSIFIER_THRESHOLDS, "runqueue_share", "runqueue_min_ms", "capacity_requests_share"),
    ),
    DiagnosisRule(
        "EVENT_LOOP_BLOCKED",
        event_loop_blocked,
        advice=(
            "Blocking work ran on the asyncio event loop and stalled every other request. Declare the endpoint "
            "with `def`, or offload with `await asyncio.to_thread(...)` / `run_in_threadpool`."
        ),
        thresholds=(
            "min_stage_ms",
            "quiet_share",
            "quiet_cpu_pressure_ms",
            "queued_min_ms",
            "event_loop_stage_ms",
            "event_loop_lag_ms",
            "event_loop_wait_ms",
            "event_loop_wait_share",
        ),
    ),
    DiagnosisRule(
        "QUEUEING",
        queueing,
        advice=(
            "The request waited for a worker thread or a batch slot. Raise the limit (anyio thread limiter, "
            "batch size), scale out, or shed load earlier."
        ),
        requires=frozenset({Signal.WAIT_STAGE}),
        thresholds=("queueing_ms", "queueing_share"),
    ),
    DiagnosisRule(
        "POOL_SATURATED",
        pool_saturated,
        advice=(
            "Every worker of the process pool was busy, and calls queued for one. Give the pool more workers (up "
            "to the CPUs the service has, less what the application's own threads need), make each call shorter "
            "(less work a task, smaller chunks), or shed load before the pool; where the workers wait for CPUs "
            "themselves (WORKER_OVERSUBSCRIBED) more workers will not help."
        ),
        requires=frozenset({Signal.OFFLOAD}),
        thresholds=("pool_saturated_share", "pool_saturated_min_ms"),
    ),
    DiagnosisRule(
        "IPC_BOUND",
        ipc_bound,
        advice=(
            "Moving the call's data to the worker and back costs much of what the worker saves. Send less: the "
            "encoded bytes (the JPEG, not the decoded array), a path or a key the worker reads itself, or shared "
            "memory for large arrays (multiprocessing.shared_memory, a torch tensor's share_memory_()); return "
            "only what the request needs; batch small calls (Executor.map with a chunksize)."
        ),
        requires=frozenset({Signal.OFFLOAD}),
        thresholds=("ipc_share", "ipc_min_ms", "ipc_payload_bytes"),
    ),
    DiagnosisRule(
        "WORKER_OVERSUBSCRIBED",
        worker_oversubscribed,
        advice=(
            "The pool's workers waited for a CPU: workers times the threads each runs outnumber the CPUs. Cap "
            "each worker's intra-op threads in the pool's initializer (torch.set_num_threads(1); OMP_NUM_THREADS=1 "
            "in the workers' environment) and size the pool to the CPUs left beside the application."
        ),
        requires=frozenset({Signal.STAGE_CPU}),
        thresholds=("min_stage_ms", "runqueue_share", "runqueue_min_ms"),
    ),
    DiagnosisRule(
        "WORKER_COLD_START",
        worker_cold_start,
        advice=(
            "The call paid for its worker's start (a new process and its imports: torch alone takes seconds under "
            "spawn). Start the pool and warm every worker before serving (an initializer that imports the heavy "
            "modules, a no-op call a worker at start-up), prefer fork or forkserver with the modules preloaded, "
            "and keep max_tasks_per_child from recycling workers under load."
        ),
        requires=frozenset({Signal.OFFLOAD}),
        thresholds=("cold_start_share", "cold_start_min_ms"),
    ),
    DiagnosisRule(
        "BATCH_WAIT",
        batch_wait,
        advice=(
            "The request spent most of its time waiting for its batch to form. Shorten the batcher's max wait "
            "(or make it adaptive to the arrival rate): at this load a batch does not fill before it expires."
        ),
        requires=frozenset({Signal.BATCH}),
        thresholds=("batch_wait_share", "batch_wait_min_ms"),
    ),
    DiagnosisRule(
        "BATCH_UNDERFILLED",
        batch_underfilled,
        advice=(
            "Requests queued while batches ran far below their max size and the GPU did little of the batch's "
            "time: the batcher, not the GPU, is the limit. Let batches fill (a longer max wait, a larger max "
            "size), run fewer batcher replicas per GPU, and move per-batch CPU work out of the batch loop."
        ),
        requires=frozenset({Signal.BATCH}),
        thresholds=("gpu_starved_utilization", "queueing_ms", "batch_underfilled_fill", "batch_underfilled_gpu_share"),
    ),
    DiagnosisRule(
        "STREAM_CPU_BOUND",
        stream_cpu_bound,
        advice=(
            "A CPU stage runs for every chunk and outweighs the model's own step. Detokenize incrementally (only "
            "the new tokens, not the whole sequence again), build each chunk's payload once and small, send "
            "several tokens a chunk, and move per-chunk work off the request's path."
        ),
        requires=frozenset({Signal.STREAM}),
        thresholds=("stream_min_chunks", "stream_cpu_share"),
    ),
    DiagnosisRule(
        "SLOW_CONSUMER",
        slow_consumer,
        advice=(
            "The client (or a proxy between) reads slower than the stream is produced: the server's send buffer "
            "fills and the stream waits on it. Check client and proxy buffering (nginx proxy_buffering, a client "
            "that renders every token), send fewer, larger chunks, or pace the stream to its reader."
        ),
        requires=frozenset({Signal.STREAM}),
        thresholds=("stream_min_chunks", "slow_consumer_share", "slow_consumer_min_ms"),
    ),
    DiagnosisRule(
        "STREAM_STALL",
        stream_stall,
        advice=(
            "Something stopped the stream once, far beyond its usual gap: a blocked event loop (see its "
            "event_loop.wait), a garbage-collection pause, a lock or a queue. Open the slowest occurrence of the "
            "repeated stages (stagetrace.compressed.slowest) and what ran around that moment."
        ),
        requires=frozenset({Signal.STREAM}),
        thresholds=("stream_min_chunks", "stream_stall_factor", "stream_stall_min_ms"),
    ),
    DiagnosisRule(
        "UNTRACKED_TIME",
        untracked_time,
        advice=(
            "Most of the request's time is in no stage. Add stages (@stagetrace.stage) around the code between "
            "the ones you have, or enable automatic stages for PIL, tokenizers and torch."
        ),
        thresholds=(
            "min_stage_ms",
            "quiet_share",
            "quiet_cpu_pressure_ms",
            "queued_min_ms",
            "untracked_share",
            "untracked_min_ms",
        ),
    ),
)
RULE_CODES = tuple(rule.code for rule in RULES)
ADVICE: Mapping[str, str] = {rule.code: rule.advice for rule in RULES}
# Codes that report a measurement without naming a cause, and the causes they could not tell apart.
UNDETERMINED_BETWEEN: Mapping[str, tuple[str, ...]] = {
    rule.code: rule.undetermined_between for rule in RULES if rule.undetermined_between
}


def _available(stages: Sequence[StageLike], signals: TraceSignals, th: DiagnosisThresholds) -> int:
    """What the trace carries of what the rules require, in one pass over its stages, as a mask of ``_BITS``
    (a rule runs where its own mask is inside it: two integer operations a rule, where sets were a subset
    test and a frozenset a trace)."""
    have = 0
    min_stage_ms = th.min_stage_ms
    for s in stages:
        kind = s.kind
        # The per-stage CPU rules judge only CPU stages of min_stage_ms or more (``causes.cpu_stages``): a
        # trace of short stages skips all four, as most traces do.
        if kind == "cpu":
            if (s.blocked_ms is not None or s.runqueue_ms is not None) and s.wall_ms >= min_stage_ms:
                have |= _STAGE_CPU
        elif kind == "wait":
            have |= _WAIT_STAGE
        elif kind == "h2d":
            have |= _H2D_STAGE
        if s.batch is not None:
            have |= _BATCH
        if s.offload is not None:
            have |= _OFFLOAD
    if signals.gpu_utilization is not None:
        have |= _GPU_UTILIZATION
    if signals.stream is not None:
        have |= _STREAM
    return have


# Each Signal's bit in a mask of them, and a set of them as its mask.
_BITS = {signal: 1 << i for i, signal in enumerate(Signal)}


def _mask(signals: frozenset[Signal]) -> int:
    mask = 0
    for signal in signals:
        mask |= _BITS[signal]
    return mask


_STAGE_CPU, _WAIT_STAGE, _H2D_STAGE, _BATCH, _OFFLOAD = (
    _BITS[Signal.STAGE_CPU], _BITS[Signal.WAIT_STAGE], _BITS[Signal.H2D_STAGE], _BITS[Signal.BATCH],
    _BITS[Signal.OFFLOAD],
)  # fmt: skip
_GPU_UTILIZATION, _STREAM = _BITS[Signal.GPU_UTILIZATION], _BITS[Signal.STREAM]


def diagnose(
    analysis: TraceAnalysis,
    stages: Sequence[StageLike],
    signals: TraceSignals = NO_SIGNALS,
    thresholds: DiagnosisThresholds = DEFAULT_THRESHOLDS,
) -> tuple[Diagnosis, ...]:
    """Run every rule; at most one diagnosis per code, in the order of ``RULES``.

    Stages that started after the root ended (background work) are not the request's problem and are
    left out, matching the breakdown. A rule whose required signals the trace lacks is skipped (most traces
    carry no CPU, GPU or stream signals at all).
    """
    if len(analysis.charged_ms) == len(stages):
        kept: Sequence[StageLike] = [s for s, charged in zip(stages, analysis.charged_ms) if charged is not None]
    else:
        kept = stages
    in_request = JudgedStages(kept, signals, thresholds)
    have = _available(in_request, signals, thresholds)
    found = []
    for code, check, advice, requires in _RULE_TABLE:
        if requires & ~have:  # it requires what the trace lacks
            continue
        hit = check(analysis, in_request, signals, thresholds)
        if hit is not None:
            message, stage, evidence = hit
            diagnosis: Diagnosis = _NEW(Diagnosis)
            fields = {"code": code, "message": message, "advice": advice, "stage": stage, "evidence": evidence}
            _SET(diagnosis, "__dict__", fields)  # (every field, in order: tests/analysis/test_rule_edges.py)
            found.append(diagnosis)
    return tuple(found)


_NEW, _SET = object.__new__, object.__setattr__

# ``RULES`` as plain tuples, for ``diagnose``: every trace runs down the list, and a field of a rule read through
# its frozen dataclass costs a generic attribute lookup (compiled, about a hundred instructions) each time. What
# a rule requires, as a mask of ``_BITS``.
_RULE_TABLE = tuple((rule.code, rule.check, rule.advice, _mask(rule.requires)) for rule in RULES)


__all__ = [
    "ADVICE",
    "RULES",
    "RULE_CODES",
    "UNDETERMINED_BETWEEN",
    "Diagnosis",
    "DiagnosisRule",
    "DiagnosisThresholds",
    "Found",
    "Signal",
    "TraceSignals",
    "diagnose",
]
