"""A bounded load test: a stagetrace-instrumented FastAPI app under uvicorn on 127.0.0.1, many concurrent
clients from another process, then the checks: every request has exactly one trace with a verdict, no
stage landed in another request's trace, RSS sampled over the run, stagetrace's drop counters.

Used by ``benchmarks/load.py`` (1,000 clients for 60 s) and by the test suite (a short run), with the small
helpers both share (``free_port``, ``wait_for_port``, ``terminate``): the benchmarks import it from their own
directory, the tests through ``conftest.py``. Not part of the installed package. Every loop is bounded in
count and time; only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request  # module level: FastAPI resolves the string annotations here

from stagetrace.report.loader import spans_from_line

REQ_HEADER = "x-load-req"
REQ_ATTR = "load.req"


def build_app(out_dir: str) -> Any:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    import stagetrace
    from stagetrace import conventions as c

    reader = InMemoryMetricReader()
    verdicts = [0]
    stagetrace.configure(
        "load-test",
        metric_reader=reader,
        on_verdict=lambda v: verdicts.__setitem__(0, verdicts[0] + 1),
        # the harness checks that every request has its trace: all kept, no budget
        settings=stagetrace.Settings(healthy_sample=1.0, export_budget_per_s=None),
    )
    app = FastAPI()

    @app.get("/work")
    async def work(request: Request) -> dict:
        req = request.headers.get(REQ_HEADER, "")
        with stagetrace.stage("parse") as s:
            s.set_attribute(REQ_ATTR, req)
            sum(range(2000))
        async with stagetrace.stage("fetch", kind="io") as s:
            s.set_attribute(REQ_ATTR, req)
            await asyncio.sleep(0.002)
        with stagetrace.stage("respond") as s:
            s.set_attribute(REQ_ATTR, req)
            return {"req": req}

    @app.on_event("shutdown")
    def dump_stats() -> None:
        from stagetrace.configuration import current_handle

        handle = current_handle()
        if handle is not None:
            handle.force_flush(30)
        dropped: dict[str, float] = {}
        data = reader.get_metrics_data()
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == c.METRIC_DROPPED:
                        for p in m.data.data_points:
                            dropped[str((p.attributes or {})[c.DROP_REASON])] = getattr(p, "value", 0)
        Path(out_dir, "stats.json").write_text(json.dumps({"verdicts": verdicts[0], "dropped": dropped}))

    stagetrace.instrument_fastapi(app)
    return app


def serve_main(port: int, out_dir: str) -> None:
    import uvicorn

    os.environ["STAGETRACE_OUTPUT_DIR"] = out_dir
    uvicorn.run(
        build_app(out_dir),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        backlog=4096,
        limit_concurrency=None,
        timeout_keep_alive=60,  # no keep-alive close racing a reused connection
    )


async def _client(url: str, duration_s: float, concurrency: int, max_requests: int) -> dict:
    import httpx

    deadline = time.monotonic() + duration_s
    counter = iter(range(max_requests))
    ok = errors = 0
    reasons: dict[str, int] = {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def worker() -> None:
            nonlocal ok, errors
            while time.monotonic() < deadline:
                req = next(counter, None)
                if req is None:
                    return
                try:
                    r = await client.get("/work", headers={REQ_HEADER: str(req)})
                    if r.status_code == 200 and r.json()["req"] == str(req):
                        ok += 1
                        continue
                    reason = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    reason = type(e).__name__
                errors += 1
                reasons[reason] = reasons.get(reason, 0) + 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ok": ok, "errors": errors, "reasons": reasons}


def client_main(url: str, duration_s: float, concurrency: int, max_requests: int) -> None:
    print(json.dumps(asyncio.run(_client(url, duration_s, concurrency, max_requests))))


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, for a server a test or benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Until something accepts on 127.0.0.1:port; an error with the server's stderr if it died first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            detail = proc.stderr.read()[-2000:] if proc.stderr else ""
            raise RuntimeError(f"server on port {port} did not start: {detail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)


def terminate(proc: subprocess.Popen, timeout_s: float = 120) -> None:
    """SIGTERM (a graceful server shutdown, which flushes stagetrace), then kill past the timeout."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def check_traces(out_dir: Path) -> dict[str, Any]:
    """Per request id: how many traces, and whether any trace holds stages of several requests."""
    traces: dict[str, set[str]] = defaultdict(set)
    roots_with_verdict: set[str] = set()
    for path in out_dir.glob("traces-*.jsonl"):
        for line in path.read_text().splitlines():
            for span in spans_from_line(line):
                if "stagetrace.total_ms" in span.attributes:
                    roots_with_verdict.add(span.trace_id)
                req = span.attributes.get(REQ_ATTR)
                if req is not None:
                    traces[span.trace_id].add(req)
    mixed = sum(1 for reqs in traces.values() if len(reqs) > 1)
    per_req: dict[str, int] = defaultdict(int)
    for reqs in traces.values():
        for r in reqs:
            per_req[r] += 1
    return {
        "traces": len(traces),
        "roots_with_verdict": len(roots_with_verdict & set(traces)),
        "mixed_traces": mixed,
        "requests_in_several_traces": sum(1 for n in per_req.values() if n > 1),
        "requests_traced": len(per_req),
    }


def run(duration_s: float, concurrency: int, out_dir: Path, max_requests: int = 10_000_000) -> dict[str, Any]:
    port = free_port()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "serve", str(port), str(out_dir)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_port(port, server)
        client = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "client",
                f"http://127.0.0.1:{port}",
                str(duration_s),
                str(concurrency),
                str(max_requests),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        rss: list[float] = []
        t0 = time.monotonic()
        while client.poll() is None and time.monotonic() - t0 < duration_s + 120:
            rss.append(_rss_mb(server.pid))
            time.sleep(1.0)
        out, err = client.communicate(timeout=120)
        if client.returncode != 0:
            raise RuntimeError(f"load client failed: {err[-2000:]}")
        sent = json.loads(out)
    finally:
        terminate(server)
    stats = json.loads((out_dir / "stats.json").read_text()) if (out_dir / "stats.json").exists() else {}
    return {"sent": sent, "rss_mb": rss, "stats": stats, **check_traces(out_dir), "elapsed_s": time.monotonic() - t0}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve_main(int(sys.argv[2]), sys.argv[3])
    elif sys.argv[1] == "client":
        client_main(sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
