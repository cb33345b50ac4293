"""stagetrace report: streaming reader, joins across services and files, verdicts from global roots,
malformed lines, --json, --html (opened in headless Chromium)."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
from pathlib import Path

import pytest

import stagetrace
from otlp_lines import T1, line, span, stage
from stagetrace import conventions as c
from stagetrace.cli.report import run_report
from stagetrace.report.loader import spans_from_line
from stagetrace.report.sketch import QuantileSketch

# Where the headless browser's screenshot of the report goes, for a person to look at (a temporary
# directory unless STAGETRACE_TEST_ARTIFACTS names one: the suite writes nothing into the working tree).
ARTIFACTS_ENV = "STAGETRACE_TEST_ARTIFACTS"


def test_quantile_sketch_is_accurate_within_its_bound():
    s = QuantileSketch()
    for v in range(1, 10001):
        s.add(v / 10)
    assert s.quantile(0.5) == pytest.approx(500, rel=0.02)
    assert s.quantile(0.99) == pytest.approx(990, rel=0.02)


def test_a_trace_across_two_services_and_files_gets_one_verdict_from_its_global_root(tmp_path):
    # gateway (global root) -> model service (a remote child with its own stages)
    gw = [
        span(T1, "a" * 16, "", "POST /predict", 0, 100, {c.HTTP_ROUTE: "/predict"}, kind=2),
        stage(T1, "b" * 16, "a" * 16, "decode", 1, 31),
    ]
    model = [
        span(T1, "c" * 16, "a" * 16, "POST /infer", 35, 95, {c.TOTAL_MS: 60.0, c.STAGES: "x"}, kind=2),
        stage(T1, "d" * 16, "c" * 16, "infer", 36, 90, kind="gpu"),
    ]
    (tmp_path / "gateway.jsonl").write_text(line("gateway", gw) + "\n")
    (tmp_path / "model.jsonl").write_text(line("model", model) + "\n")
    out = io.StringIO()
    assert run_report([str(tmp_path)], as_json=True, out=out, err=io.StringIO()) == 0
    doc = json.loads(out.getvalue())
    assert doc["traces"] == 1
    assert doc["bottlenecks"] == {"infer": 1}
    assert set(doc["stages"]) == {"decode", "infer"}
    assert doc["stages"]["infer"]["p50_ms"] == pytest.approx(54, rel=0.02)
    assert doc["stages"]["infer"]["mean_share"] == pytest.approx(0.54, abs=0.01)
    for key in ("slow_traces", "stages", "bottlenecks", "diagnoses"):
        assert key in doc


def test_malformed_lines_are_reported_and_skipped(tmp_path):
    good = line("svc", [span(T1, "a" * 16, "", "root", 0, 10), stage(T1, "b" * 16, "a" * 16, "s", 1, 9)])
    bad_lines = [
        "{not json",
        json.dumps({"hello": 1}),
        line("svc", [{"traceId": T1, "name": "no ids"}]),
        line("svc", [span("zz", "a" * 16, "", "bad id", 0, 1)]),
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join([bad_lines[0], good, *bad_lines[1:]]) + "\n")
    out, err = io.StringIO(), io.StringIO()
    assert run_report([str(path)], as_json=True, out=out, err=err) == 0
    lines = err.getvalue().splitlines()
    assert [ln.split(": ", 1)[0] for ln in lines] == [f"{path}:1", f"{path}:3", f"{path}:4", f"{path}:5"]
    assert "invalid JSON" in lines[0] and "no resourceSpans" in lines[1]
    doc = json.loads(out.getvalue())
    assert doc["traces"] == 1 and doc["input"]["malformed"] == 4


def test_base64_ids_from_generic_protobuf_json_are_accepted():
    b64 = base64.b64encode(bytes.fromhex(T1)).decode()
    sid = base64.b64encode(bytes.fromhex("a" * 16)).decode()
    (s,) = spans_from_line(line("svc", [span(b64, sid, "", "root", 0, 1)]))
    assert s.trace_id == T1 and s.span_id == "a" * 16


def test_missing_path_is_a_clear_error():
    err = io.StringIO()
    assert run_report(["/no/such/file.jsonl"], out=io.StringIO(), err=err) == 2
    assert "no such file" in err.getvalue()


def test_report_uses_the_verdicts_stagetrace_exported(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGETRACE_OUTPUT_DIR", str(tmp_path))
    import time

    handle = stagetrace.configure("report-src", slow_threshold_ms=5, set_global=False)
    for i in range(20):
        with stagetrace.pipeline("job"):
            with stagetrace.stage("decode"):
                time.sleep(0.004 if i % 2 else 0.001)
            with stagetrace.stage("infer", kind="io"):
                time.sleep(0.002)
    handle.force_flush()
    handle.shutdown()
    out = io.StringIO()
    assert run_report([str(tmp_path)], as_json=True, out=out, err=io.StringIO()) == 0
    doc = json.loads(out.getvalue())
    assert doc["traces"] == 20
    assert doc["stages"]["infer"]["kind"] == "io"  # kinds come back from the stage spans
    assert doc["slow_traces"] >= 10
    assert set(doc["stages"]) == {"decode", "infer"}
    assert sum(doc["bottlenecks"].values()) == 20


def _chromium_driver(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not chromium or not chromedriver:
        pytest.skip("headless Chromium is not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'chrome-profile'}",
        "--window-size=1100,1600",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(chromedriver), options=options)


def test_html_report_renders_in_headless_chromium(tmp_path):
    gw = [
        span(T1, "a" * 16, "", "POST /predict", 0, 300, {c.HTTP_ROUTE: "/predict"}, kind=2),
        stage(T1, "b" * 16, "a" * 16, "decode", 1, 240),
        stage(T1, "d" * 16, "a" * 16, "infer", 241, 290, kind="gpu"),
    ]
    batch = span(
        "1" * 32, "c" * 16, "", "infer.batch", 241, 290, {c.BATCH_ID: "c" * 16, c.BATCH_SIZE: 3, c.BATCH_FILL: 0.375}
    )
    (tmp_path / "t.jsonl").write_text(line("gateway", gw) + "\n" + line("gateway", [batch]) + "\n")
    html_path = tmp_path / "report.html"
    assert run_report([str(tmp_path / "t.jsonl")], html_path=str(html_path), out=io.StringIO()) == 0
    page = html_path.read_text()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # self-contained: nothing fetched
    driver = _chromium_driver(tmp_path)
    try:
        driver.get(html_path.as_uri())
        kpis = {e.get_attribute("data-kpi"): e.text for e in driver.find_elements("css selector", ".kpi")}
        assert kpis["traces"].endswith("1")
        assert "1 (100%)" in kpis["slow traces"]
        rows = driver.find_elements("css selector", "#stages tr")
        assert [r.find_elements("css selector", "td")[0].text for r in rows[1:]] == ["decode", "infer"]
        assert len(driver.find_elements("css selector", "svg.waterfall rect")) == 3
        cells = [td.text for td in driver.find_elements("css selector", "#batches td")]
        assert cells == ["infer.batch", "1", "3.0", "3", "3", "38%"]
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        assert errors == []
        artifacts = Path(os.environ.get(ARTIFACTS_ENV) or tmp_path)
        artifacts.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(artifacts / "report.png"))
    finally:
        driver.quit()


def test_report_summarises_batches_and_keeps_them_out_of_the_request_count(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGETRACE_OUTPUT_DIR", str(tmp_path))
    import time

    from opentelemetry.trace import use_span

    handle = stagetrace.configure("batch-src", set_global=False)
    tracer = handle.tracer_provider.get_tracer("t")
    for size in (2, 4):
        roots, tickets = [], []
        for _ in range(size):
            root = tracer.start_span("request")
            with use_span(root, end_on_exit=False):
                tickets.append(stagetrace.enqueue("infer.queue"))
            roots.append(root)
        time.sleep(0.003)
        with stagetrace.batch("infer", tickets, max_size=8):
            with stagetrace.stage("forward"):
                time.sleep(0.002)
        for root in roots:
            root.end()
    handle.force_flush()
    handle.shutdown()
    out = io.StringIO()
    assert run_report([str(tmp_path)], as_json=True, out=out, err=io.StringIO()) == 0
    doc = json.loads(out.getvalue())
    assert doc["traces"] == 6 and set(doc["stages"]) == {"infer.queue", "infer", "forward"}
    batches = doc["batches"]["infer"]
    assert (batches["executions"], batches["size_mean"], batches["fill_mean"]) == (2, 3.0, 0.375)
    assert 2 <= batches["size_p50"] <= batches["size_p95"] <= 4
    waits = doc["batch_waits"]["infer.queue"]
    assert waits["requests"] == 6 and waits["formation_p50_ms"] >= 3 and waits["busy_p50_ms"] == 0
    text = io.StringIO()
    run_report([str(tmp_path)], out=text, err=io.StringIO())
    assert "Batches (requests per execution" in text.getvalue() and "Batch waits" in text.getvalue()


def test_report_recomputes_batch_diagnoses_from_span_attributes_and_links():
    """A member trace without stagetrace's verdict (e.g. from another SDK's file): the report rebuilds the
    batch membership from the attributes and the link to the batch span, and judges it with the same rules."""
    batch_attrs = {c.BATCH_ID: "b" * 16, c.BATCH_SIZE: 3, c.BATCH_ITEMS: 2, c.BATCH_INDEX: 0}
    wait = span(
        T1,
        "1" * 16,
        "a" * 16,
        "infer.queue",
        0,
        60,
        {
            c.STAGE: "infer.queue",
            c.STAGE_KIND: "wait",
            **batch_attrs,
            c.BATCH_FORMATION_MS: 10.0,
            c.BATCH_BUSY_MS: 50.0,
        },
    )
    head = span(
        T1,
        "2" * 16,
        "a" * 16,
        "infer",
        60,
        100,
        {c.STAGE: "infer", c.STAGE_KIND: "cpu", **batch_attrs, c.BATCH_MAX_SIZE: 16},
    )
    head["links"] = [{"traceId": "f" * 32, "spanId": "e" * 16}]
    forward = span(T1, "3" * 16, "2" * 16, "forward", 61, 65, {c.STAGE: "forward", c.STAGE_KIND: "gpu", **batch_attrs})
    root = span(T1, "a" * 16, "", "request", 0, 100)
    (parsed_head,) = [s for s in spans_from_line(line("svc", [head])) if s.name == "infer"]
    assert parsed_head.links == [("f" * 32, "e" * 16)]
    from stagetrace.report.traces import verdict_for_trace

    verdict = verdict_for_trace(spans_from_line(line("svc", [root, wait, head, forward])))
    assert set(verdict.diagnosis_codes) == {"QUEUEING", "BATCH_UNDERFILLED"}
    assert "2 of 16 items" in next(d.message for d in verdict.diagnoses if d.code == "BATCH_UNDERFILLED")


def test_the_report_counts_untracked_as_the_headline_of_traces_mostly_in_no_stage(tmp_path):
    # 100 ms: decode 10 ms, the rest in no stage; a second trace whose stage holds most of its time
    spans = [
        span(T1, "a" * 16, "", "POST /predict", 0, 100, kind=2),
        stage(T1, "b" * 16, "a" * 16, "decode", 0, 10),
        span("1" * 32, "c" * 16, "", "POST /predict", 0, 100, kind=2),
        stage("1" * 32, "d" * 16, "c" * 16, "decode", 0, 80),
    ]
    (tmp_path / "t.jsonl").write_text(line("svc", spans) + "\n")
    out = io.StringIO()
    assert run_report([str(tmp_path)], as_json=True, out=out, err=io.StringIO()) == 0
    doc = json.loads(out.getvalue())
    assert doc["bottlenecks"] == {"untracked": 1, "decode": 1}
    assert doc["stages"]["decode"]["bottleneck_traces"] == 1
    text = io.StringIO()
    assert run_report([str(tmp_path)], out=text, err=io.StringIO()) == 0
    assert "untracked (in no stage)" in text.getvalue()


def test_batch_wait_quantiles_come_from_their_own_split():
    """Formation and busy time are kept apart: each of the four figures reads its own series."""
    from stagetrace.report.aggregate import Aggregator

    agg = Aggregator()
    for i in range(1, 101):
        agg.add_batch_wait("infer.queue", formation_ms=float(i), busy_ms=1000.0 + 10 * i)
    waits = agg.summary()["batch_waits"]["infer.queue"]
    assert waits["requests"] == 100
    assert waits["formation_p50_ms"] == pytest.approx(50, rel=0.03)
    assert waits["formation_p95_ms"] == pytest.approx(95, rel=0.03)
    assert waits["busy_p50_ms"] == pytest.approx(1500, rel=0.03)
    assert waits["busy_p95_ms"] == pytest.approx(1950, rel=0.03)


def test_the_waterfall_draws_overlapping_spans_of_one_stage_as_their_union():
    """A composite ``event_loop.wait`` and the slowest occurrence it shows beside it, and stretches that
    overlap, drew more bars than the trace lasted (11.5 s of bars in a 9.6 s trace): one bar now, their
    union, as the verdict counts them; a stage that starts after the others ended keeps its own bar."""
    from stagetrace.report.traces import waterfall

    root = span(T1, "a" * 16, "", "GET /", 0, 100, kind=2)
    waits = [
        stage(T1, "b" * 16, "a" * 16, c.EVENT_LOOP_WAIT, 0, 60, kind="wait"),  # the composite's extent
        stage(T1, "c" * 16, "a" * 16, c.EVENT_LOOP_WAIT, 10, 30, kind="wait"),  # its slowest occurrence
        stage(T1, "d" * 16, "a" * 16, c.EVENT_LOOP_WAIT, 50, 70, kind="wait"),  # overlapping the first
        stage(T1, "e" * 16, "a" * 16, c.EVENT_LOOP_WAIT, 80, 90, kind="wait"),  # after: a bar of its own
    ]
    other = stage(T1, "f" * 16, "a" * 16, "decode", 20, 40)  # another stage at the same time: its own bar
    bars = waterfall(spans_from_line(line("svc", [root, *waits, other])))
    drawn = [(b["name"], b["start_ms"], b["end_ms"], b["spans"]) for b in bars]
    assert drawn == [
        ("GET /", 0.0, 100.0, 1),
        (c.EVENT_LOOP_WAIT, 0.0, 70.0, 3),
        ("decode", 20.0, 40.0, 1),
        (c.EVENT_LOOP_WAIT, 80.0, 90.0, 1),
    ]
    waited = sum(b["end_ms"] - b["start_ms"] for b in bars if b["name"] == c.EVENT_LOOP_WAIT)
    assert waited <= 100.0


def test_the_html_report_says_who_blocked_the_event_loop(tmp_path):
    blocker = "resize@" + "9" * 32
    attrs = {
        c.HTTP_ROUTE: "/p", c.TOTAL_MS: 300.0, c.SLOW: True, c.STAGES: [c.EVENT_LOOP_WAIT],
        c.STAGES_MS: [250.0], c.BOTTLENECK_STAGE: c.EVENT_LOOP_WAIT, c.BOTTLENECK_RATIO: 0.83,
        c.BLOCKED_BY: [blocker, "decode@" + "8" * 32],
    }  # fmt: skip
    root = span(T1, "a" * 16, "", "POST /p", 0, 300, attrs, kind=2)
    (tmp_path / "t.jsonl").write_text(line("svc", [root]) + "\n")
    page = tmp_path / "r.html"
    assert run_report([str(tmp_path / "t.jsonl")], html_path=str(page), out=io.StringIO()) == 0
    html = page.read_text()
    assert 'class="blocked-by"' in html
    assert f'<li><span class="code">resize</span> of trace {"9" * 32}</li>' in html
    assert html.index("resize") < html.index(f"decode</span> of trace {'8' * 32}")  # longest first, as stored


def test_a_diagnosis_reads_as_its_finding_then_its_evidence(tmp_path):
    """A long message was one ~400-character sentence: the finding and the evidence that decided it travel
    apart (the diagnosis event's evidence attribute) and are shown apart."""
    attrs = {
        c.TOTAL_MS: 64.0, c.SLOW: False, c.STAGES: ["tokenize"], c.STAGES_MS: [64.0],
        c.BOTTLENECK_STAGE: "tokenize", c.BOTTLENECK_RATIO: 1.0, c.DIAGNOSIS: ["OFF_CPU_WAIT"],
    }  # fmt: skip
    root = span(T1, "a" * 16, "", "POST /p", 0, 64, attrs, kind=2)
    finding = "'tokenize' was off-CPU 25.0 ms of its 64.0 ms, for the GIL or for a lock or I/O; the signals cannot tell"
    said = "the request spanned too few GIL-monitor wake-ups to measure GIL pressure"
    root["events"] = [
        {
            "name": c.DIAGNOSIS_EVENT,
            "timeUnixNano": root["endTimeUnixNano"],
            "attributes": [
                {"key": k, "value": {"stringValue": v}}
                for k, v in (
                    (c.DIAGNOSIS_EVENT_CODE, "OFF_CPU_WAIT"),
                    (c.DIAGNOSIS_EVENT_MESSAGE, finding),
                    (c.DIAGNOSIS_EVENT_EVIDENCE, said),
                )
            ],
        }
    ]
    (tmp_path / "t.jsonl").write_text(line("svc", [root]) + "\n")
    text, page = io.StringIO(), tmp_path / "r.html"
    assert run_report([str(tmp_path / "t.jsonl")], html_path=str(page), out=text) == 0
    lines = text.getvalue().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("  OFF_CPU_WAIT"))
    assert lines[at].endswith(f"e.g. {finding}")
    assert lines[at + 1] == f"      evidence: {said}"
    assert f'<p class="evidence">evidence: {said}</p>' in page.read_text()


