"""Diagnosis rules against a real uvicorn server on 127.0.0.1 with concurrent clients: one scenario app per
rule, each naming its cause, and a healthy app that must fire none of them."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import threading
from collections import Counter

import pytest
from fastapi import FastAPI
from harness import free_port, terminate, wait_for_port

import stagetrace
from scenarios import SCENARIOS, run_in_own_process
from scenarios.collect import explain
from scenarios.corpus import busy
from servers import exported_spans, hit, own_process_server, run_scenario, serve, settle_heap
from stagetrace import conventions as c


@pytest.fixture(autouse=True)
def frozen_heap(spare_cpus):
    """Collections hold the GIL: over the heap the rest of the suite leaves behind they read as GIL
    pressure. Freeze what exists before each scenario so collections only scan the scenario's objects.
    (Each scenario also needs a host with CPUs to spare: ``spare_cpus``.)"""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def codes(verdicts) -> Counter:
    return Counter(code for v in verdicts for code in v.diagnosis_codes)


def misread(collector, verdicts, code: str) -> str:
    """Why ``code`` fired, for an assertion's message: the verdicts' figures, and the threads that shared the
    server's GIL (the scenario's, and any an earlier test left running)."""
    threads = ", ".join(sorted(t.name for t in threading.enumerate()))
    return f"{collector.explain(v for v in verdicts if code in v.diagnosis_codes)}\nthreads: {threads}"


def test_cpu_heavy_sync_stage_in_async_endpoint_blocks_the_event_loop(collector):
    app = FastAPI()

    @app.get("/resize")
    async def resize():
        with stagetrace.stage("resize"):  # sync CPU work on the loop thread
            busy(40)
        return {}

    verdicts = run_scenario(collector, app, "/resize", n=12, concurrency=4)
    found = codes(verdicts)
    assert found["EVENT_LOOP_BLOCKED"] == len(verdicts)
    d = next(d for d in verdicts[0].diagnoses if d.code == "EVENT_LOOP_BLOCKED")
    assert d.stage == "resize" and "event-loop thread" in d.message


@pytest.mark.slow  # over 1.4 s on its own: out of the quick loop
def test_stage_waiting_on_a_lock_is_lock_or_io_wait(spare_cpus, tmp_path):
    """The corpus's lock-waited app (a holder keeps the lock 60 ms at a time with the GIL free; the request's
    ``cache_lookup`` stage waits for it) served by uvicorn in a process of its own, as a deployed service is.
    Served in the suite's process, the server shared its GIL with what the earlier tests had left there: in one
    CI run, two requests of ten had the process's other threads on a CPU for 11-12 ms of their 45 ms lock
    wait, the GIL monitor read 1.2-1.8 ms of pressure, and GIL_CONTENTION was named beside the lock."""
    scenario = next(s for s in SCENARIOS if s.name == "lock-waited")
    outcome, spans = run_in_own_process(scenario, tmp_path)
    assert outcome.verdicts == scenario.requests
    assert {s.service for s in spans} == {"accuracy-lock-waited"}  # the scenario's own server wrote them
    assert outcome.lived >= 0.7 * outcome.verdicts, "the holder thread ran in the server's process"
    misread = "\n".join(explain(v, spans) for v in outcome.misread)
    assert outcome.right >= 0.7 * outcome.lived, misread
    assert outcome.wrong == 0, misread  # GIL_CONTENTION, or any other cause, named for the lock: none


@pytest.mark.slow
def test_cpu_stage_beside_a_busy_python_thread_is_gil_contention(collector):
    app = FastAPI()
    stop = threading.Event()

    def hog():
        x = 0
        while not stop.is_set():
            x += 1

    @app.get("/tokenize")
    def tokenize():
        with stagetrace.stage("tokenize"):
            n = 0
            for i in range(3_000_000):  # pure Python: needs the GIL throughout (~150 ms alone)
                n += i % 7
        return {}

    t = threading.Thread(target=hog, daemon=True)
    t.start()
    try:
        verdicts = run_scenario(collector, app, "/tokenize", n=8, concurrency=1)
    finally:
        stop.set()
        t.join()
    # What happened, per request: the stage's own split of its wall time (blocked: waiting for the GIL with
    # the GIL pressure measured high; run queue: waiting for a CPU, which a busy host adds on top) and the
    # rule that split calls for. With CPUs to spare (the stage barely queued for a CPU, nor did the GIL
    # sampler's wake-ups) a GIL wait is named GIL_CONTENTION. On a host short of CPUs a wait as short as a GIL
    # handoff can be for a holder the scheduler preempted: the verdict may then say so (CPU_OVERSUBSCRIBED) or
    # name no cause (OFF_CPU_WAIT), but it must never guess a lock, nor claim GIL contention it did not see.
    stages = collector.stage_attributes("tokenize")
    th = stagetrace.DiagnosisThresholds()
    contended = 0
    for v in verdicts:
        a = stages[v.trace_id]
        codes = set(v.diagnosis_codes)
        wall = v.breakdown["tokenize"]
        blocked, runqueue = a.get(c.BLOCKED_MS, 0.0), a.get(c.RUNQUEUE_MS, 0.0)
        # no longer than the other threads were on a CPU or queued for one: only they can have held the GIL
        held_by_others = a.get(c.OTHERS_CPU_MS, float("inf")) + a.get(c.OTHERS_RUNQUEUE_MS, 0.0)
        gil = v.gil_pressure_ms or 0.0
        gil_wait = min(blocked, held_by_others) >= max(th.blocked_min_ms, th.blocked_share * wall)
        gil_wait = gil_wait and gil >= th.gil_pressure_ms
        cpu_wait = runqueue >= max(th.runqueue_min_ms, th.runqueue_share * wall)
        queued_share = runqueue / (runqueue + blocked) if runqueue + blocked else 0.0
        cpus_to_spare = queued_share < th.quiet_share and (v.cpu_pressure_ms or 0.0) < th.quiet_cpu_pressure_ms
        contended += gil_wait or cpu_wait
        evidence = (v.diagnoses, a, gil, v.cpu_pressure_ms)
        if "GIL_CONTENTION" in codes:
            assert gil_wait, evidence
        if gil_wait and cpus_to_spare:
            assert "GIL_CONTENTION" in codes, evidence
        elif gil_wait:
            assert codes & {"GIL_CONTENTION", "CPU_OVERSUBSCRIBED", "OFF_CPU_WAIT"}, evidence
        if cpu_wait:
            assert "CPU_OVERSUBSCRIBED" in codes, evidence
        elif "CPU_OVERSUBSCRIBED" in codes:
            assert not cpus_to_spare, evidence  # only for holders the scheduler preempted
        if gil >= th.gil_pressure_ms:
            assert "LOCK_OR_IO_WAIT" not in codes  # the GIL was contended: never blamed on a lock
    # the busy thread made at least one request measurably wait (how many depends on the host's load)
    assert contended >= 1, [(v.breakdown, stages[v.trace_id], v.gil_pressure_ms) for v in verdicts]


# Stops the process whose pid it is given for pause_s, after_s after each byte it reads from the FIFO: what a
# hypervisor taking a virtual machine's CPU (steal) does to a stage, with no run queue to show for it.
PAUSER = """
import os, signal, sys, time
pid, after_s, pause_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
fd = os.open(sys.argv[4], os.O_RDONLY)
while os.read(fd, 1):
    time.sleep(after_s)
    os.kill(pid, signal.SIGSTOP)
    time.sleep(pause_s)
    os.kill(pid, signal.SIGCONT)
