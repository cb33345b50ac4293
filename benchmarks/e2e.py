"""End-to-end cost under load, measured side by side in one run.

    python benchmarks/e2e.py [--seconds 8] [--rounds 6] [--concurrency 8] [--workload both] [--no-pin]
    python benchmarks/e2e.py --instructions [--requests 200]     # valgrind: instructions a request

The same FastAPI endpoint (6 stages, ~9 ms of work a request) served by uvicorn, each variant in its own
server process on 127.0.0.1:
  uninstrumented    no OpenTelemetry at all;
  contrib-only      the contrib FastAPI instrumentation alone (server span, no stages);
  native-only       FastAPI's own telemetry alone (0.142+: server span and operation spans, no stages),
                    an SDK provider with a BatchSpanProcessor;
  handwritten       the contrib FastAPI instrumentation plus one SDK span per stage (what a user writes
                    today), BatchSpanProcessor;
  stagetrace        stagetrace.instrument_fastapi (FastAPI's own telemetry where FastAPI has it), every
                    signal on, the default local tail sampling (slow, diagnosed and errored traces, and
                    10 % of the healthy ones, exported in full within the export budget);
  stagetrace-contrib the same on the contrib instrumentation (instrument_fastapi(telemetry="contrib"));
  stagetrace-all    the same with STAGETRACE_HEALTHY_SAMPLE=1.0 and STAGETRACE_EXPORT_BUDGET=off (every
                    trace exported);
  stagetrace-thread the default, with STAGETRACE_EXPORT_PROCESS=off (the exporter's work on a thread of
                    the server process).
Two workloads: "gil-free" (zlib compression, which releases the GIL; the thread pool as FastAPI sets it)
and "gil-bound" (pure-Python stage work, one worker thread). A third, "offload" (``--workload offload``), is
the fix stagetrace's advice gives for the second: each stage's pure-Python work handed to the server's
``ProcessPoolExecutor`` of one worker (fork, warmed before anything is configured) and waited for; its pairs
put the cost of tracing each offloaded call (an offload stage, its four children, the worker's report) beside
the same server with process pools left untraced (``stagetrace-pools-off``: ``STAGETRACE_NO_PROCESS_POOLS=1``)
and beside hand-written spans around each call. The pool's worker is in its server's tree (and in the
"exporter process" column, which is the tree less the server process). Every instrumented variant exports OTLP/HTTP
to the same local sink process (it answers and drops the bytes; it is not part of any server's process
tree). The clients are threads of this process, each on its own keep-alive connection
(``stagetrace.demo.load.TimedConnection``: little CPU a request).

Noise, and how it is cancelled: this kind of VM moves CPU figures by +-20 % between runs (its CPUs are
shared with other tenants: steal time, caches), and two variants measured one after the other differ by
as much as any overhead measured here. So variants are measured in pairs, at the same time, on the same
CPU: both servers' whole process trees (exporter processes included) run on CPU 0, in CPU cgroups of equal
weight (as root; otherwise the scheduler's fairness between threads decides the shares), each driven at
saturation by its own clients from the other CPUs for ``--seconds``. Each gets half of CPU 0 whatever the
machine is doing meanwhile, so the ratio of their throughputs is the inverse ratio of what a request costs
each whole tree. Each server then runs at half the rate it reaches alone, so per-second costs (a sampler's
wake-ups) weigh twice what they weigh on a full core. Rounds rotate the order of the pairs; the tables give
the median and range of the rounds' ratios, and CPU a request by where it is paid (the event loop, the
request threads, stagetrace's helper and GIL monitor, the SDK's export thread, the exporter process) less
the baseline's in the same co-run.

Targets (both workloads), from the issue that set them: throughput >= 0.97 x the baseline (contrib-only
on the contrib path, native-only on FastAPI's own telemetry); over contrib-only, stagetrace's
server-process CPU added <= 0.5 x what the hand-written spans add, and the whole tree's <= 1.0 x. Goals
beyond: 0.1 x and 0.25 x, and >= 1.10 x handwritten's throughput.

``--instructions`` counts what a request costs in instructions (valgrind's callgrind, per process and per
thread, zeroed after a warm-up and dumped after ``--requests`` requests two at a time), which this VM's
noise does not move. The GIL monitor and the loop-lag monitor wake on wall time, which valgrind stretches,
so they are off there and their cost per second is in the tables above and in ``benchmarks/idle_cost.py``;
the service is kept healthy (``DiagnosisThresholds.silent()``: under valgrind every request would be slow
and oversubscribed, and so kept), so the default exports nothing and ``stagetrace-all`` everything.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from harness import free_port, wait_for_port
from proctree import descendants, process_cpu_s, tree_cpu_s

STAGES = (
    ("decode", 2.0),
    ("resize", 1.5),
    ("to_tensor", 1.0),
    ("infer", 3.0),
    ("postprocess", 1.0),
    ("serialize", 0.5),
)
_BLOCK = os.urandom(64 * 1024)


def gil_free_work(ms: float) -> int:
    """zlib over random bytes for about ``ms`` milliseconds (zlib releases the GIL while it compresses)."""
    total = 0
    for _ in range(max(1, int(ms * _PER_MS["gil-free"]))):
        total += len(zlib.compress(_BLOCK, 1))
    return total


def gil_bound_work(ms: float) -> int:
    """A pure-Python loop for about ``ms`` milliseconds: holds the GIL throughout."""
    total = 0
    for i in range(max(1, int(ms * _PER_MS["gil-bound"]))):
        total += i * i % 7
    return total


_POOL: Any = None  # the offload workload's process pool: one worker, made in ``serve`` before the app


def offload_work(ms: float) -> int:
    """The GIL-bound work handed to the server's process pool, waited for."""
    return int(_POOL.submit(gil_bound_work, ms).result())


