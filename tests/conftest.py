from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import stagetrace
from scenarios.collect import Collector, wait_for_verdicts
from stagetrace.analysis import DiagnosisThresholds, Verdict

# The load harness and the helpers tests and benchmarks share (free_port, ...) live in benchmarks/harness.py.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

# --- the suite writes only into temporary directories ---------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
# What running Python and pytest leaves in any checkout, and the set-up's own environment.
_TOOLING = (".venv/", "__pycache__/", ".pytest_cache/", ".egg-info/", ".ruff_cache/", ".mypy_cache/", "mutants/")

# No .hypothesis/ in the working tree: no example database, and hypothesis's other caches in a temporary
# directory (hypothesis reads the variable when it first writes).
settings.register_profile("stagetrace", database=None)
settings.load_profile("stagetrace")
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", tempfile.mkdtemp(prefix="stagetrace-hypothesis-"))


def _untracked_files() -> set[str] | None:
    """Files in the working tree that git does not track, ignored ones included (None outside a checkout)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--ignored", "--untracked-files=all"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    paths = {line[3:] for line in out.splitlines() if line[:2] in ("??", "!!")}
    # Sources and docs are a developer's new files, written while the suite ran, not the suite's output.
    return {p for p in paths if not any(part in p for part in _TOOLING) and not p.endswith((".py", ".md"))}


@pytest.fixture(scope="session", autouse=True)
def writes_stay_in_temporary_directories(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The embedded default's traces go to a temporary directory, for every process the suite starts
    (servers inherit the environment), and the suite fails if it left any new file in the working tree:
    a test's output there would mix with the demo's in ``stagetrace report stagetrace-out``."""
    before = _untracked_files()
    out_dir = tmp_path_factory.mktemp("stagetrace-out")
    previous = os.environ.get("STAGETRACE_OUTPUT_DIR")
    os.environ["STAGETRACE_OUTPUT_DIR"] = str(out_dir)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("STAGETRACE_OUTPUT_DIR", None)
        else:
            os.environ["STAGETRACE_OUTPUT_DIR"] = previous
    after = _untracked_files()
    if before is not None and after is not None and after - before:
        pytest.fail("the suite wrote into the working tree: " + ", ".join(sorted(after - before)[:10]), pytrace=False)


# --- scenarios that need a host with CPUs to spare -------------------------------------------------------

HOST_BUSY_SHARE = 0.25  # of the host's CPUs kept busy by other processes: the host is short of CPUs


def _host_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already in user
    return total - idle, total


def _own_jiffies() -> int:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def others_cpu_share(window_s: float = 0.25) -> float | None:
    """The share of the host's CPUs that other processes kept busy over ``window_s`` (this one sleeps
    meanwhile), None where /proc cannot tell."""
    try:
        busy0, total0, own0 = *_host_jiffies(), _own_jiffies()
        time.sleep(window_s)
        busy1, total1, own1 = *_host_jiffies(), _own_jiffies()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / (total1 - total0)


@pytest.fixture
def host_has_spare_cpus() -> bool:
    """Whether other processes leave this host's CPUs to the test (``spare_cpus`` without the skip), for a
    test whose other checks still hold on a busy host."""
    share = others_cpu_share()
    return share is None or share <= HOST_BUSY_SHARE


@pytest.fixture
def spare_cpus() -> None:
    """For scenarios whose requests must live one cause and whose healthy twins none: on a host that other
    processes keep short of CPUs, every request really lives CPU oversubscription too, and stagetrace
    rightly says so. Such a run cannot be the scenario it was written to be, so it is skipped, saying why
    (the suite beside a CPU hog: the rest of it still runs and must pass)."""
    share = others_cpu_share()
    if share is not None and share > HOST_BUSY_SHARE:
        pytest.skip(f"the host is short of CPUs: other processes kept {share:.0%} of them busy")


def rules_that_cannot_fire() -> DiagnosisThresholds:
    """Thresholds no trace can reach. For tests that need a healthy trace to stay undiagnosed on a loaded
    host (where any request can lose time to the scheduler and be rightly diagnosed);
    ``tests/analysis/test_rules.py`` checks that no rule fires with them."""
    return DiagnosisThresholds.silent()


class Harness:
    """A configured stagetrace with in-memory export, plus helpers to read what it produced."""

    def __init__(self, **kwargs: Any) -> None:
        self.exporter = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()
        self.verdicts: list[Verdict] = []
        kwargs.setdefault("on_verdict", self.verdicts.append)
        self.handle = stagetrace.configure(
            "test-service", span_exporter=self.exporter, metric_reader=self.reader, set_global=False, **kwargs
        )

    @property
    def tracer(self) -> Any:
        return self.handle.tracer_provider.get_tracer("test")

    def flush(self) -> None:
        assert self.handle.force_flush(10)

    def spans(self) -> list[Any]:
        self.flush()
        return list(self.exporter.get_finished_spans())

    def by_name(self, name: str) -> list[Any]:
        return [s for s in self.spans() if s.name == name]

    def roots(self) -> list[Any]:
        return [s for s in self.spans() if s.parent is None or s.parent.is_remote]

    def metric_points(self, name: str, *, flush: bool = True) -> list[Any]:
        """``flush=False``: read what the reader has now (when a flush cannot succeed, or would collect)."""
        if flush:
            self.flush()
        data = self.reader.get_metrics_data()
        points = []
        for rm in data.resource_metrics if data else ():
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == name:
                        points.extend(m.data.data_points)
        return points

    def wait_verdicts(self, n: int, timeout: float = 10.0) -> list[Verdict]:
        wait_for_verdicts(self.handle, self.verdicts, n, timeout)
        return self.verdicts


