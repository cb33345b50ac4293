"""``stagetrace report PATH... [--json] [--html FILE]``: summarise exported traces."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from stagetrace.report.collect import aggregate_files
from stagetrace.report.loader import expand_paths
from stagetrace.report.render import html_report, text_report
from stagetrace.settings import DEFAULT_SLOW_THRESHOLD_MS


def run_report(
    paths: list[str],
    *,
    as_json: bool = False,
    html_path: str | None = None,
    slow_threshold_ms: float = DEFAULT_SLOW_THRESHOLD_MS,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        print(f"stagetrace report: no such file or directory: {', '.join(missing)}", file=err)
        return 2
    if not expand_paths(paths):
        print("stagetrace report: no trace files found (expected OTLP JSON lines, *.jsonl)", file=err)
        return 2
    agg, counts = aggregate_files(paths, slow_threshold_ms, err)
    summary: dict[str, Any] = agg.summary()
    summary["input"] = counts
    if as_json:
        json.dump(summary, out, indent=2)
        out.write("\n")
    else:
        print(text_report(summary, "stagetrace report"), file=out)
        print(
            f"\nread {counts['spans']} spans from {counts['files']} files ({counts['malformed']} malformed lines)",
            file=out,
        )
    if html_path:
        Path(html_path).write_text(html_report(summary, agg.slowest(), "stagetrace report"), encoding="utf-8")
        print(f"wrote {html_path}", file=err if as_json else out)
    return 0
