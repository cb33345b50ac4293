"""The deployment stack, verified offline: compose file, Collector configs, Grafana provisioning and the
dashboard (schema, promtool, and every query against a real Prometheus scraping a stagetrace app)."""

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

from stackcheck import check_collector_config
from stagetrace.testing.load import free_port

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
    assert {"otel-collector", "jaeger", "prometheus", "grafana", "demo"} <= set(services)
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
    assert "tail_sampling" not in pipes["traces/all"]["processors"]  # span metrics see every span
    assert pipes["traces/all"]["exporters"] == ["span_metrics"]
    assert cfg["exporters"]["prometheus"]["enable_open_metrics"] is True


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
        handle.shutdown()
