"""The GPU session's own logic, checked on CPU: each row of benchmarks/gpu_check.py and gpu_probes.py fails
when what it measures is wrong or when its control sees nothing; the fakes' profiler gives runtime calls the
thread ids kineto gives them; benchmarks/gpu_session.sh fits the device machine (its ``--dry-run`` runs
every step with fakes in place of CUDA)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from fakes import FakeEvent, FakeGpu, FakeProfiler, FakeTensor

REPO = Path(__file__).resolve().parent.parent
SESSION = REPO / "benchmarks" / "gpu_session.sh"


def _benchmark(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))  # gpu_probes imports gpu_check from there
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _benchmark("gpu_check")
probes = _benchmark("gpu_probes")


def by_prefix(rows, prefix: str):
    found = [r for r in rows if r.check.startswith(prefix)]
    assert found, f"no row {prefix!r}"
    return found


# --- (a) synchronisations, attributed by CUPTI's thread -----------------------------------------------------


def test_a_helper_threads_queries_are_not_charged_to_the_request_thread():
    """kineto gives a runtime call made outside any op (``Event.query``) the profiler id of the thread
    that collected the profile, here the request thread: filtering on ``FunctionEvent.thread`` charges
    another thread's queries to it. CUPTI's thread (``device_resource_id``) tells them apart."""
    gpu = FakeGpu()
    event = FakeEvent(gpu, enable_timing=True)
    event.record()
    helper: list = []

    def poll() -> None:
        helper.append(check.ThreadIds.current())
        for _ in range(7):
            event.query()

    with FakeProfiler(gpu) as prof:
        with prof.record_function(check.REQUEST_MARK):
            FakeTensor(gpu, 4096, "cuda:0").to("cpu")  # a blocking copy: one sync of the request thread's
            t = threading.Thread(target=poll)
            t.start()
            t.join()
    events = prof.events()
    request_rf = next(e.thread for e in events if e.name == check.REQUEST_MARK)
    assert {e.thread for e in events if e.name == check.QUERY} == {request_rf}  # the trap, as in torch
    profile = check.read_profile(events)
    me = check.ThreadIds.current()
    mine = check.calls_on(profile, me, (*check.SYNC_CALLS, check.QUERY), inside=check.REQUEST_MARK)
    assert mine == Counter({"cudaStreamSynchronize": 1})
    assert check.calls_on(profile, helper[0], [check.QUERY]) == Counter({check.QUERY: 7})


def test_thread_ids_match_each_form_cupti_gives():
    ids = check.ThreadIds(native=4321, ident=0x7F3A_9ABC_DEF0)
    assert ids.matches(4321)
    assert ids.matches(0x9ABC_DEF0)  # CUPTI's: the low 32 bits of pthread_self()
    assert ids.matches(0x9ABC_DEF0 - (1 << 32))  # the same, as kineto's int32
    assert not ids.matches(0x7F3A_9ABC_DEF0) and not ids.matches(4322)


def _counts(**changes) -> object:
    good = check.SyncCounts(
        plain=Counter({"cudaStreamSynchronize": 10}),
        traced=Counter({"cudaStreamSynchronize": 10}),
        requests=10,
        control_made=20,
        control_own=Counter(dict.fromkeys(check.CONTROL_CALLS, 20)),
        control_other=Counter(dict.fromkeys(check.CONTROL_CALLS, 20)),
        control_leaked=Counter(),
    )
    return good._replace(**changes)


@pytest.mark.parametrize(
    ("changes", "failing"),
    [
        ({}, []),
        ({"traced": Counter({"cudaStreamSynchronize": 10, "cudaEventSynchronize": 3})}, ["(a) cudaEventSynchronize"]),
        ({"traced": Counter({"cudaStreamSynchronize": 10, "cudaEventQuery": 1})}, ["(a) cudaEventQuery on"]),
        # the profile saw no sync at all: "0 added" proves nothing
        ({"plain": Counter(), "traced": Counter()}, ["(a) control: the plain run"]),
        # another thread's queries charged to the request thread
        ({"control_own": Counter({"cudaEventQuery": 40, "cudaEventSynchronize": 20})}, ["(a) control: cudaEventQuery"]),
        # a profiler that does not record cudaEventSynchronize
        ({"control_own": Counter({"cudaEventQuery": 20}), "control_other": Counter({"cudaEventQuery": 20})},
         ["(a) control: cudaEventSynchronize"]),
    ],
)  # fmt: skip
def test_sync_rows_pass_only_on_a_measurement(changes, failing):
    rows = check.sync_rows(_counts(**changes))
    assert sorted(r.check for r in rows if not r.ok) == sorted(
        r.check for r in rows if any(r.check.startswith(f) for f in failing)
    )
    assert len([r for r in rows if not r.ok]) == len(failing)


# --- (b), (f): GPU time and placement against CUPTI ---------------------------------------------------------


def test_cupti_records_are_cut_into_requests():
    ops = []
    for i in range(3):  # per request: a copy in, two kernels with a launch gap, a copy out; a memset ignored
        t = i * 1000.0
        ops += [
            ("Memcpy HtoD (Pinned -> Device)", t, t + 100),
            ("ampere_sgemm_128x64_tn", t + 110, t + 310),
            ("Memset (Device)", t + 312, t + 313),
            ("void elementwise_kernel", t + 320, t + 350),
            ("Memcpy DtoH (Device -> Pageable)", t + 360, t + 440),
        ]
    ops.append(("Memcpy DtoH (Device -> Pageable)", 5000.0, 5010.0))  # a stray copy outside a request
    out = check.truth_per_request(reversed(ops))
    assert [r.ms() for r in out] == [{"h2d": 0.1, "infer": 0.24, "d2h": 0.08}] * 3
    assert out[1].h2d_end == 1100 and out[1].k1 == 1350
    # a copy to pageable memory staged in pieces is one copy
    staged = [
        *ops[:4],
        ("Memcpy DtoH (Device -> Pageable)", 360.0, 400.0),
        ("Memcpy DtoH (Device -> Pageable)", 405.0, 440.0),
    ]
    assert [r.ms() for r in check.truth_per_request(staged)] == [{"h2d": 0.1, "infer": 0.24, "d2h": 0.08}]
    assert check.within(1.04, 1.0) and not check.within(1.06, 1.0)
    assert check.within(0.03, 0.015)  # 20 us of slack for tiny stages


def test_the_profiles_clock_is_bounded_by_every_mark():
    marks = [check.ClockMark(1_000_000, 1_000_900, 100.0), check.ClockMark(2_000_300, 2_000_500, 1100.0)]
    offset, error = check.profile_to_epoch(marks)
    # mark 1: offset in [900_000, 900_900]; mark 2: [900_300, 900_500]
    assert (offset, error) == (900_400, 100)


def _truth(n: int = 3) -> list:
    return [check.RequestTruth(i * 10_000.0, i * 10_000 + 1000.0, i * 10_000 + 1002.0, i * 10_000 + 5000.0,
                               i * 10_000 + 5003.0, i * 10_000 + 6000.0) for i in range(n)]  # fmt: skip


def _placed(truth, offset_ns: float, shift_ns: int = 0, host_lead_ns: int = 4_000_000) -> list:
    return [
        check.Placed(
            infer_start=int(t.h2d_end * 1000 + offset_ns) + 1_000 + shift_ns,
            infer_end=int(t.k1 * 1000 + offset_ns) - 2_000,
            d2h_start=int(t.k1 * 1000 + offset_ns) + 500,
            error_ns=3_000,
            host_d2h_ns=int(t.k1 * 1000 + offset_ns) - host_lead_ns,
        )
        for t in truth
    ]


def test_placement_rows_fail_for_a_span_off_by_more_than_its_error_bar():
    truth, offset = _truth(), 1.7e18
    rows, _ = check.placement_rows(_placed(truth, offset), truth, offset, 1_000, 3)
    assert all(r.ok for r in rows), rows
    rows, _ = check.placement_rows(_placed(truth, offset, shift_ns=20_000), truth, offset, 1_000, 3)
    assert [r.ok for r in rows] == [True, False, True]
    # the control: a host clock as close to CUPTI as the placements cannot tell a wrong placement apart
    rows, _ = check.placement_rows(_placed(truth, offset, host_lead_ns=50_000), truth, offset, 1_000, 3)
    assert [r.ok for r in rows] == [True, True, False]
    rows, _ = check.placement_rows(_placed(truth, offset)[:2], truth, offset, 1_000, 3)
    assert not rows[0].ok  # a request's spans were not placed


# --- (c) hot path, (e) NVML ---------------------------------------------------------------------------------


def test_hot_path_rows():
    assert all(r.ok for r in check.hot_path_rows(check.HotPath(5.0, 6.0, 13.0, 0, 0)))
    assert [r.ok for r in check.hot_path_rows(check.HotPath(5.0, 6.0, 17.0, 0, 0))] == [True, False, True]
    assert [r.ok for r in check.hot_path_rows(check.HotPath(5.0, 6.0, 13.0, 0, 194))] == [True, True, False]
    assert not check.hot_path_rows(check.HotPath(5.0, 0.0, 13.0, 0, 0))[0].ok  # the control measured nothing


def test_the_uuid_row_compares_with_nvmls_own_enumeration():
    gpu = check.NvmlDevice("GPU-" + "a" * 8 + "-1111-2222-3333-444444444444", "NVIDIA H200", (0, 0x19, 0))
    other = check.NvmlDevice("GPU-" + "b" * 8 + "-1111-2222-3333-444444444444", "NVIDIA H200", (0, 0x2A, 0))
    raw = gpu.uuid[len("GPU-") :]
    torch_dev = check.TorchDevice(raw, "NVIDIA H200", (0, 0x19, 0))
    assert check.uuid_row(torch_dev, gpu.uuid, [other, gpu]).ok
    assert not check.uuid_row(torch_dev, other.uuid, [other, gpu]).ok
    assert not check.uuid_row(torch_dev, "MIG-" + raw, [other, gpu]).ok  # a wrong prefix is a wrong UUID
    no_pci = torch_dev._replace(pci=None)
    assert check.uuid_row(no_pci, gpu.uuid, [other, gpu]).ok  # by the hex and the name
    assert not check.uuid_row(no_pci, gpu.uuid, [other]).ok


def _reading(**changes):
    good = check.NvmlReading(166.7, "epoch", 120.0, 80, 2, 0.97, 0.98, 8, 0.0)
    return good._replace(**changes)


@pytest.mark.parametrize(
    ("changes", "ok"),
    [
        ({}, [True, True, True]),
        ({"newest_age_ms": 3.6e9}, [False, True, True]),  # the wrong clock: the newest sample is an hour old
        ({"busy_samples": 0, "busy_expected": None}, [True, False, True]),  # no driver sample: stand-ins only
        ({"busy_expected": 0.5}, [True, False, True]),
        ({"busy": 0.2, "busy_expected": 0.2}, [True, True, False]),  # the GPU was not busy: the control fails
    ],
)
def test_nvml_rows_pass_only_on_real_samples(changes, ok):
    assert [r.ok for r in check.nvml_rows(_reading(**changes))] == ok


@pytest.mark.slow  # over 1.4 s on its own: out of the quick loop
def test_the_check_on_the_fakes_passes_where_it_measures_no_time():
    """The whole check in-process on FakeGpu, FakeProfiler and FakeNvml: the rows whose result does not
    depend on the host's timing pass (the others are asserted by the pure tests above)."""
    rows, figures = check.run_check(check.FakeRig(model_ms=2.0, copy_bytes=8 << 20), requests=3)
    for prefix in ("(a)", "(d)", "(e) torch's device", "(g)"):
        assert all(r.ok for r in by_prefix(rows, prefix)), [r for r in by_prefix(rows, prefix) if not r.ok]
    assert by_prefix(rows, "(f) GPU spans placed")[0].result.startswith("3 / 3")
    json.dumps(figures, default=str)


