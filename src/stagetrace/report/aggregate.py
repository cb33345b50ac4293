"""Summaries of many verdicts, shared by ``stagetrace demo`` and ``stagetrace report``. Pure: verdicts in,
numbers out; memory bounded by the number of distinct stages and the slowest-traces list."""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from stagetrace.analysis import Verdict
from stagetrace.analysis.diagnosis import ADVICE
from stagetrace.analysis.streams import StreamSummary
from stagetrace.report.sketch import QuantileSketch


@dataclass
class StageSummary:
    kind: str = "cpu"
    latency: QuantileSketch = field(default_factory=QuantileSketch)
    share_sum: float = 0.0
    traces: int = 0
    bottleneck: int = 0

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
class StreamsSummary:
    """The streamed responses: what their clients lived (time to the first chunk, each stream's gap p99),
    and which stage dominated each phase, counted per stream."""

    streams: int = 0
    chunks: QuantileSketch = field(default_factory=QuantileSketch)
    first_chunk: QuantileSketch = field(default_factory=QuantileSketch)
    gap_p99: QuantileSketch = field(default_factory=QuantileSketch)
    chunks_per_s: QuantileSketch = field(default_factory=QuantileSketch)
    disconnected: int = 0
    first_chunk_bottlenecks: Counter[str] = field(default_factory=Counter)
    gap_bottlenecks: Counter[str] = field(default_factory=Counter)

    def add(self, stream: StreamSummary) -> None:
        self.streams += 1
        self.chunks.add(stream.chunks)
        self.first_chunk.add(stream.first_chunk_ms)
        if stream.gap_p99_ms is not None:
            self.gap_p99.add(stream.gap_p99_ms)
        if stream.streaming_ms > 0 and stream.chunks > 1:
            self.chunks_per_s.add((stream.chunks - 1) / (stream.streaming_ms / 1e3))
        self.disconnected += stream.disconnected
        if stream.first_chunk_bottleneck:
            self.first_chunk_bottlenecks[stream.first_chunk_bottleneck] += 1
        if stream.gap_bottleneck:
            self.gap_bottlenecks[stream.gap_bottleneck] += 1

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
        self.first_chunk_bottlenecks.update(other.first_chunk_bottlenecks)
        self.gap_bottlenecks.update(other.gap_bottlenecks)

    def summary(self) -> dict[str, Any]:
        """The ``--json`` shape of the ``streams`` key."""

        def quantiles(sketch: QuantileSketch) -> dict[str, float] | None:
            if not sketch.count:
                return None
            return {f"p{round(q * 100)}": round(sketch.quantile(q), 3) for q in (0.5, 0.95, 0.99)}

        return {
            "streams": self.streams,
            "chunks_mean": round(self.chunks.mean, 1),
            "first_chunk_ms": quantiles(self.first_chunk),
            "gap_p99_ms": quantiles(self.gap_p99),
            "chunks_per_s": quantiles(self.chunks_per_s),
            "disconnected": self.disconnected,
            "first_chunk_bottlenecks": dict(self.first_chunk_bottlenecks.most_common()),
            "gap_bottlenecks": dict(self.gap_bottlenecks.most_common()),
        }


@dataclass(order=True)
class _Slow:
    total_ms: float
    seq: int
    verdict: Verdict = field(compare=False)
    waterfall: list[dict[str, Any]] = field(compare=False)


class Aggregator:
    """Feed verdicts (with an optional waterfall: spans as dicts with name, start_ms, end_ms, depth, kind);
    read ``summary()``. Aggregators of parts of the data ``merge`` into the aggregator of the whole; a loader
    that aggregates elsewhere (``report.fleet``: SQL in ClickHouse) fills the same fields from its counts."""

    def __init__(self, keep_slowest: int = 10) -> None:
        self.traces = 0
        self.slow_traces = 0
        self.stages: dict[str, StageSummary] = {}
        self.bottlenecks: Counter[str] = Counter()
        self.diagnoses: Counter[str] = Counter()
        self.messages: dict[str, str] = {}
        self.total = QuantileSketch()
        self.gpu_utilization = QuantileSketch()
        self.batches: dict[str, BatchSummary] = {}
        self.batch_waits: dict[str, BatchWaitSummary] = {}
        self.streams = StreamsSummary()
        self._slowest: list[_Slow] = []
        self._keep = keep_slowest
        self._seq = 0

    def add(self, verdict: Verdict, waterfall: list[dict[str, Any]] | None = None) -> None:
        self.traces += 1
        self.slow_traces += bool(verdict.slow)
        self.total.add(verdict.total_ms)
        total = verdict.total_ms or 0.0
        for name, ms in verdict.breakdown.items():
            s = self.stage(name, verdict.stage_kinds.get(name, "cpu"))
            s.latency.add(ms)
            s.traces += 1
            s.share_sum += min(1.0, ms / total) if total > 0 else 0.0
        if verdict.bottleneck:
            self.bottlenecks[verdict.bottleneck] += 1
            if verdict.bottleneck in self.stages:
                self.stages[verdict.bottleneck].bottleneck += 1
        for d in verdict.diagnoses:
            self.diagnoses[d.code] += 1
            self.messages.setdefault(d.code, d.message)
        if verdict.gpu_utilization is not None:
            self.gpu_utilization.add(verdict.gpu_utilization)
        if verdict.stream is not None:
            self.streams.add(verdict.stream)
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
        item = _Slow(verdict.total_ms, self._seq, verdict, waterfall or [])
        if len(self._slowest) < self._keep:
            heapq.heappush(self._slowest, item)
        elif item.total_ms > self._slowest[0].total_ms:
            heapq.heapreplace(self._slowest, item)

    def merge(self, other: Aggregator) -> None:
        """Add another aggregator's traces (e.g. one group's) to this one; sketches merge exactly."""
        self.traces += other.traces
        self.slow_traces += other.slow_traces
        for name, s in other.stages.items():
            self.stage(name, s.kind).merge(s)
        self.bottlenecks.update(other.bottlenecks)
        self.diagnoses.update(other.diagnoses)
        for code, message in other.messages.items():
            self.messages.setdefault(code, message)
        self.total.merge(other.total)
        self.gpu_utilization.merge(other.gpu_utilization)
        for name, b in other.batches.items():
            self.batches.setdefault(name, BatchSummary()).merge(b)
        for name, w in other.batch_waits.items():
            self.batch_waits.setdefault(name, BatchWaitSummary()).merge(w)
        self.streams.merge(other.streams)
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

    def would_keep(self, total_ms: float) -> bool:
        """Whether a trace this long enters the slowest list (so its waterfall is worth building)."""
        return len(self._slowest) < self._keep or total_ms > self._slowest[0].total_ms

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
                "mean_share": round(s.share_sum / self.traces, 4) if self.traces else 0.0,
                "bottleneck_traces": s.bottleneck,
            }
        out: dict[str, Any] = {
            "traces": self.traces,
            "slow_traces": self.slow_traces,
            "total_ms": {
                "p50": round(self.total.quantile(0.5), 3),
                "p95": round(self.total.quantile(0.95), 3),
                "p99": round(self.total.quantile(0.99), 3),
            },
            "stages": stages,
            "bottlenecks": dict(self.bottlenecks.most_common()),
            "diagnoses": dict(self.diagnoses.most_common()),
            "advice": {code: ADVICE.get(code, "") for code in self.diagnoses},
            "examples": {code: self.messages[code] for code in self.diagnoses},
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
