"""The exporter process: where the work runs, its lifecycle (start, end with the parent, restart after a
kill, flush on shutdown), the channel (bounded, never blocking, malformed input skipped, unreachable by
others) and local tail sampling."""

from __future__ import annotations

import marshal
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import stagetrace
from stagetrace import conventions as c
from stagetrace.common.channel import FrameReader, encode_frame
from stagetrace.exporter.keep import in_healthy_share
from stagetrace.settings import Settings


def dropped(h, reason, *, flush=True):
    points = h.metric_points(c.METRIC_DROPPED, flush=flush)
    return sum(p.value for p in points if p.attributes[c.DROP_REASON] == reason)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie is not alive
    except FileNotFoundError:
        return False


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def run_pipelines(n: int, name: str = "p") -> None:
    for _ in range(n):
        with stagetrace.pipeline(name), stagetrace.stage("work"):
            pass


# --- where the work runs ------------------------------------------------------------------------------


def test_the_work_runs_in_another_process_and_describes_the_application(harness):
    pid = harness.handle.exporter_pid
    assert pid is not None and pid != os.getpid() and alive(pid)
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        assert b"stagetrace.exporter" in fh.read()
    run_pipelines(1)
    (root,) = harness.by_name("p")
    assert c.BOTTLENECK_STAGE in root.attributes  # the verdict came back from the exporter
    assert root.resource.attributes["process.pid"] == os.getpid()  # the application's, not the exporter's
    assert root.resource.attributes["service.name"] == "test-service"


def test_with_the_export_process_off_no_process_is_started(make_harness, monkeypatch):
    monkeypatch.setenv("STAGETRACE_EXPORT_PROCESS", "off")
    h = make_harness()
    assert h.handle.exporter_pid is None
    run_pipelines(2)
    h.flush()
    assert len(h.verdicts) == 2 and len(h.by_name("p")) == 2


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_bad_mode_and_share_values_are_clear_errors(monkeypatch, value):
    monkeypatch.setenv("STAGETRACE_EXPORT_PROCESS", value)
    with pytest.raises(ValueError, match="STAGETRACE_EXPORT_PROCESS must be on or off"):
        Settings()
    monkeypatch.setenv("STAGETRACE_EXPORT_PROCESS", "on")
    monkeypatch.setenv("STAGETRACE_HEALTHY_SAMPLE", value)
    with pytest.raises(ValueError, match="STAGETRACE_HEALTHY_SAMPLE"):
        Settings()


def test_a_flush_held_for_the_signals_is_answered_without_waiting_a_poll_interval(make_harness):
    """A flush behind a trace that waits for the GIL monitor's next wake-up (the gate) went out only at the
    helper thread's next poll: 0.2 s a flush by default, every poll interval here (so none within 5 s)."""
    h = make_harness(settings=Settings(poll_interval_s=60, sweep_interval_s=60))
    for _ in range(3):
        run_pipelines(1)
        assert h.handle.force_flush(5)
    assert len(h.verdicts) == 3


# --- lifecycle ---------------------------------------------------------------------------------------


def test_shutdown_flushes_and_leaves_no_process_or_zombie(make_harness):
    h = make_harness()
    pid = h.handle.exporter_pid
    run_pipelines(20)
    h.handle.shutdown()
    assert len(h.verdicts) == 20  # flushed on shutdown, nothing lost
    assert not alive(pid)  # exited and reaped


