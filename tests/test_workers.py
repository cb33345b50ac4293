"""Multi-process servers: every worker has its own exporter process, samplers and export, and no verdict is
lost or duplicated (uvicorn --workers, gunicorn with UvicornWorker, with and without --preload)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import free_port, terminate, wait_for_port

from servers import hit
from stagetrace import conventions as c
from stagetrace.report.loader import spans_from_line

HERE = Path(__file__).resolve().parent


def _roots(out_dir: Path) -> tuple[list, set[str]]:
    roots, files = [], set()
    for path in out_dir.glob("traces-*.jsonl"):
        for line in path.read_text().splitlines():
            for span in spans_from_line(line):
                if span.name == "GET /work":
                    roots.append(span)
                    files.add(path.name)
    return roots, files


COMMANDS = {
    "uvicorn --workers 2": ["-m", "uvicorn", "fork_app:app", "--workers", "2", "--host", "127.0.0.1", "--port"],
    "gunicorn -k UvicornWorker -w 2": ["-m", "gunicorn", "-k", "uvicorn.workers.UvicornWorker", "-w", "2", "-b"],
    "gunicorn --preload": ["-m", "gunicorn", "--preload", "-k", "uvicorn.workers.UvicornWorker", "-w", "2", "-b"],
}


@pytest.mark.slow
@pytest.mark.parametrize("server", list(COMMANDS))
def test_every_worker_exports_its_own_verdicts_exactly_once(server, tmp_path):
    port = free_port()
    args = COMMANDS[server] + ([str(port)] if "uvicorn --" in server else [f"127.0.0.1:{port}", "fork_app:app"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    env.update(STAGETRACE_OUTPUT_DIR=str(tmp_path), PYTHONPATH=str(HERE), STAGETRACE_HEALTHY_SAMPLE="1")
    env["STAGETRACE_EXPORT_BUDGET"] = "off"  # every request's trace is counted
    proc = subprocess.Popen(
        [sys.executable, *args], cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for_port(port, proc)
        time.sleep(1.0)  # let both workers come up
        n = 60
        assert hit(f"http://127.0.0.1:{port}", "/work", n, 12, keepalive=False) == [200] * n
    finally:
        terminate(proc, timeout_s=30)
    roots, files = _roots(tmp_path)
    trace_ids = [r.trace_id for r in roots]
    assert len(roots) == n, f"{len(roots)} roots exported for {n} requests (files: {files})"
    assert len(set(trace_ids)) == n  # none duplicated
    assert all(c.BOTTLENECK_STAGE in r.attributes for r in roots)  # every verdict
    assert len(files) >= 2, f"expected one file per worker, got {files}"
