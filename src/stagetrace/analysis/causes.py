"""Why a CPU stage was blocked: the GIL, a lock or I/O, GIL holders the scheduler preempted, or
undetermined, read from the stage's own scheduler counts and the process's GIL and CPU pressure. Pure; the
rules that name a cause (``diagnosis.py``) each take the stages of theirs, so no stage's blocked time is
given two causes."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from stagetrace.analysis.model import StageLike
from stagetrace.analysis.signals import NO_SIGNALS, TraceSignals
from stagetrace.analysis.thresholds import DiagnosisThresholds

# The DiagnosisThresholds fields the blocked-cause classifier reads: every rule that names a cause from it
# (GIL_CONTENTION, LOCK_OR_IO_WAIT, OFF_CPU_WAIT, CPU_OVERSUBSCRIBED) reads them all.
CLASSIFIER_THRESHOLDS = (
    "min_stage_ms",
    "blocked_share",
    "blocked_min_ms",
    "gil_pressure_ms",
    "gil_free_ms",
    "quiet_share",
    "quiet_cpu_pressure_ms",
    "queued_share",
    "queued_min_ms",
    "cpu_pressure_ms",
    "gil_held_ms",
    "gil_over_cpu",
    "holders_queued_share",
)


def cpu_stages(stages: Sequence[StageLike], th: DiagnosisThresholds) -> list[StageLike]:
    """The CPU stages long enough for a per-stage rule."""
    return [s for s in stages if s.kind == "cpu" and s.wall_ms >= th.min_stage_ms]


def at_least(ms: float | None, floor_ms: float, share: float, s: StageLike) -> bool:
    return ms is not None and ms >= max(floor_ms, share * s.wall_ms)


def blocked_enough(s: StageLike, th: DiagnosisThresholds) -> bool:
    """A CPU stage the blocked-cause rules look at: long enough, and blocked enough to matter. Only these need
    the other threads' time beside them (``others_runqueue_ms``, ``others_cpu_ms``)."""
    return (
        s.kind == "cpu"
        and s.wall_ms >= th.min_stage_ms
        and at_least(s.blocked_ms, th.blocked_min_ms, th.blocked_share, s)
    )


def waited_for_cpu(s: StageLike, th: DiagnosisThresholds) -> bool:
    return at_least(s.runqueue_ms, th.runqueue_min_ms, th.runqueue_share, s)


def host_out_of_cpus(sig: TraceSignals, th: DiagnosisThresholds) -> bool:
    return sig.cpu_pressure_ms is not None and sig.cpu_pressure_ms >= th.cpu_pressure_ms


class Oversubscription(enum.Enum):
    """Who took the CPUs a stage waited for, from the process's load over the trace (``TraceSignals.load``)."""

    CAPACITY = "the requests themselves: more in flight than there are CPUs"
    THREADS = "threads beside the requests' own: intra-op or worker pools beyond the CPUs"
    HOST = "other processes: the process's own threads fit its CPUs"


def oversubscription(sig: TraceSignals, th: DiagnosisThresholds) -> Oversubscription | None:
    """None where the load was not read. The process's threads running or queued for a CPU (``runnable``)
    no more than its CPUs: the CPUs went to other processes. More: the requests' doing when more requests
    were in flight than there are CPUs and they make up ``capacity_requests_share`` of those threads (a
    request runs on one thread); threads beside them otherwise."""
    load = sig.load
    if load is None:
        return None
    if load.runnable <= load.cpus:
        return Oversubscription.HOST
    requests = load.requests
    if (
        requests is not None
        and requests > load.cpus
        and min(requests, load.runnable) >= th.capacity_requests_share * load.runnable
    ):
        return Oversubscription.CAPACITY
    return Oversubscription.THREADS