@pytest.mark.parametrize(
    "how",
    [
        pytest.param(signal.SIGKILL, id="killed"),
        # a crash of the compiled exporter (stagetrace._compiled) is a crash of its process, nothing more
        pytest.param(signal.SIGSEGV, id="segfault", marks=pytest.mark.slow),
    ],
)
def test_a_killed_exporter_is_restarted_and_every_trace_is_either_analysed_or_counted(make_harness, how):
    h = make_harness()
    first = h.handle.exporter_pid
    total, t0 = 0, time.monotonic()
    for i in range(60):
        run_pipelines(10)
        total += 10
        if i == 20:
            os.kill(first, how)  # mid-load
    assert time.monotonic() - t0 < 10  # the application kept serving, never waiting on the exporter
    assert wait_until(lambda: h.handle.exporter_pid not in (None, first))
    h.flush()
    before = len(h.verdicts)
    run_pipelines(10)
    total += 10
    h.flush()
    assert len(h.verdicts) == before + 10  # verdicts resumed after the restart
    lost = dropped(h, "exporter_restart")
    assert len(h.verdicts) + lost == total  # none silently lost: each trace analysed or counted
    assert alive(h.handle.exporter_pid) and not alive(first)


@pytest.mark.slow
def test_the_exporter_ends_with_its_application(tmp_path):
    """A crashed application (SIGKILL: no atexit, no shutdown) leaves no orphaned exporter behind."""
    code = textwrap.dedent(
        """
        import sys, time, stagetrace
        h = stagetrace.configure("orphan-check", traces_path=sys.argv[1])
        print(h.exporter_pid, flush=True)
        time.sleep(60)
        """
    )
    app = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "t.jsonl")], stdout=subprocess.PIPE, text=True)
    try:
        exporter = int(app.stdout.readline())
        assert alive(exporter)
        app.kill()
        app.wait(10)
        assert wait_until(lambda: not alive(exporter), 10)
    finally:
        app.kill()


def test_ctrl_c_in_a_terminal_does_not_kill_the_exporter_before_the_application_flushes(harness):
    harness.flush()  # the exporter is up
    pid = harness.handle.exporter_pid
    assert os.getpgid(pid) != os.getpgid(0)  # not in the terminal's foreground group: Ctrl-C does not reach it
    os.kill(pid, signal.SIGINT)  # and if a SIGINT does arrive, it is ignored
    time.sleep(0.2)
    assert alive(pid)
    run_pipelines(3)
    harness.flush()
    assert len(harness.verdicts) == 3


# --- the channel -------------------------------------------------------------------------------------


def test_a_full_channel_drops_and_counts_and_never_blocks_the_request(make_harness):
    h = make_harness(settings=Settings(channel_buffer_bytes=2**20))  # a trace of 80 KB fits; 200 do not
    run_pipelines(1)
    h.flush()
    pid = h.handle.exporter_pid
    os.kill(pid, signal.SIGSTOP)  # the exporter stops reading: the pipe, then the buffer, fill up
    try:
        t0 = time.monotonic()
        for _ in range(200):
            with stagetrace.pipeline("p"), stagetrace.stage("work") as s:
                for i in range(20):  # 80 KB a trace: the pipe and the buffer fill within a few traces
                    s.set_attribute(f"padding{i}", f"{i}" + "x" * 4000)  # distinct: marshal shares equal objects
        elapsed = time.monotonic() - t0
        assert wait_until(lambda: not h.handle.runtime.shipper._items, 5)  # all handed to the (full) channel
        time.sleep(0.2)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert elapsed < 5
    h.flush()
    lost = dropped(h, "channel_full")
    assert lost > 0
    assert len(h.verdicts) + lost == 201


def test_malformed_records_in_the_channel_are_skipped_and_counted(harness):
    run_pipelines(1)
    harness.flush()
    transport = harness.handle.runtime.shipper.transport
    writer = transport._writer
    writer.write(b"garbage that is no frame" * 10, force=True)  # a torn or corrupted write
    writer.write(encode_frame(b"\x00not marshal"), force=True)  # a frame whose payload does not decode
    writer.write(encode_frame(marshal.dumps([("T", "not a trace")])), force=True)  # a record of the wrong shape
    writer.write(encode_frame(marshal.dumps([("?", 1)])), force=True)  # an unknown kind
    run_pipelines(5)
    harness.flush()
    assert len(harness.verdicts) == 6  # everything around the bad records got through
    assert dropped(harness, "malformed_record") >= 4
    assert alive(harness.handle.exporter_pid)