WORK = {"gil-free": gil_free_work, "gil-bound": gil_bound_work, "offload": offload_work}


def _calibrate() -> dict[str, float]:
    out = {}
    t0 = time.perf_counter()
    for _ in range(40):
        zlib.compress(_BLOCK, 1)
    out["gil-free"] = 40 / ((time.perf_counter() - t0) * 1000)
    t0 = time.perf_counter()
    n = 0
    for i in range(300_000):
        n += i * i % 7
    out["gil-bound"] = 300_000 / ((time.perf_counter() - t0) * 1000)
    return out


_PER_MS = {"gil-free": 1.0, "gil-bound": 1.0}


def make_app(variant: str, workload: str):
    from fastapi import FastAPI

    work = WORK[workload]
    lifespan = one_worker_thread if workload == "gil-bound" else None
    app = FastAPI(lifespan=lifespan)
    if variant == "uninstrumented":

        @app.get("/predict")
        def predict():
            return {"n": sum(work(ms) for _, ms in STAGES)}

    elif variant == "native-only":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        app = FastAPI(telemetry={"tracer_provider": provider, "metrics": False, "logs": False}, lifespan=lifespan)

        @app.get("/predict")
        def predict():
            return {"n": sum(work(ms) for _, ms in STAGES)}

    elif variant in ("handwritten", "contrib-only"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        tracer = provider.get_tracer("bench")

        if variant == "contrib-only":

            @app.get("/predict")
            def predict():
                return {"n": sum(work(ms) for _, ms in STAGES)}

        else:

            @app.get("/predict")
            def predict():
                n = 0
                for name, ms in STAGES:
                    with tracer.start_as_current_span(name):
                        n += work(ms)
                return {"n": n}

        FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, exclude_spans=["send", "receive"])
    else:
        import stagetrace
        from stagetrace.analysis import DiagnosisThresholds

        settings = None
        if os.environ.get("E2E_QUIET_SAMPLERS"):
            # --instructions: the wall-clock samplers are counted apart, and the service is healthy (under
            # valgrind every request is slow and oversubscribed, which would keep every trace)
            settings = stagetrace.Settings(
                gil_sampler_period_s=0,
                loop_lag_interval_s=3600.0,
                slow_threshold_ms=1e9,
                thresholds=DiagnosisThresholds.silent(),
            )
        stagetrace.configure("bench", settings=settings)  # OTLP/HTTP to the sink, from the OTEL_* variables
        stages = [(stagetrace.stage(name), ms) for name, ms in STAGES]

        @app.get("/predict")
        def predict():
            n = 0
            for stage, ms in stages:
                with stage:
                    n += work(ms)
            return {"n": n}

        contrib = variant in ("stagetrace-contrib", "stagetrace-pools-off")
        stagetrace.instrument_fastapi(app, telemetry="contrib" if contrib else "auto")
    return app


