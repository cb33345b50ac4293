"""What stagetrace's application-side threads cost a server with no request in flight, and with one.

    python benchmarks/idle_cost.py [--seconds 10]

Each variant in a fresh application process, side by side: ``configure()``, then ``--seconds`` with nothing
to do (idle) or with one trace held open the whole time (a request in flight: the samplers run), alone or beside
40 idle threads (what the GIL monitor reads grows with the threads: a thread pool after a burst). Per
second: the process's CPU time (``time.process_time``, every thread) and the GIL monitor thread's wake-ups (its
schedstat's count of times scheduled in, ``/proc/self/task/<tid>/schedstat``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = """
import json, os, sys, time
import stagetrace
seconds, in_flight, period = float(sys.argv[1]), sys.argv[2] == "1", float(sys.argv[3])
import threading
parked = threading.Event()
for _ in range(int(sys.argv[5])):  # idle threads, as a thread pool keeps them after a burst
    threading.Thread(target=parked.wait, daemon=True).start()
h = stagetrace.configure("idle", traces_path=sys.argv[4], settings=stagetrace.Settings(gil_sampler_period_s=period))
time.sleep(1.0)  # the exporter started, the threads settled

def cpu_s():
    return time.process_time()  # every thread of the process, at the clock's full resolution

def sampler_wakeups():
    import threading
    for t in threading.enumerate():
        if t.name == "stagetrace-gil":
            with open(f"/proc/self/task/{t.native_id}/schedstat") as f:
                return int(f.read().split()[2])
    return 0

pipeline = stagetrace.pipeline("held-open") if in_flight else None
if pipeline is not None:
    pipeline.__enter__()
c0, w0 = cpu_s(), sampler_wakeups()
time.sleep(seconds)
c1, w1 = cpu_s(), sampler_wakeups()
if pipeline is not None:
    pipeline.__exit__(None, None, None)
h.shutdown()
print(json.dumps({"cpu_ms_per_s": (c1 - c0) * 1e3 / seconds, "wakeups_per_s": (w1 - w0) / seconds}))
"""

VARIANTS = {  # (a trace in flight, the GIL monitor's period, idle threads beside)
    "GIL monitor off (gil_sampler_period_s=0)": ("0", "0", "0"),
    "default, idle (no trace in flight)": ("0", "0.01", "0"),
    "GIL monitor off, one trace in flight all along": ("1", "0", "0"),
    "default, one trace in flight all along": ("1", "0.01", "0"),
    "default, one trace in flight, 40 idle threads beside (a thread pool after a burst)": ("1", "0.01", "40"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    print(f"{args.seconds:.0f} s per variant, each in a fresh process")
    print("| variant | application CPU ms/s | GIL monitor wake-ups /s |")
    print("|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (in_flight, period, threads) in VARIANTS.items():
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, str(args.seconds), in_flight, period, f"{tmp}/t.jsonl", threads],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=args.seconds + 60,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {name} | {r['cpu_ms_per_s']:.2f} | {r['wakeups_per_s']:.1f} |")


if __name__ == "__main__":
    main()
