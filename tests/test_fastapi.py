"""FastAPI and Flask integrations in process: the server span is the local root and carries the verdict."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import time

import httpx
import pytest
from fastapi import BackgroundTasks, FastAPI

import stagetrace
from stagetrace import conventions as c


def make_app() -> FastAPI:
    app = FastAPI()

    @stagetrace.stage("decode")
    def decode(n: int) -> int:
        return sum(range(n))

    @app.get("/predict/{item}")
    async def predict(item: int):
        started = time.perf_counter()
        decode(300_000)  # over 1 ms: CPU attributes are kept for stages of at least 1 ms
        decoded_s = time.perf_counter() - started
        async with stagetrace.stage("infer", kind="io"):
            # The longest part of the request, whatever a cold framework or a loaded host costs: at least
            # three times what decode took this time.
            await asyncio.sleep(max(0.02, 3 * decoded_s))
        return {"item": item}

    @app.get("/sync")
    def sync_endpoint():
        with stagetrace.stage("work"):
            time.sleep(0.002)
        return {"ok": True}

    @app.get("/bg")
    async def with_background(tasks: BackgroundTasks):
        def later():
            with stagetrace.stage("send_email"):
                time.sleep(0.005)

        tasks.add_task(later)
        return {"queued": True}

    pool = concurrent.futures.ThreadPoolExecutor(2)

    @app.get("/executor")
    async def executor():
        def job(name):
            with stagetrace.stage(name):
                time.sleep(0.001)

        loop = asyncio.get_running_loop()
        await loop.run_in_executor(pool, job, "in_executor")
        pool.submit(job, "submitted").result()
        await asyncio.to_thread(job, "to_thread")
        return {}

    return app


@pytest.fixture(params=["native", "contrib"])
def telemetry(request):
    """Both sources of the server span: FastAPI's own telemetry (the default where FastAPI has it) and the
    contrib instrumentation. The contrib ``instrument_app`` also patches starlette's ``BackgroundTask``
    for the whole process, with the tracer of the app it instrumented: undone after each test, or later
    tests' background tasks would run inside a span of a provider already shut down."""
    yield request.param
    from starlette.background import BackgroundTask

    original = getattr(BackgroundTask, "_otel_original_call", None)
    if original is not None:
        BackgroundTask.__call__ = original
        del BackgroundTask._otel_original_call


def call(app, *paths):
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [await client.get(p) for p in paths]

    return asyncio.run(go())


def test_server_span_is_the_root_with_verdict_and_route_metrics(harness, telemetry):
    app = stagetrace.instrument_fastapi(make_app(), telemetry=telemetry)
    (resp,) = call(app, "/predict/7")
    assert resp.status_code == 200
    spans = harness.spans()
    (root,) = [s for s in spans if s.parent is None]
    assert root.kind.name == "SERVER"
    assert root.attributes["http.route"] == "/predict/{item}"
    if telemetry == "native":  # FastAPI's own span, its dependency resolution and serialization as stages
        assert root.instrumentation_scope.name == "fastapi"
        assert root.attributes[c.STAGES] == ("fastapi.dependencies", "decode", "infer", "fastapi.serialization")
        (ser,) = harness.by_name("fastapi.serialization")
        assert ser.attributes[c.STAGE_KIND] == "cpu" and ser.instrumentation_scope.name == "fastapi"
    else:
        assert root.instrumentation_scope.name.startswith("opentelemetry.instrumentation")
        assert root.attributes[c.STAGES] == ("decode", "infer")
    assert root.attributes[c.BOTTLENECK_STAGE] == "infer"
    stages = {s.name: s for s in spans if c.STAGE in s.attributes}
    enclosing = {root.context.span_id} | {s.context.span_id for s in spans if s.name == "fastapi.endpoint"}
    assert all(s.parent.span_id in enclosing for s in stages.values())
    assert stages["decode"].attributes[c.ON_EVENT_LOOP] is True  # a sync stage inside async def
    assert c.ON_EVENT_LOOP not in stages["infer"].attributes  # async with: not blocking the loop
    assert stages["decode"].attributes[c.CPU_MS] >= 0
    routes = {p.attributes.get(c.HTTP_ROUTE) for p in harness.metric_points(c.METRIC_STAGE_DURATION)}
    assert routes == {"/predict/{item}"}
    assert not any(s.name.startswith("GET /predict/{item} http") for s in spans)  # send/receive excluded


def test_sync_endpoint_records_the_threadpool_wait(harness, telemetry, monkeypatch):
    # A warm pool can dispatch under the noise floor (then no stage is recorded, by design): with the floor
    # at zero the wait is always a stage, so the test asserts what happened, not what usually happens.
    monkeypatch.setattr("stagetrace.integrations.threads.MIN_WAIT_NS", 0)
    app = stagetrace.instrument_fastapi(make_app(), telemetry=telemetry)
    call(app, "/sync")
    stages = {s.name: s for s in harness.spans() if c.STAGE in s.attributes}
    assert stages["threadpool.wait"].attributes[c.STAGE_KIND] == "wait"
    assert c.ON_EVENT_LOOP not in stages["work"].attributes  # ran on a worker thread
    assert harness.verdicts[0].route == "/sync"