@contextlib.asynccontextmanager
async def one_worker_thread(app: Any) -> AsyncIterator[None]:
    """The GIL-bound workload's lifespan: its pure-Python stages run on one worker thread."""
    import anyio.to_thread

    anyio.to_thread.current_default_thread_limiter().total_tokens = 1
    yield


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that reads each request and drops it (an empty protobuf is a valid reply)."""

    protocol_version = "HTTP/1.1"  # keep-alive, as a collector's receiver

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


class _SinkServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        return None  # an exporter closing its connection at shutdown is not news


def sink(port: int) -> None:
    _SinkServer(("127.0.0.1", port), _Sink).serve_forever()


def _publish_threads(path: str) -> None:
    """Every second, this process's threads as {native id: name}, for the per-thread table (one wake-up a
    second, alike in every variant)."""
    import json
    import threading

    def run() -> None:
        while True:
            names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
            tmp = f"{path}.tmp"
            with open(tmp, "w") as fh:
                json.dump(names, fh)
            os.replace(tmp, path)
            time.sleep(1.0)

    threading.Thread(target=run, name="e2e-threads", daemon=True).start()


def serve(variant: str, workload: str, port: int) -> None:
    import uvicorn

    global _POOL
    _PER_MS.update({k: float(v) for k, v in (kv.split("=") for kv in os.environ["E2E_PER_MS"].split(","))})
    if workload == "offload":
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        _POOL = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"))
        _POOL.submit(gil_bound_work, 1.0).result()  # the worker started and warm before the first request
    app = make_app(variant, workload)
    _publish_threads(os.environ["E2E_THREADS_FILE"])
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        if _POOL is not None:
            _POOL.shutdown(cancel_futures=True)  # its worker would outlive the server, holding its pipes


def _load(port: int, n: int, concurrency: int) -> tuple[float, list[float]]:
    """``n`` requests from ``concurrency`` threads, each on a warm keep-alive connection; requests a second
    and each request's latency (ms)."""
    import threading

    from stagetrace.demo.load import TimedConnection

    latencies: list[float] = []
    remaining = [n]
    lock = threading.Lock()
    conns = [TimedConnection("127.0.0.1", port) for _ in range(concurrency)]
    for conn in conns:
        conn.exchange("GET", "/predict")

    def client(conn: TimedConnection) -> None:
        while True:
            with lock:
                if remaining[0] <= 0:
                    return
                remaining[0] -= 1
            status, ms = conn.exchange("GET", "/predict")
            if status != 200:
                raise RuntimeError(f"HTTP {status}")
            latencies.append(ms)

    threads = [threading.Thread(target=client, args=(conn,)) for conn in conns]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for conn in conns:
        conn.close()
    if len(latencies) != n:
        raise RuntimeError(f"{n - len(latencies)} requests failed")
    return n / elapsed, latencies


VARIANT_ENV = {
    "stagetrace-all": {"STAGETRACE_HEALTHY_SAMPLE": "1.0", "STAGETRACE_EXPORT_BUDGET": "off"},
    "stagetrace-thread": {"STAGETRACE_EXPORT_PROCESS": "off"},
    "stagetrace-pools-off": {"STAGETRACE_NO_PROCESS_POOLS": "1"},
}
VARIANTS = (
    "uninstrumented",
    "contrib-only",
    "native-only",
    "handwritten",
    "stagetrace",
    "stagetrace-contrib",
    "stagetrace-all",
    "stagetrace-thread",
)

# Where a server thread's CPU is paid, by its name (threading's names; the rest is "other").
THREAD_ROLES = (
    ("loop", ("MainThread",)),
    ("request threads", ("AnyIO worker thread",)),
    ("stagetrace helper", ("stagetrace-shipper",)),
    ("GIL monitor", ("stagetrace-gil",)),
    ("SDK export", ("OtelBatch", "OtelPeriodicExportingMetricReader")),
)
ROLES = (*(role for role, _ in THREAD_ROLES), "other", "exporter process")


def _role(name: str) -> str:
    for role, prefixes in THREAD_ROLES:
        if name.startswith(prefixes):
            return role
    return "other"


