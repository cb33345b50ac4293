"""What one wake-up of the GIL monitor costs in CPU time, quiet and at saturation, beside the floor that any
Python thread waking 100 times a second pays under the same load.

    python benchmarks/monitor_cost.py [--seconds 5] [--rounds 3] [--only TEXT] [--against SRC]

``--only TEXT`` runs the variants whose label holds TEXT (with their floors); ``--against SRC`` runs each
monitor variant a second time on another source tree (``git archive REV src | tar -x -C DIR``; SRC is
``DIR/src``), interleaved with this tree's, and gives the ratio of the two: a change to the monitor measured
side by side.

Each variant runs in a fresh process, the variants interleaved round by round (so that a slower spell of the
machine falls on all of them): one trace held open, so that the monitor wakes every 10 ms, for ``--seconds``;
then the waking thread's on-CPU time (its own ``/proc/self/task/<tid>/schedstat``) over its wake-ups (which
it counts). The median of the rounds. The thread that wakes:

  floor                 no stagetrace: a bare Python thread sleeping 10 ms at a time, what waking costs
  floor + one read      the same and one GIL-holding ``pread`` of its own schedstat at each wake-up, the least
                        a wake-up that measures its own run-queue wait does
  the monitor           stagetrace's GIL monitor; "no reads of the totals": the same with its reads of the
                        other threads' counts switched off (their share of its cost)

under one of these loads:

  quiet                 nothing else running
  CPU-saturated         the process on one CPU beside 8 threads compressing with zlib (the GIL released) in a
                        loop: wake-ups wait for the CPU, and those that waited read the process's totals (a read
                        per thread); "+ 40 idle threads": beside 40 parked threads too (a thread pool after a burst)
  GIL-bound             the process on one CPU beside a thread spinning in Python: wake-ups wait for the GIL

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
seconds, waker, load, idle, traces_path = float(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
if load != "quiet":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before any thread: every thread on one CPU
parked, stop = threading.Event(), threading.Event()
for _ in range(idle):
    threading.Thread(target=parked.wait, daemon=True).start()
payload = os.urandom(20_000) + bytes(20_000)

def compress():
    while not stop.is_set():
        zlib.compress(payload, 6)  # releases the GIL while it works

def spin():
    while not stop.is_set():
        pass

def schedstat(tid):  # (on-CPU ns, times scheduled in)
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        fields = f.read().split()
        return int(fields[0]), int(fields[2])

if waker.startswith("floor"):
    from stagetrace.capture.cpu import CpuSignals
    read = CpuSignals().read if waker == "floor-read" else None
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
    while monitor._thread is None or monitor._thread.native_id is None or monitor.wakeups == 0:
        time.sleep(0.01)
    if waker == "monitor-no-reads":
        monitor._process = None  # its loop reads the totals only while this is set
    tid, wakeups, reads = monitor._thread.native_id, (lambda: monitor.wakeups), (lambda: monitor.process_reads)
for _ in range(8 if load == "cpu" else 0):
    threading.Thread(target=compress, daemon=True).start()
if load == "gil":
    threading.Thread(target=spin, daemon=True).start()
time.sleep(1.0)  # settled: the load running, the thread waking
(cpu0, in0), woke0, read0 = schedstat(tid), wakeups(), reads()
time.sleep(seconds)
(cpu1, in1), woke1, read1 = schedstat(tid), wakeups(), reads()
stop.set()
woke = max(1, woke1 - woke0)
print(json.dumps({"us": (cpu1 - cpu0) / 1e3 / woke, "per_s": woke / seconds, "reads": (read1 - read0) / woke,
                  "slices": (in1 - in0) / woke}))
sys.stdout.flush()
os._exit(0)
"""

# label: (the thread that wakes, the load, idle threads beside)
VARIANTS = {
    "floor, quiet": ("floor", "quiet", 0),
    "floor + one read, quiet": ("floor-read", "quiet", 0),
    "the monitor, quiet": ("monitor", "quiet", 0),
    "floor + one read, CPU-saturated": ("floor-read", "cpu", 0),
    "the monitor, CPU-saturated": ("monitor", "cpu", 0),
    "the monitor, CPU-saturated, no reads of the totals": ("monitor-no-reads", "cpu", 0),
    "the monitor, CPU-saturated + 40 idle threads": ("monitor", "cpu", 40),
    "floor + one read, GIL-bound": ("floor-read", "gil", 0),
    "the monitor, GIL-bound": ("monitor", "gil", 0),
}
# under each load, the floor the monitor is compared with: the bare thread with one read, under that load
FLOOR_OF = {load: label for label, (waker, load, _) in VARIANTS.items() if waker == "floor-read"}


def measure(variant: tuple[str, str, int], seconds: float, directory: str, src: str | None) -> dict[str, float]:
    waker, load, idle = variant
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    if src is not None:
        env["PYTHONPATH"] = src
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(seconds), waker, load, str(idle), os.path.join(directory, "t.jsonl")],
        env=env, capture_output=True, text=True, check=True, timeout=seconds + 60,
    )  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="the variants whose label holds this text, with their floors")
    ap.add_argument("--against", default=None, help="another tree's src/, its monitor run beside this one's")
    args = ap.parse_args(argv)
    chosen = {label: v for label, v in VARIANTS.items() if args.only in label or label in FLOOR_OF.values()}
    runs: dict[tuple[str, str | None], list[dict[str, float]]] = {}
    for label, (waker, _, _) in chosen.items():
        runs[label, None] = []
        if args.against and waker.startswith("monitor"):
            runs[label, args.against] = []
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.rounds):
            for (label, src), results in runs.items():
                results.append(measure(chosen[label], args.seconds, directory, src))
    cost = {key: statistics.median(r["us"] for r in results) for key, results in runs.items()}
    print(f"CPU a wake-up of the thread that wakes (median of {args.rounds} rounds of {args.seconds:.0f} s)")
    print("| the thread that wakes, load | CPU µs a wake-up | x the floor + one read, same load | wake-ups /s "
          "| readings of the totals a wake-up | scheduled in a wake-up |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for (label, src), results in runs.items():
        waker, load, _ = chosen[label]
        per_s = statistics.median(r["per_s"] for r in results)
        reads = "-" if not waker.startswith("monitor") else f"{statistics.median(r['reads'] for r in results):.2f}"
        floor = cost.get((FLOOR_OF[load], None))
        ratio = "-" if waker == "floor" or floor is None else f"{cost[label, src] / floor:.2f}"
        name = label if src is None else f"{label} [against]"
        slices = statistics.median(r["slices"] for r in results)
        print(f"| {name} | {cost[label, src]:.0f} | {ratio} | {per_s:.0f} | {reads} | {slices:.2f} |")
    if args.against:
        print(f"\nthis tree / {args.against}, the monitor's CPU a wake-up, same run")
        print("| variant | ratio |\n|---|---:|")
        for label, src in runs:
            if src is not None:
                print(f"| {label} | {cost[label, None] / cost[label, src]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