# --- the probes ---------------------------------------------------------------------------------------------


def test_the_capture_probe_compares_with_the_plain_workload_and_its_control_breaks_captures():
    rows, figures = probes.probe_capture(probes.FakeDevice(), captures=5)
    assert all(r.ok for r in rows), rows
    plain, ours, control = figures["phases"]
    assert control["failures"] == 5 and plain["failures"] == ours["failures"] == 0
    assert min(p["worker_iterations"] for p in (plain, ours, control)) >= 10  # two a capture, at least


def test_unmet_requirements_follow_the_chain_and_skip_what_does_not_apply():
    installed = {"a": "1.0", "b": "1.0", "c": "3.0"}
    requires = {"a": ["b==2", "c>=2", 'd; python_version < "3"', "e; extra == 'x'"], "b": [], "c": []}
    unmet = probes.unmet_requirements(["a>=1"], installed.get, lambda n: requires.get(n, []))
    assert unmet == ["b==2 (installed: 1.0)"]
    assert probes.unmet_requirements(["zz"], installed.get, lambda n: []) == ["zz (installed: None)"]


# --- the session's files and summary --------------------------------------------------------------------------


def test_the_summary_keeps_failures_first_and_under_the_limit():
    rows = [{"check": f"(x) row {i} " + "w" * 60, "result": "r" * 80, "target": "t", "ok": i != 77} for i in range(90)]
    steps = {"gpu-check": {"rc": "1", "seconds": "50", "limit_s": "100", "figures": {"rows": rows}}}
    summary = check.summarize(steps)
    assert len(summary) <= check.SUMMARY_LIMIT
    failing = summary.split("ROWS:")[0]
    assert "FAILING (2):\n[gpu-check rc=1] (no output)" in failing and "(x) row 77" in failing
    assert summary.endswith("session.json has every row)")


