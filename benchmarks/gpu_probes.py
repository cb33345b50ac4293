"""Probes for the GPU session (benchmarks/gpu_session.sh runs them), each printing a table of rows that pass
only on a measurement, each with a control that shows the measurement can see what it looks for.

    python benchmarks/gpu_probes.py env [--json FILE] [--dry-run]       # the device, and stagetrace's requirements met
    python benchmarks/gpu_probes.py anchors [--json FILE] [--dry-run]   # clock anchors beside busy Python threads
    python benchmarks/gpu_probes.py capture [--json FILE] [--dry-run]   # graph captures beside GPU work
    python benchmarks/gpu_probes.py dtype [--json FILE] [--dry-run]     # automatic copy stages change nothing

env: the device, torch and driver; the session's prerequisites (pytest, torch, pynvml, OpenTelemetry, each
    carried wheel installed), each missing one with what to do; every requirement of stagetrace's
    (pyproject.toml), and of theirs, met by what is installed (the carried wheels where the image lacks a
    package); the image's own packages kept (none imported from /tmp/site, where the session installs the
    wheels). Control: a requirement that cannot be met is reported unmet.
anchors: calibrations of a timer of its own, with 0 and 2 pure-Python CPU-bound threads beside it: how many
    anchors are kept and their error bars, and whether their records were made with the GIL held. Control:
    beside the busy threads, a 100 us GIL-free sleep comes back only after a switch interval (the threads
    really hold the GIL); torch's own ``Event.record`` there is timed for the record.
capture: global-mode CUDA-graph captures on one thread while a worker runs requests on another, three times
    with the same workload: plain, with stagetrace's GPU stages, and (the control) with the worker querying
    an event in global mode, which must break captures. Each capture stays open until the worker has run a
    whole request (at most a second), so every capture overlaps its work. The worker allocates nothing
    after its buffers (``torch.cuda.graph`` empties the allocator's cache, and a cudaMalloc would break a
    capture itself), works on a stream of its own, makes its own synchronisation in relaxed capture mode,
    counts its iterations and keeps going after an error, counting it. stagetrace may not break more
    captures than the plain run, nor add worker errors.
dtype: the automatic copy stages leave the results of ``Tensor.to`` / ``Module.to`` unchanged.

``--dry-run`` runs a probe on CPU against tests/fakes.py (anchors, capture) or torch's CPU device (dtype).
Each exits 0 when every row passes, 1 when one fails, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import Row, format_table

# --- env ----------------------------------------------------------------------------------------------------

IMAGE_MODULES = ("wrapt", "typing_extensions", "zipp", "google.protobuf", "grpc", "requests", "packaging")


def unmet_requirements(
    roots: list[str], installed: Callable[[str], str | None], requires: Callable[[str], list[str]]
) -> list[str]:
    """The requirements reachable from ``roots`` (PEP 508 strings) that what is installed does not meet:
    a missing distribution, or a version outside the specifier. Extras are not followed; markers are
    evaluated for this interpreter."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    unmet, seen, todo = [], set(), list(roots)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        version = installed(name)
        if version is None or (req.specifier and not req.specifier.contains(version, prereleases=True)):
            unmet.append(f"{req} (installed: {version})")
            continue
        if name not in seen:
            seen.add(name)
            todo.extend(requires(name))
    return sorted(set(unmet))


# What the session's steps import, and what to do when one is missing: the device image has torch, pytest
# and nvidia-ml-py; OpenTelemetry comes in the wheels carried from here.
PREREQUISITES = (
    ("pytest", "the cuda-tests step runs pytest: pip install pytest"),
    ("torch", "every GPU step: pip install torch"),
    ("pynvml", "NVML sampling: pip install nvidia-ml-py"),
    ("opentelemetry.sdk", "stagetrace itself: run scripts/gpu_wheels.sh here and carry .whl"),
)


