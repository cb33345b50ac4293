"""A real OTLP receiver on 127.0.0.1 for tests and benchmarks: gRPC and HTTP/protobuf, decoded with
opentelemetry-proto. ``export_delay_s`` makes it a slow collector."""

from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def _attr_value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_attr_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


class ReceivedSpan:
    def __init__(self, span: Any, resource: dict[str, Any]) -> None:
        self.name = span.name
        self.trace_id = span.trace_id.hex()
        self.span_id = span.span_id.hex()
        self.parent_span_id = span.parent_span_id.hex()
        self.start_ns = span.start_time_unix_nano
        self.end_ns = span.end_time_unix_nano
        self.attributes = {kv.key: _attr_value(kv.value) for kv in span.attributes}
        self.events = [(e.name, {kv.key: _attr_value(kv.value) for kv in e.attributes}) for e in span.events]
        self.resource = resource

    def __repr__(self) -> str:
        return f"ReceivedSpan({self.name!r})"


class OtlpSink:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.metric_names: set[str] = set()
        self.requests = 0
        self._lock = threading.Lock()

    def add_traces(self, req: Any) -> None:
        with self._lock:
            self.requests += 1
            for rs in req.resource_spans:
                resource = {kv.key: _attr_value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend(ReceivedSpan(s, resource) for s in ss.spans)

    def add_metrics(self, req: Any) -> None:
        with self._lock:
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    self.metric_names.update(m.name for m in sm.metrics)

    def wait_for(self, predicate: Any, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if predicate(self):
                    return True
            time.sleep(0.02)
        return False


class _TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpSink, delay_s: float) -> None:
        self.sink = sink
        self.delay_s = delay_s

    def Export(self, request: Any, context: Any) -> Any:
        if self.delay_s:
            time.sleep(self.delay_s)
        self.sink.add_traces(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsServicer(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, sink: OtlpSink) -> None:
        self.sink = sink

    def Export(self, request: Any, context: Any) -> Any:
        self.sink.add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OtlpReceiver:
    """Starts both protocols; ``grpc_endpoint`` and ``http_endpoint`` are base URLs on 127.0.0.1."""

    def __init__(self, grpc_port: int = 0, export_delay_s: float = 0.0) -> None:
        self.sink = OtlpSink()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        servicer = _TraceServicer(self.sink, export_delay_s)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, self._grpc)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsServicer(self.sink), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port(f"127.0.0.1:{grpc_port}")
        sink = self.sink

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    req = trace_service_pb2.ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    sink.add_traces(req)
                    out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    req = metrics_service_pb2.ExportMetricsServiceRequest()
                    req.ParseFromString(body)
                    sink.add_metrics(req)
                    out = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self) -> OtlpReceiver:
        self._grpc.start()
        self._http_thread.start()
        return self

    def stop(self) -> None:
        self._grpc.stop(grace=None)
        self._http.shutdown()
        self._http.server_close()
