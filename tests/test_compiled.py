"""The exporter's compiled modules (``stagetrace._compiled``, built by ``hatch_build.py``): the application
process imports the sources, the exporter process the compiled modules, ``STAGETRACE_PURE_PYTHON=1`` the
sources everywhere; both give the same verdicts, metrics and spans on the same generated traces."""

from __future__ import annotations

import importlib.machinery
import json
import marshal
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stagetrace
from conftest import in_compiled_exporter
from stagetrace import _compiled
from stagetrace import conventions as c
from stagetrace.common import wire

HERE = Path(__file__).parent
BUILT = _compiled.compiled_available()
needs_build = pytest.mark.skipif(
    len(BUILT) != len(_compiled.COMPILED_MODULES) or _compiled.pure_python_forced(),
    reason="the exporter's modules are not compiled on this install, or STAGETRACE_PURE_PYTHON=1",
)


def test_source_first_hands_the_import_system_the_source_of_each_listed_module(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "fast.py").write_text("WHERE = 'source'\n")
    (package / "other.py").write_text("")
    finder = _compiled.SourceFirst(["pkg.fast"])
    spec = finder.find_spec("pkg.fast", [str(package)])
    assert spec is not None and spec.origin == str(package / "fast.py")
    assert finder.find_spec("pkg.other", [str(package)]) is None  # not listed: the usual import
    assert finder.find_spec("pkg.fast", [str(tmp_path)]) is None  # no source there: the usual import


def test_every_process_but_an_allowed_exporter_imports_the_sources():
    # the suite's own environment chooses nothing here (CI runs it once with STAGETRACE_PURE_PYTHON=1)
    inherited = {
        k: v for k, v in os.environ.items() if k not in (_compiled.EXPORTER_VARIABLE, _compiled.PURE_PYTHON_VARIABLE)
    }
    env_app = {}
    env_exporter = {_compiled.EXPORTER_VARIABLE: "1"}
    env_forced = {_compiled.EXPORTER_VARIABLE: "1", _compiled.PURE_PYTHON_VARIABLE: "1"}
    script = (
        "import sys; from stagetrace import _compiled; "
        "print(_compiled.install(dict(__import__('json').loads(sys.argv[1]))))"
    )
    out = {}
    for name, env in (("app", env_app), ("exporter", env_exporter), ("forced", env_forced)):
        run = subprocess.run(
            [sys.executable, "-c", script, json.dumps(env)], capture_output=True, text=True, check=True,
            env=inherited,
        )  # fmt: skip
        out[name] = run.stdout.strip()
    # importing stagetrace installed the finder already in the application (True either way) ...
    assert out["app"] == "True" and out["forced"] == "True"
    # ... and in a fresh interpreter told it is an exporter allowed compiled modules, only stale ones are sources
    allowed = subprocess.run(
        [sys.executable, "-c", "import sys, stagetrace; from stagetrace._compiled import SourceFirst; "
         "print([f.stale_only for f in sys.meta_path if isinstance(f, SourceFirst)])"],
        capture_output=True, text=True, check=True, env={**inherited, **env_exporter},
    )  # fmt: skip
    assert allowed.stdout.strip() == "[True]"


