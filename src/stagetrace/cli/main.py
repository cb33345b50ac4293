"""Entry point of the ``stagetrace`` console script."""

from __future__ import annotations

import argparse
import sys

from stagetrace.settings import DEFAULT_SLOW_THRESHOLD_MS


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="stagetrace", description="Stage-level tracing for AI inference services.")
    sub = ap.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a traced inference service under load and show where the time goes")
    demo.add_argument("--requests", type=_positive_int, default=200, help="requests to send (default 200)")
    demo.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight (default 8)")
    demo.add_argument("--pipeline", choices=("image", "text"), default="image")
    demo.add_argument("--optimized", action="store_true", help="also run the fixed pipeline and compare")
    demo.add_argument("--out", default="stagetrace-out", help="where traces and the HTML report go")
    demo.add_argument("--slow-threshold-ms", type=float, default=None, help="slow-trace threshold (default 200)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")

    report = sub.add_parser("report", help="summarise exported traces (OTLP JSON lines)")
    report.add_argument("paths", nargs="+", help="files or directories of OTLP JSON lines")
    report.add_argument("--json", action="store_true", help="print one JSON object")
    report.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page")
    report.add_argument("--slow-threshold-ms", type=float, default=DEFAULT_SLOW_THRESHOLD_MS)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from stagetrace.cli.report import run_report

        return run_report(args.paths, as_json=args.json, html_path=args.html, slow_threshold_ms=args.slow_threshold_ms)
    from stagetrace.demo.runner import run_demo

    return run_demo(
        requests=args.requests,
        concurrency=args.concurrency,
        pipeline=args.pipeline,
        optimized=args.optimized,
        out_dir=args.out,
        slow_threshold_ms=args.slow_threshold_ms,
        progress=not args.no_progress,
    )


if __name__ == "__main__":
    sys.exit(main())