def queued_share(s: StageLike) -> float:
    """The share of the stage's time off the CPU that it spent in the run queue."""
    rq = s.runqueue_ms or 0.0
    off_cpu = rq + (s.blocked_ms or 0.0)
    return rq / off_cpu if off_cpu > 0 else 0.0


def short_of_cpus(stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds) -> bool:
    """The process's threads waited for CPUs during the request (the GIL monitor's wake-ups did, or a stage's)."""
    return (sig.cpu_pressure_ms or 0.0) >= th.quiet_cpu_pressure_ms or any(
        (s.runqueue_ms or 0.0) >= th.queued_min_ms and queued_share(s) >= th.quiet_share for s in cpu_stages(stages, th)
    )


def _gil_shaped_ms(s: StageLike) -> float:
    """The part of a stage's blocked time its own scheduler counts do not prove was something else."""
    return (s.blocked_ms or 0.0) - (s.not_gil_ms or 0.0)


def gil_explainable_ms(s: StageLike) -> float:
    """The part of a stage's blocked time that waits for the GIL could account for: all but what its own
    scheduler counts prove was not (``not_gil_ms``), and at most what the process's other threads spent on a
    CPU or queued for one meanwhile, the only time one of them can have held the GIL. That bound is what keeps
    a GIL the stage's own thread kept busy (the GIL monitor waits on it too) or a stage stalled for another
    reason (the hypervisor taking its CPU) from reading as contention."""
    explainable = _gil_shaped_ms(s)
    if s.others_cpu_ms is not None:
        explainable = min(explainable, s.others_cpu_ms + (s.others_runqueue_ms or 0.0))
    return explainable


def others_too_idle_for_gil(s: StageLike, th: DiagnosisThresholds) -> bool:
    """The stage's blocked time would read as GIL waits but for the other threads' time on or queued for a
    CPU, which was too short to have held the GIL through it."""
    return at_least(_gil_shaped_ms(s), th.blocked_min_ms, th.blocked_share, s) and not at_least(
        gil_explainable_ms(s), th.blocked_min_ms, th.blocked_share, s
    )


def proven_not_gil(s: StageLike, th: DiagnosisThresholds) -> bool:
    return at_least(s.not_gil_ms, th.blocked_min_ms, th.blocked_share, s)


def holders_preempted(s: StageLike, th: DiagnosisThresholds) -> bool | None:
    """Whether the process's other threads, the only ones that can have held the GIL the stage waited for,
    spent at least ``holders_queued_share`` of their time meanwhile in the run queue (None: not read). A holder
    the scheduler preempts keeps the GIL while it queues; holders that mostly ran held it through their switch
    intervals, and the GIL monitor's free or whole-interval readings stand for them."""
    if s.others_cpu_ms is None or s.others_runqueue_ms is None:
        return None
    others_ms = s.others_cpu_ms + s.others_runqueue_ms
    return others_ms > 0 and s.others_runqueue_ms >= th.holders_queued_share * others_ms


def blocked_ms(s: StageLike) -> float:
    return s.blocked_ms or 0.0


class BlockedCause(enum.Enum):
    """Why a CPU stage was blocked (off-CPU, not waiting for a CPU), as far as the signals can tell."""

    GIL = "gil"
    LOCK = "lock"
    PREEMPTED_HOLDERS = "preempted holders"
    UNDETERMINED = "undetermined"


GIL, LOCK, PREEMPTED_HOLDERS, UNDETERMINED = BlockedCause


def _cause_not_preemption(
    s: StageLike, sig: TraceSignals, th: DiagnosisThresholds, preempted_ms: float
) -> BlockedCause:
    """The cause of blocked time that preempted holders do not explain (all but ``preempted_ms`` of it):

    - LOCK: the stage's own scheduler counts prove that much of it was in waits longer than any wait for the
      GIL (``not_gil_ms``), or the GIL monitor found the GIL free;
    - GIL: waits as short as GIL waits, beyond ``preempted_ms``, while the GIL monitor found the GIL contended;
    - UNDETERMINED: GIL pressure not measured, or between free and contended.
    """
    if proven_not_gil(s, th):
        return LOCK
    pressure = sig.gil_pressure_ms
    gil_like = at_least(gil_explainable_ms(s) - preempted_ms, th.blocked_min_ms, th.blocked_share, s)
    if gil_like and pressure is not None and pressure >= th.gil_pressure_ms:
        return GIL
    if pressure is not None and pressure < th.gil_free_ms:
        return LOCK
    return UNDETERMINED


