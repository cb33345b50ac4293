"""Zero-code: `opentelemetry-instrument python app.py` with stagetrace installed gives stage spans and
verdicts, through the entry point, with or without a user's distro/configurator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stagetrace import conventions as c

APP = textwrap.dedent(
    """
    import asyncio, time
    import httpx
    from fastapi import FastAPI
    import stagetrace

    app = FastAPI()   # created after instrumentation: the contrib instrumentor patched the class

    @stagetrace.stage("decode")
    def decode():
        time.sleep(0.03)  # longer than the framework's own time: the headline is this stage

    @app.get("/predict")
    async def predict():
        decode()
        with stagetrace.stage("postprocess"):
            time.sleep(0.001)
        return {"ok": True}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            for _ in range(3):
                assert (await client.get("/predict")).status_code == 200

    asyncio.run(main())
    import os
    print(f"app pid {os.getpid()}")
    """
)
NO_DISTRO = {"OTEL_PYTHON_DISTRO": "none-installed", "OTEL_PYTHON_CONFIGURATOR": "none-installed"}


def run_instrumented(tmp_path: Path, env_extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "app.py"
    script.write_text(APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    env["STAGETRACE_HEALTHY_SAMPLE"] = "1"  # these tests count every trace
    env["STAGETRACE_EXPORT_BUDGET"] = "off"
    env.update(env_extra)
    instrument = shutil.which("opentelemetry-instrument", path=str(Path(sys.executable).parent))
    assert instrument, "opentelemetry-instrument not installed"
    # python must resolve to this interpreter (pitfall: opentelemetry-instrument uses shutil.which)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    out = subprocess.run(
        [instrument, "python", str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def app_pid(out: subprocess.CompletedProcess[str]) -> int:
    return int(out.stdout.split("app pid ")[1].split()[0])


def json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def root_spans(path: Path) -> list[tuple[dict, dict]]:
    """(resource attributes, span) of each ``GET /predict`` root in an OTLP JSON lines file."""
    found = []
    for doc in json_lines(path):
        for rs in doc["resourceSpans"]:
            resource = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
            found += [(resource, sp) for ss in rs["scopeSpans"] for sp in ss["spans"] if sp["name"] == "GET /predict"]
    return found


def both(extra: dict[str, str], traces: tuple[str, ...], metrics: tuple[str, ...], name: str, fast: bool = False):
    """A case with OpenTelemetry's distro and configurator, and with none (as where they are not installed)."""
    return [
        pytest.param(extra, traces, metrics, id=f"{name}, distro", marks=() if fast else pytest.mark.slow),
        pytest.param({**extra, **NO_DISTRO}, traces, metrics, id=f"{name}, no distro", marks=pytest.mark.slow),
    ]


# Every value the docs list for OTEL_TRACES_EXPORTER and OTEL_METRICS_EXPORTER (and none at all), and a list
# of several, with OpenTelemetry's distro and without: each signal goes where it was asked to (a JSON lines
# file, standard output, the collector) or, asked nothing, where the docs' table says; nothing tries to reach
# a collector that is not there, and a file is written only where the user asked for one or chose nothing,
# named after the application's process and carrying its service name.
FILE, CONSOLE, COLLECTOR = "file", "console", "collector"
DISTRO_CASES = [
    *both({}, (FILE,), (FILE,), "nothing chosen", fast=True),
    *both({"OTEL_TRACES_EXPORTER": "file"}, (FILE,), (FILE,), "file"),
    *both({"OTEL_TRACES_EXPORTER": "none"}, (), (), "none"),
    *both({"OTEL_TRACES_EXPORTER": "console"}, (CONSOLE,), (), "console"),
    *both({"OTEL_TRACES_EXPORTER": "otlp"}, (COLLECTOR,), (), "otlp"),
    *both({"OTEL_TRACES_EXPORTER": "file,console"}, (FILE, CONSOLE), (FILE,), "file+console"),
    *both({"OTEL_METRICS_EXPORTER": "file"}, (FILE,), (FILE,), "metrics file"),
    *both({"OTEL_METRICS_EXPORTER": "none"}, (FILE,), (), "metrics none"),
    *both({"OTEL_METRICS_EXPORTER": "console"}, (FILE,), (CONSOLE,), "metrics console"),
    *both({"OTEL_METRICS_EXPORTER": "otlp"}, (FILE,), (COLLECTOR,), "metrics otlp"),
]


