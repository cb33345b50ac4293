"""Exact request and slow counts from the metrics the exporter writes beside its traces (OTLP JSON lines,
``metrics-<service>-<pid>.jsonl``): the ``stagetrace.trace.duration`` histogram sees every request, kept
or not, so its counts are what a report over a sample of traces cannot know. Pure: documents in, counts
out.

A cumulative stream (the default, and what stagetrace's file exporter writes) is counted once, at its
latest point: a stream is one process's (its resource), one attribute set's, since one start time. Delta
points are added up.
"""

from __future__ import annotations

from typing import Any

from stagetrace import conventions as c
from stagetrace.report.aggregate import Counted
from stagetrace.report.loader import attributes_of

_CUMULATIVE = 2  # OTLP's AggregationTemporality
StreamKey = tuple[Any, ...]


def _frozen(attributes: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, repr(v)) for k, v in attributes.items()))


class TraceCounts:
    """Fed OTLP JSON metrics documents (``add``); ``counted(route)`` gives the totals, None when no
    ``stagetrace.trace.duration`` point was read."""

    def __init__(self) -> None:
        self._latest: dict[StreamKey, tuple[int, int, bool, str | None]] = {}  # stream -> (time, count, slow, route)
        self._deltas: list[tuple[int, bool, str | None]] = []

    def add(self, doc: dict[str, Any]) -> None:
        """Raises ValueError, KeyError or TypeError on a document of another shape (the caller counts the
        line malformed)."""
        for rm in doc.get("resourceMetrics") or ():
            resource = _frozen(attributes_of((rm.get("resource") or {}).get("attributes")))
            for sm in rm.get("scopeMetrics") or ():
                for metric in sm.get("metrics") or ():
                    if metric.get("name") != c.METRIC_TRACE_DURATION or "histogram" not in metric:
                        continue
                    histogram = metric["histogram"]
                    cumulative = int(histogram.get("aggregationTemporality", _CUMULATIVE)) == _CUMULATIVE
                    for point in histogram.get("dataPoints") or ():
                        self._add_point(resource, point, cumulative)

    def _add_point(self, resource: tuple[Any, ...], point: dict[str, Any], cumulative: bool) -> None:
        attributes = attributes_of(point.get("attributes"))
        count = int(point.get("count", 0))
        slow = attributes.get(c.SLOW) is True
        route = attributes.get(c.HTTP_ROUTE)
        route = route if isinstance(route, str) else None
        if not cumulative:
            self._deltas.append((count, slow, route))
            return
        key = (resource, _frozen(attributes), point.get("startTimeUnixNano"))
        at = int(point.get("timeUnixNano", 0))
        seen = self._latest.get(key)
        if seen is None or at >= seen[0]:
            self._latest[key] = (at, count, slow, route)

    def counted(self, route: str | None = None) -> Counted | None:
        if not self._latest and not self._deltas:
            return None
        rows = [(n, slow, r) for _, n, slow, r in self._latest.values()] + self._deltas
        rows = [row for row in rows if route is None or row[2] == route]
        return Counted(sum(n for n, _, _ in rows), sum(n for n, slow, _ in rows if slow))
