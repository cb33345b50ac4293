"""The event-loop wait: a request that was ready while other requests' sync stages held its loop gets an
``event_loop.wait`` stage naming them (``stagetrace.blocked_by``), and each blocking stage says how many
other requests were on its loop (``stagetrace.delayed_requests``). The arithmetic with controlled intervals,
the capture on a real loop, and a real uvicorn under concurrent clients."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from fastapi import FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.trace import format_trace_id

import stagetrace
from scenarios.corpus import busy
from servers import run_scenario
from stagetrace import conventions as c
from stagetrace.analysis.loopwait import LoopBlock, loop_waits
from stagetrace.capture.loopblocks import LoopBlockBuffer
from stagetrace.exporter.signals import LoopBlockSeries

MS = 1_000_000
T = 7  # the loop's thread


def block(start_ms, end_ms, trace_id, name="decode"):
    return LoopBlock(int(start_ms * MS), int(end_ms * MS), T, trace_id, name)


def ms(waits):
    return [(w.start_ns / MS, w.end_ns / MS) for w in waits]


def test_the_wait_is_others_blocks_inside_the_window_minus_the_requests_own_stages():
    blocks = [
        block(0, 30, 2, "resize"),  # starts before the request: only 10-30 counts
        block(30, 50, 1, "own"),  # the request's own block is its own time
        block(50, 80, 3, "decode"),  # the request ran a worker-thread stage 60-70 meanwhile
        block(90, 120, 4, "late"),  # runs past the request's end at 100
    ]
    waits = loop_waits((10 * MS, 100 * MS), [(60 * MS, 70 * MS)], blocks, trace_id=1)
    assert ms(waits) == [(10, 30), (50, 60), (70, 80), (90, 100)]
    assert [w.blockers for w in waits] == [
        (("resize", 2, 20 * MS),),
        (("decode", 3, 10 * MS),),
        (("decode", 3, 10 * MS),),
        (("late", 4, 10 * MS),),
    ]


def test_back_to_back_blockers_make_one_stretch_naming_both_longest_first():
    waits = loop_waits((0, 100 * MS), [], [block(10, 20, 2, "a"), block(20, 50, 3, "b")], trace_id=1)
    assert ms(waits) == [(10, 50)]
    assert waits[0].blockers == (("b", 3, 30 * MS), ("a", 2, 10 * MS))


def test_stretches_shorter_than_the_minimum_and_windows_without_blockers_give_nothing():
    blocks = [block(10, 20, 2)]
    assert loop_waits((0, 100 * MS), [(10 * MS, 19_950_000)], blocks, trace_id=1, min_ns=100_000) == []
    assert loop_waits((30 * MS, 40 * MS), [], blocks, trace_id=1) == []
    assert loop_waits((0, 100 * MS), [], [], trace_id=1) == []


def test_the_exporters_block_series_answers_per_thread_in_end_order_and_skips_malformed_entries():
    series = LoopBlockSeries(max_blocks=4)
    series.extend(
        [
            (50 * MS, 60 * MS, T, 3, "c"),
            (10 * MS, 20 * MS, T, 2, "a"),  # arrives late: still found in order
            (10 * MS, 20 * MS, 99, 5, "other loop"),
            ("x", 1, T, 1, "bad"),
            (1, 2, 3),
        ]
    )
    assert [b.name for b in series.overlapping(T, 0, 100 * MS)] == ["a", "c"]
    assert [b.name for b in series.overlapping(T, 20 * MS, 55 * MS)] == ["c"]
    assert series.overlapping(T, 60 * MS, 70 * MS) == [] and series.overlapping(42, 0, 100 * MS) == []
    series.extend([(i * MS, i * MS + 1, T, 9, "n") for i in range(100, 104)])  # bounded: the oldest go
    assert len(series) <= 5 and series.overlapping(T, 0, 30 * MS) == []


def test_only_outermost_sync_stages_of_at_least_a_millisecond_on_the_loop_are_noted(harness):
    rt = harness.handle.runtime
    rt.loop_blocks = LoopBlockBuffer()  # one the helper thread does not drain, to read it here

    async def request():
        async with stagetrace.pipeline("request"):
            with stagetrace.stage("outer"):
                with stagetrace.stage("inner"):
                    busy(3)
            with stagetrace.stage("short"):
                pass

    asyncio.run(request())
    blocks = rt.loop_blocks.drain()
    assert [b[4] for b in blocks] == ["outer"]
    start, end, thread, trace_id, _ = blocks[0]
    assert end - start >= MS and thread != 0 and trace_id != 0


def test_a_blocking_stage_counts_the_other_requests_in_flight_on_its_loop(harness):
    async def request(name: str, gate: asyncio.Event, hold: bool) -> None:
        async with stagetrace.pipeline(name):
            if hold:
                await gate.wait()
                with stagetrace.stage("resize"):
                    busy(2)
            else:
                gate.set()
                await asyncio.sleep(0.02)

    async def main() -> None:
        gate = asyncio.Event()
        await asyncio.gather(
            request("victim-a", gate, False), request("victim-b", gate, False), request("x", gate, True)
        )

    asyncio.run(main())
    harness.wait_verdicts(3)
    (resize,) = harness.by_name("resize")
    assert resize.attributes[c.DELAYED_REQUESTS] == 2
    (x,) = harness.by_name("x")
    assert x.attributes[c.DELAYED_REQUESTS] == 2
    victim = next(v for v in harness.verdicts if v.root_name == "victim-a")
    assert victim.blocked_by == (f"resize@{format_trace_id(x.context.trace_id)}",)
    (wait,) = [s for s in harness.by_name(c.EVENT_LOOP_WAIT) if s.context.trace_id == int(victim.trace_id, 16)]
    assert wait.attributes[c.STAGE_KIND] == "wait" and wait.attributes[c.BLOCKED_BY] == victim.blocked_by
    assert wait.end_time - wait.start_time == pytest.approx(resize.end_time - resize.start_time, rel=0.05)


def test_event_loop_wait_is_a_reserved_stage_name():
    with pytest.raises(ValueError, match="reserved"):
        stagetrace.stage(c.EVENT_LOOP_WAIT)


@pytest.mark.slow  # a real server: out of the quick loop and of the mutation run
def test_requests_waiting_for_a_loop_held_by_others_name_what_held_it(harness):
    app = FastAPI()

    @app.get("/resize")
    async def resize():
        await asyncio.sleep(0.02)  # ready again after 20 ms, while other requests' resize holds the loop
        with stagetrace.stage("resize"):  # sync CPU work on the loop thread
            busy(40)
        return {}

    verdicts = run_scenario(harness, app, "/resize", n=12, concurrency=4)
    by_trace = {v.trace_id: v for v in verdicts}
    victims = [v for v in verdicts if c.EVENT_LOOP_WAIT in v.breakdown]
    assert victims, "four clients at once: some request was ready while another's resize held the loop"
    # The blockers of waits inside a victim's server span knew it was in flight; a wait before its server
    # span began (capture/arrival.py) may be behind a blocker that could not know of it yet.
    framework_start = {
        format_trace_id(s.context.trace_id): s.attributes.get(c.ROOT_FRAMEWORK_START_NS, s.start_time)
        for s in harness.roots()
    }
    inside = {
        (format_trace_id(s.context.trace_id), entry)
        for s in harness.by_name(c.EVENT_LOOP_WAIT)
        if s.start_time >= framework_start[format_trace_id(s.context.trace_id)]
        for entry in s.attributes[c.BLOCKED_BY]
    }
    for v in victims:
        assert v.blocked_by, (v.breakdown, v.total_ms)
        for entry in v.blocked_by:
            name, trace_id = entry.split("@")
            assert name == "resize" and trace_id != v.trace_id and trace_id in by_trace
            if (v.trace_id, entry) in inside:
                assert (by_trace[trace_id].delayed_requests or 0) >= 1  # the blocker knows it delayed someone
        assert v.breakdown[c.EVENT_LOOP_WAIT] <= v.total_ms
        d = next((d for d in v.diagnoses if d.code == "EVENT_LOOP_BLOCKED"), None)
        assert d is not None
        if d.stage == c.EVENT_LOOP_WAIT:
            assert "'resize' of trace " in (d.evidence or "")
    slowest = max(victims, key=lambda v: v.breakdown[c.EVENT_LOOP_WAIT])
    assert slowest.breakdown[c.EVENT_LOOP_WAIT] >= 20  # at least half a resize waited out


def test_a_request_running_on_a_worker_thread_meanwhile_is_not_waiting_for_the_loop(harness):
    import concurrent.futures

    from stagetrace.integrations.threads import propagate_context_to_threads, stop_propagating_context

    pool = concurrent.futures.ThreadPoolExecutor(1)
    propagate_context_to_threads()
    try:

        async def offloaded(started: asyncio.Event) -> None:
            async with stagetrace.pipeline("offloaded"):
                loop = asyncio.get_running_loop()
                started.set()
                await loop.run_in_executor(pool, time.sleep, 0.06)  # its own work, no stage of its own
                await asyncio.sleep(0.03)  # then ready at once: held only by what still runs on the loop

        async def blocker(started: asyncio.Event) -> None:
            async with stagetrace.pipeline("blocker"):
                await started.wait()
                await asyncio.sleep(0.005)
                with stagetrace.stage("resize"):  # 5..45 ms: inside the other request's worker run
                    busy(40)

        async def main() -> None:
            started = asyncio.Event()
            await asyncio.gather(offloaded(started), blocker(started))

        asyncio.run(main())
    finally:
        stop_propagating_context()
        pool.shutdown()
    harness.wait_verdicts(2)
    v = next(v for v in harness.verdicts if v.root_name == "offloaded")
    assert c.EVENT_LOOP_WAIT not in v.breakdown, v.breakdown


@settings(max_examples=300, deadline=None)
@given(
    st.tuples(st.integers(0, 40), st.integers(0, 40)).map(sorted),
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)).map(sorted), max_size=5),
    st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(1, 3)), max_size=5),
)
def test_the_wait_equals_a_point_by_point_count(window, own, raw_blocks):
    """Against a brute force over 1-unit cells: the wait covers exactly the cells of the window under some
    other trace's block and under none of the request's own intervals, and each stretch lists exactly the
    blocks that overlap it, with their overlap."""
    blocks = [LoopBlock(min(a, b), max(a, b), T, tid, f"s{i}") for i, (a, b, tid) in enumerate(raw_blocks)]
    waits = loop_waits(tuple(window), [tuple(o) for o in own], blocks, trace_id=1)
    expected = {
        x
        for x in range(window[0], window[1])
        if any(b.trace_id != 1 and b.start_ns <= x < b.end_ns for b in blocks)
        and not any(o[0] <= x < o[1] for o in own)
    }
    got = {x for w in waits for x in range(w.start_ns, w.end_ns)}
    assert got == expected
    assert all(w.end_ns > w.start_ns for w in waits)  # no empty stretches
    assert all(a.end_ns < b.start_ns for a, b in itertools.pairwise(waits))  # separate stretches, in order
    for w in waits:
        listed = {(name, tid, ns) for name, tid, ns in w.blockers}
        overlapping = {
            (b.name, b.trace_id, min(w.end_ns, b.end_ns) - max(w.start_ns, b.start_ns))
            for b in blocks
            if b.trace_id != 1 and min(w.end_ns, b.end_ns) > max(w.start_ns, b.start_ns)
        }
        assert listed == overlapping
        assert [h[2] for h in w.blockers] == sorted((h[2] for h in w.blockers), reverse=True)


def test_stretches_as_long_as_the_minimum_are_kept_wherever_they_come():
    blocks = [block(0, 0.05, 2), block(10, 10.1, 3)]  # a 50 us stretch first, then one of exactly 100 us
    waits = loop_waits((0, 100 * MS), [], blocks, trace_id=1, min_ns=100_000)
    assert ms(waits) == [(10, 10.1)]
    assert loop_waits((0, 100 * MS), [], [block(10, 10.1, 3)], trace_id=1)[0].blockers == (("decode", 3, 100_000),)


def test_several_own_stages_inside_one_blocked_stretch_are_all_taken_out():
    own = [(10 * MS, 12 * MS), (20 * MS, 22 * MS), (30 * MS, 32 * MS)]
    waits = loop_waits((0, 100 * MS), own, [block(0, 50, 2)], trace_id=1)
    assert ms(waits) == [(0, 10), (12, 20), (22, 30), (32, 50)]


def test_many_stretches_fold_and_are_charged_once(harness):
    """A request held back again and again (more stretches than KEEP_REPEATS) gets its waits folded into a
    composite, with the slowest kept as an example: the wait is charged once, never more than the request."""
    import httpx

    app = FastAPI()

    @app.get("/victim")
    async def victim():
        for _ in range(12):
            await asyncio.sleep(0.001)  # ready again at once, while the hog's stage holds the loop
        return {}

    @app.get("/hog")
    async def hog():
        for _ in range(12):
            with stagetrace.stage("resize"):
                busy(6)
            await asyncio.sleep(0)
        return {}

    stagetrace.instrument_fastapi(app)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            await asyncio.gather(client.get("/hog"), client.get("/victim"))

    asyncio.run(main())
    verdicts = harness.wait_verdicts(2)
    (v,) = [v for v in verdicts if v.root_name.endswith("/victim")]
    waits = [s for s in harness.by_name(c.EVENT_LOOP_WAIT) if format_trace_id(s.context.trace_id) == v.trace_id]
    folded = [s for s in waits if c.COMPRESSED_COUNT in s.attributes]
    assert folded, [(s.start_time, s.end_time) for s in waits]  # more stretches than are kept whole
    whole = [s for s in waits if c.COMPRESSED_COUNT not in s.attributes and not s.attributes.get(c.COMPRESSED_SLOWEST)]
    lived = sum(s.end_time - s.start_time for s in whole) / 1e6 + sum(s.attributes[c.COMPRESSED_SUM_MS] for s in folded)
    assert v.breakdown[c.EVENT_LOOP_WAIT] == pytest.approx(lived, abs=0.01)
    assert v.breakdown[c.EVENT_LOOP_WAIT] <= v.total_ms