def queued_for_cpu(s: StageLike, th: DiagnosisThresholds) -> bool:
    return (s.runqueue_ms or 0.0) >= th.queued_min_ms and queued_share(s) >= th.queued_share


def cpus_to_spare(s: StageLike, sig: TraceSignals, th: DiagnosisThresholds) -> bool:
    return queued_share(s) < th.quiet_share and (sig.cpu_pressure_ms or 0.0) < th.quiet_cpu_pressure_ms


def blocked_cause(s: StageLike, sig: TraceSignals, th: DiagnosisThresholds) -> BlockedCause | None:
    """None when the stage was not blocked enough to matter; else what its blocked time was.

    With CPUs to spare (the stage's wake-ups barely queued for a CPU, nor did the GIL monitor's):

    - LOCK: its own scheduler counts prove that much of it was in waits longer than any wait for the GIL
      (``not_gil_ms``), or the GIL monitor found the GIL free.
    - GIL: waits as short as GIL waits while the GIL monitor found the GIL contended.

    On a host out of CPUs a thread holding the GIL is preempted as often as it runs, every other thread waits
    on it, and the one made to drop the GIL waits, untimed, for a successor stuck in the run queue:

    - PREEMPTED_HOLDERS: waits as short as GIL waits; CPU_OVERSUBSCRIBED's cause and remedy, not GIL
      contention's. When the stage's own wake-ups queued for a CPU (the GIL monitor, a sleeper the scheduler
      favours, queues less than the threads beside it), or only the GIL monitor's did; unless its GIL waits
      were a whole switch interval and far longer than its waits for a CPU while the other threads, the
      would-be holders, mostly ran rather than queued (``holders_preempted``): holders running Python
      through their interval, GIL contention, as it is on a host a little short of CPUs. When only the GIL
      monitor's wake-ups queued and the other threads mostly ran, no holder was preempted for long:
      UNDETERMINED, unless the GIL monitor read whole intervals (GIL).

    - LOCK: the GIL monitor found the GIL free: a holder the scheduler preempted keeps the GIL and would have
      held the GIL monitor's wake-ups back too (the stage's own wait for a CPU is its run-queue time, named
      CPU_OVERSUBSCRIBED on its own when it is long). Its wake-ups sample the GIL every few ms, though, and
      miss holders that take it briefly: when the waits were as short as GIL waits and the other threads
      queued for a CPU much of their time, brief holders preempted explain them as well as a lock does, and
      the cause is UNDETERMINED.

    Unless preemption cannot account for it: every wait on a preempted holder, or on the GIL handed to a
    thread still queued for a CPU, is run-queue time of another thread of the process, so when the blocked
    time less all of theirs meanwhile (``others_runqueue_ms``) still matters, the host's shortage does not
    explain it and the cause is judged as with CPUs to spare, on that remainder.

    UNDETERMINED otherwise: GIL pressure not measured or between free and contended, long waits on a host
    short of CPUs (a lock, or the GIL handed to a thread stuck in the run queue), short ones on a host a little
    short of CPUs. Naming a cause there would be a guess.
    """
    if not at_least(s.blocked_ms, th.blocked_min_ms, th.blocked_share, s):
        return None
    if cpus_to_spare(s, sig, th):
        return _cause_not_preemption(s, sig, th, 0.0)
    preempted_at_most = s.others_runqueue_ms
    if preempted_at_most is not None and at_least(
        blocked_ms(s) - preempted_at_most, th.blocked_min_ms, th.blocked_share, s
    ):
        return _cause_not_preemption(s, sig, th, preempted_at_most)
    proven = proven_not_gil(s, th)
    gil_like = at_least(gil_explainable_ms(s), th.blocked_min_ms, th.blocked_share, s)
    pressure = sig.gil_pressure_ms
    # A GIL the GIL monitor found free was neither held nor with a holder the scheduler had preempted (one that
    # took it only briefly may have slipped between its wake-ups).
    free = pressure is not None and pressure < th.gil_free_ms
    if free:
        return UNDETERMINED if not proven and holders_preempted(s, th) else LOCK
    if proven or not gil_like:
        return UNDETERMINED
    held = (
        pressure is not None and pressure >= th.gil_held_ms and pressure >= th.gil_over_cpu * (sig.cpu_pressure_ms or 0)
    )
    if queued_for_cpu(s, th) and not (held and holders_preempted(s, th) is False):
        return PREEMPTED_HOLDERS
    if held:
        return GIL
    # Only the GIL monitor's wake-ups waited long for a CPU: preempted holders, unless the other threads
    # were read and mostly ran.
    return PREEMPTED_HOLDERS if host_out_of_cpus(sig, th) and holders_preempted(s, th) is not False else UNDETERMINED


