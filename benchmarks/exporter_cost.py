"""What the exporter process spends on one trace: the verdict and metrics every trace gets, and the spans
and OTLP bytes of an exported one.

    python benchmarks/exporter_cost.py [--requests 300] [--rounds 5]
    python benchmarks/exporter_cost.py --instructions        # valgrind: instructions a trace
    python benchmarks/exporter_cost.py --instructions --mypyc  # and the same modules compiled by mypyc
    python benchmarks/exporter_cost.py --instructions --against OTHER/src  # and another tree, same recordings

The messages come from the endpoint of ``benchmarks/e2e.py`` (a FastAPI route of six stages), served in
process by Starlette's TestClient with the exporter's work on a thread (``STAGETRACE_EXPORT_PROCESS=off``)
and recorded as the exporter received them: on the contrib path and on FastAPI's own telemetry, one request
at a time (short stages: the four per-stage CPU rules skip them, as in a service below saturation), and on
the contrib path beside a thread spinning in Python (its stages stretch past ``min_stage_ms``, blocked on
the GIL, and the CPU rules run, as at saturation). They are then replayed into a fresh ``ExporterCore`` as
the exporter process feeds it (``marshal`` frames of 20 messages), with stagetrace's metric aggregation
behind an SDK reader:

  verdict    every trace analysed, diagnosed and counted in the metrics, none kept (no healthy share, an
             export budget with next to no tokens): what every trace costs the exporter;
  exported   every trace also kept (healthy share 1.0, no export budget), its spans built and encoded to
             OTLP/HTTP protobuf bytes (not sent): what a kept trace costs on top.

CPU time a trace is the median of ``--rounds`` rounds (this VM moves it by +-20 % between runs).
``--instructions`` counts instructions instead (valgrind's callgrind, the replay at ``--reps`` and twice as
many passes over the recorded traces, the difference divided by the traces, so start-up cancels), which
moves by a few per cent at most. Needs ``apt-get install valgrind``.

``--against SRC`` replays the same recordings into another source tree (its ``src`` directory, its modules
built in place as an install builds them: ``pip install -e`` there, or ``hatch_build.py``'s build), sources
and compiled, and adds a table of this tree's figures over that one's: a change to the exporter measured on
the very messages it is measured on before.

Each row compares the sources with the installed build (Cython); ``--mypyc`` adds the same modules compiled
by mypyc in a copy, the other compiler the issue asked to weigh. mypyc enforces the annotations and lays out
classes natively at run time, so code that Cython compiles as it is must suit it first: on 2026-12-06 the
replay stopped at ``analysis/verdict.py``'s ``object.__new__(Verdict)`` (the slots-filled construction that
Cython keeps cheap) after three annotation fixes, and no mypyc figure exists yet (docs/performance.md).
A replay whose traces raise inside the core fails the benchmark rather than print its count.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import marshal
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

# (variant, contended): the row's label. Contended: recorded beside a thread spinning in Python, as a service
# is at saturation: its stages stretch past ``min_stage_ms``, blocked, and the four per-stage CPU rules run.
RECORDINGS = {
    ("stagetrace-contrib", False): "contrib path (a server span and 6 stages)",
    ("stagetrace", False): "FastAPI's own telemetry (and its operation spans)",
    ("stagetrace-contrib", True): "contrib path, beside a thread spinning in Python (the CPU rules run)",
}
MODES = ("verdict", "exported")
FRAME = 20  # messages a frame, about what the helper thread ships at once under load


def record(variant: str, requests: int, path: str, contended: bool = False) -> None:
    """The messages the exporter receives for ``requests`` requests to the e2e endpoint, pickled to ``path``;
    ``contended``: with a thread spinning in Python meanwhile."""
    os.environ.update(STAGETRACE_EXPORT_PROCESS="off", OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none")
    import e2e
    from fastapi.testclient import TestClient

    from stagetrace import configuration
    from stagetrace.exporter.core import ExporterCore

    received: list[Any] = []
    handle = ExporterCore.handle

    def recording(self: ExporterCore, msg: Any) -> None:
        received.append(msg)
        handle(self, msg)

    ExporterCore.handle = recording  # type: ignore[method-assign]
    app = e2e.make_app(variant, "gil-free")
    spinning = threading.Event()
    if contended:
        spinning.set()
        threading.Thread(target=spin, args=(spinning,), daemon=True).start()
    with TestClient(app) as client:
        for _ in range(requests):
            client.get("/predict")
    spinning.clear()
    current = configuration._current_handle
    if current is not None:
        current.shutdown()
    with open(path, "wb") as f:
        pickle.dump(received, f)


def spin(spinning: threading.Event) -> None:
    while spinning.is_set():
        pass


def replay(path: str, mode: str, passes: int, rounds: int = 1) -> list[float]:
    """CPU seconds a trace, per round, of ``passes`` passes over the recorded messages."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.resources import Resource

    from stagetrace.common import wire
    from stagetrace.exporter.aggregation import AggregatedMetrics
    from stagetrace.exporter.core import ExporterCore
    from stagetrace.exporter.otlp_encoding import TraceRequestEncoder
    from stagetrace.exporter.outputs import LocalOutputs
    from stagetrace.exporter.signals import LagSeries
    from stagetrace.settings import Settings

    with open(path, "rb") as f:
        messages = pickle.load(f)
    if mode == "verdict":
        # Every rule runs; diagnosed traces are kept but for a budget that holds next to no tokens (a
        # signature's slowest trace of the minute still goes, once: the first pass keeps it, the difference
        # of two runs cancels it).
        starved = dict(export_budget_per_s=1e-9, export_budget_burst=1.0)
        starved.update(signature_budget_per_s=1e-9, signature_budget_burst=1.0)
        settings = Settings(healthy_sample=0.0, slow_threshold_ms=1e9, **starved)
    else:
        settings = Settings(healthy_sample=1.0, export_budget_per_s=None, slow_threshold_ms=1e9)
    resource = Resource.create({"service.name": "bench"})
    metrics = AggregatedMetrics(resource, settings.max_stage_names)
    reader = InMemoryMetricReader()
    MeterProvider(metric_readers=[reader], resource=resource, shutdown_on_exit=False)
    metrics.attach_readers([reader])
    encoder = TraceRequestEncoder(resource.attributes)

    class EncodingSink:
        spans = kept_traces = 0

        def export(self, spans: Any) -> None:
            self.spans += len(spans)
            self.kept_traces += 1  # the exporter core hands over one kept trace a call
            encoder.encode(spans)

        def flush(self, timeout_s: float) -> bool:
            return True

    class Complaints(logging.Handler):
        count = 0

        def emit(self, record: logging.LogRecord) -> None:
            self.count += 1

    complaints = Complaints(logging.WARNING)  # a contained error or a skipped record: the count would lie
    logging.getLogger("stagetrace").addHandler(complaints)
    sink = EncodingSink()
    core = ExporterCore(settings, LocalOutputs(spans=sink, metrics=metrics))
    frames = [marshal.dumps(messages[i : i + FRAME]) for i in range(0, len(messages), FRAME)]
    traces = sum(1 for m in messages if m[0] == wire.TRACE)

    def run(n: int) -> None:
        for _ in range(n):
            # Each pass replays the same sampler readings: into fresh series, as a live exporter takes new ones
            # (older than the last kept, they would be skipped as out of order).
            core.series.update((name, LagSeries()) for name in core.series)
            for frame in frames:
                for msg in marshal.loads(frame):
                    core.handle_or_count(msg)

    out = []
    for _ in range(rounds):
        t0 = time.process_time()
        run(passes)
        out.append((time.process_time() - t0) / (passes * traces))
    if complaints.count:
        raise SystemExit(f"the exporter's core complained {complaints.count} times (its messages above)")
    if mode == "exported" and sink.spans == 0:
        raise SystemExit("exported mode exported nothing")
    if mode == "verdict" and sink.kept_traces > 0.05 * traces * passes * rounds:
        raise SystemExit(f"verdict mode kept {sink.kept_traces} of {traces * passes * rounds} traces")
    return out