def in_compiled_exporter(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a process that imports the compiled modules, as an exporter allowed them does (the
    suite's own ``STAGETRACE_PURE_PYTHON`` left out), its output captured as text."""
    from stagetrace import _compiled

    env = {k: v for k, v in os.environ.items() if k != _compiled.PURE_PYTHON_VARIABLE}
    env[_compiled.EXPORTER_VARIABLE] = "1"
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, **kwargs)


def compiled_only(module: str) -> pytest.MarkDecorator:
    """Skips a test of ``module``'s compiled build where the install did not build it or the suite runs with
    ``STAGETRACE_PURE_PYTHON=1``."""
    from stagetrace import _compiled

    return pytest.mark.skipif(
        module not in _compiled.compiled_available() or _compiled.pure_python_forced(),
        reason="the exporter's modules are not compiled on this install, or STAGETRACE_PURE_PYTHON=1",
    )


def run_compiled(module: str, body: str) -> str:
    """``body`` run where ``module`` is imported (by its last name) from its compiled build, as an exporter allowed
    them imports it; its output. The test fails where the source was imported instead or ``body`` raised."""
    package, name = module.rsplit(".", 1)
    header = f"from {package} import {name}\nassert not {name}.__file__.endswith('.py'), {name}.__file__\n"
    run = in_compiled_exporter(["-c", header + body])
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


@pytest.fixture
def export_mode() -> str:
    """Where the exporter's work runs: "process" (the default) or "thread". Test modules that must hold in
    both modes override this fixture with a parametrized one (``both_modes`` below)."""
    return "process"


@pytest.fixture(autouse=True)
def stagetrace_env(monkeypatch: pytest.MonkeyPatch, export_mode: str) -> None:
    """Every test keeps all traces (``STAGETRACE_HEALTHY_SAMPLE=1`` and no export budget; the sampling and
    budget tests set their own) and runs the exporter where ``export_mode`` says."""
    monkeypatch.setenv("STAGETRACE_HEALTHY_SAMPLE", "1.0")
    monkeypatch.setenv("STAGETRACE_EXPORT_BUDGET", "off")
    monkeypatch.setenv("STAGETRACE_EXPORT_PROCESS", "on" if export_mode == "process" else "off")


@pytest.fixture(params=["process", pytest.param("thread", marks=pytest.mark.slow)], name="export_mode")
def both_modes(request: pytest.FixtureRequest) -> str:
    """Import into a test module as ``export_mode = both_modes`` to run its tests in both modes. The quick loop
    runs the default mode (the exporter process); the thread mode's run is in the full suite."""
    return request.param


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    h.handle.shutdown()


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    """For scenarios of the CPU-side rules: spans leave the server's process as a deployed service's do, through
    the exporter process to a file (``scenarios.collect``), so that no span is built on the server's GIL
    beside the scenario's cause; verdicts come back (``collector.verdicts``)."""
    made = Collector(tmp_path / "traces.jsonl")
    yield made
    made.shutdown()


@pytest.fixture
def make_harness() -> Iterator[Any]:
    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        h = Harness(**kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.handle.shutdown()


@pytest.fixture
def otlp_receiver() -> Iterator[Any]:
    from stagetrace.testing import OtlpReceiver

    r = OtlpReceiver().start()
    yield r
    r.stop()


class _InternalErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "stagetrace internal error" in message:
            self.records.append(message + ("\n" + self.format(record) if record.exc_info else ""))


@pytest.fixture(autouse=True)
def no_internal_errors(request: pytest.FixtureRequest) -> Iterator[None]:
    """A swallowed bug fails the test: stagetrace contains its own errors (the application never sees them)
    and logs them, from every thread and from the exporter process (whose log records come back to this
    process). Tests that cause one on purpose are marked ``internal_errors_expected``."""
    handler = _InternalErrors()
    handler.setFormatter(logging.Formatter())
    log = logging.getLogger("stagetrace")
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
    if handler.records and request.node.get_closest_marker("internal_errors_expected") is None:
        pytest.fail("stagetrace logged internal errors:\n" + "\n".join(handler.records[:3]), pytrace=False)


@pytest.fixture(autouse=True)
def restore_global_patches() -> Iterator[None]:
    """Integrations patch classes (executor submit, starlette, fastapi): undo them after every test."""
    yield
    from stagetrace.integrations import auto_stages
    from stagetrace.integrations.asgi import uninstall_request_signals
    from stagetrace.integrations.threads import stop_propagating_context

    uninstall_request_signals()
    stop_propagating_context()
    auto_stages.uninstrument()