def test_every_step_that_did_not_end_well_is_under_failing_with_its_rc_and_output(tmp_path):
    """A step that failed, timed out or was killed may leave no rows at all (pytest missing, a hang): the
    summary's FAILING list names it with its rc and the end of its output, beside the failing rows."""
    work = tmp_path / "work"
    work.mkdir()
    logs = {
        "env": ("0", "every prerequisite met"),
        "cuda-tests": ("1", "collecting\n/usr/bin/python3: No module named pytest\n"),
        "anchors": ("124", "calibrating\nstill calibrating (busy threads: 2)\n"),
        "capture": ("137", ""),
        "gpu-check": ("1", "table\n"),
    }
    for name, (rc, log) in logs.items():
        (work / f"{name}.log").write_text(log)
        (work / f"{name}.status").write_text(f"{rc} 3 20")
    failed_row = {"check": "(x) sync", "result": "2", "target": "0", "ok": False}
    (work / "gpu-check.json").write_text(json.dumps({"rows": [failed_row]}))
    (work / "steps.txt").write_text("\n".join(logs))
    summary = check.session_report(work, tmp_path / "out")
    failing = summary.split("FAILING (5):\n")[1].split("ROWS:")[0].splitlines()
    assert failing == [
        "[cuda-tests rc=1] collecting | /usr/bin/python3: No module named pytest",
        "[anchors rc=124 TIMED OUT] calibrating | still calibrating (busy threads: 2)",
        "[capture rc=137 KILLED] (no output)",
        "[gpu-check rc=1] table",
        "(x) sync: 2 [target 0]",
    ]
    all_well = {"env": {"rc": "0", "seconds": "1", "limit_s": "20", "figures": None}}
    assert check.summarize(all_well).endswith("FAILING: none\nROWS:")


