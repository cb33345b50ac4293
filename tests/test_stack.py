"""The deployment stack, verified offline: compose file, Collector configs, Grafana provisioning and the
dashboards (schema, promtool, and every query against a real Prometheus scraping a stagetrace app; the fleet
dashboard's SQL against chDB holding stagetrace's traces in the Collector ClickHouse exporter's table)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from harness import free_port

from stackcheck import check_clickhouse_exporter, check_collector_config

ROOT = Path(__file__).resolve().parent.parent
COLLECTOR_CONFIGS = sorted((ROOT / "collector-config").glob("*.yaml"))


def need(tool: str) -> str:
    path = shutil.which(tool)
    if not path:
        pytest.skip(f"{tool} is not installed (scripts/setup.sh installs it)")
    return path


def test_compose_file_is_valid_for_docker_compose():
    compose = need("docker-compose")
    out = subprocess.run(
        [compose, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr


def test_compose_publishes_only_on_loopback_pins_images_and_ships_no_admin_password():
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = doc["services"]
    assert {"otel-collector", "jaeger", "prometheus", "grafana", "clickhouse", "demo"} <= set(services)
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        if "image" in svc:
            tag = svc["image"].rsplit(":", 1)
            assert len(tag) == 2 and tag[1] not in ("latest", ""), f"{name}: unpinned image {svc['image']}"
    assert services["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")  # v2, not the EOL all-in-one
    assert "--enable-feature=exemplar-storage" in services["prometheus"]["command"]
    env = services["grafana"]["environment"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer" and env["GF_AUTH_DISABLE_LOGIN_FORM"] == "true"
    assert services["demo"]["profiles"] == ["demo"]


@pytest.mark.parametrize("path", COLLECTOR_CONFIGS, ids=lambda p: p.name)
def test_collector_configs_are_structurally_sound(path):
    cfg = yaml.safe_load(path.read_text())
    assert check_collector_config(cfg) == []


def test_the_structural_checker_catches_mistakes():
    bad = {
        "receivers": {"otlp": {}},
        "processors": {"batch": {}, "memory_limiter": {}},
        "exporters": {"logging": {}, "otlp/x": {}},
        "connectors": {"spanmetrics": {}},
        "service": {
            "pipelines": {
                "traces": {
                    "receivers": ["otlp"],
                    "processors": ["batch", "memory_limiter"],
                    "exporters": ["spanmetrics", "nope"],
                }
            }
        },
    }
    found = "\n".join(check_collector_config(bad))
    for expected in (
        "'nope' is not defined",
        "memory_limiter must be the first",
        "'spanmetrics' must be an exporter",
        "deprecated type 'logging'",
        "deprecated type 'otlp'",
        "'logging' is defined but not used",
    ):
        assert expected in found


def test_single_node_config_keeps_slow_and_diagnosed_traces_and_feeds_span_metrics_unsampled():
    cfg = yaml.safe_load((ROOT / "collector-config" / "otelcol.yaml").read_text())
    policies = {p["name"]: p for p in cfg["processors"]["tail_sampling"]["policies"]}
    assert policies["slow"]["boolean_attribute"] == {"key": "stagetrace.slow", "value": True}
    assert "stagetrace.diagnosis" in policies["diagnosed"]["ottl_condition"]["span"][0]
    assert "STAGETRACE_BASELINE_SAMPLING_PERCENT" in str(policies["baseline"])
    pipes = cfg["service"]["pipelines"]
    assert "tail_sampling" not in pipes["traces/all"]["processors"]  # span metrics and ClickHouse see every span
    assert pipes["traces/all"]["exporters"] == ["span_metrics", "clickhouse"]
    assert pipes["traces/sampled"]["exporters"] == ["otlp_grpc/jaeger"]
    assert cfg["exporters"]["prometheus"]["enable_open_metrics"] is True


@pytest.mark.parametrize("name", ["otelcol.yaml", "otelcol-gateway.yaml"])
def test_clickhouse_exporter_follows_the_exporters_schema_and_feeds_the_report(name):
    cfg = yaml.safe_load((ROOT / "collector-config" / name).read_text())
    pytest.importorskip("jsonschema")
    block = cfg["exporters"]["clickhouse"]
    assert check_clickhouse_exporter(block) == []
    assert "batch" not in cfg["service"]["pipelines"]["traces/all"].get("processors", [])  # sending_queue batches
    assert (block["database"], block["traces_table_name"]) == ("otel", "otel_traces")
    assert block["password"] == "${env:CLICKHOUSE_PASSWORD}"  # never in the file
    assert any(
        "unexpected" in p or "Additional properties" in p for p in check_clickhouse_exporter({**block, "tabel": "x"})
    )
    assert check_clickhouse_exporter({**block, "create_schema": "yes"})  # wrong type


def test_clickhouse_is_shared_by_collector_grafana_and_the_report():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ch = compose["clickhouse"]
    assert ch["image"].startswith("clickhouse/clickhouse-server:26.")
    assert ch["environment"]["CLICKHOUSE_DB"] == "otel"
    password = ch["environment"]["CLICKHOUSE_PASSWORD"]
    for service in ("otel-collector", "grafana"):
        assert compose[service]["environment"]["CLICKHOUSE_PASSWORD"] == password
    assert compose["otel-collector"]["depends_on"]["clickhouse"] == {"condition": "service_healthy"}
    assert compose["grafana"]["environment"]["GF_PLUGINS_PREINSTALL_SYNC"].startswith("grafana-clickhouse-datasource@")
    ds = yaml.safe_load((ROOT / "grafana/provisioning/datasources/datasources.yaml").read_text())["datasources"]
    source = next(d for d in ds if d["type"] == "grafana-clickhouse-datasource")
    data = source["jsonData"]
    assert (data["host"], data["port"], data["protocol"]) == ("clickhouse", 8123, "http")
    assert data["username"] == ch["environment"]["CLICKHOUSE_USER"]
    assert source["secureJsonData"]["password"] == "$CLICKHOUSE_PASSWORD"
    assert (data["traces"]["defaultDatabase"], data["traces"]["defaultTable"]) == ("otel", "otel_traces")
    fleet = json.loads((ROOT / "dashboards/stagetrace-fleet.json").read_text())
    assert fleet["templating"]["list"][0]["current"]["value"] == source["uid"]


def test_gateway_tier_is_fed_by_trace_id_load_balancing():
    agent = yaml.safe_load((ROOT / "collector-config" / "otelcol-agent.yaml").read_text())
    assert agent["exporters"]["load_balancing"]["routing_key"] == "traceID"
    gateway = yaml.safe_load((ROOT / "collector-config" / "otelcol-gateway.yaml").read_text())
    assert "tail_sampling" in gateway["processors"]


def test_grafana_provisioning_links_exemplars_to_jaeger_and_loads_the_dashboard():
    ds = yaml.safe_load((ROOT / "grafana/provisioning/datasources/datasources.yaml").read_text())["datasources"]
    prom = next(d for d in ds if d["type"] == "prometheus")
    jaeger = next(d for d in ds if d["type"] == "jaeger")
    dest = prom["jsonData"]["exemplarTraceIdDestinations"][0]
    assert dest == {**dest, "name": "trace_id", "datasourceUid": jaeger["uid"]}
    prov = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/dashboards.yaml").read_text())["providers"][0]
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]
    assert f"./dashboards:{prov['options']['path']}:ro" in compose["volumes"]


def test_dashboard_is_generated_and_matches_grafanas_schema():
    jsonschema = pytest.importorskip("jsonschema")
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/build_dashboard.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    schema = json.loads((ROOT / "dashboards/grafana-dashboard.schema.json").read_text())
    dashboard = json.loads((ROOT / "dashboards/stagetrace.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    assert [e.message for e in validator.iter_errors(dashboard)] == []
    broken = json.loads(json.dumps(dashboard))
    broken["panels"][0]["gridPos"]["w"] = "wide"
    assert list(validator.iter_errors(broken))
    titles = " ".join(p["title"] for p in dashboard["panels"])
    for needed in ("p50 / p95 / p99", "Share of request time", "Bottleneck", "Slow", "Diagnoses", "GPU"):
        assert needed in titles
    assert any(t.get("exemplar") for p in dashboard["panels"] for t in p["targets"])
    assert {v["name"] for v in dashboard["templating"]["list"]} >= {"service", "route"}


def test_fleet_dashboard_is_generated_and_matches_grafanas_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "dashboards/grafana-dashboard.schema.json").read_text())
    fleet = json.loads((ROOT / "dashboards/stagetrace-fleet.json").read_text())
    assert [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(fleet)] == []
    titles = " ".join(p["title"] for p in fleet["panels"])
    assert "Stage p50 / p99 by service.version" in titles and "Request p99 by service.version" in titles
    for p in fleet["panels"]:
        assert p["datasource"]["type"] == "grafana-clickhouse-datasource"
        assert all(t["editorType"] == "sql" and "otel.otel_traces" in t["rawSql"] for t in p["targets"])


def fleet_queries() -> list[tuple[str, str]]:
    """The fleet dashboard's SQL with Grafana's macros as the ClickHouse data source expands them."""
    fleet = json.loads((ROOT / "dashboards/stagetrace-fleet.json").read_text())
    raw = [(p["title"], t["rawSql"]) for p in fleet["panels"] for t in p["targets"]]
    raw += [
        (f"variable {v['name']}", v["query"]["rawSql"]) for v in fleet["templating"]["list"] if v["type"] == "query"
    ]
    return [
        (
            title,
            # the range as Grafana sends it: explicit bounds (now() has whole seconds: a span of this second
            # would fall after it)
            sql.replace(
                "$__timeFilter(Timestamp)", "Timestamp BETWEEN now() - INTERVAL 1 DAY AND now() + INTERVAL 1 HOUR"
            )
            .replace("$__timeInterval(Timestamp)", "toStartOfInterval(Timestamp, INTERVAL 60 second)")
            .replace("${service:singlequote}", "'fleet-app'"),
        )
        for title, sql in raw
    ]


def test_every_fleet_dashboard_query_runs_on_stored_verdicts(tmp_path, monkeypatch):
    """stagetrace's own traces (two versions of one service) loaded into chDB through the exporter's table:
    every panel's query runs and the stage table compares both versions."""
    chdb_session = pytest.importorskip("chdb.session", reason="chDB is not installed (the clickhouse extra)")
    import stagetrace
    from stagetrace.report.clickhouse import ChdbConnection, insert_otlp_lines
    from stagetrace.report.fleet import Source, quote_identifier
    from stagetrace.report.otel_schema import TRACES_TABLE_DDL

    monkeypatch.setenv("STAGETRACE_OUTPUT_DIR", str(tmp_path / "traces"))
    handle = stagetrace.configure("fleet-app", slow_threshold_ms=1, set_global=False)
    for _ in range(6):
        with stagetrace.pipeline("job"):
            with stagetrace.stage("decode"):
                time.sleep(0.001)
            with stagetrace.stage("infer", kind="io"):
                time.sleep(0.001)
            time.sleep(0.02)  # in no stage: UNTRACKED_TIME (>= 10 ms, most of the trace) for the diagnoses panel
    handle.force_flush()
    handle.shutdown()
    versions = iter(["1.0", "1.1"] * 100)

    def tag(row: dict) -> dict:
        if not row["ParentSpanId"]:
            row["ResourceAttributes"]["service.version"] = next(versions)
        return row

    db = tmp_path / "db"
    session = chdb_session.Session(str(db))
    session.query("CREATE DATABASE otel")
    session.query(TRACES_TABLE_DDL.format(database=quote_identifier("otel"), table=quote_identifier("otel_traces")))
    session.close()
    conn = ChdbConnection(str(db))
    lines = [ln for f in (tmp_path / "traces").glob("*.jsonl") for ln in f.read_text().splitlines()]
    assert insert_otlp_lines(conn, Source("otel", "otel_traces"), lines, transform=tag) > 0
    conn.close()
    session = chdb_session.Session(str(db))
    try:
        results = {}
        for title, sql in fleet_queries():
            results[title] = [json.loads(r) for r in session.query(sql, "JSONCompactEachRow").bytes().splitlines()]
    finally:
        session.close()
    assert all(results.values()), [t for t, rows in results.items() if not rows]
    stage_rows = results["Stage p50 / p99 by service.version (stored verdicts)"]
    assert {(r[0], r[1]) for r in stage_rows} == {(s, v) for s in ("decode", "infer") for v in ("1.0", "1.1")}
    assert sum(r[2] for r in stage_rows if r[0] == "decode") == 6


