"""``python tests/verdicts_of.py MESSAGES OUT``: the verdicts and metrics an ``ExporterCore`` in this process
makes of the marshalled messages in MESSAGES, as JSON in OUT. Run once as an exporter process allowed the
compiled modules (``_STAGETRACE_EXPORTER_PROCESS=1``) and once on the sources (``STAGETRACE_PURE_PYTHON=1``):
``tests/test_compiled.py`` compares the two field by field."""

from __future__ import annotations

import dataclasses
import json
import marshal
import sys
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from stagetrace._compiled import compiled_in_use
from stagetrace.common import wire
from stagetrace.exporter.aggregation import AggregatedMetrics
from stagetrace.exporter.core import ExporterCore
from stagetrace.exporter.outputs import LocalOutputs
from stagetrace.settings import Settings


def plain(value: Any) -> Any:
    """A verdict's field as JSON holds it: dataclasses and named tuples as their fields, floats as written."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {name: plain(v) for name, v in zip(value._fields, value)}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    return value


def main(messages_path: str, out_path: str) -> int:
    with open(messages_path, "rb") as f:
        messages = marshal.load(f)
    resource = Resource.create({"service.name": "compare"})
    metrics = AggregatedMetrics(resource, 256)
    reader = InMemoryMetricReader()
    MeterProvider(metric_readers=[reader], resource=resource, shutdown_on_exit=False)
    metrics.attach_readers([reader])
    verdicts: list[Any] = []
    spans: list[Any] = []

    class Sink:
        def export(self, batch: Any) -> None:
            spans.extend(plain(wire.WireSpan._make(s)) for s in batch)

        def flush(self, timeout_s: float) -> bool:
            return True

    settings = Settings(healthy_sample=0.5, export_budget_per_s=None, exporter_cpu_budget=None)
    core = ExporterCore(settings, LocalOutputs(spans=Sink(), metrics=metrics, callbacks=[verdicts.append]))
    skipped = 0
    for msg in messages:
        try:
            core.handle(msg)
        except Exception as e:  # malformed: counted the same way on both paths
            skipped += 1
            verdicts.append({"malformed": type(e).__name__})
    data = reader.get_metrics_data()
    points = sorted(
        json.dumps([m.name, sorted(p.attributes.items()), getattr(p, "value", None), getattr(p, "count", None),
                    getattr(p, "sum", None)], default=str)
        for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics for p in m.data.data_points
    )  # fmt: skip
    with open(out_path, "w") as f:
        json.dump(
            {"compiled": list(compiled_in_use()), "verdicts": [plain(v) for v in verdicts], "spans": spans,
             "metrics": points, "skipped": skipped},
            f, default=str,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