def _thread_cpu_s(pid: int) -> dict[int, float]:
    """Each thread's CPU seconds: its schedstat's on-CPU ns where the kernel has it, else its clock ticks. A
    tick is 10 ms: over a co-run's few hundred requests each thread's figure would round by up to 0.03 ms a
    request, and the dozen threads' sum, which "other" is taken from, by ten times that."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                out[int(tid)] = int(fh.read().split()[0]) / 1e9
            continue
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


class CpuSnapshot(NamedTuple):
    server: float
    tree: float
    threads: dict[int, float]


def _confine(cpus: set[int] | None, cgroup_procs: str | None) -> None:
    """In the server's process before it runs: its CPUs and CPU group, which its exporter process inherits."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    if cgroup_procs:
        with open(cgroup_procs, "w") as fh:
            fh.write(str(os.getpid()))


class Server:
    def __init__(
        self,
        variant: str,
        workload: str,
        per_ms: dict[str, float],
        sink_port: int,
        cpus: set[int] | None,
        *,
        prefix: list[str] | None = None,
        extra_env: dict[str, str] | None = None,
        start_timeout_s: float = 30,
        cgroup_procs: str | None = None,
    ):
        import tempfile

        self.variant = variant
        self.port = free_port()
        self.threads_file = os.path.join(tempfile.mkdtemp(prefix="e2e-"), "threads.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
        env.update(
            E2E_PER_MS=",".join(f"{k}={v}" for k, v in per_ms.items()),
            E2E_THREADS_FILE=self.threads_file,
            # This directory first, then the caller's own path (a checkout being measured rather than the install).
            PYTHONPATH=os.pathsep.join(
                filter(None, (os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")))
            ),
            OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{sink_port}",
            OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        )
        env.update(extra_env or {})
        env.update(VARIANT_ENV.get(variant, {}))
        self.proc = subprocess.Popen(
            [*(prefix or ()), sys.executable, __file__, "serve", variant, workload, str(self.port)],
            env=env,
            preexec_fn=lambda: _confine(cpus, cgroup_procs),
        )
        wait_for_port(self.port, self.proc, timeout_s=start_timeout_s)

    def cpu(self) -> CpuSnapshot:
        """CPU seconds so far: the server process, its tree, and each of the server's threads."""
        return CpuSnapshot(process_cpu_s(self.proc.pid), tree_cpu_s(self.proc.pid), _thread_cpu_s(self.proc.pid))

    def cpu_since(self, before: CpuSnapshot, requests: int) -> dict[str, float]:
        """CPU ms a request since ``before``: the server, its tree, the exporter process and the server's
        threads by role (a thread counted from its start where it started since; what threads that ended
        meanwhile used, the ones not yet named, and the process's total's rounding to a clock tick, up to
        0.03 ms a request over a co-run, is "other")."""
        import json

        after = self.cpu()
        try:
            with open(self.threads_file) as fh:
                names = {int(k): v for k, v in json.load(fh).items()}
        except (OSError, ValueError):
            names = {}
        out = dict.fromkeys(ROLES, 0.0)
        for tid, seconds in after.threads.items():
            out[_role(names.get(tid, ""))] += seconds - before.threads.get(tid, 0.0)
        out["server"] = after.server - before.server
        out["tree"] = after.tree - before.tree
        out["exporter process"] = out["tree"] - out["server"]
        out["other"] += out["server"] - sum(out[role] for role in ROLES if role != "exporter process")
        return {k: v * 1000 / requests for k, v in out.items()}

    def stop(self) -> None:
        """The server and whatever it started (its exporter process, its pool's worker): a worker whose server
        is gone would hold this benchmark's output open."""
        left = descendants(self.proc.pid)
        self.proc.terminate()
        self.proc.wait(timeout=30)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


# --- paired co-runs ---------------------------------------------------------------------------------------

# (candidate, baseline): run together, each tree on CPU 0 with an equal share of it, each driven at saturation.
PAIRS = (
    ("contrib-only", "uninstrumented"),
    ("native-only", "uninstrumented"),
    ("handwritten", "contrib-only"),
    ("stagetrace-contrib", "contrib-only"),
    ("stagetrace", "native-only"),
    ("stagetrace-contrib", "handwritten"),
    ("stagetrace-all", "stagetrace"),
    ("stagetrace-thread", "stagetrace"),
)
# The offload workload's: what tracing the calls costs, against the same stagetrace with pools untraced and
# against hand-written spans around each call.
OFFLOAD_PAIRS = (
    ("handwritten", "contrib-only"),
    ("stagetrace-contrib", "contrib-only"),
    ("stagetrace-contrib", "handwritten"),
    ("stagetrace-contrib", "stagetrace-pools-off"),
)


def pairs_of(workload: str) -> tuple[tuple[str, str], ...]:
    return OFFLOAD_PAIRS if workload == "offload" else PAIRS


class CpuGroups:
    """CPU cgroups of equal weight, one per server tree (cgroup v1's ``cpu`` controller, or v2's), so that two
    trees sharing a CPU get half of it each whatever their number of threads (the scheduler is fair between
    threads, not processes). ``available`` is False where they cannot be made (not root, no controller)."""

    def __init__(self) -> None:
        self.root, self.weight_file, self.weight = None, "", ""
        if os.path.isfile("/sys/fs/cgroup/cpu/cpu.shares"):
            self.root, self.weight_file, self.weight = "/sys/fs/cgroup/cpu", "cpu.shares", "1024"
        elif "cpu" in _read("/sys/fs/cgroup/cgroup.controllers").split():
            try:
                with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as fh:
                    fh.write("+cpu")
                self.root, self.weight_file, self.weight = "/sys/fs/cgroup", "cpu.weight", "100"
            except OSError:
                pass
        self.made: list[str] = []
        self.available = self.root is not None and os.access(self.root, os.W_OK)

    def make(self, name: str) -> str | None:
        """A new group's ``cgroup.procs``, or None."""
        if not self.available:
            return None
        path = os.path.join(self.root or "", f"stagetrace-e2e-{os.getpid()}-{name}")
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, self.weight_file), "w") as fh:
                fh.write(self.weight)
        except OSError:
            return None
        self.made.append(path)
        return os.path.join(path, "cgroup.procs")

    def remove(self) -> None:
        for path in self.made:
            try:
                os.rmdir(path)
            except OSError:
                pass


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def _load_until(port: int, start: threading.Event, stop_at: list[float], concurrency: int) -> list[float]:
    """Requests from ``concurrency`` warm keep-alive connections from ``start`` until ``stop_at[0]``
    (monotonic); each completed request's latency (ms)."""
    from stagetrace.demo.load import TimedConnection

    latencies: list[float] = []
    conns = [TimedConnection("127.0.0.1", port) for _ in range(concurrency)]
    for conn in conns:
        conn.exchange("GET", "/predict")

    def client(conn: TimedConnection) -> None:
        start.wait()
        while time.monotonic() < stop_at[0]:
            status, ms = conn.exchange("GET", "/predict")
            if status != 200:
                raise RuntimeError(f"HTTP {status}")
            latencies.append(ms)

    threads = [threading.Thread(target=client, args=(conn,)) for conn in conns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for conn in conns:
        conn.close()
    return latencies


def co_run(a: Server, b: Server, seconds: float, concurrency: int) -> dict[str, dict[str, float]]:
    """Both servers driven at once for ``seconds``: each one's requests a second and CPU ms a request (server,
    tree, and by thread role), over the same stretch of this machine's time."""
    start, stop_at = threading.Event(), [0.0]
    results: dict[int, list[float]] = {}

    def drive(server: Server) -> None:
        results[id(server)] = _load_until(server.port, start, stop_at, concurrency)

    drivers = [threading.Thread(target=drive, args=(server,)) for server in (a, b)]
    for t in drivers:
        t.start()
    time.sleep(0.5)  # connections open and warm
    before = {id(s): s.cpu() for s in (a, b)}
    stop_at[0] = time.monotonic() + seconds
    start.set()
    for t in drivers:
        t.join()
    time.sleep(0.3)  # what the requests left to background threads and the exporter
    out = {}
    for server in (a, b):
        n = len(results[id(server)])
        row = server.cpu_since(before[id(server)], n)
        row["rps"] = n / seconds
        out[server.variant] = row
    return out


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def run_workload(workload: str, args: argparse.Namespace, per_ms: dict[str, float], sink_port: int) -> dict:
    groups = CpuGroups()
    cpus = {0} if args.pin else None
    pairs = pairs_of(workload)
    variants = tuple(dict.fromkeys(v for pair in pairs for v in pair))
    servers = {v: Server(v, workload, per_ms, sink_port, cpus, cgroup_procs=groups.make(v)) for v in variants}
    rounds: list[dict[tuple[str, str], dict[str, dict[str, float]]]] = []
    try:
        for v in variants:
            _load(servers[v].port, 200, args.concurrency)  # warm-up
        time.sleep(1.0)
        for r in range(args.rounds):
            row = {}
            for candidate, baseline in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
                row[(candidate, baseline)] = co_run(
                    servers[candidate], servers[baseline], args.seconds, args.concurrency
                )
            rounds.append(row)
            print(f"  {workload} round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
        groups.remove()
    return {"rounds": rounds, "equal_shares": groups.available}


def report(workload: str, result: dict, args: argparse.Namespace) -> bool:
    rounds = result["rounds"]

    def per_pair(pair: tuple[str, str], fn) -> tuple[float, float, float]:
        return _stats([fn(r[pair][pair[0]], r[pair][pair[1]]) for r in rounds])

    shares = "cgroups of equal weight" if result["equal_shares"] else "no cgroups (not root): shares per thread"
    pin = f"both trees on CPU 0 ({shares})" if args.pin else "unpinned"
    print(
        f"\ne2e, {workload} workload: 6 stages (~9 ms a request); paired co-runs, {pin}, each driven by "
        f"{args.concurrency} clients for {args.seconds:g} s, {args.rounds} rounds, {os.cpu_count()} CPUs"
    )
    print(
        f"{'candidate / baseline':40} {'throughput (range)':>24} {'tree CPU a request (range)':>28} "
        f"{'candidate req/s':>15} {'tree CPU ms/req':>15}"
    )
    for pair in pairs_of(workload):
        t, t_lo, t_hi = per_pair(pair, lambda c, b: c["rps"] / b["rps"])
        c, c_lo, c_hi = per_pair(pair, lambda c, b: c["tree"] / b["tree"])
        rps = statistics.median(r[pair][pair[0]]["rps"] for r in rounds)
        cpu = statistics.median(r[pair][pair[0]]["tree"] for r in rounds)
        print(
            f"{pair[0] + ' / ' + pair[1]:40} {t:10.3f} ({t_lo:.3f}-{t_hi:.3f}) {c:14.3f} ({c_lo:.3f}-{c_hi:.3f}) "
            f"{rps:15.1f} {cpu:15.3f}"
        )
    print("\nCPU ms a request by where it is paid, less the baseline's in the same co-run (median of the rounds)")
    print(f"{'candidate / baseline':40} " + " ".join(f"{role:>17}" for role in ROLES) + f" {'server':>9} {'tree':>9}")
    for pair in pairs_of(workload):
        cells = [
            statistics.median(r[pair][pair[0]][k] - r[pair][pair[1]][k] for r in rounds)
            for k in (*ROLES, "server", "tree")
        ]
        print(
            f"{pair[0] + ' / ' + pair[1]:40} "
            + " ".join(f"{x:17.3f}" for x in cells[:-2])
            + f" {cells[-2]:9.3f} {cells[-1]:9.3f}"
        )

    hand, st = ("handwritten", "contrib-only"), ("stagetrace-contrib", "contrib-only")
    if workload == "offload":
        return report_offload(rounds, per_pair)

    def added(pair: tuple[str, str], part: str) -> float:
        """The candidate's CPU a request over its baseline's tree, as a share of the baseline's, median."""
        return statistics.median(r[pair][pair[0]][part] / r[pair][pair[1]]["tree"] - 1 for r in rounds)

    def share(part: str) -> float:
        return added(st, part) / added(hand, "tree") if added(hand, "tree") > 0 else float("nan")

    throughput_st = per_pair(st, lambda c, b: c["rps"] / b["rps"])
    throughput_native = per_pair(("stagetrace", "native-only"), lambda c, b: c["rps"] / b["rps"])
    against_hand = per_pair(("stagetrace-contrib", "handwritten"), lambda c, b: c["rps"] / b["rps"])
    checks = [
        ("stagetrace-contrib throughput >= 0.97 x contrib-only", throughput_st[0], throughput_st[0] >= 0.97, True),
        (
            "stagetrace throughput >= 0.97 x native-only (its own server span)",
            throughput_native[0],
            throughput_native[0] >= 0.97,
            True,
        ),
        ("stagetrace-contrib server CPU added <= 0.5 x handwritten's", share("server"), share("server") <= 0.5, True),
        ("stagetrace-contrib tree CPU added <= 1.0 x handwritten's", share("tree"), share("tree") <= 1.0, True),
        ("goal: server CPU added <= 0.1 x handwritten's", share("server"), share("server") <= 0.1, False),
        ("goal: tree CPU added <= 0.25 x handwritten's", share("tree"), share("tree") <= 0.25, False),
        ("goal: stagetrace-contrib throughput >= 1.10 x handwritten", against_hand[0], against_hand[0] >= 1.10, False),
    ]
    ok = True
    print()
    for label, value, passed, counts in checks:
        ok &= passed or not counts
        print(f"{'target' if counts else 'goal'} {label}: {'PASS' if passed else 'FAIL'} ({value:.3f})")
    every = per_pair(("stagetrace-all", "stagetrace"), lambda c, b: c["tree"] - b["tree"])
    print(
        f"every trace exported, over the budgeted default: {every[0]:+.3f} ms of tree CPU a request "
        f"({every[1]:+.3f} to {every[2]:+.3f})"
    )
    return ok


def report_offload(rounds: list[dict], per_pair: Any) -> bool:
    """What tracing the offloaded calls costs: against the same server with pools untraced, and against the
    hand-written spans around each call (what stagetrace's own stages would be without the offload's)."""
    traced = ("stagetrace-contrib", "stagetrace-pools-off")
    t = per_pair(traced, lambda c, b: c["rps"] / b["rps"])
    added = per_pair(traced, lambda c, b: c["tree"] - b["tree"])
    hand = per_pair(("handwritten", "contrib-only"), lambda c, b: c["tree"] - b["tree"])
    print(
        f"\ntracing the offloaded calls (six a request): throughput {t[0]:.3f} x the same server with pools "
        f"untraced ({t[1]:.3f}-{t[2]:.3f}), {added[0]:+.3f} ms of tree CPU a request ({added[1]:+.3f} to "
        f"{added[2]:+.3f}); hand-written spans around the calls add {hand[0]:+.3f} ms over contrib-only"
    )
    return True


# --- instruction counts (--instructions) ------------------------------------------------------------------


def _callgrind_control(option: str, pid: int) -> None:
    subprocess.run(["callgrind_control", option, str(pid)], check=True, stdout=subprocess.DEVNULL)


def _dumped_instructions(directory: str, pid: int) -> dict[int, int]:
    """Instructions per thread (1: the main thread) in the first dump callgrind_control asked of ``pid``."""
    import glob

    out = {}
    for path in glob.glob(os.path.join(directory, f"cg.{pid}.1-*")):
        with open(path) as fh:
            total = next((int(line.split()[1]) for line in fh if line.startswith("summary:")), 0)
        out[int(path.rsplit("-", 1)[1])] = total
    return out


def count_variant(variant: str, workload: str, requests: int, sink_port: int) -> dict[str, float]:
    """Instructions a request of one variant's server under callgrind: its event-loop (main) thread, its other
    threads, and its child processes (the exporter), counted from after a warm-up to after ``requests``
    requests, two at a time, and what they left to background threads."""
    import tempfile

    from proctree import descendants

    with tempfile.TemporaryDirectory(prefix="e2e-icount-") as directory:
        prefix = [
            "valgrind",
            "--tool=callgrind",
            "--separate-threads=yes",
            "--trace-children=yes",
            f"--callgrind-out-file={directory}/cg.%p",
            f"--log-file={directory}/vg.%p",
        ]
        server = Server(
            variant,
            workload,
            {"gil-free": 0.0, "gil-bound": 0.0},  # one unit of work a stage: the work is alike in every variant
            sink_port,
            None,
            prefix=prefix,
            extra_env={
                "E2E_QUIET_SAMPLERS": "1",
                "STAGETRACE_HEALTHY_SAMPLE": "0",
                "STAGETRACE_OUTPUT_DIR": directory,
                "PYTHONHASHSEED": "0",  # one hash seed for every run: dict layouts (and counts) alike
            },
            start_timeout_s=600,
        )
        try:
            _load(server.port, 40, 2)  # warm-up: imports, first-call paths, the exporter process started
            time.sleep(2.0)
            pids = [server.proc.pid, *descendants(server.proc.pid)]
            for pid in pids:
                _callgrind_control("-z", pid)
            _load(server.port, requests, 2)
            time.sleep(2.0)  # what the requests left to the helper thread and the exporter
            for pid in pids:
                _callgrind_control("-d", pid)
            counts = {pid: _dumped_instructions(directory, pid) for pid in pids}
        finally:
            server.stop()
    app = counts.pop(server.proc.pid)
    loop = app.get(1, 0)
    server_total = sum(app.values())
    children = sum(sum(threads.values()) for threads in counts.values())
    return {
        "loop": loop / requests,
        "other threads": (server_total - loop) / requests,
        "server": server_total / requests,
        "exporter process": children / requests,
        "tree": (server_total + children) / requests,
    }


def instructions_main(args: argparse.Namespace, sink_port: int) -> bool:
    import shutil

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("--instructions needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return False
    workload = "gil-free" if args.workload == "both" else args.workload
    rows = {}
    for v in VARIANTS:
        rows[v] = count_variant(v, workload, args.requests, sink_port)
        print(f"  {v} counted", file=sys.stderr, flush=True)
    parts = ("loop", "other threads", "server", "exporter process", "tree")
    print(
        f"\ne2e --instructions, {workload} workload: instructions a request (callgrind; {args.requests} requests two "
        f"at a time after a warm-up; the GIL monitor and the loop-lag monitor off, their cost per second apart)"
    )
    print(f"{'variant':18} " + " ".join(f"{p:>16}" for p in parts) + f" {'tree added':>12}")
    base = rows["contrib-only"]
    for v, r in rows.items():
        print(
            f"{v:18} " + " ".join(f"{r[p] / 1e3:15.1f}k" for p in parts) + f" {(r['tree'] - base['tree']) / 1e3:11.1f}k"
        )

    def share(v: str, part: str) -> float:
        hand = rows["handwritten"][part] - base[part]
        return (rows[v][part] - base[part]) / hand if hand > 0 else float("nan")

    ok = True
    print()
    for label, value, bound in (
        (
            "stagetrace-contrib server instructions added <= 0.5 x handwritten's",
            share("stagetrace-contrib", "server"),
            0.5,
        ),
        ("stagetrace-contrib tree instructions added <= 1.0 x handwritten's", share("stagetrace-contrib", "tree"), 1.0),
        ("goal: server added <= 0.1 x handwritten's", share("stagetrace-contrib", "server"), 0.1),
        ("goal: tree added <= 0.25 x handwritten's", share("stagetrace-contrib", "tree"), 0.25),
    ):
        passed = value <= bound
        if not label.startswith("goal"):
            ok &= passed
        print(f"target {label}: {'PASS' if passed else 'FAIL'} ({value:.3f})")
    return ok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        serve(argv[1], argv[2], int(argv[3]))
        return 0
    if argv[:1] == ["sink"]:
        sink(int(argv[1]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8.0, help="length of each paired co-run")
    ap.add_argument("--requests", type=int, default=200, help="with --instructions: requests counted a variant")
    ap.add_argument("--concurrency", type=int, default=8, help="clients a server")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--workload", choices=("gil-free", "gil-bound", "both", "offload"), default="both")
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="servers and clients share every CPU")
    ap.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions a request under valgrind instead (one workload; --requests defaults to 200)",
    )
    args = ap.parse_args(argv)
    if args.pin and (not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2):
        args.pin = False
    others = set(range(1, os.cpu_count() or 1))
    if args.pin:
        os.sched_setaffinity(0, others)  # the clients, the sink and this process stay off the servers' CPU
    per_ms = _calibrate()
    sink_port = free_port()
    sink_proc = subprocess.Popen([sys.executable, __file__, "sink", str(sink_port)])
    ok = True
    try:
        wait_for_port(sink_port, sink_proc, timeout_s=30)
        if args.instructions:
            return 0 if instructions_main(args, sink_port) else 1
        workloads = ("gil-free", "gil-bound") if args.workload == "both" else (args.workload,)
        for workload in workloads:
            ok &= report(workload, run_workload(workload, args, per_ms, sink_port), args)
    finally:
        sink_proc.terminate()
        sink_proc.wait(timeout=10)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
