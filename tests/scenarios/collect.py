"""Where a scenario's verdicts and spans go: as in a deployed service, spans leave the application through the
exporter process (written here to a JSON lines file), and only verdicts come back. A test harness that
brings every span back to build it in the server's own process (an in-memory span exporter) runs Python
there on other threads while requests run: GIL contention of its own, beside the scenario's cause."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import stagetrace
from stagetrace.analysis import Verdict
from stagetrace.report.loader import Span, read_traces


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
        deadline = time.monotonic() + timeout_s
        while len(self.verdicts) < n and time.monotonic() < deadline:
            self.handle.force_flush(1)
            time.sleep(0.01)
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

    def shutdown(self) -> None:
        self.handle.shutdown()