def missing_prerequisites(
    importable: Callable[[str], bool], wheels: list[str], installed: Callable[[str], str | None]
) -> list[str]:
    """What the session needs and this Python lacks, each with what to do: a module of ``PREREQUISITES``
    that cannot be imported, or a carried wheel (a path under .whl/) whose distribution is not installed
    (the install step failed or was skipped)."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    missing = [f"{module} ({why})" for module, why in PREREQUISITES if not importable(module)]
    for path in wheels:
        name = canonicalize_name(parse_wheel_filename(Path(path).name)[0])
        if installed(name) is None:
            missing.append(f"{name} (carried in {Path(path).name}, not installed: see the install step)")
    return missing


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def probe_env(device: Any, site: str = "/tmp/site") -> tuple[list[Row], dict[str, Any]]:
    import importlib
    import importlib.metadata as md

    import tomllib  # Python 3.11+: the GPU machine's is 3.12

    def installed(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    def requires(name: str) -> list[str]:
        return list(md.requires(name) or ())

    repo = Path(__file__).resolve().parent.parent
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    project = pyproject["project"]
    roots = [*project["dependencies"], *project["optional-dependencies"]["gpu"]]
    unmet = unmet_requirements(roots, installed, requires)
    missing = missing_prerequisites(_importable, sorted(map(str, repo.glob(".whl/*.whl"))), installed)
    control = unmet_requirements(["opentelemetry-api>=999"], installed, requires)
    shadowed = []
    for module in IMAGE_MODULES:
        try:
            where = str(getattr(importlib.import_module(module), "__file__", "") or "")
        except ImportError:
            continue
        if where.startswith(site):
            shadowed.append(module)
    info = device.describe()
    rows = [
        Row("(env) device / torch / CUDA", f"{info['name']} / {info['torch']} / {info['cuda']}", "a CUDA device",
            bool(info["available"])),
        Row("(env) the session's prerequisites missing", "; ".join(missing)[:300] or "none", "none", not missing),
        Row("(env) stagetrace's requirements, and theirs, unmet", "; ".join(unmet)[:120] or "none", "none", not unmet),
        Row("(env) control: opentelemetry-api>=999 reported unmet", str(bool(control)), "True", bool(control)),
        Row(f"(env) image packages imported from {site}", ", ".join(shadowed) or "none", "none", not shadowed),
    ]  # fmt: skip
    versions = {r: installed(r) for r in ("opentelemetry-sdk", "nvidia-ml-py", "torch", "wrapt", "typing-extensions",
                                          "protobuf")}  # fmt: skip
    return rows, {"missing": missing, "unmet": unmet, "shadowed": shadowed, "versions": versions, "device": info}


# --- anchors ------------------------------------------------------------------------------------------------


class AnchorRun(NamedTuple):
    busy_threads: int
    calibrations: int
    kept: int
    errors_us: list[float]

    def row(self, min_share: float) -> Row:
        errs = sorted(self.errors_us)
        p50 = statistics.median(errs) if errs else None
        shown = f"{p50:.1f} / {errs[-1]:.1f}" if errs else "- / -"
        return Row(
            f"(anchors) {self.busy_threads} busy threads: kept / calibrations; error bar p50 / max (us)",
            f"{self.kept} / {self.calibrations}; {shown}",
            f">= {min_share:.0%}; p50 <= 25",
            self.kept >= min_share * self.calibrations and p50 is not None and p50 <= 25,
        )


@contextmanager
def busy_threads(n: int) -> Iterator[None]:
    """``n`` pure-Python CPU-bound threads (a tokenizer, JSON): each gives the GIL up only when asked to."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    threads = [threading.Thread(target=spin, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join()


def probe_anchors(device: Any, calibrations: int = 100) -> tuple[list[Row], dict[str, Any]]:
    from stagetrace.gpu.events import CaptureGuard, CudaEventTimer, EventPool

    backend = device.backend()
    timer = CudaEventTimer(backend, EventPool(backend), CaptureGuard())
    runs = []
    for busy in (0, 2):
        with busy_threads(busy), backend.on_device(0):
            errors, rejected0 = [], timer.anchors_rejected
            for _ in range(calibrations):
                before = timer.anchors(0)
                timer._calibrate(0)
                after = timer.anchors(0)
                if after and (not before or after[-1] is not before[-1]):
                    errors.append(after[-1].error_ns / 1000)
            runs.append(AnchorRun(busy, calibrations, calibrations - (timer.anchors_rejected - rejected0), errors))
    with busy_threads(2):
        sleeps = _timed(lambda: time.sleep(100e-6), 20)
        records = _timed(device.torch_record(), 20)
    rows = [runs[0].row(0.9), runs[1].row(0.5)]
    rows.append(
        Row(
            "(anchors) anchor records with the GIL held / through torch",
            f"{timer.records_holding_gil} / {timer.records_through_torch}",
            "> 0 / 0",
            timer.records_holding_gil > 0 and timer.records_through_torch == 0,
        )
    )
    sleep_ms = statistics.median(sleeps) / 1e6
    rows.append(
        Row(
            "(anchors) control: beside 2 busy threads, a 100 us GIL-free sleep takes (ms, p50)",
            f"{sleep_ms:.2f}",
            ">= 1 (a switch interval)",
            sleep_ms >= 1,
        )
    )
    figures = {
        "runs": [r._asdict() for r in runs],
        "gil_free_sleep_ms_p50": sleep_ms,
        "torch_record_us_p50_beside_busy_threads": statistics.median(records) / 1e3,
    }
    return rows, figures


