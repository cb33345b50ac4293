"""Summaries of many verdicts, shared by ``stagetrace demo`` and ``stagetrace report``. Pure: verdicts in,
numbers out; memory bounded by the number of distinct stages and the slowest-traces list.

A verdict may stand for several requests (``weight``: its trace's adjusted count, when the exporter kept a
sample): every count, share and quantile is then weighted, an estimate of every request's, and
``summary()`` says so (``requests`` beside ``traces``, the kept ones). Exact totals read elsewhere (the
metrics the exporter wrote beside the traces) go in ``counted``."""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from stagetrace.analysis import Verdict
from stagetrace.analysis.diagnosis import ADVICE
from stagetrace.analysis.offload import OffloadedCall
from stagetrace.analysis.streams import StreamSummary
from stagetrace.conventions import SLOW_TOTAL
from stagetrace.report.sketch import QuantileSketch


class Tally(defaultdict[str, float]):
    """Weighted counts by name (a ``Counter`` holds whole numbers)."""

    def __init__(self) -> None:
        super().__init__(float)

    def add_all(self, other: Tally) -> None:
        for name, n in other.items():
            self[name] += n


@dataclass
class StageSummary:
    """``traces``: the kept traces with the stage; ``bottleneck`` and the sketches are weighted."""

    kind: str = "cpu"
    latency: QuantileSketch = field(default_factory=QuantileSketch)
    share_sum: float = 0.0
    traces: int = 0
    bottleneck: float = 0

    def merge(self, other: StageSummary) -> None:
        self.latency.merge(other.latency)
        self.share_sum += other.share_sum
        self.traces += other.traces
        self.bottleneck += other.bottleneck


@dataclass
class BatchSummary:
    """One batcher's executions: how many requests each served and how full it ran."""

    executions: int = 0
    size: QuantileSketch = field(default_factory=QuantileSketch)
    fill: QuantileSketch = field(default_factory=QuantileSketch)

    def merge(self, other: BatchSummary) -> None:
        self.executions += other.executions
        self.size.merge(other.size)
        self.fill.merge(other.fill)


@dataclass
class BatchWaitSummary:
    """One batch wait stage across requests, split into forming the batch and the previous batch's run."""

    requests: int = 0
    formation: QuantileSketch = field(default_factory=QuantileSketch)
    busy: QuantileSketch = field(default_factory=QuantileSketch)

    def merge(self, other: BatchWaitSummary) -> None:
        self.requests += other.requests
        self.formation.merge(other.formation)
        self.busy.merge(other.busy)


@dataclass
class OffloadSummary:
    """One function's calls handed to a process pool, across requests: the four stretches of each, what it
    moved, how many were a worker's first task."""

    executor: str = ""
    calls: float = 0
    queue: QuantileSketch = field(default_factory=QuantileSketch)
    send: QuantileSketch = field(default_factory=QuantileSketch)
    run: QuantileSketch = field(default_factory=QuantileSketch)
    ret: QuantileSketch = field(default_factory=QuantileSketch)
    args_bytes: float = 0
    result_bytes: float = 0
    first_tasks: float = 0
    saturated: float = 0

    def add(self, call: OffloadedCall, weight: float = 1) -> None:
        self.executor = self.executor or call.info.executor
        self.calls += weight
        self.queue.add(call.queue_ms, weight)
        self.send.add(call.send_ms, weight)
        self.run.add(call.run_ms, weight)
        self.ret.add(call.return_ms, weight)
        self.args_bytes += (call.info.args_bytes or 0) * weight
        self.result_bytes += (call.info.result_bytes or 0) * weight
        self.first_tasks += weight if call.info.worker_task_seq == 1 else 0
        self.saturated += weight if call.saturated else 0

    def merge(self, other: OffloadSummary) -> None:
        self.executor = self.executor or other.executor
        self.calls += other.calls
        for mine, theirs in ((self.queue, other.queue), (self.send, other.send), (self.run, other.run),
                             (self.ret, other.ret)):  # fmt: skip
            mine.merge(theirs)
        self.args_bytes += other.args_bytes
        self.result_bytes += other.result_bytes
        self.first_tasks += other.first_tasks
        self.saturated += other.saturated

    def summary(self) -> dict[str, Any]:
        def p(sketch: QuantileSketch, q: float) -> float:
            return round(sketch.quantile(q), 3)

        n = self.calls or 1
        return {
            "executor": self.executor,
            "calls": as_count(self.calls),
            "queue_p50_ms": p(self.queue, 0.5),
            "queue_p95_ms": p(self.queue, 0.95),
            "send_p50_ms": p(self.send, 0.5),
            "run_p50_ms": p(self.run, 0.5),
            "return_p50_ms": p(self.ret, 0.5),
            "args_bytes_mean": round(self.args_bytes / n),
            "result_bytes_mean": round(self.result_bytes / n),
            "first_tasks": as_count(self.first_tasks),
            "saturated": as_count(self.saturated),
        }