"""


@pytest.mark.slow
def test_a_stage_whose_process_was_paused_is_not_gil_contention(tmp_path):
    """A pure-Python stage alone in its process keeps the GIL busy itself (the GIL monitor waits on it), so
    GIL pressure is high; paused mid-stage, it is off the CPU with no run queue, as on a virtual machine whose
    hypervisor takes its CPU (this VM's kernel counts steal neither as on-CPU nor as run-queue time). CI named
    GIL_CONTENTION on a healthy twin's 100 ms stage so, most likely for that reason. The other threads barely
    ran meanwhile, so no GIL holder can explain the pause. The server runs in its own process (``paused_app``):
    the test process's own threads would be other threads of the server's."""
    pause_s = 0.07  # of a 200 ms stage
    fifo = tmp_path / "pause"
    os.mkfifo(fifo)
    port = free_port()
    server = own_process_server(
        ["-m", "uvicorn", "paused_app:app", "--host", "127.0.0.1", "--port", str(port)], tmp_path, PAUSER_FIFO=str(fifo)
    )
    pauser = subprocess.Popen([sys.executable, "-c", PAUSER, str(server.pid), "0.03", str(pause_s), str(fifo)])
    try:
        wait_for_port(port, server)
        assert hit(f"http://127.0.0.1:{port}", "/tokenize", 7, 1) == [200] * 7
    finally:
        terminate(server, timeout_s=30)
        pauser.wait(10)
    spans = exported_spans(tmp_path)
    stages = {s.trace_id: s.attributes for s in spans if s.name == "tokenize"}
    roots = sorted((s for s in spans if s.name == "GET /tokenize"), key=lambda s: s.start_ns)
    assert len(roots) == 7
    paused = 0
    for root in roots[1:]:  # the first pays the server's lazy set-up, on other threads too: they did run
        a = stages[root.trace_id]
        codes = tuple(root.attributes.get(c.DIAGNOSIS, ()))
        evidence = (codes, a, root.attributes.get(c.GIL_PRESSURE_MS))
        assert "GIL_CONTENTION" not in codes, evidence
        assert "LOCK_OR_IO_WAIT" not in codes, evidence  # nor a lock it did not see
        if a.get(c.BLOCKED_MS, 0.0) >= pause_s * 1000 * 0.9 and c.OTHERS_CPU_MS in a:
            paused += 1
    assert paused >= 1, [(s.get(c.BLOCKED_MS), s.get(c.OTHERS_CPU_MS)) for s in stages.values()]  # pauses lived


def test_healthy_endpoints_fire_nothing(collector):
    app = FastAPI()

    @app.get("/healthy")
    async def healthy():
        async with stagetrace.stage("fetch", kind="io"):
            await asyncio.sleep(0.01)
        with stagetrace.stage("postprocess"):
            busy(1)
        return {}

    @app.get("/healthy-sync")
    def healthy_sync():
        with stagetrace.stage("compute"):
            busy(8)
        return {}

    stagetrace.instrument_fastapi(app)
    settle_heap()
    with serve(app) as base:
        hit(base, "/healthy", 20, 4)
        hit(base, "/healthy-sync", 10, 1)
    verdicts = collector.wait_verdicts(30)
    assert len(verdicts) == 30
    assert codes(verdicts) == Counter(), [v.diagnoses for v in verdicts if v.diagnoses][:3]


def test_large_bodies_on_keep_alive_connections_do_not_chain_requests_into_one_trace(harness, tmp_path):
    """uvicorn pauses reading on a large body; resuming it from the request task makes asyncio capture that
    task's context for the connection's next requests. Each request must still be its own trace."""
    from fastapi import Request

    from stagetrace.demo import runner

    app = FastAPI()

    @app.post("/upload")
    async def upload(request: Request):
        body = await request.body()
        with stagetrace.stage("parse"):
            return {"n": len(body)}

    stagetrace.instrument_fastapi(app)
    with serve(app) as base:
        runner._drive(base, "/upload", 30, 3, b"x" * 400_000, runner._Progress(30, "", False))
    spans = harness.spans()
    servers = [s for s in spans if s.name == "POST /upload"]
    assert len(servers) == 30
    assert all(s.parent is None for s in servers)
    assert len({s.context.trace_id for s in servers}) == 30
    assert len(harness.wait_verdicts(30)) == 30
