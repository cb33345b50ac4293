"""The cost of tracing a call handed to a process pool, in instructions, side by side in one run.

    python benchmarks/offload.py [N]     # valgrind: N and 2N calls a workload (default 200), the difference over N

Target (issue 39): "an offloaded call adds at most ~2 stages' worth of request-thread instructions in the
parent and at most one stage's worth a worker stage".

Each workload runs N and 2N calls under valgrind's callgrind (``--separate-threads``), in a process of its own
whose pool (``ProcessPoolExecutor(1)``, fork) is started and warm before counting; the difference cancels
start-up. The application's request (main) thread is read, and the worker's main thread (a forked child
stays under valgrind: its counts are the worker's), and the rest of each process apart (the pool's threads,
the helper thread: they wake on wall time, which valgrind stretches). Every call runs inside a
``pipeline()`` root and waits for its result:

  plain          ``pool.submit(work, k).result()`` with ``Settings(process_pools=False)``: the pool alone;
  offload        the same, traced: the call an offload stage, its report back with its result;
  offload-5      the same, the worker's function running five ``stagetrace.stage()`` calls a call;
  pipeline0 / pipeline5  a root alone and a root with five stages, in the application (a stage's price, as
                 ``benchmarks/overhead.py`` reads it).

Rows: the request thread's instructions a call (offload - plain), as a multiple of one stage; the worker's a
worker stage ((offload-5 - offload) / 5), as a multiple of one stage; the pool's threads' a call (the call's
serialisation, the result's reading back). CPU times on this VM move +-20 %, instruction counts under 1 %.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

os.environ["STAGETRACE_HEALTHY_SAMPLE"] = "1.0"
os.environ["STAGETRACE_EXPORT_BUDGET"] = "off"

import stagetrace

WORKLOADS = ("plain", "offload", "offload-5", "pipeline0", "pipeline5")
FIVE = ("receive", "decode", "to_tensor", "infer", "postprocess")


def work(stages: int) -> int:
    for name in FIVE[:stages]:
        with stagetrace.stage(name):
            pass
    return stages


def workload(name: str, n: int, pids: str) -> None:
    from stagetrace.handoff import shipper

    shipper.FLUSH_POLL_S = 1.0  # type: ignore[attr-defined]  # the helper thread ships when flushed
    settings = stagetrace.Settings(
        gil_sampler_period_s=0, loop_lag_interval_s=3600.0, poll_interval_s=3600.0, shutdown_timeout_s=600.0,
        slow_threshold_ms=1e9, process_pools=name.startswith("offload"),
    )  # fmt: skip
    handle = stagetrace.configure("bench-offload", set_global=False, settings=settings)
    stages = 5 if name.endswith("-5") else 0
    with ProcessPoolExecutor(1) as pool:
        worker = pool.submit(os.getpid).result()  # started and warm
        with open(pids, "w") as fh:
            fh.write(f"{os.getpid()} {worker}\n")
        for _ in range(n):
            with stagetrace.pipeline("request"):
                if name.startswith("pipeline"):
                    for stage_name in FIVE if name == "pipeline5" else ():
                        with stagetrace.stage(stage_name):
                            pass
                else:
                    pool.submit(work, stages).result()
    handle.force_flush(600)
    handle.shutdown()
    os._exit(0)


def _counts(directory: str) -> dict[str, int]:
    """The application's request thread and other threads, the worker's main thread, from callgrind's
    ``cg.<pid>-<thread>`` files."""
    with open(os.path.join(directory, "pids")) as fh:
        app, worker = (int(v) for v in fh.read().split())
    out = {"request": 0, "app_other": 0, "worker": 0}
    for path in glob.glob(os.path.join(directory, "cg.*")):
        pid_text, dash, thread = path.rsplit("cg.", 1)[1].partition("-")
        if not dash:
            continue
        with open(path) as f:
            count = next((int(line.split()[1]) for line in f if line.startswith("summary:")), 0)
        pid, main = int(pid_text), int(thread) == 1
        if pid == app:
            out["request" if main else "app_other"] += count
        elif pid == worker and main:
            out["worker"] += count
    return out


def _count(name: str, n: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as directory:
        env = dict(os.environ, STAGETRACE_OUTPUT_DIR=directory, PYTHONHASHSEED="0", OTEL_METRICS_EXPORTER="none")
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        env.pop("OTEL_TRACES_EXPORTER", None)
        command = [
            "valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={directory}/cg.%p",
            f"--log-file={directory}/vg.%p", sys.executable, os.path.abspath(__file__), "--workload", name, str(n),
            os.path.join(directory, "pids"),
        ]  # fmt: skip
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
        return _counts(directory)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--workload"]:
        workload(argv[1], int(argv[2]), argv[3])
        return 0
    n = int(argv[0]) if argv else 200
    if shutil.which("valgrind") is None:
        print("needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    jobs = [(w, size) for w in WORKLOADS for size in (n, 2 * n)]
    with ThreadPoolExecutor(2) as runs:
        counts = dict(zip(jobs, runs.map(lambda job: _count(*job), jobs)))
    per = {w: {k: (counts[(w, 2 * n)][k] - counts[(w, n)][k]) / n for k in counts[(w, n)]} for w in WORKLOADS}
    stage = (per["pipeline5"]["request"] - per["pipeline0"]["request"]) / len(FIVE)
    # What the application's other threads pay a stage (its packing and shipping on the helper thread): a
    # worker has one thread, so its stage carries its own shipping (packed and pickled with the result).
    shipping = (per["pipeline5"]["app_other"] - per["pipeline0"]["app_other"]) / len(FIVE)
    version = sys.version.split()[0]
    print(f"instructions a call (callgrind; {n} and {2 * n} calls, the difference over {n}), python {version}")
    print(f"{'workload':12} {'request thread':>15} {'app, other threads':>19} {'worker thread':>14}")
    for w in WORKLOADS:
        p = per[w]
        print(f"{w:12} {p['request'] / 1e3:14.1f}k {p['app_other'] / 1e3:18.1f}k {p['worker'] / 1e3:13.1f}k")
    parent = per["offload"]["request"] - per["plain"]["request"]
    pool_threads = per["offload"]["app_other"] - per["plain"]["app_other"]
    worker_stage = (per["offload-5"]["worker"] - per["offload"]["worker"]) / len(FIVE)
    worker_call = per["offload"]["worker"] - per["plain"]["worker"]
    print()
    print(f"one stage (a pipeline's, request thread): {stage / 1e3:.1f}k instructions")
    print(f"an offloaded call, the request thread:   {parent / 1e3:.1f}k = {parent / stage:.2f} x a stage "
          f"(target <= 2: {'PASS' if parent <= 2 * stage else 'FAIL'})")  # fmt: skip
    print(f"a worker stage, the worker's thread:    {worker_stage / 1e3:.1f}k = {worker_stage / stage:.2f} x a stage "
          f"(target <= 1: {'PASS' if worker_stage <= stage else 'FAIL'})")  # fmt: skip
    print(f"  against a stage's whole cost in the application (request thread + {shipping / 1e3:.1f}k shipping on "
          f"its other threads): {worker_stage / (stage + shipping):.2f} x")  # fmt: skip
    print(f"a call's own bookkeeping in the worker: {worker_call / 1e3:.1f}k = {worker_call / stage:.2f} x a stage")
    print(f"the application's other threads a call (pickling the call, reading the report): {pool_threads / 1e3:.1f}k")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