def test_an_exporter_allowed_compiled_modules_loads_the_source_of_one_built_before_it_changed(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    source = package / "fast.py"
    source.write_text("")
    built = package / ("fast" + importlib.machinery.EXTENSION_SUFFIXES[0])
    built.write_bytes(b"")

    # a finder decides once, at the first listed import (a process runs all compiled or none): one a state here
    def find() -> importlib.machinery.ModuleSpec | None:
        return _compiled.SourceFirst(["pkg.fast"], stale_only=True).find_spec("pkg.fast", [str(package)])

    os.utime(source, (1_000, 1_000))
    os.utime(built, (2_000, 2_000))
    assert find() is None  # built from this source: the extension
    os.utime(source, (3_000, 3_000))  # the source edited since
    spec = find()
    assert spec is not None and spec.origin == str(source)
    os.utime(source, (1_000, 1_000))
    declared = package / "fast.pxd"  # the C types Cython compiled it with, edited since: stale too
    declared.write_text("")
    os.utime(declared, (1_500, 1_500))
    assert find() is None
    os.utime(declared, (3_000, 3_000))
    spec = find()
    assert spec is not None and spec.origin == str(source)


def test_one_stale_module_puts_every_listed_one_on_its_source(tmp_path):
    """A compiled module calls another's functions in C (a cimport) and imports only beside the extension it was
    compiled against: one module edited since its build, and every listed one loads from source."""
    package = tmp_path / "pkg"
    package.mkdir()
    for name, built_at in (("fast", 2_000), ("other", 500)):  # other's source is newer than its extension
        (package / f"{name}.py").write_text("")
        os.utime(package / f"{name}.py", (1_000, 1_000))
        built = package / (name + importlib.machinery.EXTENSION_SUFFIXES[0])
        built.write_bytes(b"")
        os.utime(built, (built_at, built_at))
    stale = _compiled.SourceFirst(["pkg.fast", "pkg.other"], stale_only=True)
    spec = stale.find_spec("pkg.fast", [str(package)])
    assert spec is not None and spec.origin == str(package / "fast.py")  # current itself, yet from source
    os.utime(package / ("other" + importlib.machinery.EXTENSION_SUFFIXES[0]), (2_000, 2_000))
    current = _compiled.SourceFirst(["pkg.fast", "pkg.other"], stale_only=True)
    assert current.find_spec("pkg.fast", [str(package)]) is None  # both current: the extensions


def mapped_modules(pid: int) -> set[str]:
    """The stagetrace extension modules a process has mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if "stagetrace" in line and line.rstrip().endswith(".so")}


@needs_build
def test_the_exporter_process_runs_compiled_and_the_application_the_sources(make_harness):
    h = make_harness()
    with stagetrace.pipeline("request"), stagetrace.stage("work"):
        pass
    h.wait_verdicts(1)
    assert len(mapped_modules(h.handle.exporter_pid)) == len(_compiled.COMPILED_MODULES)
    assert mapped_modules(os.getpid()) == set() and _compiled.compiled_in_use() == ()


@needs_build
def test_pure_python_forced_keeps_the_exporter_on_the_sources(make_harness, monkeypatch):
    monkeypatch.setenv(_compiled.PURE_PYTHON_VARIABLE, "1")
    h = make_harness()
    with stagetrace.pipeline("request"), stagetrace.stage("work"):
        pass
    h.wait_verdicts(1)
    assert mapped_modules(h.handle.exporter_pid) == set()


# --- the same verdicts, compiled and not ---------------------------------------------------------------------

MS = 1_000_000
T0 = 50_000 * MS
NAMES = ("decode", "resize", "infer", "threadpool.wait", "postprocess")
KINDS = ("cpu", "cpu", "io", "wait", "gpu")


@st.composite
def traces(draw: st.DrawFn, trace_id: int) -> tuple:
    """A trace the exporter may receive: a root, up to eight stages anywhere in it (nested, overlapping, past
    its end), CPU readings, the event loop's thread, errors, GPU times, a stream."""
    total = draw(st.integers(1, 400))
    stages = []
    for i in range(draw(st.integers(0, 8))):
        start = draw(st.integers(-5, total))
        end = start + draw(st.integers(0, total + 10))
        name = draw(st.sampled_from(NAMES))
        parent = draw(st.sampled_from([1, *range(2, 2 + i)])) if i else 1
        s = wire.ShippedStage.added(name, draw(st.sampled_from(KINDS)), 2 + i, parent, T0 + start * MS, T0 + end * MS)
        if draw(st.booleans()):
            cpu, rq, slices = draw(st.integers(0, end - start)), draw(st.integers(0, 30)), draw(st.integers(1, 12))
            s.cpu_start, s.cpu_end = b"0 0 1\n", f"{cpu * MS} {rq * MS} {1 + slices}\n".encode()
        s.on_event_loop = draw(st.booleans())
        s.error = draw(st.sampled_from([None, None, ("ValueError", "bad input", "Traceback ...")]))
        if s.kind == "gpu":
            s.gpu_ms = draw(st.one_of(st.none(), st.floats(0, 500)))
        stages.append(tuple(wire.pack_stage(s)))
    attrs = {c.HTTP_ROUTE: draw(st.sampled_from(["/a", "/b"]))}
    status = draw(st.sampled_from([0, 0, 0, 2]))
    root = wire.WireSpan(
        "GET", trace_id, 1, 0, False, 2, T0, T0 + total * MS, attrs, (), (), status, "", "s", "", 1, "", 0, 0, 0
    )
    return wire.trace_message(
        trace_id=trace_id, flags=draw(st.sampled_from([1, 1, 0])), state="", offset=0, dropped_stages=0,
        gpu_utilization=draw(st.one_of(st.none(), st.floats(0, 1))), root=tuple(root), stages=tuple(stages),
        others=(), loop_thread=0, worker_runs=(), task_created_ns=0, received_ms_ago=-1, stream=None, gen_ai=None,
    )  # fmt: skip


def signals_message(draw: st.DrawFn) -> tuple:
    """The GIL monitor's readings over the traces' window (wake-up lag and run-queue wait, ms)."""
    points = draw(st.lists(st.tuples(st.integers(0, 400), st.floats(0, 12)), min_size=0, max_size=40))
    flat: list = []
    for at, value in sorted(points):
        flat += [T0 + at * MS, value]
    return (wire.SIGNAL, "gil", tuple(flat))


@st.composite
def workloads(draw: st.DrawFn) -> list[tuple]:
    messages = [signals_message(draw)]
    messages += [draw(traces(trace_id)) for trace_id in range(1, draw(st.integers(1, 60)) + 1)]
    return messages


def verdicts_of(messages: list, tmp_path: Path, **env: str) -> dict:
    source, out = tmp_path / "messages.bin", tmp_path / f"out-{len(env)}-{sorted(env)}.json"
    source.write_bytes(marshal.dumps(messages))
    clean = {k: v for k, v in os.environ.items() if k not in (_compiled.PURE_PYTHON_VARIABLE,)}
    subprocess.run(
        [sys.executable, str(HERE / "verdicts_of.py"), str(source), str(out)], env={**clean, **env}, check=True
    )
    return json.loads(out.read_text())


def comparable_spans(spans: list) -> list:
    """Spans without the ids the exporter draws at random for the spans it adds."""
    return [{k: v for k, v in s.items() if k not in ("span_id", "parent_span_id", "links")} for s in spans]


@needs_build
@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=workloads())
def test_the_compiled_exporter_and_the_sources_give_the_same_verdicts_field_by_field(messages, tmp_path):
    compiled = verdicts_of(messages, tmp_path, **{_compiled.EXPORTER_VARIABLE: "1"})
    pure = verdicts_of(messages, tmp_path, **{_compiled.PURE_PYTHON_VARIABLE: "1"})
    # every compiled module the exporter's core imports (not the OTLP encoder: spans go to a plain sink here)
    assert len(compiled["compiled"]) >= len(_compiled.COMPILED_MODULES) - 1 and pure["compiled"] == []
    assert len(compiled["verdicts"]) == len(pure["verdicts"]) == len(messages) - 1
    for a, b in zip(compiled["verdicts"], pure["verdicts"]):
        assert a.keys() == b.keys()
        for field in a:
            assert a[field] == b[field], (field, a.get("trace_id"))
    assert compiled["metrics"] == pure["metrics"] and compiled["skipped"] == pure["skipped"]
    assert comparable_spans(compiled["spans"]) == comparable_spans(pure["spans"])