@pytest.mark.parametrize(("extra", "traces", "metrics"), DISTRO_CASES)
def test_each_documented_exporter_value_with_and_without_the_distro(tmp_path, otlp_receiver, extra, traces, metrics):
    out_dir = tmp_path / "out"
    env = {"OTEL_SERVICE_NAME": "zc-app", "STAGETRACE_OUTPUT_DIR": str(out_dir), **extra}
    if COLLECTOR in traces:
        env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.grpc_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_METRICS_EXPORTER": "none"}  # fmt: skip
    if COLLECTOR in metrics:  # the metrics' own endpoint: the traces' choice stays unmade
        env |= {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": otlp_receiver.grpc_endpoint,
                "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_INSECURE": "true"}  # fmt: skip
    out = run_instrumented(tmp_path, env)
    pid = app_pid(out)
    assert "localhost:4317" not in out.stderr and "Failed to export" not in out.stderr, out.stderr[-2000:]
    files = sorted(p.name for p in out_dir.glob("*.jsonl")) if out_dir.exists() else []
    expected = [f"metrics-zc-app-{pid}.jsonl"] * (FILE in metrics) + [f"traces-zc-app-{pid}.jsonl"] * (FILE in traces)
    assert files == expected
    if FILE in traces:
        roots = root_spans(out_dir / f"traces-zc-app-{pid}.jsonl")
        assert len(roots) == 3
        assert all(r["service.name"] == {"stringValue": "zc-app"} for r, _ in roots)
        report = subprocess.run(
            [sys.executable, "-m", "stagetrace.cli.main", "report", str(out_dir)], capture_output=True, text=True
        )
        assert report.returncode == 0 and "3 traces" in report.stdout, report.stdout + report.stderr
    if FILE in metrics:
        (metrics_line, *_) = json_lines(out_dir / f"metrics-zc-app-{pid}.jsonl")
        resources = [
            {a["key"]: a["value"] for a in rm["resource"]["attributes"]} for rm in metrics_line["resourceMetrics"]
        ]
        assert resources and all(r["service.name"] == {"stringValue": "zc-app"} for r in resources)
        names = {
            m["name"] for rm in metrics_line["resourceMetrics"] for sm in rm["scopeMetrics"] for m in sm["metrics"]
        }
        assert c.METRIC_TRACE_DURATION in names
    assert out.stdout.count('"name": "GET /predict"') == (3 if CONSOLE in traces else 0)
    console_metrics = f'"name": "{c.METRIC_TRACE_DURATION}"' in out.stdout
    assert console_metrics == (CONSOLE in metrics), out.stdout[-2000:]
    if CONSOLE in metrics:
        assert '"service.name": "zc-app"' in out.stdout
    sink = otlp_receiver.sink
    if COLLECTOR in traces:
        assert sink.wait_for(lambda s: sum(1 for x in s.spans if x.name == "GET /predict") >= 3)
        assert all(x.resource["service.name"] == "zc-app" for x in sink.spans if x.name == "GET /predict")
    if COLLECTOR in metrics:
        assert sink.wait_for(lambda s: c.METRIC_TRACE_DURATION in s.metric_names)
    assert (COLLECTOR in traces) == bool(sink.spans) and (COLLECTOR in metrics) == bool(sink.metric_names)


