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
    """
)


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


def test_uninstrument_restores_everything():
    import concurrent.futures

    import fastapi.routing

    from stagetrace.integrations.zero_code import StagetraceInstrumentor

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