def test_background_task_work_lands_in_the_request_trace(harness, telemetry):
    app = stagetrace.instrument_fastapi(make_app(), telemetry=telemetry)
    call(app, "/bg")
    deadline = time.monotonic() + 5
    while not harness.by_name("send_email") and time.monotonic() < deadline:
        time.sleep(0.02)
    (bg,) = harness.by_name("send_email")
    root = next(s for s in harness.spans() if s.parent is None and s.kind.name == "SERVER")
    assert bg.context.trace_id == root.context.trace_id
    assert "send_email" not in harness.verdicts[0].breakdown  # after the response: not request latency
    assert bg.attributes[c.LATE] is True
    if telemetry == "native":  # FastAPI's span of the task is a late stage too, enclosing the user's
        (task,) = harness.by_name("fastapi.background_task")
        assert task.attributes[c.LATE] is True and task.attributes[c.STAGE_KIND] == "cpu"
        assert bg.parent.span_id == task.context.span_id
        assert "fastapi.background_task" not in harness.verdicts[0].breakdown


def test_context_reaches_executor_and_thread_workers(harness, telemetry):
    app = stagetrace.instrument_fastapi(make_app(), telemetry=telemetry)
    call(app, "/executor")
    spans = harness.spans()
    root = next(s for s in spans if s.parent is None)
    for name in ("in_executor", "submitted", "to_thread"):
        (span,) = [s for s in spans if s.name == name]
        assert span.context.trace_id == root.context.trace_id, name
    work = {"in_executor", "submitted", "to_thread"}
    assert work <= set(harness.verdicts[0].breakdown)
    waits = set(harness.verdicts[0].breakdown) - work - {"fastapi.dependencies", "fastapi.serialization"}
    assert waits <= {"executor.wait", "asyncio.wait", "threadpool.wait"}  # queue waits, low-cardinality names


def test_flask_server_span_carries_the_verdict(harness):
    from flask import Flask

    app = Flask(__name__)

    @app.get("/hello")
    def hello():
        with stagetrace.stage("render"):
            time.sleep(0.02)  # longer than the framework's own time, so the stage is the headline
        return "hi"

    stagetrace.instrument_flask(app)
    assert app.test_client().get("/hello").status_code == 200
    root = next(s for s in harness.spans() if s.parent is None)
    assert root.attributes[c.BOTTLENECK_STAGE] == "render"
    assert harness.verdicts[0].route == "/hello"


