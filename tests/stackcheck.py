"""Offline checks of the deployment stack (no Docker engine, no Collector binary here).

``check_collector_config`` is a structural checker for OpenTelemetry Collector configs: every pipeline uses
defined components, every connector is an exporter in one pipeline and a receiver in another,
memory_limiter comes first, nothing defined goes unused, and no deprecated component type is used.
"""

from __future__ import annotations

from typing import Any

# type -> what replaced it (collector and contrib changelogs, 2023-2026)
DEPRECATED_TYPES = {
    "logging": "debug",
    "spanmetrics": "span_metrics",
    "otlp": "otlp_grpc",  # as an exporter
    "otlphttp": "otlp_http",
    "loadbalancing": "load_balancing",
    "prometheusremotewrite": "prometheus_remote_write",
    "jaeger": "otlp_grpc to Jaeger's OTLP port",
}


def _type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def check_collector_config(cfg: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    sections = {k: set((cfg.get(k) or {}).keys()) for k in ("receivers", "processors", "exporters", "connectors")}
    pipelines = (cfg.get("service") or {}).get("pipelines") or {}
    if not pipelines:
        problems.append("service.pipelines is empty")
    used: dict[str, set[str]] = {k: set() for k in sections}
    connector_as_exporter: set[str] = set()
    connector_as_receiver: set[str] = set()
    for name, pipe in pipelines.items():
        for role, section in (("receivers", "receivers"), ("processors", "processors"), ("exporters", "exporters")):
            for comp in pipe.get(role) or []:
                if comp in sections[section]:
                    used[section].add(comp)
                elif role in ("receivers", "exporters") and comp in sections["connectors"]:
                    used["connectors"].add(comp)
                    (connector_as_receiver if role == "receivers" else connector_as_exporter).add(comp)
                else:
                    problems.append(f"pipeline {name}: {role[:-1]} {comp!r} is not defined")
        procs = pipe.get("processors") or []
        if procs and _type(procs[0]) != "memory_limiter":
            problems.append(f"pipeline {name}: memory_limiter must be the first processor (got {procs[0]!r})")
        if not pipe.get("receivers") or not pipe.get("exporters"):
            problems.append(f"pipeline {name}: needs receivers and exporters")
    for conn in sections["connectors"]:
        if conn not in connector_as_exporter or conn not in connector_as_receiver:
            problems.append(f"connector {conn!r} must be an exporter in one pipeline and a receiver in another")
    for section, names in sections.items():
        for comp in names - used[section]:
            problems.append(f"{section[:-1]} {comp!r} is defined but not used in any pipeline")
    for section in ("receivers", "processors", "exporters", "connectors"):
        for comp in sections[section]:
            t = _type(comp)
            if t in DEPRECATED_TYPES and not (t == "otlp" and section == "receivers"):
                problems.append(f"{section[:-1]} {comp!r}: deprecated type {t!r}, use {DEPRECATED_TYPES[t]!r}")
    for ext in (cfg.get("service") or {}).get("extensions") or []:
        if ext not in (cfg.get("extensions") or {}):
            problems.append(f"service extension {ext!r} is not defined")
    return problems


# The clickhouse exporter's options: open-telemetry/opentelemetry-collector-contrib,
# exporter/clickhouseexporter/config.schema.yaml (2026), its own properties with their types, plus the keys it
# takes from exporterhelper (timeout, sending_queue) and configretry (retry_on_failure). Unknown keys are
# errors, as they are for the Collector.
CLICKHOUSE_EXPORTER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["endpoint"],
    "properties": {
        **{
            key: {"type": "string"}
            for key in (
                "endpoint",
                "username",
                "password",
                "database",
                "traces_table_name",
                "logs_table_name",
                "profiles_table_name",
                "metrics_table_name",
                "cluster_name",
                "compress",
                "ttl",
                "timeout",
            )
        },
        **{key: {"type": "boolean"} for key in ("async_insert", "create_schema", "json")},
        "connection_params": {"type": "object", "additionalProperties": {"type": "string"}},
        "metrics_tables": {"type": "object"},
        "table_engine": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "params": {"type": "string"}},
        },
        "tls": {"type": "object"},
        "sending_queue": {"type": "object"},
        "retry_on_failure": {"type": "object"},
    },
}


def check_clickhouse_exporter(block: dict[str, Any]) -> list[str]:
    """Problems with one clickhouse exporter's options, by the exporter's schema (needs jsonschema)."""
    import jsonschema

    validator = jsonschema.Draft7Validator(CLICKHOUSE_EXPORTER_SCHEMA)
    return [f"{'.'.join(map(str, e.path)) or '(block)'}: {e.message}" for e in validator.iter_errors(block)]