# How the replay imports the exporter's modules: the sources, or compiled as the exporter process runs them
# (``stagetrace._compiled``; where they were built at install).
BUILDS = {
    "sources": {"STAGETRACE_PURE_PYTHON": "1"},
    "compiled": {"_STAGETRACE_EXPORTER_PROCESS": "1"},
    "mypyc": {"_STAGETRACE_EXPORTER_PROCESS": "1"},  # with --mypyc, the copy first on PYTHONPATH (below)
}


# With --mypyc: a third build, the same modules compiled by mypyc instead of Cython, in a copy of the sources
# whose src directory goes first on PYTHONPATH (the choice between the two, measured on one recording).
MYPYC_SRC_VARIABLE = "_EXPORTER_COST_MYPYC_SRC"


def replay_env(build: str, against: str | None = None) -> dict[str, str]:
    """The replay's environment for ``build``; ``against``: another tree's src directory, first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("STAGETRACE_PURE_PYTHON", "_STAGETRACE_EXPORTER_PROCESS")}
    first = os.environ[MYPYC_SRC_VARIABLE] if build == "mypyc" else against
    if first:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (first, env.get("PYTHONPATH"))))
    return {**env, **BUILDS[build], "PYTHONHASHSEED": "0"}


def build_with_mypyc(scratch: str) -> tuple[str, list[str]]:
    """A copy of ``src/stagetrace`` in ``scratch`` with the modules of ``stagetrace._compiled`` compiled by mypyc
    (its default optimisation, annotations as native types); returns the copy's src directory and the modules
    mypyc could not compile, left as sources in the copy (mypyc refuses some constructs Cython takes, such as
    a class that subclasses ``list``: each refusal names its module, which the next attempt leaves out)."""
    from stagetrace._compiled import COMPILED_MODULES

    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src")
    copy = os.path.join(scratch, "src")
    shutil.copytree(
        os.path.join(src, "stagetrace"),
        os.path.join(copy, "stagetrace"),
        ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"),
    )
    paths = [name.replace(".", "/") + ".py" for name in COMPILED_MODULES]
    script = (
        "import sys\nfrom setuptools import setup\nfrom mypyc.build import mypycify\n"
        "setup(name='stagetrace_mypyc', script_args=['build_ext', '--inplace'],"
        " ext_modules=mypycify(['--ignore-missing-imports', *sys.argv[1:]], group_name='stagetrace_exporter'))\n"
    )
    left_out: list[str] = []
    while paths:
        built = subprocess.run([sys.executable, "-c", script, *paths], cwd=copy, capture_output=True, text=True)
        if not built.returncode:
            return copy, left_out
        refused = {line.split(":", 1)[0] for line in built.stdout.splitlines() if ": error:" in line}
        if not refused & set(paths):
            sys.stderr.write(built.stdout[-6000:] + built.stderr[-6000:])
            raise SystemExit("mypyc could not build the exporter's modules (its messages above)")
        left_out += sorted(refused & set(paths))
        paths = [path for path in paths if path not in refused]
    raise SystemExit("mypyc compiled none of the exporter's modules")


def count_instructions(path: str, mode: str, passes: int, build: str = "sources", against: str | None = None) -> int:
    with tempfile.TemporaryDirectory() as directory:
        out = os.path.join(directory, "cg.out")
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", f"--log-file={directory}/vg"]
        command += [sys.executable, os.path.abspath(__file__), "--replay", path, mode, str(passes)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=replay_env(build, against))
        with open(out) as f:
            return next(int(line.split()[1]) for line in f if line.startswith("summary:"))


def cpu_seconds(path: str, mode: str, passes: int, rounds: int, build: str, against: str | None = None) -> float:
    """The median CPU seconds a trace of ``rounds`` replays, in a process importing ``build``."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--replay", path, mode, str(passes), str(rounds)],
        check=True,
        capture_output=True,
        text=True,
        env=replay_env(build, against),
    )
    return statistics.median(float(v) for v in out.stdout.split())