@dataclass
class StreamsSummary:
    """The streamed responses: what their clients lived (time to the first chunk, each stream's gap p99),
    and which stage dominated each phase, counted per stream."""

    streams: float = 0
    chunks: QuantileSketch = field(default_factory=QuantileSketch)
    first_chunk: QuantileSketch = field(default_factory=QuantileSketch)
    gap_p99: QuantileSketch = field(default_factory=QuantileSketch)
    chunks_per_s: QuantileSketch = field(default_factory=QuantileSketch)
    disconnected: float = 0
    first_chunk_bottlenecks: Tally = field(default_factory=Tally)
    gap_bottlenecks: Tally = field(default_factory=Tally)

    def add(self, stream: StreamSummary, weight: float = 1) -> None:
        self.streams += weight
        self.chunks.add(stream.chunks, weight)
        self.first_chunk.add(stream.first_chunk_ms, weight)
        if stream.gap_p99_ms is not None:
            self.gap_p99.add(stream.gap_p99_ms, weight)
        if stream.streaming_ms > 0 and stream.chunks > 1:
            self.chunks_per_s.add((stream.chunks - 1) / (stream.streaming_ms / 1e3), weight)
        self.disconnected += stream.disconnected * weight
        if stream.first_chunk_bottleneck:
            self.first_chunk_bottlenecks[stream.first_chunk_bottleneck] += weight
        if stream.gap_bottleneck:
            self.gap_bottlenecks[stream.gap_bottleneck] += weight

    def merge(self, other: StreamsSummary) -> None:
        self.streams += other.streams
        for mine, theirs in (
            (self.chunks, other.chunks),
            (self.first_chunk, other.first_chunk),
            (self.gap_p99, other.gap_p99),
            (self.chunks_per_s, other.chunks_per_s),
        ):
            mine.merge(theirs)
        self.disconnected += other.disconnected
        self.first_chunk_bottlenecks.add_all(other.first_chunk_bottlenecks)
        self.gap_bottlenecks.add_all(other.gap_bottlenecks)

    def summary(self) -> dict[str, Any]:
        """The ``--json`` shape of the ``streams`` key."""

        def quantiles(sketch: QuantileSketch) -> dict[str, float] | None:
            if not sketch.count:
                return None
            return {f"p{round(q * 100)}": round(sketch.quantile(q), 3) for q in (0.5, 0.95, 0.99)}

        return {
            "streams": as_count(self.streams),
            "chunks_mean": round(self.chunks.mean, 1),
            "first_chunk_ms": quantiles(self.first_chunk),
            "gap_p99_ms": quantiles(self.gap_p99),
            "chunks_per_s": quantiles(self.chunks_per_s),
            "disconnected": as_count(self.disconnected),
            "first_chunk_bottlenecks": counts(self.first_chunk_bottlenecks),
            "gap_bottlenecks": counts(self.gap_bottlenecks),
        }


def as_count(value: float) -> int | float:
    """A weighted count as the summary shows it: whole when it is (every weight 1), else to a tenth."""
    return int(value) if value == int(value) else round(value, 1)


def counts(tally: Tally) -> dict[str, int | float]:
    """Most first (ties in the order first seen)."""
    return {name: as_count(n) for name, n in sorted(tally.items(), key=lambda item: -item[1])}


class Counted(NamedTuple):
    """Exact totals from the metrics (``stagetrace.trace.duration``, which sees every request): the report's
    request and slow counts where they are known."""

    requests: int
    slow: int


@dataclass(order=True)
class _Slow:
    slowness: float  # Verdict.slowness: a stream ranks by its slow phase, not by how long it lasted
    seq: int
    verdict: Verdict = field(compare=False)
    waterfall: list[dict[str, Any]] = field(compare=False)


