"""What one wake-up of the GIL monitor costs in CPU time, quiet and at saturation, beside the floor that any
Python thread waking 100 times a second pays on the same host.

    python benchmarks/monitor_cost.py [--seconds 5] [--rounds 3]

Each variant runs in a fresh process, the variants interleaved round by round (so that a slower spell of the
machine falls on all of them): one trace held open, so that the monitor wakes every 10 ms, for ``--seconds``;
then the monitor thread's on-CPU time (its own ``/proc/self/task/<tid>/schedstat``) over its wake-ups (which
it counts). The median of the rounds. Variants:

  floor: a bare Python thread      no stagetrace: a thread sleeping 10 ms at a time, what waking costs here
  floor + one schedstat read       the same and one GIL-holding ``pread`` of its own schedstat at each
                                   wake-up, the least a wake-up that measures its own run-queue wait does
  quiet                            the monitor, nothing else running (the process's totals read every fifth
                                   wake-up)
  saturated                        the process on one CPU beside 8 threads compressing with zlib (the GIL
                                   released) in a loop: every wake-up waits for the CPU, so every one reads
                                   the process's totals (a read per thread)
  saturated, 40 idle threads       the same beside 40 parked threads (a thread pool after a burst)

Not in instructions: valgrind runs one thread at a time and ~30 x slower, so there every wake-up is late, and
beside busy threads the monitor hardly gets one. CPU time on a VM moves from run to run: compare within one
table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = """
import json, os, sys, threading, time, zlib
seconds, variant, traces_path = float(sys.argv[1]), sys.argv[2], sys.argv[3]
workers, idle = {"saturated": (8, 0), "saturated-idle": (8, 40)}.get(variant, (0, 0))
if workers:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before any thread: every thread on one CPU
parked, stop = threading.Event(), threading.Event()
for _ in range(idle):
    threading.Thread(target=parked.wait, daemon=True).start()
payload = os.urandom(20_000) + bytes(20_000)

def compress():
    while not stop.is_set():
        zlib.compress(payload, 6)  # releases the GIL while it works

def schedstat(tid):
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0])

if variant.startswith("floor"):
    from stagetrace.capture.cpu import CpuSignals
    read = CpuSignals().read if variant == "floor-read" else None
    ticks, ready = [0], threading.Event()
    def floor():
        ticks.append(threading.get_native_id()); ready.set()
        while not stop.is_set():
            time.sleep(0.010)
            if read is not None:
                read()
            ticks[0] += 1
    threading.Thread(target=floor, daemon=True).start()
    ready.wait()
    tid, wakeups, reads = ticks[1], (lambda: ticks[0]), (lambda: 0)
else:
    import stagetrace
    from stagetrace import _state
    handle = stagetrace.configure("monitor-cost", traces_path=traces_path)
    pipeline = stagetrace.pipeline("held-open")
    pipeline.__enter__()
    monitor = _state.runtime.gil_sampler
    while monitor._thread is None or monitor._thread.native_id is None:
        time.sleep(0.01)
    tid, wakeups, reads = monitor._thread.native_id, (lambda: monitor.wakeups), (lambda: monitor.process_reads)
for _ in range(workers):
    threading.Thread(target=compress, daemon=True).start()
time.sleep(1.0)  # settled: the workers running, the monitor waking
cpu0, woke0, read0 = schedstat(tid), wakeups(), reads()
time.sleep(seconds)
cpu1, woke1, read1 = schedstat(tid), wakeups(), reads()
stop.set()
woke = max(1, woke1 - woke0)
print(json.dumps({"us": (cpu1 - cpu0) / 1e3 / woke, "per_s": woke / seconds, "reads": (read1 - read0) / woke}))
sys.stdout.flush()
os._exit(0)
"""

VARIANTS = {
    "floor: a bare Python thread": "floor",
    "floor + one schedstat read": "floor-read",
    "quiet": "quiet",
    "saturated (8 busy threads, one CPU)": "saturated",
    "saturated, 40 idle threads beside": "saturated-idle",
}


def measure(variant: str, seconds: float, directory: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(seconds), variant, os.path.join(directory, "t.jsonl")],
        env=env, capture_output=True, text=True, check=True, timeout=seconds + 60,
    )  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in VARIANTS}
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.rounds):
            for label, variant in VARIANTS.items():
                runs[label].append(measure(variant, args.seconds, directory))
    floor = statistics.median(r["us"] for r in runs["floor + one schedstat read"])
    print(f"the GIL monitor's thread, CPU a wake-up (median of {args.rounds} rounds of {args.seconds:.0f} s)")
    print("| variant | CPU µs a wake-up | x the floor with one read | wake-ups /s | readings of the totals a wake-up |")
    print("|---|---:|---:|---:|---:|")
    for label, results in runs.items():
        us = statistics.median(r["us"] for r in results)
        per_s = statistics.median(r["per_s"] for r in results)
        reads = statistics.median(r["reads"] for r in results)
        shown = "-" if label.startswith("floor") else f"{reads:.2f}"
        print(f"| {label} | {us:.0f} | {us / floor:.2f} | {per_s:.0f} | {shown} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