def _memory() -> Any:
    """Spans kept in memory: a probe writes no trace file."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    return InMemorySpanExporter()


def _timed(fn: Callable[[], Any], n: int) -> list[int]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


# --- capture ------------------------------------------------------------------------------------------------


class CapturePhase(NamedTuple):
    name: str
    captures: int
    failures: int
    first_failure: str
    worker_iterations: int
    worker_errors: int
    first_worker_error: str
    traces: int  # requests stagetrace delivered a verdict for (its helper read their events meanwhile)


def capture_phase(device: Any, name: str, *, stagetrace_on: bool, unsafe_worker: bool, captures: int) -> CapturePhase:
    """``captures`` global-mode captures on this thread while a worker thread runs requests."""
    import stagetrace

    handle = None
    verdicts: list[Any] = []
    if stagetrace_on:
        handle = stagetrace.configure(
            "capture-probe", span_exporter=_memory(), set_global=False, gpu=device.gpu_flag, on_verdict=verdicts.append
        )
        device.attach(handle)
    worker = device.capture_worker(stagetrace_on=stagetrace_on, unsafe=unsafe_worker)
    stop = threading.Event()
    iterations, errors = [0], []

    def run() -> None:
        while not stop.is_set():
            try:
                worker()
                iterations[0] += 1
            except Exception as e:  # what the probe looks for: counted, and the worker goes on
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")

    t = threading.Thread(target=run, name="capture-probe-worker", daemon=True)
    t.start()

    def during() -> None:
        """Inside each capture: until the worker has run a whole request (at most a second), so that
        every capture overlaps the worker's work, on any host."""
        until, deadline = iterations[0] + 2, time.monotonic() + 1.0
        while iterations[0] < until and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.0005)

    failures = []
    try:
        while iterations[0] < 3 and t.is_alive():
            time.sleep(0.001)  # the worker is under way before the first capture
        for i in range(captures):
            try:
                device.capture_once(during)
            except Exception as e:
                failures.append(f"capture {i}: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            time.sleep(0.002)
    finally:
        stop.set()
        t.join(30)
        device.synchronize()
        if handle is not None:
            handle.force_flush(30)
            handle.shutdown()
    return CapturePhase(
        name,
        captures,
        len(failures),
        failures[0] if failures else "",
        iterations[0],
        len(errors),
        errors[0] if errors else "",
        len(verdicts),
    )


def probe_capture(device: Any, captures: int = 30) -> tuple[list[Row], dict[str, Any]]:
    device.prepare_capture()
    plain = capture_phase(device, "plain", stagetrace_on=False, unsafe_worker=False, captures=captures)
    ours = capture_phase(device, "stagetrace", stagetrace_on=True, unsafe_worker=False, captures=captures)
    control = capture_phase(device, "control", stagetrace_on=False, unsafe_worker=True, captures=captures)

    def ran(p: CapturePhase) -> bool:
        return p.worker_iterations >= p.captures and p.worker_iterations > p.worker_errors

    rows = [
        Row(
            "(capture) plain: failed / captures; worker iterations, errors",
            f"{plain.failures} / {plain.captures}; {plain.worker_iterations}, {plain.worker_errors}",
            "- ; >= captures",
            ran(plain),
        ),
        Row(
            "(capture) stagetrace: failed / captures; worker iterations, errors; traces read",
            f"{ours.failures} / {ours.captures}; {ours.worker_iterations}, {ours.worker_errors}; {ours.traces}",
            f"<= {plain.failures}; >= captures, <= {plain.worker_errors}; > 0",
            ran(ours)
            and ours.failures <= plain.failures
            and ours.worker_errors <= plain.worker_errors
            and ours.traces > 0,
        ),
        Row(
            "(capture) control: a worker querying an event in global mode: failed / captures",
            f"{control.failures} / {control.captures}; worker iterations {control.worker_iterations}",
            ">= 1",
            control.failures >= 1 and control.worker_iterations > 0,
        ),
    ]
    return rows, {"phases": [p._asdict() for p in (plain, ours, control)]}


# --- dtype --------------------------------------------------------------------------------------------------


def probe_dtype(device: Any) -> tuple[list[Row], dict[str, Any]]:
    import torch

    import stagetrace
    from stagetrace.integrations import auto_stages

    target = device.dtype_target
    cases = [
        ("t.to(dev, torch.float16)", lambda t: t.to(target, torch.float16)),
        ("t.to(dev, non_blocking=True)", lambda t: t.to(target, non_blocking=True)),
        ("t.to(torch.device(dev), torch.bfloat16, True)", lambda t: t.to(torch.device(target), torch.bfloat16, True)),
        ("t.to(dev, memory_format=channels_last)", lambda t: t.to(target, memory_format=torch.channels_last)),
        ("t.to(dev, copy=True)", lambda t: t.to(target, copy=True)),
    ]
    src = torch.randn(2, 3, 8, 8)
    if target != "cpu":
        src = src.pin_memory()

    def describe(out: Any) -> tuple[Any, ...]:
        return (out.dtype, out.device.type, out.is_contiguous(memory_format=torch.channels_last), tuple(out.shape))

    expected = {name: describe(fn(src)) for name, fn in cases}
    m_expected = torch.nn.Linear(4, 4).to(target, torch.float16).weight.dtype
    handle = stagetrace.configure("dtype-probe", span_exporter=_memory(), set_global=False, gpu=device.gpu_flag)
    auto_stages.instrument()
    bad = []
    try:
        with stagetrace.pipeline("dtype"):
            for name, fn in cases:
                got = describe(fn(src))
                if got != expected[name]:
                    bad.append(f"{name}: {got} != {expected[name]}")
            m_got = torch.nn.Linear(4, 4).to(target, torch.float16).weight.dtype
            if m_got != m_expected:
                bad.append(f"Module.to(dev, float16): {m_got} != {m_expected}")
    finally:
        auto_stages.uninstrument()
        handle.shutdown()
    rows = [
        Row(
            f"(dtype) Tensor.to / Module.to results, automatic stages on ({target})",
            f"{len(cases) + 1} call shapes, {len(bad)} differ",
            "0 differ",
            not bad,
        )
    ]
    return rows, {"differ": bad}


# --- the device: CUDA, or the fakes ---------------------------------------------------------------------------


class CudaDevice:
    gpu_flag = True
    dtype_target = "cuda"

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        torch.zeros(1, device="cuda")  # the application initialises CUDA, as stagetrace waits for it to

    def describe(self) -> dict[str, Any]:
        t = self.torch
        return {"available": True, "name": t.cuda.get_device_name(0), "torch": t.__version__, "cuda": t.version.cuda}

    def backend(self) -> Any:
        from stagetrace.gpu.backend import TorchCudaBackend

        return TorchCudaBackend(self.torch)

    def attach(self, handle: Any) -> None:
        pass  # configure(gpu=True) attached GPU support

    def torch_record(self) -> Callable[[], None]:
        event, stream = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Stream()
        return lambda: event.record(stream)

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def prepare_capture(self) -> None:
        torch = self.torch
        self.model = torch.nn.Linear(1024, 1024).cuda()
        self.static_in = torch.randn(64, 1024, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.model(self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def capture_once(self, during: Callable[[], None]) -> None:
        torch = self.torch
        g = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(g, capture_error_mode="global"):
            self.model(self.static_in)
            during()
        g.replay()

    def capture_worker(self, *, stagetrace_on: bool, unsafe: bool) -> Callable[[], None]:
        """One request a call, on a stream of its own: H2D into a buffer, a matmul into a buffer, D2H into
        pinned memory, then a wait for it in relaxed capture mode; nothing is allocated after the buffers.
        ``unsafe``: also an event query in global mode (the control)."""
        import stagetrace
        from stagetrace.gpu.backend import CAPTURE_MODE_RELAXED, exchange_capture_mode

        torch = self.torch
        host_in = torch.randn(256, 1024).pin_memory()
        host_out = torch.empty(256, 1024).pin_memory()
        dev_in = torch.empty(256, 1024, device="cuda")
        dev_out = torch.empty(256, 1024, device="cuda")
        weight = torch.randn(1024, 1024, device="cuda")
        stream = torch.cuda.Stream()
        done = torch.cuda.Event()
        stage = stagetrace.gpu_stage if stagetrace_on else _no_stage
        pipeline = stagetrace.pipeline if stagetrace_on else _no_stage

        def request() -> None:
            with torch.cuda.stream(stream), pipeline("request"):
                with stage("h2d"):
                    dev_in.copy_(host_in, non_blocking=True)
                with stage("infer"):
                    torch.matmul(dev_in, weight, out=dev_out)
                with stage("d2h"):
                    host_out.copy_(dev_out, non_blocking=True)
            done.record(stream)
            if unsafe:
                done.query()
            previous = exchange_capture_mode(CAPTURE_MODE_RELAXED)
            try:
                done.synchronize()
            finally:
                if previous is not None:
                    exchange_capture_mode(previous)

        return request


@contextmanager
def _no_stage(name: str) -> Iterator[None]:
    yield


class _NoDevice:
    """What ``env`` reports where torch sees no CUDA device, or where the device could not be set up at all
    (torch or the fakes' imports missing): the prerequisites row then says what to install."""

    def __init__(self, torch_version: str | None, why: str = "no CUDA device") -> None:
        self.torch_version = torch_version
        self.why = why

    def describe(self) -> dict[str, Any]:
        return {"available": False, "name": self.why, "torch": self.torch_version, "cuda": None}


class FakeDevice:
    """The same surface over tests/fakes.py."""

    gpu_flag = False
    dtype_target = "cpu"

    def __init__(self) -> None:
        import fakes

        self.fakes = fakes
        self.gpu = fakes.FakeGpu()
        self._backend = fakes.FakeCudaBackend(self.gpu)

    def describe(self) -> dict[str, Any]:
        return {"available": True, "name": "FakeGpu (dry run)", "torch": None, "cuda": None}

    def backend(self) -> Any:
        return self._backend

    def attach(self, handle: Any) -> None:
        from stagetrace.gpu import attach_gpu

        attach_gpu(handle.runtime, backend=self._backend, nvml_enabled=False)

    def torch_record(self) -> Callable[[], None]:
        event, stream = self.fakes.FakeEvent(self.gpu, enable_timing=True), self.fakes.FakeStream(self.gpu)
        return lambda: event.record(stream)

    def synchronize(self) -> None:
        self.gpu.default_stream.wait_host()

    def prepare_capture(self) -> None:
        pass

    def capture_once(self, during: Callable[[], None]) -> None:
        g = self._backend.graph_class()()
        g.capture_begin()
        try:
            self.gpu.current_stream().enqueue(0.2)
            during()
        finally:
            g.capture_end()

    def capture_worker(self, *, stagetrace_on: bool, unsafe: bool) -> Callable[[], None]:
        import stagetrace
        from stagetrace.gpu.backend import CAPTURE_MODE_RELAXED

        fakes, gpu = self.fakes, self.gpu
        stream, done = fakes.FakeStream(gpu), fakes.FakeEvent(gpu)
        stage = stagetrace.gpu_stage if stagetrace_on else _no_stage
        pipeline = stagetrace.pipeline if stagetrace_on else _no_stage

        def request() -> None:
            with gpu.stream(stream), pipeline("request"):
                with stage("h2d"):
                    stream.enqueue(0.1, "Memcpy HtoD (Pinned -> Device)")
                with stage("infer"):
                    stream.enqueue(0.3)
                with stage("d2h"):
                    stream.enqueue(0.1, "Memcpy DtoH (Device -> Pinned)")
            done.record(stream)
            if unsafe:
                done.query()
            previous = gpu.exchange_capture_mode(CAPTURE_MODE_RELAXED)
            try:
                done.synchronize()
            finally:
                gpu.exchange_capture_mode(previous)

        return request


# --- main ---------------------------------------------------------------------------------------------------

PROBES: dict[str, Callable[[Any], tuple[list[Row], dict[str, Any]]]] = {
    "env": probe_env,
    "anchors": probe_anchors,
    "capture": probe_capture,
    "dtype": probe_dtype,
}


def _device(*, dry_run: bool) -> Any:
    if dry_run:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        return FakeDevice()
    import torch

    return CudaDevice(torch) if torch.cuda.is_available() else _NoDevice(torch.__version__)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("probe", choices=sorted(PROBES))
    ap.add_argument("--json", help="write the rows and figures here")
    ap.add_argument("--dry-run", action="store_true", help="on CPU, against tests/fakes.py")
    args = ap.parse_args(argv)
    try:
        device = _device(dry_run=args.dry_run)
    except ImportError as e:  # env still says what is missing; every other probe needs the device
        if args.probe != "env":
            raise
        device = _NoDevice(None, f"no device: {e}")
    if isinstance(device, _NoDevice):
        print(f"gpu_probes {args.probe}: {device.why} (run this on a GPU machine, or --dry-run)")
        if args.probe != "env":
            return 2
    rows, figures = PROBES[args.probe](device)
    print(format_table(rows, f"stagetrace GPU probe: {args.probe}{' (dry run)' if args.dry_run else ''}"))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": [r._asdict() for r in rows], "figures": figures}, indent=1))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