def test_missing_extra_gives_a_helpful_error_where_the_contrib_path_is_needed(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.instrumentation.fastapi", None)
    with pytest.raises(RuntimeError, match=r"pip install 'stagetrace\[fastapi\]'"):
        stagetrace.instrument_fastapi(FastAPI(), telemetry="contrib")


def test_no_query_strings_headers_or_bodies_are_recorded_by_default(harness, telemetry):
    app = FastAPI()

    @app.post("/search")
    async def search(q: str, request: __import__("fastapi").Request):
        await request.body()
        with stagetrace.stage("lookup"):
            return {"ok": True}

    stagetrace.instrument_fastapi(app, telemetry=telemetry)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.post(
                "/search?q=SECRET-QUERY",
                content=b"SECRET-BODY",
                headers={"authorization": "SECRET-HEADER", "x-user": "SECRET-HEADER"},
            )
            assert r.status_code == 200

    asyncio.run(go())
    dumped = repr([(s.name, dict(s.attributes), [e.attributes for e in s.events]) for s in harness.spans()])
    assert "/search" in dumped
    assert "SECRET" not in dumped


def test_query_strings_are_kept_when_opted_in(make_harness, monkeypatch, telemetry):
    monkeypatch.setenv("STAGETRACE_RECORD_QUERY_STRINGS", "true")
    h = make_harness()
    app = stagetrace.instrument_fastapi(make_app(), telemetry=telemetry)
    call(app, "/predict/3?debug=1")
    root = next(s for s in h.spans() if s.parent is None)
    assert any("debug=1" in str(v) for v in root.attributes.values())


def test_a_dependency_is_a_stage_whose_own_time_leaves_out_the_stages_inside_it(harness):
    from fastapi import Depends

    app = FastAPI()

    def user():
        with stagetrace.stage("auth"):
            time.sleep(0.01)
        return "u"

    @app.get("/me")
    async def me(who: str = Depends(user)):
        return {"who": who}

    call(stagetrace.instrument_fastapi(app), "/me")
    (v,) = harness.wait_verdicts(1)
    assert v.breakdown["auth"] >= 9
    (auth,) = harness.by_name("auth")
    (deps,) = [s for s in harness.by_name("fastapi.dependencies") if s.context.span_id == auth.parent.span_id]
    assert deps.attributes[c.STAGE_KIND] == "cpu"
    # Its own time only: its span less the stages inside it (auth, and the wait for a threadpool worker
    # that a sync dependency runs on). Checked against the spans' bounds, not against auth's length: a cold
    # worker thread or a loaded host can make the dependency's own time outlast auth.
    inside = [s for s in harness.spans() if s.parent is not None and s.parent.span_id == deps.context.span_id]
    assert auth in inside
    own_ns = (deps.end_time - deps.start_time) - sum(s.end_time - s.start_time for s in inside)
    assert v.breakdown["fastapi.dependencies"] == pytest.approx(own_ns / 1e6, abs=0.002)


@pytest.mark.parametrize(
    "why",
    ["no native telemetry", "already instrumented by contrib", "contrib options given"],
)
def test_auto_falls_back_to_the_contrib_instrumentation(harness, monkeypatch, why):
    app = make_app()
    kwargs = {}
    if why == "no native telemetry":
        monkeypatch.setattr("stagetrace.integrations.fastapi.fastapi_telemetry_config", lambda app: None)
    elif why == "already instrumented by contrib":
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.instrument_app(app, tracer_provider=harness.handle.tracer_provider)
    else:
        kwargs = {"excluded_urls": "/health"}
    try:
        call(stagetrace.instrument_fastapi(app, **kwargs), "/predict/1")
        (root,) = [s for s in harness.spans() if s.parent is None]
        assert root.instrumentation_scope.name.startswith("opentelemetry.instrumentation")
        assert len([s for s in harness.spans() if s.kind.name == "SERVER"]) == 1
    finally:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

        FastAPIInstrumentor.uninstrument_app(app)


def test_telemetry_choices_are_checked():
    with pytest.raises(ValueError, match="telemetry must be one of auto, native, contrib"):
        stagetrace.instrument_fastapi(FastAPI(), telemetry="otel")
    with pytest.raises(TypeError, match="excluded_urls"):
        stagetrace.instrument_fastapi(FastAPI(), telemetry="native", excluded_urls="/x")


def test_native_is_refused_where_fastapi_has_no_telemetry_of_its_own(monkeypatch):
    monkeypatch.setattr("stagetrace.integrations.fastapi.fastapi_telemetry_config", lambda app: None)
    with pytest.raises(RuntimeError, match=r"needs FastAPI 0\.142 or later"):
        stagetrace.instrument_fastapi(FastAPI(), telemetry="native")


def test_the_frameworks_own_http_metrics_reach_a_metric_reader_in_the_application(harness, telemetry):
    """With a reader in the application, the instrumentation's own HTTP server metrics (FastAPI's or the
    contrib middleware's) reach it beside stagetrace's."""
    app = stagetrace.instrument_fastapi(make_app(), telemetry=telemetry)
    (resp,) = call(app, "/sync")
    assert resp.status_code == 200
    harness.flush()
    data = harness.reader.get_metrics_data()
    names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert c.METRIC_TRACE_DURATION in names
    assert any(n.startswith("http.server.") for n in names), names


def test_without_a_metric_reader_in_the_application_no_measurement_is_built(monkeypatch, telemetry):
    """Nothing in the application reads metrics (they are the exporter process's, or off): stagetrace builds
    no SDK MeterProvider there, which would build and clean a measurement for every record another
    instrumentation makes and throw it away; the global provider stays the user's to set."""
    from opentelemetry.metrics import _internal as metrics_internal
    from opentelemetry.sdk.metrics._internal import measurement
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.util._once import Once

    monkeypatch.delenv("OTEL_METRICS_EXPORTER", raising=False)
    # this process's global meter provider as a fresh one has it: the API's placeholder, not yet set
    monkeypatch.setattr(metrics_internal, "_METER_PROVIDER", None)
    monkeypatch.setattr(metrics_internal, "_METER_PROVIDER_SET_ONCE", Once())
    built = []
    original = measurement.Measurement.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(measurement.Measurement, "__init__", counting)
    exporter = InMemorySpanExporter()
    handle = stagetrace.configure("no-reader", span_exporter=exporter)  # set_global: the default
    try:
        assert handle.meter_provider is None
        assert stagetrace._compat.meter_provider_is_unset()
        app = stagetrace.instrument_fastapi(make_app(), telemetry=telemetry)
        (resp,) = call(app, "/sync")
        assert resp.status_code == 200
        assert handle.force_flush(10)
        assert {s.name for s in exporter.get_finished_spans()} >= {"work", "GET /sync"}
        assert built == []
    finally:
        handle.shutdown()