def test_a_long_output_keeps_its_end_on_one_line():
    tail = check.output_tail("\n".join(f"line {i}   with   spaces" for i in range(100)), chars=60)
    assert len(tail) == 60 and tail.startswith("...") and tail.endswith("line 99 with spaces")


@pytest.mark.slow
def test_the_session_names_a_failed_a_timed_out_and_a_killed_step(tmp_path):
    """The session itself, with a stand-in Python: pytest missing (rc 1, no rows), a probe that kills itself
    (137), and the last step hanging past its limit (124): all three under FAILING with their output."""
    stub = tmp_path / "python"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        f'case "$*" in *--report*) exec {sys.executable} "$@";;\n'
        '  *"-m pytest"*) echo "/stub/python: No module named pytest" >&2; exit 1;;\n'
        '  *" capture "*) echo "capturing"; kill -9 $$;;\n'
        '  *gpu_check.py*) echo "measuring"; exec sleep 60;;\n'
        "esac\nexit 0\n"
    )
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(stub), "GPU_SESSION_BUDGET": "24"}
    subprocess.run(["bash", str(SESSION), "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    summary = (out / "summary.txt").read_text()
    failing = summary.split("FAILING (3):\n")[1].split("ROWS:")[0]
    assert "[cuda-tests rc=1] /stub/python: No module named pytest" in failing
    assert "[capture rc=137 KILLED] capturing" in failing
    assert "[gpu-check rc=124 TIMED OUT] measuring" in failing


def test_missing_prerequisites_say_what_to_do():
    wheels = [".whl/opentelemetry_sdk-1.40.0-py3-none-any.whl", ".whl/googleapis_common_protos-1.70.0-py3-none-any.whl"]
    installed = {"opentelemetry-sdk": "1.40.0"}.get
    missing = probes.missing_prerequisites(lambda m: m != "pytest", wheels, installed)
    assert missing == [
        "pytest (the cuda-tests step runs pytest: pip install pytest)",
        "googleapis-common-protos (carried in googleapis_common_protos-1.70.0-py3-none-any.whl, not installed: "
        "see the install step)",
    ]
    assert probes.missing_prerequisites(lambda m: True, wheels, lambda n: "1") == []
    rows, figures = probes.probe_env(probes.FakeDevice())
    (row,) = by_prefix(rows, "(env) the session's prerequisites missing")
    assert row.ok and figures["missing"] == []  # this venv has them all


def test_the_tests_row_reads_pytests_junit_file(tmp_path):
    junit = tmp_path / "t.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase name="test_a"/><testcase name="test_real_cuda_one"/>'
        '<testcase name="test_real_cuda_two"/><testcase name="test_b"><skipped/></testcase></testsuite></testsuites>'
    )
    (row,) = check.test_figures(junit, "", dry_run=False)["rows"]
    assert row["ok"] and row["result"] == "3 / 0 / 0 / 1; 2"
    junit.write_text('<testsuite><testcase name="test_real_cuda_one"><skipped/></testcase></testsuite>')
    assert not check.test_figures(junit, "", dry_run=False)["rows"][0]["ok"]  # the CUDA tests did not run


def test_the_session_is_bounded_to_fit_the_device_machine():
    """Every step's limit, the kill grace and the report's reserve within 6 minutes, so that a rerun fits
    in the 15 minutes of device time; the CUDA tests without the slow ones."""
    text = SESSION.read_text()
    assert subprocess.run(["bash", "-n", str(SESSION)]).returncode == 0
    steps = re.findall(r"^\s*step (\S+) (\d+) ", text, flags=re.M)
    assert [s for s, _ in steps] == ["install", "env", "env", "cuda-tests", "anchors", "capture", "dtype", "gpu-check"]
    limits = {name: int(limit) for name, limit in steps}
    budget = int(re.search(r"GPU_SESSION_BUDGET:-(\d+)", text).group(1))
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)", text, flags=re.M).group(1))
    assert sum(limits.values()) + kill_after * len(limits) + 15 <= 360
    assert budget <= 330
    assert '-m "not slow"' in text


