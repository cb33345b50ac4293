"""`stagetrace report --clickhouse`: the demo's traces loaded into chDB through the Collector ClickHouse
exporter's schema give the file report's numbers; groups, filters, traces recomputed from their spans, the
HTTP client (against a ClickHouse HTTP interface served from chDB), and bad input without tracebacks."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from otlp_lines import T1, line, span, stage
from stagetrace import conventions as c
from stagetrace.cli.main import main
from stagetrace.cli.report import run_clickhouse_report, run_report
from stagetrace.report.aggregate import Aggregator
from stagetrace.report.clickhouse import ChdbConnection, insert_otlp_lines
from stagetrace.report.collect import add_trace
from stagetrace.report.fleet import Source, bucket_expression, parse_time, quote_identifier, quote_string
from stagetrace.report.loader import read_traces
from stagetrace.report.otel_schema import TRACES_TABLE_DDL, attribute_value, exporter_string
from stagetrace.report.sketch import QuantileSketch

chdb_session = pytest.importorskip(
    "chdb.session", reason="chDB is not installed (pip install 'stagetrace[clickhouse]', part of the dev extra)"
)

pytestmark = pytest.mark.chdb  # left out of the mutation run (pyproject.toml, [tool.mutmut])

SOURCE = Source("otel", "otel_traces")
ALPHA = QuantileSketch().alpha


def create_table(path: Path, source: Source = SOURCE, ddl: str = TRACES_TABLE_DDL) -> None:
    session = chdb_session.Session(str(path))
    try:
        session.query(f"CREATE DATABASE IF NOT EXISTS {quote_identifier(source.database)}")
        session.query(ddl.format(database=quote_identifier(source.database), table=quote_identifier(source.table)))
    finally:
        session.close()


def load(path: Path, lines: list[str], transform=None, source: Source = SOURCE) -> int:
    """Lines of OTLP JSON into the exporter's table, as the Collector's clickhouse exporter writes them."""
    if not (path / "metadata").exists():
        create_table(path, source)
    conn = ChdbConnection(str(path))
    try:
        return insert_otlp_lines(conn, source, lines, transform=transform)
    finally:
        conn.close()


def jsonl(directory: Path) -> list[str]:
    """The trace lines (what the Collector's ClickHouse exporter stores), not the metrics beside them."""
    return [ln for f in sorted(directory.glob("traces-*.jsonl")) for ln in f.read_text().splitlines() if ln.strip()]


def file_report(paths: list[str], **kw) -> dict:
    out = io.StringIO()
    assert run_report(paths, as_json=True, out=out, err=io.StringIO(), **kw) == 0
    return json.loads(out.getvalue())


def ch_report(url: str, **kw) -> tuple[int, dict | None, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = run_clickhouse_report(url, database=SOURCE.database, as_json=True, out=out, err=err, **kw)
    return rc, (json.loads(out.getvalue()) if rc == 0 else None), err.getvalue()


def within_sketch_error(a: float, b: float) -> bool:
    """Two quantiles read from sketches of the same values: each within alpha of a true value, and the
    report rounds to 3 decimals."""
    return abs(a - b) <= 2 * ALPHA * max(abs(a), abs(b)) + 1e-3


def assert_same_report(files: dict, ch: dict) -> None:
    assert ch["traces"] == files["traces"] and ch["slow_traces"] == files["slow_traces"]
    assert ch["requests"] == pytest.approx(files["requests"]) and ch["sampled"] == files["sampled"]
    assert ch["slow_requests"] == pytest.approx(files["slow_requests"])
    assert ch["slow_reasons"] == pytest.approx(files["slow_reasons"])
    assert ch["bottlenecks"] == files["bottlenecks"]
    assert ch["diagnoses"] == files["diagnoses"]
    for q in ("p50", "p95", "p99"):
        assert within_sketch_error(ch["total_ms"][q], files["total_ms"][q]), q
    assert set(ch["stages"]) == set(files["stages"])
    for name, f in files["stages"].items():
        s = ch["stages"][name]
        assert (s["kind"], s["traces"], s["bottleneck_traces"]) == (f["kind"], f["traces"], f["bottleneck_traces"])
        for q in ("p50_ms", "p95_ms", "p99_ms"):
            assert within_sketch_error(s[q], f[q]), (name, q, s[q], f[q])
        assert s["mean_ms"] == pytest.approx(f["mean_ms"], abs=2e-3)
        assert s["mean_share"] == pytest.approx(f["mean_share"], abs=2e-4)
    assert ch.get("batches", {}).keys() == files.get("batches", {}).keys()
    for name, b in files.get("batches", {}).items():
        assert ch["batches"][name]["executions"] == b["executions"]
        assert ch["batches"][name]["size_mean"] == b["size_mean"]
    assert ch.get("batch_waits", {}).keys() == files.get("batch_waits", {}).keys()
    for name, w in files.get("batch_waits", {}).items():
        assert ch["batch_waits"][name]["requests"] == w["requests"]
        assert within_sketch_error(ch["batch_waits"][name]["formation_p50_ms"], w["formation_p50_ms"])
    assert [t["trace_id"] for t in ch["slowest"]] == [t["trace_id"] for t in files["slowest"]]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Path]:
    """`stagetrace demo` (two routes, the naive and the optimized pipeline) and its traces in chDB."""
    tmp = tmp_path_factory.mktemp("demo")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    cmd = [sys.executable, "-m", "stagetrace.cli.main", "demo", "--requests", "16", "--concurrency", "4"]
    run = subprocess.run(
        [*cmd, "--optimized", "--no-progress", "--out", str(tmp / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    db = tmp / "db"
    assert load(db, jsonl(tmp / "out")) > 0
    return tmp / "out", db


@pytest.mark.slow
def test_the_demos_traces_in_clickhouse_give_the_file_reports_numbers(demo):
    out, db = demo
    files = file_report([str(out)])
    rc, ch, err = ch_report(f"chdb:{db}")
    assert rc == 0, err
    assert files["traces"] == 32 and files["diagnoses"]  # both routes, and the naive one's diagnoses
    assert_same_report(files, ch)
    assert ch["input"]["traces_from_stored_verdicts"] == 32 and ch["input"]["traces_recomputed_from_spans"] == 0
    for route in ("/predict", "/predict-optimized"):
        rc, ch, err = ch_report(f"chdb:{db}", route=route)
        assert rc == 0, err
        assert_same_report(file_report([str(out)], route=route), ch)


@pytest.mark.slow  # the demo fixture runs `stagetrace demo` (~4 s)
def test_groups_of_a_resource_attribute_are_compared_with_each_groups_own_numbers(demo, tmp_path):
    """Traces tagged service.version 1.0 / 1.1 by their trace id: each group's numbers are those of the file
    report's analysis of that group's traces alone."""
    out, _ = demo

    def version(trace_id: str) -> str:
        return "1.1" if int(trace_id[-1], 16) % 2 else "1.0"

    def tag(row: dict) -> dict:
        row["ResourceAttributes"]["service.version"] = version(row["TraceId"])
        return row

    db = tmp_path / "db"
    load(db, jsonl(out), transform=tag)
    expected: dict[str, Aggregator] = {"1.0": Aggregator(), "1.1": Aggregator()}
    read_traces([str(out)], lambda spans: add_trace(expected[version(spans[0].trace_id)], spans, 200.0, io.StringIO()))
    rc, ch, err = ch_report(f"chdb:{db}", group_by="service.version")
    assert rc == 0, err
    assert set(ch["groups"]) == {"1.0", "1.1"}
    for value, agg in expected.items():
        files = agg.summary()
        group = ch["groups"][value]
        assert_same_report({**files, "slowest": []}, {**group, "slowest": []})
        assert group["slowest_trace"] == files["slowest"][0]["trace_id"]
    assert sum(g["traces"] for g in ch["groups"].values()) == ch["traces"] == 32
    text = io.StringIO()
    assert run_clickhouse_report(f"chdb:{db}", database="otel", group_by="service.version", out=text) == 0
    page = tmp_path / "fleet.html"
    assert (
        run_clickhouse_report(
            f"chdb:{db}", database="otel", group_by="service.version", html_path=str(page), out=io.StringIO()
        )
        == 0
    )
    assert "By service.version (2 groups)" in text.getvalue() and "Stage p99 ms by service.version" in text.getvalue()
    html = page.read_text()
    assert 'id="groups"' in html and 'id="group-stages"' in html and html.count('<svg class="waterfall"') >= 5


@pytest.mark.slow  # the demo fixture runs `stagetrace demo` (~4 s)
def test_time_window_and_service_select_roots(demo):
    out, db = demo
    starts = sorted(
        int(s["startTimeUnixNano"])
        for ln in jsonl(out)
        for rs in json.loads(ln)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
        if any(a["key"] == c.TOTAL_MS for a in s.get("attributes", []))
    )
    middle = starts[len(starts) // 2]
    since = f"{middle // 10**9}.{middle % 10**9:09d}"  # epoch seconds, to the nanosecond
    rc, ch, err = ch_report(f"chdb:{db}", since=since)
    assert rc == 0, err
    assert ch["traces"] == sum(1 for s in starts if s >= middle)
    rc, ch, err = ch_report(f"chdb:{db}", until=since)
    assert rc == 0, err
    assert ch["traces"] == sum(1 for s in starts if s < middle)
    rc, ch, err = ch_report(f"chdb:{db}", service="someone-else")
    assert (rc, ch["traces"]) == (0, 0)
    assert "no spans in otel.otel_traces for service someone-else" in err


def recomputed_traces() -> list[str]:
    """Traces the report must judge from their spans, as the file report does: a gateway calling a model
    service that has its own verdict (one trace, two services), a trace with stages but no verdict (another
    SDK's), a batch's own trace with a member that waited for it."""
    gateway = [
        span(T1, "a" * 16, "", "POST /predict", 0, 100, {c.HTTP_ROUTE: "/predict"}, kind=2),
        stage(T1, "b" * 16, "a" * 16, "decode", 1, 31),
    ]
    model = [
        span(T1, "c" * 16, "a" * 16, "POST /infer", 35, 95, {c.TOTAL_MS: 60.0, c.STAGES: "infer"}, kind=2),
        stage(T1, "d" * 16, "c" * 16, "infer", 36, 90, kind="gpu"),
    ]
    t2, t3, t4 = "2" * 32, "3" * 32, "4" * 32
    foreign = [span(t2, "e" * 16, "", "job", 0, 50), stage(t2, "f" * 16, "e" * 16, "decode", 0, 40)]
    batch_id = "1234567890123456"  # a span id of digits only: must stay a string
    batch = [
        span(t3, batch_id, "", "infer.batch", 10, 30, {c.BATCH_ID: batch_id, c.BATCH_SIZE: 3, c.BATCH_FILL: 0.375})
    ]
    member_wait = span(
        t4,
        "9" * 16,
        "8" * 16,
        "infer.queue",
        0,
        10,
        {c.STAGE: "infer.queue", c.STAGE_KIND: "wait", c.BATCH_ID: batch_id, c.BATCH_FORMATION_MS: 4.0},
    )
    member = [span(t4, "8" * 16, "", "request", 0, 40), member_wait, stage(t4, "7" * 16, "8" * 16, "post", 30, 38)]
    return [line("gateway", gateway), line("model", model), line("worker", foreign), line("batcher", batch + member)]


def test_traces_without_a_stored_verdict_on_their_root_are_recomputed_like_the_file_report(tmp_path):
    lines = recomputed_traces()
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    db = tmp_path / "db"
    load(db, lines)
    files = file_report([str(tmp_path / "t.jsonl")])
    rc, ch, err = ch_report(f"chdb:{db}")
    assert rc == 0, err
    assert_same_report(files, ch)
    assert files["traces"] == 3 and files["bottlenecks"]["infer"] == 1  # the gateway's trace, judged whole
    assert ch["input"]["traces_recomputed_from_spans"] == 3  # gateway+model, the worker's, the member's
    assert ch["batches"]["infer.batch"]["executions"] == 1


def test_traces_in_the_fleet_without_stagetrace_are_skipped_and_said(tmp_path):
    db = tmp_path / "db"
    plain = [span(f"{i:032x}", f"{i + 1:016x}", "", "GET /", 0, 5, {"http.route": "/"}) for i in range(1, 4)]
    load(db, [line("web", plain)])
    rc, ch, err = ch_report(f"chdb:{db}")
    assert rc == 0 and ch["traces"] == 0
    assert "none of the 3 spans in otel.otel_traces carries stagetrace's attributes" in err
    load(db, recomputed_traces()[:2])
    rc, ch, err = ch_report(f"chdb:{db}")
    assert rc == 0 and ch["traces"] == 1
    assert ch["input"]["root_spans_without_stagetrace"] == 3
    assert "skipped 3 traces whose root span has no stagetrace verdict" in err


class ClickHouseOverChdb(BaseHTTPRequestHandler):
    """ClickHouse's HTTP interface, enough of it for clickhouse-connect, answered by a chDB session: the
    query in the body (or ?query=), the format in its FORMAT clause or ?default_format."""

    session = None
    lock = threading.Lock()

    def log_message(self, *args) -> None:
        pass

    def _answer(self, body: bytes) -> None:
        params = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
        query = (params.get("query", [""])[0] + " " + body.decode()).strip()
        if not query:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"Ok.\n")
            return
        try:
            with self.lock:
                data = self.session.query(query, params.get("default_format", ["TabSeparated"])[0]).bytes()
        except Exception as e:
            self.send_response(500)
            self.send_header("X-ClickHouse-Exception-Code", "60")
            self.end_headers()
            self.wfile.write(str(e).encode())
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer(b"")

    def do_POST(self) -> None:
        self._answer(self.rfile.read(int(self.headers.get("Content-Length") or 0)))


@pytest.fixture
def http_clickhouse(demo) -> Iterator[str]:
    pytest.importorskip("clickhouse_connect", reason="clickhouse-connect is not installed")
    _, db = demo
    ClickHouseOverChdb.session = chdb_session.Session(str(db))
    server = ThreadingHTTPServer(("127.0.0.1", 0), ClickHouseOverChdb)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://default:secret@127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(timeout=10)
        ClickHouseOverChdb.session.close()


@pytest.mark.slow  # the demo fixture runs `stagetrace demo` (~4 s)
def test_the_http_client_reads_the_same_report_as_chdb(demo, http_clickhouse):
    out, _ = demo
    rc, ch, err = ch_report(http_clickhouse, group_by="service.name")
    assert rc == 0, err
    assert_same_report(file_report([str(out)]), ch)
    assert set(ch["groups"]) == {"stagetrace-demo"}
    rc, _, err = ch_report(http_clickhouse, table="nope")
    assert rc == 2 and "no table otel.nope" in err and "otel.otel_traces" in err


def test_an_unreachable_server_is_one_line_not_a_traceback(capsys):
    pytest.importorskip("clickhouse_connect", reason="clickhouse-connect is not installed")
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["report", "--clickhouse", f"http://u:pw@127.0.0.1:{port}"]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"stagetrace report: cannot connect to ClickHouse at http://u:***@127.0.0.1:{port}: "
        "connection refused (is ClickHouse listening there?)"
    )


def test_wrong_places_and_other_schemas_are_named(tmp_path):
    rc, _, err = ch_report(f"chdb:{tmp_path / 'missing'}")
    assert rc == 2 and err.strip().endswith("is not a chDB database directory (it has no metadata/ folder)")
    db = tmp_path / "db"
    load(db, recomputed_traces()[:2])
    rc, _, err = ch_report(f"chdb:{db}", table="otel_spans")
    assert (
        rc == 2 and "no table otel.otel_spans" in err and "tables with a SpanAttributes column: otel.otel_traces" in err
    )
    # the exporter's JSON schema, and a table of someone else's spans
    json_ddl = "CREATE TABLE {database}.{table} (Timestamp DateTime64(9), SpanAttributes JSON) ORDER BY Timestamp"
    create_table(db, Source("otel", "otel_traces_json"), json_ddl)
    rc, _, err = ch_report(f"chdb:{db}", table="otel_traces_json")
    assert rc == 2 and "uses the exporter's JSON schema (option `json: true`" in err
    create_table(db, Source("otel", "spans"), "CREATE TABLE {database}.{table} (x String) ENGINE = Memory")
    create_table(
        db, Source("otel", "spans2"), "CREATE TABLE {database}.{table} (SpanAttributes String) ENGINE = Memory"
    )
    rc, _, err = ch_report(f"chdb:{db}", table="spans2")
    assert rc == 2 and "otel.spans2 is not a trace table of the OpenTelemetry Collector's ClickHouse exporter" in err
    assert "no column Timestamp" in err and "column SpanAttributes is String, expected Map(" in err
    assert "Traceback" not in err


def test_the_previous_exporter_schema_is_read_too(tmp_path):
    """Before ScopeName/ScopeVersion columns (2024), with a signed Duration and another sort key."""
    old = (
        TRACES_TABLE_DDL.replace("    ScopeName String CODEC(ZSTD(1)),\n", "")
        .replace("    ScopeVersion String CODEC(ZSTD(1)),\n", "")
        .replace("Duration UInt64", "Duration Int64")
        .replace("toDateTime(Timestamp))", "toUnixTimestamp(Timestamp), TraceId)")
    )
    db = tmp_path / "db"
    create_table(db, SOURCE, old)

    def drop_scope(row: dict) -> dict:
        row.pop("ScopeName")
        row.pop("ScopeVersion")
        return row

    lines = recomputed_traces()
    load(db, lines, transform=drop_scope)
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    rc, ch, err = ch_report(f"chdb:{db}")
    assert rc == 0, err
    assert_same_report(file_report([str(tmp_path / "t.jsonl")]), ch)


def test_attributes_read_back_as_stagetrace_wrote_them():
    for key, value in [
        (c.STAGES, ("decode", 'say "hi" <b>')),
        (c.STAGES_MS, (1.5, 2.0, 1e-7, 1.5e21)),
        (c.TOTAL_MS, 12.25),
        (c.SLOW, True),
        (c.H2D_BYTES, 1 << 40),
        (c.BATCH_ID, "0123456789012345"),
        (c.STAGE, "2"),
        ("http.route", "12"),
    ]:
        assert attribute_value(key, exporter_string(value)) == value, key
    assert exporter_string((1.5, 2.0)) == "[1.5,2]"  # Go's JSON, as the exporter writes arrays
    assert exporter_string(("<a>",)) == '["\\u003ca\\u003e"]'


def test_the_sql_bucket_is_the_sketchs_bucket(tmp_path):
    """The bucket formula ClickHouse evaluates is the one QuantileSketch.add uses, value for value (a value
    within a rounding error of a bucket's edge may land on the other side in one of them: still within the
    sketch's error; none of these values is that close)."""
    import random

    sketch, rng = QuantileSketch(), random.Random(26)
    values = [0.0, -1.0, 1e-12, 1e-9, 2e-9, 0.001, 0.0123, 0.5, 1.0, 3.3, 47.1, 999.9, 12345.678, 8e6]
    values += [math.exp(rng.uniform(-12, 16)) for _ in range(300)]  # log-uniform, 6 ns to 9e6 s
    session = chdb_session.Session(str(tmp_path / "db"))
    try:
        sql = ", ".join(bucket_expression(f"toFloat64({v!r})", sketch) for v in values)
        got = json.loads(session.query(f"SELECT {sql}", "JSONCompactEachRow").bytes())
    finally:
        session.close()
    assert got == [sketch.bucket_key(v) for v in values]


def test_values_are_quoted_for_clickhouse():
    assert quote_string("it's a \\ test") == "'it\\'s a \\\\ test'"
    assert quote_identifier("we`ird") == "`we\\`ird`"


def test_times_are_read_as_durations_dates_or_epoch_seconds():
    now = 1_800_000_000 * 10**9
    assert parse_time("90m", now) == now - 90 * 60 * 10**9
    assert parse_time("7d", now) == now - 7 * 86400 * 10**9
    assert parse_time("2026-11-30", now) == 1_795_996_800 * 10**9
    assert parse_time("2026-11-30T12:00:00+01:00", now) == (1_795_996_800 + 11 * 3600) * 10**9
    assert parse_time("1796083200.5", now) == 1_796_083_200_500_000_000
    assert parse_time("2026-11-30T12:00", now) == (1_795_996_800 + 12 * 3600) * 10**9  # no zone: UTC
    assert parse_time("2026-11-30T12:00:00Z", now) == (1_795_996_800 + 12 * 3600) * 10**9
    with pytest.raises(ValueError) as raised:
        parse_time("yesterday", now)
    assert str(raised.value) == (
        "cannot read time 'yesterday': use a duration before now (90m, 24h, 7d), an ISO 8601 date or time "
        "(2026-11-30, 2026-11-30T12:00:00Z) or epoch seconds"
    )
    before = time.time_ns()
    assert before - 90 * 60 * 10**9 <= parse_time("90m") <= time.time_ns() - 90 * 60 * 10**9  # now, if not given


def test_the_cli_says_which_options_need_clickhouse(capsys):
    with pytest.raises(SystemExit):
        main(["report", "--group-by", "service.version", "somewhere"])
    assert "only with --clickhouse: --group-by" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", "x.jsonl", "--clickhouse", "chdb:/nowhere"])
    assert "not both" in capsys.readouterr().err
    assert main(["report", "--clickhouse", "mysql://x"]) == 2
    assert "unsupported ClickHouse URL" in capsys.readouterr().err
    assert main(["report", "--clickhouse", "chdb:/nowhere", "--since", "soon"]) == 2
    assert "cannot read time 'soon'" in capsys.readouterr().err


def test_a_missing_extra_names_the_install_command(monkeypatch, tmp_path):
    (tmp_path / "metadata").mkdir()
    monkeypatch.setitem(sys.modules, "chdb.session", None)  # import fails as if not installed
    rc, _, err = ch_report(f"chdb:{tmp_path}")
    assert rc == 2 and "pip install 'stagetrace[clickhouse]'" in err


def sampled_root(trace: str, total_ms: float, weight: float, codes=(), diagnosis_rate: float | None = None) -> str:
    """A kept trace with its stored verdict, standing for ``weight`` requests (``diagnosis_rate``: the share of
    traces the exporter was diagnosing when it was kept)."""
    attrs = {
        c.TOTAL_MS: total_ms, c.SLOW: total_ms > 200, c.STAGES: ["work"], c.STAGES_MS: [total_ms],
        c.BOTTLENECK_STAGE: "work", c.BOTTLENECK_RATIO: 1.0, c.SAMPLING_ADJUSTED_COUNT: weight,
        **({c.DIAGNOSIS: list(codes)} if codes else {}),
        **({c.DIAGNOSIS_SAMPLE_RATE: diagnosis_rate} if diagnosis_rate is not None else {}),
        **({c.SLOW_REASON: c.SLOW_GAP} if total_ms > 200 else {}),  # a stream slow by its gaps, say
    }  # fmt: skip
    root = span(trace, "a" * 16, "", "GET /p", 0, total_ms, attrs, kind=2)
    return line("svc", [root, stage(trace, "b" * 16, "a" * 16, "work", 0, total_ms)])


def test_sampled_traces_are_weighted_in_clickhouse_as_in_the_files(tmp_path):
    """Each stored verdict's adjusted count weighs its facts in the SQL as ``Aggregator.add`` weighs them: the
    same requests, slow requests, shares, diagnoses and quantiles."""
    lines = [sampled_root(f"{i:032x}", 1.0 + i / 100, 10.0, diagnosis_rate=1.0) for i in range(1, 4)]
    lines += [sampled_root(f"{i:032x}", 300.0, 2.0, codes=("QUEUEING",), diagnosis_rate=0.5 - i / 20) for i in (4, 5)]
    (tmp_path / "t.jsonl").write_text("\n".join(lines) + "\n")
    load(tmp_path / "db", lines)
    files = file_report([str(tmp_path / "t.jsonl")])
    rc, ch, err = ch_report(f"chdb:{tmp_path / 'db'}")
    assert rc == 0, err
    assert files["traces"] == 5 and files["requests"] == 34 and files["slow_requests"] == 4
    assert files["diagnoses"] == {"QUEUEING": 4} and files["stages"]["work"]["bottleneck_traces"] == 34
    assert files["slow_reasons"] == {c.SLOW_GAP: 4}
    assert files["total_ms"]["p50"] < 2.0 < files["total_ms"]["p95"]  # 30 of the 34 requests took ~1 ms
    assert files["diagnosis_sample_rate"] == ch["diagnosis_sample_rate"] == 0.25  # the least: estimates
    assert_same_report(files, ch)