StageCauses = tuple[tuple[StageLike, BlockedCause | None], ...]  # each CPU stage a rule judges, and its cause


class JudgedStages(list[StageLike]):
    """A trace's stages as ``diagnose`` hands them to its rules, with each CPU stage's blocked cause
    classified once, on first use, for the signals and thresholds it was made with: four rules
    (GIL_CONTENTION, LOCK_OR_IO_WAIT, OFF_CPU_WAIT, CPU_OVERSUBSCRIBED) read the same classification, and at
    saturation, where every trace's stages are long and blocked enough for them all to run, classifying four
    times over was the largest part of a verdict."""

    __slots__ = ("_causes", "signals", "thresholds")

    def __init__(self, stages: Sequence[StageLike], signals: TraceSignals, thresholds: DiagnosisThresholds) -> None:
        super().__init__(stages)
        self.signals, self.thresholds = signals, thresholds
        self._causes: StageCauses | None = None

    def causes(self) -> StageCauses:
        if self._causes is None:
            sig, th = self.signals, self.thresholds
            self._causes = tuple((s, blocked_cause(s, signals_of(s, sig), th)) for s in cpu_stages(self, th))
        return self._causes


def blocked_causes(stages: Sequence[StageLike], sig: TraceSignals, th: DiagnosisThresholds) -> StageCauses:
    """Each CPU stage a per-stage rule judges, with its blocked cause (None: not blocked enough to matter).
    ``JudgedStages`` made with these very signals and thresholds answer from their memo (a tuple: no rule
    can change what the next one reads); anything else is classified afresh."""
    if isinstance(stages, JudgedStages) and stages.signals is sig and stages.thresholds is th:
        return stages.causes()
    return tuple((s, blocked_cause(s, signals_of(s, sig), th)) for s in cpu_stages(stages, th))


def signals_of(s: StageLike, sig: TraceSignals) -> TraceSignals:
    """The signals a stage is judged with: the trace's, or none of them for a stage a pool's worker ran (this
    process's GIL, threads and load were not beside it; its own CPU readings are its signals)."""
    return sig if s.worker_pid is None else NO_SIGNALS


# The part of a blocked stage's time each cause accounts for (what ranks the stages of one cause).
EXPLAINED_BY: dict[BlockedCause, Callable[[StageLike], float]] = {
    LOCK: blocked_ms,
    GIL: gil_explainable_ms,
    PREEMPTED_HOLDERS: gil_explainable_ms,
    UNDETERMINED: blocked_ms,
}