def tree_is_compiled(src: str) -> bool:
    """Whether the tree at ``src`` has every exporter module built beside its source (asked in a process that
    imports it)."""
    script = (
        "from stagetrace._compiled import COMPILED_MODULES, compiled_available;"
        "print(len(compiled_available()) == len(COMPILED_MODULES))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=replay_env("sources", src), capture_output=True, text=True, check=True
    )
    return out.stdout.strip() == "True"


def measure(path: str, traces: int, runs: list[tuple[str | None, str]], args: argparse.Namespace) -> dict:
    """Each (tree, build)'s figure a trace in each mode: instructions (valgrind runs at once, one a CPU: a count
    does not move with the others beside it), or CPU time (one at a time)."""
    jobs = [(tree, mode, build) for tree, build in runs for mode in MODES]
    if not args.instructions:
        return {job: cpu_seconds(path, job[1], args.passes, args.rounds, job[2], job[0]) * 1e6 for job in jobs}
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        counts = {
            (job, passes): pool.submit(count_instructions, path, job[1], passes, job[2], job[0])
            for job in jobs
            for passes in (args.reps, 2 * args.reps)
        }
        return {
            job: (counts[job, 2 * args.reps].result() - counts[job, args.reps].result()) / (args.reps * traces)
            for job in jobs
        }


def table_header(builds: tuple[str, ...], names: dict[str, str], kept: str) -> str:
    headers = []
    for mode in MODES:
        headers += [f"{mode} ({names[build]})" for build in builds]
        headers += [f"{names[build]} / sources" for build in builds[1:]]
    return f"| variant | {' | '.join(headers)} | exported over verdict ({names[kept]}) |\n|---|" + "---:|" * (
        len(headers) + 1
    )