class Aggregator:
    """Feed verdicts (with an optional waterfall: spans as dicts with name, start_ms, end_ms, depth, kind);
    read ``summary()``. Aggregators of parts of the data ``merge`` into the aggregator of the whole; a loader
    that aggregates elsewhere (``report.fleet``: SQL in ClickHouse) fills the same fields from its counts."""

    def __init__(self, keep_slowest: int = 10) -> None:
        self.traces = 0  # verdicts read (kept traces)
        self.requests: float = 0  # their weights' sum: the requests they stand for
        self.slow_traces = 0
        self.slow_requests: float = 0
        self.slow_reasons = Tally()  # what made them slow: a response's total, a stream's first chunk or gaps
        self.counted: Counted | None = None
        self.stages: dict[str, StageSummary] = {}
        self.bottlenecks = Tally()
        self.diagnoses = Tally()
        self.messages: dict[str, str] = {}  # an example finding of each code
        self.evidence: dict[str, str] = {}  # and its evidence, where it has one
        self.total = QuantileSketch()
        self.gpu_utilization = QuantileSketch()
        self.batches: dict[str, BatchSummary] = {}
        self.batch_waits: dict[str, BatchWaitSummary] = {}
        self.streams = StreamsSummary()
        self.offloads: dict[str, OffloadSummary] = {}  # by function handed to a process pool
        # the least share of traces the exporter was diagnosing when one of these was kept (below 1: past its
        # CPU budget, when its diagnosis counter's sums were estimates)
        self.diagnosis_sample_rate = 1.0
        self._slowest: list[_Slow] = []
        self._keep = keep_slowest
        self._seq = 0

    def add(self, verdict: Verdict, waterfall: list[dict[str, Any]] | None = None, weight: float = 1) -> None:
        """``weight``: how many requests the verdict stands for (its trace's adjusted count)."""
        self.traces += 1
        self.requests += weight
        if verdict.slow:
            self.slow_traces += 1
            self.slow_requests += weight
            self.slow_reasons[verdict.slow_reason or SLOW_TOTAL] += weight
        self.total.add(verdict.total_ms, weight)
        total = verdict.total_ms or 0.0
        for name, ms in verdict.breakdown.items():
            s = self.stage(name, verdict.stage_kinds.get(name, "cpu"))
            s.latency.add(ms, weight)
            s.traces += 1
            s.share_sum += (min(1.0, ms / total) if total > 0 else 0.0) * weight
        if verdict.bottleneck:
            self.bottlenecks[verdict.bottleneck] += weight
            if verdict.bottleneck in self.stages:
                self.stages[verdict.bottleneck].bottleneck += weight
        if verdict.diagnosis_sample_rate < self.diagnosis_sample_rate:
            self.diagnosis_sample_rate = verdict.diagnosis_sample_rate
        for d in verdict.diagnoses:
            self.diagnoses[d.code] += weight
            if d.code not in self.messages:
                self.messages[d.code] = d.message
                if d.evidence:
                    self.evidence[d.code] = d.evidence
        if verdict.gpu_utilization is not None:
            self.gpu_utilization.add(verdict.gpu_utilization, weight)
        if verdict.stream is not None:
            self.streams.add(verdict.stream, weight)
        for call in verdict.offloads:
            self.offloads.setdefault(call.name, OffloadSummary()).add(call, weight)
        self.keep_if_slowest(verdict, waterfall)

    def stage(self, name: str, kind: str = "cpu") -> StageSummary:
        """The summary of one stage, created (with its kind) the first time the stage is seen."""
        s = self.stages.get(name)
        if s is None:
            s = self.stages[name] = StageSummary(kind=kind)
        return s

    def keep_if_slowest(self, verdict: Verdict, waterfall: list[dict[str, Any]] | None) -> None:
        """Offer a trace to the slowest list without counting it (``add`` counts and offers)."""
        self._seq += 1
        item = _Slow(verdict.slowness, self._seq, verdict, waterfall or [])
        if len(self._slowest) < self._keep:
            heapq.heappush(self._slowest, item)
        elif item.slowness > self._slowest[0].slowness:
            heapq.heapreplace(self._slowest, item)

    def merge(self, other: Aggregator) -> None:
        """Add another aggregator's traces (e.g. one group's) to this one; sketches merge exactly."""
        self.traces += other.traces
        self.requests += other.requests
        self.slow_traces += other.slow_traces
        self.slow_requests += other.slow_requests
        self.slow_reasons.add_all(other.slow_reasons)
        if other.counted is not None:
            mine = self.counted or Counted(0, 0)
            self.counted = Counted(mine.requests + other.counted.requests, mine.slow + other.counted.slow)
        for name, s in other.stages.items():
            self.stage(name, s.kind).merge(s)
        self.bottlenecks.add_all(other.bottlenecks)
        self.diagnoses.add_all(other.diagnoses)
        self.diagnosis_sample_rate = min(self.diagnosis_sample_rate, other.diagnosis_sample_rate)
        for code, message in other.messages.items():
            if code not in self.messages:
                self.messages[code] = message
                if code in other.evidence:
                    self.evidence[code] = other.evidence[code]
        self.total.merge(other.total)
        self.gpu_utilization.merge(other.gpu_utilization)
        for name, b in other.batches.items():
            self.batches.setdefault(name, BatchSummary()).merge(b)
        for name, w in other.batch_waits.items():
            self.batch_waits.setdefault(name, BatchWaitSummary()).merge(w)
        self.streams.merge(other.streams)
        for name, o in other.offloads.items():
            self.offloads.setdefault(name, OffloadSummary()).merge(o)
        for slow in other._slowest:
            self.keep_if_slowest(slow.verdict, slow.waterfall)

    def add_batch(self, name: str, size: int, fill: float | None) -> None:
        """One execution of a dynamic batcher (a batch trace, which has no verdict of its own)."""
        b = self.batches.get(name)
        if b is None:
            b = self.batches[name] = BatchSummary()
        b.executions += 1
        b.size.add(size)
        if fill is not None:
            b.fill.add(fill)

    def add_batch_wait(self, name: str, formation_ms: float, busy_ms: float) -> None:
        w = self.batch_waits.get(name)
        if w is None:
            w = self.batch_waits[name] = BatchWaitSummary()
        w.requests += 1
        w.formation.add(formation_ms)
        w.busy.add(busy_ms)

    def would_keep(self, verdict: Verdict) -> bool:
        """Whether a trace this slow (``Verdict.slowness``) enters the slowest list (so its waterfall is worth
        building)."""
        return len(self._slowest) < self._keep or verdict.slowness > self._slowest[0].slowness

    def slowest(self) -> list[tuple[Verdict, list[dict[str, Any]]]]:
        return [(s.verdict, s.waterfall) for s in sorted(self._slowest, reverse=True)]

    def summary(self) -> dict[str, Any]:
        """The ``--json`` shape: traces, slow_traces, stages (p50/p95/p99/mean share), bottlenecks, diagnoses."""
        stages = {}
        for name, s in self.stages.items():
            stages[name] = {
                "kind": s.kind,
                "traces": s.traces,
                "p50_ms": round(s.latency.quantile(0.50), 3),
                "p95_ms": round(s.latency.quantile(0.95), 3),
                "p99_ms": round(s.latency.quantile(0.99), 3),
                "mean_ms": round(s.latency.mean, 3),
                "mean_share": round(s.share_sum / self.requests, 4) if self.requests else 0.0,
                "bottleneck_traces": as_count(s.bottleneck),
            }
        out: dict[str, Any] = {
            "traces": self.traces,
            "slow_traces": self.slow_traces,
            # what the kept traces stand for (their adjusted counts): every count below is weighted so
            "requests": as_count(self.requests),
            "slow_requests": as_count(self.slow_requests),
            "slow_reasons": counts(self.slow_reasons),
            "sampled": self.requests != self.traces,
            "counted": None if self.counted is None else {"requests": self.counted.requests, "slow": self.counted.slow},
            "total_ms": {
                "p50": round(self.total.quantile(0.5), 3),
                "p95": round(self.total.quantile(0.95), 3),
                "p99": round(self.total.quantile(0.99), 3),
            },
            "stages": stages,
            "bottlenecks": counts(self.bottlenecks),
            "diagnoses": counts(self.diagnoses),
            "diagnosis_sample_rate": self.diagnosis_sample_rate,
            "advice": {code: ADVICE.get(code, "") for code in self.diagnoses},
            "examples": {code: self.messages[code] for code in self.diagnoses},
            "evidence": {code: self.evidence[code] for code in self.diagnoses if code in self.evidence},
        }
        if self.gpu_utilization.count:
            out["gpu_utilization"] = {
                "mean": round(self.gpu_utilization.mean, 4),
                "p50": round(self.gpu_utilization.quantile(0.5), 4),
            }
        if self.batches:
            out["batches"] = {
                name: {
                    "executions": b.executions,
                    "size_mean": round(b.size.mean, 2),
                    "size_p50": round(b.size.quantile(0.5), 2),
                    "size_p95": round(b.size.quantile(0.95), 2),
                    "fill_mean": round(b.fill.mean, 4) if b.fill.count else None,
                }
                for name, b in self.batches.items()
            }
        if self.batch_waits:
            out["batch_waits"] = {
                name: {
                    "requests": w.requests,
                    "formation_p50_ms": round(w.formation.quantile(0.5), 3),
                    "formation_p95_ms": round(w.formation.quantile(0.95), 3),
                    "busy_p50_ms": round(w.busy.quantile(0.5), 3),
                    "busy_p95_ms": round(w.busy.quantile(0.95), 3),
                }
                for name, w in self.batch_waits.items()
            }
        if self.streams.streams:
            out["streams"] = self.streams.summary()
        if self.offloads:
            out["offloads"] = {name: o.summary() for name, o in self.offloads.items()}
        out["slowest"] = [
            {
                "trace_id": v.trace_id,
                "root": v.root_name,
                "total_ms": round(v.total_ms, 3),
                "bottleneck": v.bottleneck,
                "diagnoses": list(v.diagnosis_codes),
            }
            for v, _ in self.slowest()
        ]
        return out
