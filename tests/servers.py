"""Real servers on 127.0.0.1 for tests: uvicorn in a thread, on a free port, stopped on exit; or a server
in its own process, exporting its traces to JSON lines files."""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn

import stagetrace
from stagetrace.report.loader import Span, spans_from_line

HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def serve(app: Any, **config: Any) -> Iterator[str]:
    cfg = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on", **config)
    server = uvicorn.Server(cfg)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


_CLIENT = """
import asyncio, json, sys
import httpx

async def main(base, path, n, concurrency, keepalive):
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_keepalive_connections=concurrency if keepalive else 0)
    async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as client:
        async def one():
            async with sem:
                return (await client.get(path)).status_code
        print(json.dumps(await asyncio.gather(*(one() for _ in range(n)))))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"))
"""


def hit(base: str, path: str, n: int, concurrency: int, keepalive: bool = True) -> list[int]:
    """``n`` GET requests, ``concurrency`` at a time, from another process (as real clients are: an
    in-process client would compete for the server's GIL). ``keepalive=False``: a new connection per
    request (spreads requests over a multi-worker server). Returns the status codes."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _CLIENT, base, path, str(n), str(concurrency), "1" if keepalive else "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


def settle_heap() -> None:
    """Earlier tests leave a big heap; a full collection during a scenario is a real event-loop stall
    (and stagetrace rightly reports it), so start each scenario from a collected heap."""
    gc.collect()


def run_scenario(collector: Any, app: Any, path: str, n: int, concurrency: int) -> list:
    """``app`` instrumented and served, ``n`` requests to ``path`` from ``concurrency`` clients at a time; the
    verdicts of those requests."""
    settle_heap()
    stagetrace.instrument_fastapi(app)
    with serve(app) as base:
        statuses = hit(base, path, n, concurrency)
    assert statuses == [200] * n
    collector.wait_verdicts(n)
    verdicts = [v for v in collector.verdicts if v.route == path]
    assert len(verdicts) == n, f"{len(verdicts)} verdicts for {n} requests"
    return verdicts


def own_process_server(args: Sequence[str], out_dir: Path, **env: str) -> subprocess.Popen:
    """``python <args>`` started from this directory (its app modules importable), with none of this process's
    ``OTEL_*`` / ``STAGETRACE_*`` settings, every trace kept and written to ``out_dir`` as JSON lines, plus
    ``env``: a server whose process holds no thread of the test's."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    clean.update(
        STAGETRACE_OUTPUT_DIR=str(out_dir),
        PYTHONPATH=str(HERE),
        STAGETRACE_HEALTHY_SAMPLE="1",
        STAGETRACE_EXPORT_BUDGET="off",
        **env,
    )
    return subprocess.Popen(
        [sys.executable, *args], cwd=HERE, env=clean, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def exported_spans(out_dir: Path) -> list[Span]:
    """Every span a server in its own process wrote to ``out_dir``."""
    return [
        span
        for path in out_dir.glob("traces-*.jsonl")
        for line in path.read_text().splitlines()
        for span in spans_from_line(line)
    ]