def _two_services_streamed(first_threshold_ms=None, gap_threshold_ms=None):
    """A gateway that streams (its root has the stream's figures) and the model service under it, each with
    its own verdict: the report judges the trace whole, from the gateway's root, and must split the
    stream's phases over the model's stages and read the thresholds the gateway was judged by."""
    gateway = {c.TOTAL_MS: 100.0, c.STREAM_CHUNKS: 10, c.STREAM_FIRST_CHUNK_MS: 30.0,
               "stagetrace.stream.duration_ms": 60.0, "stagetrace.stream.gap_p99_ms": 50.0}  # fmt: skip
    if first_threshold_ms is not None:
        gateway[c.STREAM_FIRST_CHUNK_THRESHOLD_MS] = first_threshold_ms
    if gap_threshold_ms is not None:
        gateway[c.STREAM_GAP_THRESHOLD_MS] = gap_threshold_ms
    spans = [
        span(T1, "a" * 16, "", "POST /chat", 0, 100, gateway, kind=2),
        span(T1, "b" * 16, "a" * 16, "POST /generate", 0, 99, {c.TOTAL_MS: 99.0}, kind=2),
        stage(T1, "c" * 16, "b" * 16, "prefill", 0, 30, kind="gpu"),  # all before the first chunk (30 ms)
        stage(T1, "d" * 16, "b" * 16, "decode", 30, 90, kind="gpu"),  # the first chunk to the last (90 ms)
        stage(T1, "e" * 16, "b" * 16, "detokenize", 90, 95),  # after the last chunk: in neither phase
    ]
    return spans_from_line(line("svc", spans))