def open_files(pid: int) -> dict[int, str]:
    """What a process has open, read once it is idle; an fd closed between the listing and its read (a
    module file the interpreter was importing) is left out."""
    fds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
    return fds


def test_the_channel_is_anonymous_pipes_only(harness):
    harness.flush()  # the exporter has started and answered: its imports are done
    pid = harness.handle.exporter_pid
    fds = open_files(pid)
    channel = [target for fd, target in fds.items() if fd > 2 and not target.startswith(("/", "anon_inode:"))]
    assert channel and all(t.startswith("pipe:") for t in channel), fds  # no socket, no path another user could open
    assert not any(t.startswith("socket:") for t in fds.values())


def test_frame_reader_resynchronises_after_garbage_and_reports_truncation():
    good = [encode_frame(b"one"), encode_frame(b"two"), encode_frame(b"three")]
    corrupted = bytearray(good[1])
    corrupted[-1] ^= 0xFF  # checksum no longer matches
    stream = b"xx" + good[0] + b"junk" + bytes(corrupted) + good[2] + good[0][:7]
    reader = FrameReader()
    out = []
    for i in range(0, len(stream), 5):  # arrives in small pieces
        out += reader.feed(stream[i : i + 5])
    assert out == [b"one", b"three"]
    assert reader.close() >= 3  # leading junk, the middle junk or bad frame, the truncated tail


# --- local tail sampling -------------------------------------------------------------------------------


SLOW_MS = 200  # far beyond what a loaded host adds to an empty pipeline (a 20 ms threshold once caught one)
UNTRACKED_MS = 100  # the least untracked time UNTRACKED_TIME reads: the same margin


@pytest.fixture
def no_healthy_traces(make_harness, monkeypatch):
    """Healthy traces are not exported (share 0); traces over SLOW_MS are slow, and UNTRACKED_TIME needs
    UNTRACKED_MS, so that no healthy trace is kept because the host was slow to run it."""
    monkeypatch.setenv("STAGETRACE_HEALTHY_SAMPLE", "0")
    thresholds = stagetrace.DiagnosisThresholds(untracked_min_ms=UNTRACKED_MS)
    return make_harness(slow_threshold_ms=SLOW_MS, settings=stagetrace.Settings(thresholds=thresholds))


def run_healthy_then_slow(healthy: int) -> None:
    run_pipelines(healthy, "healthy")
    with stagetrace.pipeline("slow"), stagetrace.stage("work"):
        time.sleep(SLOW_MS * 1.25 / 1e3)


def test_healthy_traces_are_sampled_but_metrics_see_every_request(no_healthy_traces):
    h = no_healthy_traces
    run_healthy_then_slow(30)
    with pytest.raises(RuntimeError), stagetrace.pipeline("errored"), stagetrace.stage("work"):
        raise RuntimeError("boom")
    with stagetrace.pipeline("diagnosed"):
        with stagetrace.stage("work"):
            time.sleep(0.001)
        time.sleep(UNTRACKED_MS * 1.5 / 1e3)  # untracked time: UNTRACKED_TIME fires (not slow: under SLOW_MS)
    h.flush()
    exported = {s.name for s in h.roots()}
    assert exported == {"slow", "errored", "diagnosed"}
    # every span of a kept trace is exported with it, none of a dropped one
    assert len(h.by_name("work")) == 3
    assert sum(p.count for p in h.metric_points(c.METRIC_TRACE_DURATION)) == 33
    assert len(h.verdicts) == 33