@pytest.mark.parametrize(
    ("extra", "stages"),
    [
        ({}, ("decode", "postprocess")),  # the contrib instrumentation's server span (FastAPI's own then off)
        (
            {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "fastapi"},  # FastAPI's own telemetry, operation spans as stages
            ("fastapi.dependencies", "decode", "postprocess", "fastapi.serialization"),
        ),
    ],
    ids=["contrib", "native"],
)
def test_with_a_users_distro_stagetrace_attaches_to_its_provider(tmp_path, otlp_receiver, extra, stages):
    run_instrumented(
        tmp_path,
        {
            "OTEL_SERVICE_NAME": "zero-code-distro",
            "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.grpc_endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            **extra,
        },
    )
    sink = otlp_receiver.sink
    assert sink.wait_for(lambda s: sum(1 for x in s.spans if x.name == "GET /predict") >= 3)
    roots = [s for s in sink.spans if s.name == "GET /predict"]
    assert all(r.attributes[c.STAGES] == stages for r in roots)
    assert all(r.attributes[c.BOTTLENECK_STAGE] == "decode" for r in roots)
    assert all(r.resource["service.name"] == "zero-code-distro" for r in roots)
    decodes = [s for s in sink.spans if s.name == "decode"]
    enclosing = {r.span_id for r in roots} | {s.span_id for s in sink.spans if s.name == "fastapi.endpoint"}
    assert {d.parent_span_id for d in decodes} <= enclosing and len(decodes) == 3


@pytest.mark.slow
def test_without_an_sdk_stagetrace_configures_itself(tmp_path):
    out_dir = tmp_path / "out"
    run_instrumented(
        tmp_path,
        {
            # no distro and no configurator: nobody sets up the SDK or OTEL_* defaults
            "OTEL_PYTHON_DISTRO": "none-installed",
            "OTEL_PYTHON_CONFIGURATOR": "none-installed",
            "OTEL_SERVICE_NAME": "zero-code-bare",
            "STAGETRACE_OUTPUT_DIR": str(out_dir),
            "STAGETRACE_AUTO_STAGES": "true",
        },
    )
    (path,) = out_dir.glob("traces-*.jsonl")
    spans = [
        span
        for line in path.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for span in ss["spans"]
    ]
    roots = [s for s in spans if s["name"] == "GET /predict"]
    assert len(roots) == 3
    attrs = {a["key"]: a["value"] for a in roots[0]["attributes"]}
    assert attrs[c.BOTTLENECK_STAGE] == {"stringValue": "decode"}
    assert sum(1 for s in spans if s["name"] == "serialize") == 3  # STAGETRACE_AUTO_STAGES: no decorator needed


def test_uninstrument_restores_everything(monkeypatch):
    import concurrent.futures

    import fastapi.routing

    from stagetrace.destinations.env import DISTRO_DEFAULTS_VARIABLE
    from stagetrace.integrations.zero_code import StagetraceInstrumentor

    monkeypatch.setenv(DISTRO_DEFAULTS_VARIABLE, "")  # what instrument() records leaves with the test

    before = (concurrent.futures.ThreadPoolExecutor.submit, fastapi.routing.run_in_threadpool)
    assert not any(getattr(f, "__stagetrace_wrapped__", False) for f in before)
    inst = StagetraceInstrumentor()
    inst.instrument()
    try:
        assert getattr(concurrent.futures.ThreadPoolExecutor.submit, "__stagetrace_wrapped__", False)
        assert getattr(fastapi.routing.run_in_threadpool, "__stagetrace_wrapped__", False)
    finally:
        inst.uninstrument()
    assert (concurrent.futures.ThreadPoolExecutor.submit, fastapi.routing.run_in_threadpool) == before


def test_disabled_zero_code_is_a_no_op(tmp_path):
    flag = "true"
    out_dir = tmp_path / "out"
    run_instrumented(
        tmp_path,
        {
            "OTEL_PYTHON_DISTRO": "none-installed",
            "OTEL_PYTHON_CONFIGURATOR": "none-installed",
            "STAGETRACE_DISABLED": flag,
            "STAGETRACE_OUTPUT_DIR": str(out_dir),
        },
    )
    assert not out_dir.exists()