@pytest.mark.slow
def test_a_step_past_the_budget_is_cut_and_the_summary_still_comes_last(tmp_path):
    """With a budget of 23 s the first step gets 3 s (23, less 15 for the report and 5 for the kill grace): a
    step that hangs is killed then, the later ones do not start, and the report is written and printed last."""
    stub = tmp_path / "python"
    stub.write_text(f'#!/usr/bin/env bash\ncase "$*" in *--report*) exec {sys.executable} "$@";; esac\nexec sleep 60\n')
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": str(stub), "GPU_SESSION_BUDGET": "23"}
    run = subprocess.run(["bash", str(SESSION), "--dry-run"], capture_output=True, text=True, env=env, timeout=60)
    summary = (out / "summary.txt").read_text()
    assert run.stdout.rstrip().endswith(summary.rstrip())
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "session.json", "summary.txt"]
    steps = json.loads((out / "session.json").read_text())["steps"]
    assert steps["env"]["rc"] == "124" and steps["env"]["limit_s"] in ("2", "3")  # bash's SECONDS is whole seconds
    assert all(steps[s]["limit_s"] == "0" for s in ("cuda-tests", "anchors", "capture", "dtype", "gpu-check"))
    assert "TIMED OUT" in summary


@pytest.mark.slow
def test_the_sessions_dry_run_leaves_three_files_and_a_short_summary_printed_last(tmp_path):
    """Every step, on CPU with fakes in place of CUDA: the files that come back from $OUT (at most 8 of
    16 MiB; the session leaves 3), the summary under 4,000 characters at the end of the output, and every
    step's figures in session.json."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(SESSION), "--dry-run"], capture_output=True, text=True, env=env, timeout=300)
    files = sorted(out.iterdir())
    assert [p.name for p in files] == ["log.txt", "session.json", "summary.txt"]
    assert all(p.stat().st_size < 16 << 20 for p in files)
    summary = (out / "summary.txt").read_text()
    assert len(summary) < 4000 and run.stdout.rstrip().endswith(summary.rstrip())
    steps = json.loads((out / "session.json").read_text())["steps"]
    assert list(steps) == ["env", "cuda-tests", "anchors", "capture", "dtype", "gpu-check"]
    for name, step in steps.items():
        assert step["rc"] in ("0", "1"), (name, step)  # it ran to its end inside its limit
        assert step["figures"]["rows"], name
    assert sum(int(s["seconds"]) for s in steps.values()) <= 330