def test_exemplars_point_only_at_kept_traces(no_healthy_traces):
    h = no_healthy_traces
    run_healthy_then_slow(5)
    assert h.handle.runtime.shipper.flush(10)  # spans and metric events in; the metrics not yet collected
    points = h.metric_points(c.METRIC_TRACE_DURATION, flush=False)
    kept = {s.context.trace_id for s in h.roots()}
    exemplar_ids = {e.trace_id for p in points for e in p.exemplars}
    assert exemplar_ids and exemplar_ids <= kept


def test_spans_after_the_root_follow_their_traces_decision(no_healthy_traces):
    h = no_healthy_traces
    from opentelemetry import context

    for name, pause in (("healthy", 0), ("slow", SLOW_MS * 1.25 / 1e3)):
        with stagetrace.pipeline(name):
            with stagetrace.stage("work"):
                time.sleep(pause)
            ctx = context.get_current()
        token = context.attach(ctx)
        with stagetrace.stage(f"after-{name}"):  # background work after the response
            pass
        context.detach(token)
    h.flush()
    assert h.by_name("after-slow") and not h.by_name("after-healthy")


def test_the_healthy_share_is_a_deterministic_function_of_the_trace_id():
    import random

    rng = random.Random(7)
    ids = [rng.getrandbits(128) for _ in range(20_000)]
    share = sum(in_healthy_share(t, 0.1) for t in ids) / len(ids)
    assert 0.09 < share < 0.11
    assert [in_healthy_share(t, 0.1) for t in ids[:100]] == [in_healthy_share(t, 0.1) for t in ids[:100]]
    # independent of a TraceIdRatioBased head sampler, which keeps the ids with small low 64 bits
    head_kept = [t for t in ids if (t & (2**64 - 1)) < 0.5 * 2**64]
    assert 0.08 < sum(in_healthy_share(t, 0.1) for t in head_kept) / len(head_kept) < 0.12
    assert all(in_healthy_share(t, 1.0) for t in ids[:10]) and not any(in_healthy_share(t, 0.0) for t in ids[:10])


@pytest.mark.slow
def test_the_default_keeps_a_tenth_of_healthy_traces(tmp_path):
    code = textwrap.dedent(
        """
        import sys, stagetrace
        h = stagetrace.configure("share", traces_path=sys.argv[1])
        for _ in range(400):
            with stagetrace.pipeline("p"), stagetrace.stage("work"):
                pass
        h.shutdown()
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STAGETRACE_"))}
    env["STAGETRACE_EXPORT_BUDGET"] = "off"  # the share alone (400 traces in a burst are over the budget)
    path = tmp_path / "t.jsonl"
    subprocess.run([sys.executable, "-c", code, str(path)], env=env, check=True, timeout=60)
    roots = Path(path).read_text().count('"name":"p"')
    assert 15 <= roots <= 70  # about 40 of 400


@pytest.mark.slow
def test_an_exporter_that_keeps_dying_is_given_up_and_what_follows_is_counted(make_harness):
    h = make_harness(settings=Settings(exporter_restarts_per_minute=1))
    first = h.handle.exporter_pid
    run_pipelines(1)
    h.handle.force_flush(10)
    os.kill(first, signal.SIGKILL)
    # the first death is restarted: wait for the new exporter itself (the pid is None while it restarts)
    assert wait_until(lambda: h.handle.exporter_pid not in (None, first))
    second = h.handle.exporter_pid
    run_pipelines(1)
    h.handle.force_flush(10)
    os.kill(second, signal.SIGKILL)
    # the second exceeds the allowance: given up, not restarted in a loop
    assert wait_until(lambda: h.handle.exporter_pid is None)
    time.sleep(0.5)
    assert h.handle.exporter_pid is None
    t0 = time.monotonic()
    run_pipelines(5)
    assert h.handle.force_flush(5) is False  # says it could not, at once
    assert time.monotonic() - t0 < 3

    # still counted, in this process (read without a flush: with no exporter a flush reports failure)
    assert wait_until(lambda: dropped(h, "exporter_unavailable", flush=False) >= 5)