def test_attach_to_a_users_provider_flushes_and_detaches_cleanly():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import stagetrace
    from stagetrace import conventions as c
    from stagetrace.configuration import attach

    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    users_processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(users_processor)
    handle = attach(provider)  # no meter provider of its own: the API's proxy
    with provider.get_tracer("app").start_as_current_span("request"), stagetrace.stage("work"):
        pass
    assert handle.force_flush(5)
    root = next(s for s in exporter.get_finished_spans() if s.name == "request")
    assert c.BOTTLENECK_STAGE in root.attributes
    handle.shutdown()
    assert provider._active_span_processor._span_processors == (users_processor,)  # restored


def _exporting(exporter):
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return BatchSpanProcessor(exporter)


def test_the_takeover_moves_only_what_the_user_did_not_choose_and_stagetraces_own_files(tmp_path):
    """A distro's default OTLP exporters (their variable set after the start) and stagetrace's own JSON
    lines exporters move to stagetrace; the user's chosen exporters, their own subclasses and any other
    processor stay."""
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import SpanProcessor

    from stagetrace.destinations.distro import plan_takeover
    from stagetrace.destinations.files import JsonLinesSpanExporter

    class Vendor(OTLPSpanExporter):
        pass

    otlp, vendor, other = _exporting(OTLPSpanExporter()), _exporting(Vendor()), SpanProcessor()
    ours = _exporting(JsonLinesSpanExporter(tmp_path / "t.jsonl"))
    reader = PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=3_600_000)
    distro = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    try:
        plan = plan_takeover([otlp, vendor, other], [reader], {}, distro)  # the user chose nothing
        assert plan.kept_processors == (vendor, other) and plan.taken_processors == (otlp,)
        assert plan.taken_readers == (reader,) and plan.spans_file and plan.metrics_file
        chosen = plan_takeover([otlp, other], [reader], distro, distro)  # the same values, the user's
        assert chosen.kept_processors == (otlp, other) and not chosen.taken_readers
        assert not chosen.spans_file and not chosen.metrics_file
        endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}  # a choice of OTLP too
        assert plan_takeover([otlp], [reader], endpoint, {**distro, **endpoint}).kept_processors == (otlp,)
        mine = plan_takeover([ours, otlp], [], {"OTEL_TRACES_EXPORTER": "file,otlp"}, distro)
        assert mine.kept_processors == (otlp,) and mine.traces_path == tmp_path / "t.jsonl" and mine.spans_file
        assert mine.metrics_file  # no metric exporter chosen, traces to a file: metrics beside them
        none = plan_takeover([], [reader], {"OTEL_TRACES_EXPORTER": "none"}, distro)
        assert none.taken_readers == (reader,) and not none.spans_file and not none.metrics_file
    finally:
        for processor in (otlp, vendor, ours):
            processor.shutdown()
        reader.shutdown()