def test_a_recomputed_streams_phases_are_split_over_the_stages_at_the_first_and_last_chunk():
    from stagetrace.report.traces import verdict_for_trace

    v = verdict_for_trace(_two_services_streamed(gap_threshold_ms=40.0))
    assert v.stream is not None
    assert v.stream.first_chunk_breakdown == {"prefill": 30.0}  # decode starts exactly at the first chunk
    assert v.stream.gap_breakdown == {"decode": 60.0}
    assert (v.stream.first_chunk_bottleneck, v.stream.gap_bottleneck) == ("prefill", "decode")
    assert (v.slow, v.slow_reason, v.bottleneck, v.ratio) == (True, c.SLOW_GAP, "decode", 1.0)
    assert (v.first_chunk_threshold_ms, v.gap_threshold_ms) == (200.0, 40.0)  # the default slow threshold


def test_a_recomputed_stream_is_judged_by_the_thresholds_on_its_root_else_the_defaults():
    from stagetrace.report.traces import verdict_for_trace

    by_default = verdict_for_trace(_two_services_streamed())  # gaps' p99 50 ms under the default 100 ms
    assert (by_default.slow, by_default.gap_threshold_ms, by_default.first_chunk_threshold_ms) == (False, 100.0, 200.0)
    slow_first = verdict_for_trace(_two_services_streamed(first_threshold_ms=20.0))  # 30 ms to the first chunk
    assert (slow_first.slow_reason, slow_first.bottleneck, slow_first.first_chunk_threshold_ms) == (
        c.SLOW_FIRST_CHUNK, "prefill", 20.0,
    )  # fmt: skip
    slow_gaps = verdict_for_trace(_two_services_streamed(gap_threshold_ms=49.9))
    assert (slow_gaps.slow_reason, slow_gaps.gap_threshold_ms) == (c.SLOW_GAP, 49.9)
