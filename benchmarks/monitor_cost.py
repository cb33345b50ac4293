"""What one wake-up of the GIL monitor costs, in instructions (valgrind's callgrind, the monitor's thread
counted apart), quiet and at saturation.

    python benchmarks/monitor_cost.py [--seconds 3]

Each variant in a fresh process under callgrind: ``configure()``, one trace held open (so the monitor wakes
100 times a second), ``--seconds`` of wall time, then the monitor's thread's instructions over its wake-ups
(the wake-ups counted by the monitor itself). Valgrind runs one thread at a time and ~30 x slower, so a
second of wall time holds fewer wake-ups than it would natively, but what one wake-up costs in instructions
does not move with that: the figure is per wake-up. Variants:

  quiet        nothing else runs: the monitor reads its own schedstat, and the process's totals every fifth
               wake-up;
  saturated    a thread spinning in Python beside it (every wake-up waits for the GIL, so every one reads the
               process's totals: one read per thread);
  saturated, 40 threads   the same beside 40 idle threads (a thread pool after a burst).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile

_CHILD = """
import os, sys, threading, time
import stagetrace
from stagetrace import _state
seconds, spin, idle = float(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
parked = threading.Event()
for _ in range(idle):
    threading.Thread(target=parked.wait, daemon=True).start()
stop = threading.Event()
def spinner():
    while not stop.is_set():
        pass
h = stagetrace.configure("monitor", traces_path=sys.argv[4], settings=stagetrace.Settings(poll_interval_s=3600.0))
monitor = _state.runtime.gil_sampler
pipeline = stagetrace.pipeline("held-open")
pipeline.__enter__()
if spin:
    threading.Thread(target=spinner, daemon=True).start()
time.sleep(seconds)
stop.set()
wakeups = monitor.wakeups
with open(sys.argv[5], "w") as f:
    f.write(f"{wakeups} {monitor.process_reads}")
os._exit(0)
"""

VARIANTS = {
    "quiet": ("0", "0"),
    "saturated": ("1", "0"),
    "saturated, 40 idle threads": ("1", "40"),
}


def thread_instructions(directory: str, pid: int) -> dict[int, int]:
    """Instructions per thread of ``pid`` (callgrind's thread numbers, 1 the main thread)."""
    out = {}
    for path in glob.glob(os.path.join(directory, f"cg.{pid}-*")):
        with open(path) as f:
            out[int(path.rsplit("-", 1)[1])] = next(int(line.split()[1]) for line in f if line.startswith("summary:"))
    return out


def measure(seconds: float, spin: str, idle: str) -> tuple[float, int, int]:
    with tempfile.TemporaryDirectory() as d:
        facts = os.path.join(d, "facts")
        proc = subprocess.run(
            [
                "valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={d}/cg.%p",
                f"--log-file={d}/vg", sys.executable, "-c", _CHILD, str(seconds), spin, idle,
                os.path.join(d, "t.jsonl"), facts,
            ],
            capture_output=True, text=True, check=True,
            env={k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))},
        )  # fmt: skip
        with open(facts) as f:
            wakeups, reads = (int(v) for v in f.read().split())
        (app,) = {int(p.rsplit("cg.", 1)[1].split("-")[0]) for p in glob.glob(os.path.join(d, "cg.*-*"))}
        threads = thread_instructions(d, app)  # the application alone: its exporter process is not traced
        # the monitor: the busiest thread but the main thread and a spinner (which runs the most)
        candidates = {t: n for t, n in threads.items() if t != 1}
        if spin == "1":
            candidates.pop(max(candidates, key=candidates.__getitem__))
        monitor = max(candidates, key=candidates.__getitem__)
        del proc
        return candidates[monitor] / max(1, wakeups), wakeups, reads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    print("the GIL monitor's instructions a wake-up (callgrind, its thread alone)")
    print("| variant | instructions a wake-up | wake-ups counted | readings of the process's totals |")
    print("|---|---:|---:|---:|")
    for label, (spin, idle) in VARIANTS.items():
        per_wakeup, wakeups, reads = measure(args.seconds, spin, idle)
        print(f"| {label} | {per_wakeup / 1e3:.1f} k | {wakeups} | {reads} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