UVICORN_APP = textwrap.dedent(
    """
    import time
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/predict/")
    def predict():
        time.sleep(0.03)  # in no stage of its own: the automatic stages and the framework's
        return {"ok": True}
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("distro", [True, False], ids=["distro", "no distro"])
def test_the_zero_code_page_followed_literally_under_uvicorn_ends_with_a_report(tmp_path, distro):
    """docs/getting-started/zero-code.md as a newcomer runs it: uvicorn under opentelemetry-instrument with
    automatic stages and a service name, requests, Ctrl-C, then ``stagetrace report stagetrace-out``: the
    verdicts in the embedded default's files, counted by its metrics, and nothing sent to localhost."""
    import signal
    import urllib.request

    from harness import free_port, wait_for_port

    (tmp_path / "app.py").write_text(UVICORN_APP)
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "STAGETRACE_AUTO_STAGES": "true",
            "OTEL_SERVICE_NAME": "detector", **({} if distro else NO_DISTRO)}  # fmt: skip
    port = free_port()
    server = subprocess.Popen(
        [str(bin_dir / "opentelemetry-instrument"), "uvicorn", "app:app", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_port(port, server)
        for _ in range(12):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/predict/", data=b"", method="POST")
            assert urllib.request.urlopen(request, timeout=10).status == 200
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C
        _, stderr = server.communicate(timeout=30)
    assert "localhost:4317" not in stderr and "Failed to export" not in stderr, stderr[-2000:]
    out_dir = tmp_path / "stagetrace-out"
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == [f"metrics-detector-{server.pid}.jsonl", f"traces-detector-{server.pid}.jsonl"], names
    report = subprocess.run(
        [str(bin_dir / "stagetrace"), "report", "stagetrace-out"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    assert report.stdout.startswith("stagetrace report: ") and "(0 malformed lines)" in report.stdout
    summary = json.loads(
        subprocess.run(
            [str(bin_dir / "stagetrace"), "report", "stagetrace-out", "--json"], cwd=tmp_path, env=env,
            capture_output=True, text=True, check=True,
        ).stdout
    )  # fmt: skip
    assert summary["counted"] == {"requests": 12, "slow": 0} and 1 <= summary["traces"] <= 12
    assert "serialize" in summary["stages"] or "fastapi.serialization" in summary["stages"]  # automatic stages


WORKERS_APP = textwrap.dedent(
    """
    import os, time
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/predict/")
    async def predict():
        time.sleep(0.02)  # holds this worker's loop: concurrent connections go to the other worker too
        return {"pid": os.getpid()}
    """
)


@pytest.mark.slow
def test_under_a_process_manager_every_worker_writes_its_own_files(tmp_path):
    """``opentelemetry-instrument uvicorn app:app --workers 2`` with the distro installed: the workers start
    with the distro's defaults already in their environment (set in the supervisor, after it started), and
    still take them for the distro's, not the user's: each worker writes the embedded default's files,
    named after its own pid, with the traces of the requests it served, and nothing goes to localhost."""
    import collections
    import concurrent.futures
    import signal
    import urllib.request

    from harness import free_port, wait_for_port

    (tmp_path / "app.py").write_text(WORKERS_APP)
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_", "_STAGETRACE_"))}
    env |= {"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "OTEL_SERVICE_NAME": "detector",
            "STAGETRACE_HEALTHY_SAMPLE": "1", "STAGETRACE_EXPORT_BUDGET": "off"}  # fmt: skip
    port = free_port()
    command = ["opentelemetry-instrument", "uvicorn", "app:app", "--workers", "2", "--host", "127.0.0.1"]
    server = subprocess.Popen(
        [str(bin_dir / command[0]), *command[1:], "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def predict(_: int) -> int:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/predict/", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(json.loads(response.read())["pid"])

    served: collections.Counter[int] = collections.Counter()
    try:
        wait_for_port(port, server)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for _ in range(10):  # until both workers have served some
                served.update(pool.map(predict, range(16)))
                if len(served) == 2:
                    break
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn stops its workers, which flush
        _, stderr = server.communicate(timeout=60)
    assert len(served) == 2 and server.pid not in served, served
    assert "localhost:4317" not in stderr and "Failed to export" not in stderr, stderr[-2000:]
    out_dir = tmp_path / "stagetrace-out"
    traces = sorted(p.name for p in out_dir.glob("traces-*.jsonl"))
    assert traces == sorted(f"traces-detector-{pid}.jsonl" for pid in served), (traces, served)
    assert {p.name for p in out_dir.glob("metrics-*.jsonl")} <= {f"metrics-detector-{pid}.jsonl" for pid in served}
    for pid, requests in served.items():
        roots = [
            (resource, span)
            for doc in json_lines(out_dir / f"traces-detector-{pid}.jsonl")
            for rs in doc["resourceSpans"]
            for resource in [{a["key"]: a["value"] for a in rs["resource"]["attributes"]}]
            for ss in rs["scopeSpans"]
            for span in ss["spans"]
            if span["name"] == "POST /predict/"
        ]
        assert len(roots) == requests, (pid, len(roots), requests)  # the requests this worker served, no other's
        assert all(r["service.name"] == {"stringValue": "detector"} for r, _ in roots)