def table_row(label: str, figures: dict, builds: tuple[str, ...], kept: str, fmt: Any) -> str:
    cells = []
    for mode in MODES:
        cells += [fmt(figures[mode, build]) for build in builds]
        cells += [f"{figures[mode, build] / figures[mode, 'sources']:.2f}" for build in builds[1:]]
    extra = figures["exported", kept] - figures["verdict", kept]
    return f"| {label} | {' | '.join(cells)} | {fmt(extra)} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300, help="requests recorded a variant")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--passes", type=int, default=10, help="passes over the recorded traces a round")
    ap.add_argument("--instructions", action="store_true", help="count instructions under valgrind instead")
    ap.add_argument("--reps", type=int, default=2, help="with --instructions: passes of the smaller run")
    ap.add_argument("--mypyc", action="store_true", help="also the modules compiled by mypyc (in a copy)")
    ap.add_argument("--against", default=None, help="another tree's src/ (its modules built), same recordings")
    ap.add_argument("--record", nargs=4, metavar=("VARIANT", "REQUESTS", "PATH", "CONTENDED"), help=argparse.SUPPRESS)
    ap.add_argument("--replay", nargs="+", metavar="PATH MODE PASSES [ROUNDS]", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.record:
        record(args.record[0], int(args.record[1]), args.record[2], args.record[3] == "contended")
        return 0
    if args.replay:
        rounds = int(args.replay[3]) if len(args.replay) > 3 else 1
        print(" ".join(str(v) for v in replay(args.replay[0], args.replay[1], int(args.replay[2]), rounds)))
        return 0
    if args.instructions and shutil.which("valgrind") is None:
        print("--instructions needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH"))))
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    from stagetrace._compiled import COMPILED_MODULES, compiled_available

    builds: tuple[str, ...] = ("sources", "compiled") if compiled_available() else ("sources",)
    scratch = tempfile.TemporaryDirectory(prefix="exporter-cost-mypyc-")  # the mypyc copy, if any: gone at exit
    if args.mypyc:
        os.environ[MYPYC_SRC_VARIABLE], refused = build_with_mypyc(scratch.name)
        builds += ("mypyc",)
        print(f"mypyc compiled {len(COMPILED_MODULES) - len(refused)} of {len(COMPILED_MODULES)} modules", end="")
        print(f"; left as sources: {', '.join(refused)}" if refused else "")
    against = os.path.abspath(args.against) if args.against else None
    other_builds: tuple[str, ...] = ()
    if against is not None:
        other_builds = ("sources", "compiled") if tree_is_compiled(against) else ("sources",)
    other_kept = "compiled" if "compiled" in other_builds else "sources"
    unit = "instructions" if args.instructions else "us of CPU"
    print(f"the exporter's work a trace, {unit} (python {sys.version.split()[0]}), {' and '.join(builds)}")
    names = {"sources": "sources", "compiled": "Cython", "mypyc": "mypyc"}
    kept = "compiled" if "compiled" in builds else "sources"  # the build installs run
    print(table_header(builds, names, kept))
    fmt = (lambda v: f"{v / 1e3:.0f} k") if args.instructions else (lambda v: f"{v:.1f}")
    other_rows, ratio_rows = [], []
    with tempfile.TemporaryDirectory() as directory:
        for (variant, contended), label in RECORDINGS.items():
            how = "contended" if contended else "calm"
            path = os.path.join(directory, f"{variant}-{how}.pkl")
            recording = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--record", variant, str(args.requests), path, how],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,  # the contended one's slow traces are logged there: shown only on failure
                text=True,
            )
            if recording.returncode:
                sys.stderr.write(recording.stderr)
                raise SystemExit(f"recording {variant} ({how}) failed")
            with open(path, "rb") as f:
                traces = sum(1 for m in pickle.load(f) if m[0] == "T")
            runs = [(None, build) for build in builds] + [(against, build) for build in other_builds]
            figures = measure(path, traces, runs, args)
            print(table_row(label, {(m, b): v for (t, m, b), v in figures.items() if t is None}, builds, kept, fmt))
            if against is not None:
                theirs = {(m, b): v for (t, m, b), v in figures.items() if t == against}
                other_rows.append(table_row(label, theirs, other_builds, other_kept, fmt))
                ratios = [
                    f"{figures[None, mode, build] / theirs[mode, build]:.2f}"
                    for mode in MODES
                    for build in other_builds
                    if build in builds
                ]
                ratio_rows.append(f"| {label} | {' | '.join(ratios)} |")
    if against is not None:
        print(f"\nthe same recordings replayed into {against} ({' and '.join(other_builds)})")
        print(table_header(other_builds, names, other_kept))
        print("\n".join(other_rows))
        print(f"\nthis tree / {against}, the same recordings")
        shared = [build for build in other_builds if build in builds]
        print(f"| variant | {' | '.join(f'{mode} ({names[build]})' for mode in MODES for build in shared)} |")
        print("|---|" + "---:|" * (len(MODES) * len(shared)))
        print("\n".join(ratio_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
