"""The main job end to end: `stagetrace demo` (a short run) and `stagetrace report` on what it wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def stagetrace_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    return subprocess.run(
        [sys.executable, "-m", "stagetrace.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


@pytest.mark.slow
def test_demo_runs_and_report_reads_what_it_wrote(tmp_path, host_has_spare_cpus):
    out_dir = tmp_path / "out"
    demo = stagetrace_cli("demo", "--requests", "24", "--concurrency", "4", "--out", str(out_dir), cwd=tmp_path)
    assert demo.returncode == 0, demo.stderr[-3000:]
    text = demo.stdout
    assert "stagetrace demo (image, /predict): 24 traces" in text
    for heading in ("Stages (time charged per request", "Bottleneck stage", "Diagnoses"):
        assert heading in text
    for stage in ("decode", "resize", "to_tensor", "h2d", "infer", "d2h", "postprocess"):
        assert f"\n{stage} " in text
    assert "EVENT_LOOP_BLOCKED" in text  # the naive pipeline decodes on the event loop
    assert "24/24" in demo.stderr  # the progress bar
    # The traces last what their clients lived: each starts when its request reached the server, the wait
    # for the blocked event loop included (a client of the demo's in another process, timing each response
    # by the kernel's receive time). The median, since the p95 of 24 requests is one request (a
    # connection's first can pay the client's own start-up); the traces never last longer than what their
    # clients lived. On a host that other processes keep short of CPUs, the server's own wait for a CPU
    # before its loop sees a request is known only as a bound, never guessed into the trace: there the
    # traces may be shorter than what the clients lived, not longer.
    traced = re.search(r"request latency: p50 ([\d.]+) ms, p95 ([\d.]+) ms", text)
    lived = re.search(r"as the clients timed them: p50 ([\d.]+) ms, p95 ([\d.]+) ms", text)
    assert traced and lived, text
    (trace_p50, trace_p95), (client_p50, client_p95) = map(float, traced.groups()), map(float, lived.groups())
    if host_has_spare_cpus:
        assert abs(trace_p50 - client_p50) <= max(0.1 * client_p50, 5.0), (traced.groups(), lived.groups())
    assert trace_p50 <= client_p50 + max(0.1 * client_p50, 5.0), (traced.groups(), lived.groups())
    assert trace_p95 <= client_p95 + max(0.1 * client_p95, 5.0), (traced.groups(), lived.groups())
    page = (out_dir / "report.html").read_text()
    assert page.count('<svg class="waterfall"') >= 5  # the slowest traces, each with its waterfall
    (traces,) = out_dir.glob("traces-*.jsonl")
    assert str(traces) in text

    report = stagetrace_cli("report", str(out_dir), "--json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    doc = json.loads(report.stdout)
    assert doc["traces"] == 24
    assert {"decode", "infer", "postprocess"} <= set(doc["stages"])
    assert sum(doc["bottlenecks"].values()) == 24


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["text", "image"])
def test_demo_optimized_prints_before_and_after(tmp_path, pipeline):
    # The text pipeline: 48 requests eight at a time, as the docs' run (its GIL contention is on ~40 % of the
    # requests: 3 of 16 four at a time), and its fix with one worker for them all: undersized, and said so.
    load = ["--requests", "48", "--concurrency", "8", "--pool-workers", "1"] if pipeline == "text" else []
    demo = stagetrace_cli(
        "demo",
        "--pipeline",
        pipeline,
        "--optimized",
        *(load or ["--requests", "16", "--concurrency", "4"]),
        "--no-progress",
        "--out",
        str(tmp_path / "o"),
        cwd=tmp_path,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    text = demo.stdout
    assert "Before and after" in text
    if pipeline == "text":
        # the fixed service tokenizes in a process pool: each request's call is an offload stage, its four
        # children in the before/after and --compare's tables, the pool's table in the fixed run's report
        assert "/classify-optimized" in text and "stagetrace report --compare: /classify (48 traces)" in text
        after = text.split("Before and after")[1]
        for child in ("offload.queue", "offload.send", "offload.run", "offload.return"):
            line = next(ln for ln in after.splitlines() if ln.strip().startswith(f"{child} p50 ms"))
            assert line.split()[-2] == "-" and line.split()[-1] != "-"  # none before, measured after
        report = json.loads(stagetrace_cli("report", str(tmp_path / "o"), "--json", cwd=tmp_path).stdout)
        calls = report["offloads"]["tokenize_in_worker"]
        assert calls["calls"] == 48 and calls["executor"] == "ProcessPoolExecutor"

        def diagnoses(route):
            out = stagetrace_cli("report", str(tmp_path / "o"), "--route", route, "--json", cwd=tmp_path).stdout
            return json.loads(out)["diagnoses"]

        before, after = diagnoses("/classify"), diagnoses("/classify-optimized")
        assert before.get("GIL_CONTENTION", 0) >= 1, before  # four tokenizer threads, one GIL
        assert "GIL_CONTENTION" not in after, after  # each worker its own GIL
        assert after.get("POOL_SATURATED", 0) >= 1, after  # one worker for eight requests in flight
        return
    # the optimized image pipeline serves inference through a dynamic batcher
    assert "/predict-optimized" in text
    assert "Batches (requests per execution" in text and "\ninfer.batch " in text
    after = text.split("Before and after")[1]
    for row in ("infer.batch batch size (mean)", "infer.batch batch fill (mean)", "infer.batch.queue forming p50 ms"):
        line = next(ln for ln in after.splitlines() if row in ln)
        assert line.split()[-2] == "-" and line.split()[-1] != "-"  # none before, measured after
    report = stagetrace_cli("report", str(tmp_path / "o"), "--json", cwd=tmp_path)
    doc = json.loads(report.stdout)
    assert doc["traces"] == 32  # the batch executions are not requests
    batches = doc["batches"]["infer.batch"]
    assert 1 <= batches["executions"] <= 16
    assert batches["size_mean"] * batches["executions"] == pytest.approx(16, rel=0.01)  # a mean to 2 places
    assert doc["batch_waits"]["infer.batch.queue"]["requests"] == 16


def test_cli_rejects_bad_arguments(tmp_path):
    bad = stagetrace_cli("demo", "--requests", "0", cwd=tmp_path)
    assert bad.returncode == 2 and "must be >= 1" in bad.stderr


@pytest.mark.slow
def test_the_llm_demos_slow_streams_fall_when_the_fix_removes_their_cause(tmp_path):
    """`stagetrace demo --pipeline llm --optimized`: every stream was "slow" by its length before and after;
    judged by its phases, the baseline's streams are slow by their gaps (detokenizing the whole sequence at
    every token) and the fixed service's are not. How many of each cross the SLO moves with the machine: the
    SLO is four engine rounds measured once at start, so a CPU taken by something else during a run, or while
    the round is measured, moves the counts (on a quiet 2-vCPU VM, 40 before in 6 runs of 7 and 0 after in 5 of
    6; inside the full suite, 40 and 6 in one run, 8 and 0 in another). What does not move is the fix's effect:
    fewer streams slow by their gaps, and the typical stream's gap p99 at under 0.6 of the baseline's (0.27 quiet,
    0.36-0.42 beside a spinning process), which a fix that did nothing fails."""
    demo = stagetrace_cli(
        "demo", "--pipeline", "llm", "--optimized", "--no-progress", "--out", str(tmp_path / "o"), cwd=tmp_path
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "a stream is slow when its first chunk takes over 200 ms or its gaps' p99 over" in demo.stderr
    table = demo.stdout.split("Before and after")[1].splitlines()

    def counts(label: str) -> tuple[int, int]:
        row = next((ln for ln in table if ln.strip().startswith(label)), f"{label} 0 0")
        before, after = map(int, row.split()[-2:])
        return before, after

    before, after = counts("slow by gaps")
    assert before > after, table
    gap_row = next(ln for ln in table if ln.strip().startswith("gap p99 ms, p50 of streams"))
    gap_before, gap_after = map(float, gap_row.split()[-2:])
    assert gap_after < 0.6 * gap_before, table
    assert "slow by the gaps" in demo.stdout  # each run's own report says why its streams were slow
    report = json.loads(stagetrace_cli("report", str(tmp_path / "o"), "--json", cwd=tmp_path).stdout)
    # The report over both runs' files counts what each run's own summary counted, reason by reason (a stream
    # whose first chunk met a stall of the VM is slow by its first chunk: seen once in 8 runs).
    assert report["slow_traces"] == sum(counts("slow traces"))
    assert report["slow_reasons"].get("gap", 0) == before + after
    assert report["slow_reasons"].get("first_chunk", 0) == sum(counts("slow by first chunk"))
