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
    demo.add_argument("--requests", type=_positive_int, help="requests to send (default 200; llm: 40)")
    demo.add_argument("--concurrency", type=_positive_int, default=8, help="requests in flight (default 8)")
    demo.add_argument("--pipeline", choices=("image", "text", "llm"), default="image")
    demo.add_argument("--optimized", action="store_true", help="also run the fixed pipeline and compare")
    demo.add_argument("--out", default="stagetrace-out", help="where traces and the HTML report go")
    demo.add_argument("--slow-threshold-ms", type=float, default=None, help="slow-trace threshold (default 200)")
    demo.add_argument(
        "--pool-workers",
        type=_positive_int,
        help="text --optimized: the tokenizer's process pool size (default a worker a CPU; fewer shows POOL_SATURATED)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")

    report = sub.add_parser(
        "report",
        help="summarise exported traces (OTLP JSON lines, or the Collector's ClickHouse exporter's table)",
    )
    report.add_argument("paths", nargs="*", help="files or directories of OTLP JSON lines")
    report.add_argument("--json", action="store_true", help="print one JSON object")
    report.add_argument("--html", metavar="FILE", help="also write a self-contained HTML page")
    report.add_argument("--slow-threshold-ms", type=float, default=DEFAULT_SLOW_THRESHOLD_MS)
    report.add_argument("--route", help="only traces whose root has this http.route")
    report.add_argument(
        "--compare",
        nargs=2,
        metavar=("BEFORE", "AFTER"),
        help="before and after, per stage with 95 %% intervals: two files or directories; with --clickhouse, two "
        "windows SINCE..UNTIL (either side may be empty: 2h..1h, 2026-12-01..) or, with --group-by, two values",
    )
    report.add_argument("--resamples", type=_positive_int, default=1000, help="bootstrap resamples of --compare")
    report.add_argument("--since", help="roots from this time: 90m, 24h, 7d (before now), 2026-11-30T12:00Z, epoch s")
    report.add_argument("--until", help="roots before this time (same forms as --since)")
    fleet = report.add_argument_group(
        "ClickHouse (the OpenTelemetry Collector's clickhouse exporter; pip install 'stagetrace[clickhouse]')"
    )
    fleet.add_argument(
        "--clickhouse", metavar="URL", help="http(s)://[user:password@]host:8123, or chdb:PATH (embedded chDB)"
    )
    fleet.add_argument("--database", help="the exporter's `database` (default: default)")
    fleet.add_argument("--traces-table", help="the exporter's `traces_table_name` (default: otel_traces)")
    fleet.add_argument("--service", help="only this service (the exporter's ServiceName)")
    fleet.add_argument(
        "--group-by", metavar="ATTRIBUTE", help="compare groups of a resource attribute: service.version, k8s.pod.name"
    )
    return ap


CLICKHOUSE_ONLY = ("database", "traces_table", "service", "group_by")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "report":
        return _report(parser, args)
    from stagetrace.demo.runner import run_demo

    return run_demo(
        requests=args.requests,
        concurrency=args.concurrency,
        pipeline=args.pipeline,
        optimized=args.optimized,
        out_dir=args.out,
        slow_threshold_ms=args.slow_threshold_ms,
        progress=not args.no_progress,
        pool_workers=args.pool_workers,
    )


def _report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from stagetrace.cli.report import run_clickhouse_compare, run_clickhouse_report, run_compare, run_report

    common = {
        "as_json": args.json,
        "html_path": args.html,
        "slow_threshold_ms": args.slow_threshold_ms,
        "route": args.route,
        "since": args.since,
        "until": args.until,
    }
    if args.clickhouse is None:
        given = [f"--{name.replace('_', '-')}" for name in CLICKHOUSE_ONLY if getattr(args, name) is not None]
        if given:
            parser.error(f"only with --clickhouse: {', '.join(given)}")
        if args.compare:
            if args.paths:
                parser.error("report: --compare BEFORE AFTER takes the two sides itself, no other paths")
            return run_compare(*args.compare, resamples=args.resamples, **common)
        if not args.paths:
            parser.error("report: give trace files or directories, or --clickhouse URL")
        return run_report(args.paths, **common)
    if args.paths:
        parser.error("report: give trace files or --clickhouse URL, not both")
    if args.compare:
        return run_clickhouse_compare(
            args.clickhouse,
            *args.compare,
            database=args.database,
            table=args.traces_table,
            service=args.service,
            group_by=args.group_by,
            resamples=args.resamples,
            **common,
        )
    return run_clickhouse_report(
        args.clickhouse,
        database=args.database,
        table=args.traces_table,
        service=args.service,
        group_by=args.group_by,
        **common,
    )


if __name__ == "__main__":
    sys.exit(main())