def dashboard_queries(rate: str = "10s", range_: str = "1m") -> list[tuple[str, str]]:
    dashboard = json.loads((ROOT / "dashboards/stagetrace.json").read_text())
    out = []
    for panel in dashboard["panels"]:
        for t in panel["targets"]:
            expr = (
                t["expr"]
                .replace("$__rate_interval", rate)
                .replace("$__range", range_)
                .replace("$service", ".*")
                .replace("$route", ".*")
            )
            out.append((f"{panel['title']} [{t['refId']}]", expr))
    return out


def test_every_dashboard_query_parses_with_promtool(tmp_path):
    promtool = need("promtool")
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:q{i}", "expr": expr} for i, (_, expr) in enumerate(dashboard_queries())
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path):
    """A stagetrace-instrumented app serves traffic and exposes its metrics; a real Prometheus scrapes it
    (what the Collector's prometheus exporter does in the stack); every dashboard query must return data."""
    prometheus = need("prometheus")
    import asyncio
    import multiprocessing
    import zlib
    from concurrent.futures import ProcessPoolExecutor

    import httpx
    from fastapi import FastAPI
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import start_http_server

    import stagetrace
    from fakes import FakeCudaBackend, FakeNvml, FakeTensor, fake_model
    from stagetrace.gpu import attach_gpu
    from stagetrace.settings import Settings

    metrics_port, prom_port = free_port(), free_port()
    reader = PrometheusMetricReader()
    handle = stagetrace.configure(
        "stack-app",
        metric_reader=reader,
        slow_threshold_ms=15,
        gpu=False,
        settings=Settings(max_stage_names=6),
        set_global=False,
    )
    support = attach_gpu(
        handle.runtime, backend=FakeCudaBackend(), nvml=FakeNvml(utilization=0.2), nvml_poll_interval_s=0.05
    )
    server, _thread = start_http_server(metrics_port, addr="127.0.0.1")
    app = FastAPI()
    gpu = support.backend.gpu

    @app.get("/predict")
    async def predict():
        with stagetrace.stage("decode"):
            time.sleep(0.012)  # sync work on the event loop: a diagnosis fires
        x = stagetrace.h2d(FakeTensor(gpu, 1 << 20, pinned=True), "cuda:0")
        with stagetrace.gpu_stage("infer"):
            fake_model(x, ms=2)
        stagetrace.d2h(FakeTensor(gpu, 4096, "cuda:0"))
        return {}

    @app.get("/batched")
    async def batched():
        ticket = stagetrace.enqueue("batch.queue")
        async with stagetrace.batch("batched", [ticket], max_size=4):
            with stagetrace.stage("decode"):
                pass
        return {}

    @app.get("/generate")
    def generate():
        from fastapi.responses import StreamingResponse

        stagetrace.generation("tiny-gpt", provider="local")

        def tokens():
            for i in range(10):
                with stagetrace.stage("decode_step"):
                    time.sleep(0.001)
                yield f"data: {i}\n\n"

        return StreamingResponse(tokens(), media_type="text/event-stream")

    # A pool made before any request, started by forkserver (no copy of this process's threads): each call
    # to it is an offload stage whose queue wait and payload sizes the pool panels read.
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"))

    @app.get("/offload")
    async def offload():
        await asyncio.get_running_loop().run_in_executor(pool, zlib.compress, b"stagetrace " * 2000)
        return {}

    @app.get("/churn/{i}")
    def churn(i: int):
        with stagetrace.stage(f"dynamic-{i}"):  # too many distinct stage names: counted as dropped
            pass
        return {}

    stagetrace.instrument_fastapi(app)
    stop = threading.Event()

    def traffic():
        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                i = 0
                while not stop.is_set():
                    await c.get("/predict")
                    await c.get("/batched")
                    await c.get("/generate")
                    await c.get("/offload")
                    await c.get(f"/churn/{i % 12}")
                    i += 1
                    await asyncio.sleep(0.01)

        asyncio.run(go())

    load = threading.Thread(target=traffic, daemon=True)
    load.start()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "stack-app", "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}]}
                ],
            }
        )
    )
    proc = subprocess.Popen(
        [
            prometheus,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--enable-feature=exemplar-storage",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{prom_port}"
    try:
        deadline = time.monotonic() + 60
        ready = False
        while time.monotonic() < deadline and not ready:
            time.sleep(0.5)
            try:
                targets = _get(f"{base}/api/v1/targets")["data"]["activeTargets"]
                ready = bool(targets) and targets[0]["health"] == "up"
            except OSError:
                continue
        assert ready, "Prometheus never scraped the app"
        time.sleep(12)  # a dozen scrapes while traffic flows, so rates have data
        empty = []
        for title, expr in dashboard_queries():
            result = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
            assert result["status"] == "success", (title, result)
            if not result["data"]["result"]:
                empty.append(title)
        assert empty == [], f"queries without data: {empty}"
    finally:
        stop.set()
        load.join(timeout=10)
        proc.terminate()
        proc.wait(timeout=20)
        server.shutdown()
        pool.shutdown()
        handle.shutdown()