def trace_message(trace_id: int, stages: list, root_end: int | None = None) -> tuple:
    root_end = T0 + 100 * MS if root_end is None else root_end
    root = wire.WireSpan("GET", trace_id, 1, 0, False, 2, T0, root_end, {}, (), (), 0, "", "s", "", 1, "", 0, 0, 0)
    return wire.trace_message(
        trace_id=trace_id, flags=1, state="", offset=0, dropped_stages=0, gpu_utilization=None, root=tuple(root),
        stages=tuple(stages), others=(), loop_thread=0, worker_runs=(), task_created_ns=0, received_ms_ago=-1,
        stream=None, gen_ai=None,
    )  # fmt: skip


@needs_build
def test_times_past_what_a_c_integer_holds_get_the_same_verdicts_on_both_paths(tmp_path):
    """Where the compiled modules read a field as a C type, a value the sources take must not fail there: a
    stage's, a root's or a composite's time past 2**63 ns is judged alike on both paths (typed as a C long
    long, such a trace failed inside the compiled breakdown and lost its verdict while the sources judged it)."""

    def stage(start: int, end: int, compressed: tuple | None = None) -> tuple:
        packed = list(wire.pack_stage(wire.ShippedStage.added("decode", "cpu", 2, 1, T0, T0)))
        for field, value in (("start_ns", start), ("end_ns", end), ("compressed", compressed)):
            packed[wire.STAGE_FIELDS.index(field)] = value
        return tuple(packed)

    fine = stage(T0 + MS, T0 + 9 * MS)
    messages = [
        trace_message(1, [fine]),
        trace_message(2, [stage(T0 + MS, 1 << 63)]),
        trace_message(3, [fine], root_end=1 << 64),
        trace_message(4, [stage(T0 + MS, T0 + 9 * MS, compressed=(3, 1 << 63, 1, 2))]),
        trace_message(5, [stage(-(1 << 64), T0)]),
    ]
    compiled = verdicts_of(messages, tmp_path, **{_compiled.EXPORTER_VARIABLE: "1"})
    pure = verdicts_of(messages, tmp_path, **{_compiled.PURE_PYTHON_VARIABLE: "1"})
    assert compiled["skipped"] == pure["skipped"] == 0
    assert compiled["verdicts"] == pure["verdicts"] and len(pure["verdicts"]) == 5


@needs_build
@pytest.mark.slow
def test_the_typed_modules_pass_their_own_tests_compiled():
    """Where a ``.pxd`` types a module's locals as C values (schedstat, the signal windows, the metric store),
    the compiled module is held to the tests its sources pass: they run here in a process that imports it."""
    files = ["tests/test_signal_values.py", "tests/test_signals.py", "tests/test_export_values.py"]
    check = "from stagetrace.exporter import signals; assert not signals.__file__.endswith('.py')"
    in_compiled_exporter(["-c", check], check=True)
    run = in_compiled_exporter(
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *files], cwd=HERE.parent
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
