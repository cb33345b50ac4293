"""Where a scenario's verdicts and spans go: as in a deployed service, spans leave the application through the
exporter process (written here to a JSON lines file), and only verdicts come back. A test harness that
brings every span back to build it in the server's own process (an in-memory span exporter) runs Python
there on other threads while requests run: GIL contention of its own, beside the scenario's cause."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import stagetrace
from stagetrace import conventions as c
from stagetrace.analysis import Verdict
from stagetrace.report.loader import Span, read_traces


def wait_for_verdicts(handle: Any, verdicts: list[Verdict], n: int, timeout_s: float) -> None:
    """Flush ``handle`` until its ``on_verdict`` list holds ``n`` verdicts, or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while len(verdicts) < n and time.monotonic() < deadline:
        handle.force_flush(1)
        time.sleep(0.01)


CPU_FIGURES = (
    ("cpu", c.CPU_MS),
    ("run queue", c.RUNQUEUE_MS),
    ("blocked", c.BLOCKED_MS),
    ("not GIL", c.NOT_GIL_MS),
    ("others on CPU", c.OTHERS_CPU_MS),
    ("others queued", c.OTHERS_RUNQUEUE_MS),
)


def explain(v: Verdict, spans: Sequence[Span]) -> str:
    """One misread verdict: its breakdown, the signals the rules read, its stages' CPU figures."""
    stages = ", ".join(f"{name} {ms:.1f}" for name, ms in v.breakdown.items())
    lines = [
        f"    {v.trace_id[:8]} {v.total_ms:.1f} ms [{stages}] untracked {v.untracked_ms:.1f} "
        f"GIL pressure {v.gil_pressure_ms} CPU pressure {v.cpu_pressure_ms} loop lag {v.loop_lag_ms}"
    ]
    for span in spans:
        if span.trace_id == v.trace_id and c.CPU_MS in span.attributes:
            figures = ", ".join(
                f"{label} {span.attributes[key]}" for label, key in CPU_FIGURES if key in span.attributes
            )
            lines.append(f"      stage {span.name}: {figures}")
    lines += [
        f"      {d.code}: {d.message}" + (f" [evidence: {d.evidence}]" if d.evidence else "") for d in v.diagnoses
    ] or ["      (no diagnosis)"]
    return "\n".join(lines)


class Collector:
    """A configured stagetrace whose verdicts are kept, and whose spans are read back from its file."""

    def __init__(self, traces_path: Path, service: str = "scenarios") -> None:
        self.verdicts: list[Verdict] = []
        self.traces_path = traces_path
        self.handle = stagetrace.configure(
            service, traces_path=traces_path, set_global=False, on_verdict=self.verdicts.append
        )

    def wait_verdicts(self, n: int, timeout_s: float = 30.0) -> list[Verdict]:
        """The first ``n`` verdicts, in the order they came (fewer if they do not come in ``timeout_s``)."""
        wait_for_verdicts(self.handle, self.verdicts, n, timeout_s)
        return list(self.verdicts)

    def spans(self) -> list[Span]:
        """Every exported span; shuts stagetrace down first, so that the file holds them all."""
        self.shutdown()
        out: list[Span] = []
        read_traces([self.traces_path], out.extend, errors=sys.stderr)
        return out

    def stage_attributes(self, name: str) -> dict[str, dict]:
        """Per trace id (hex), the attributes of its stage span ``name``."""
        return {s.trace_id: s.attributes for s in self.spans() if s.name == name}

    def explain(self, verdicts: Iterable[Verdict]) -> str:
        """``verdicts`` explained (``explain``), for a failing assertion's message; shuts stagetrace down."""
        spans = self.spans()
        return "\n".join(explain(v, spans) for v in verdicts)

    def shutdown(self) -> None:
        self.handle.shutdown()
