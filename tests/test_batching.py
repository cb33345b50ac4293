"""Dynamic batching: one execution serving many requests, attributed to each of them (``enqueue`` / ``batch``)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import Counter, defaultdict

import pytest

import stagetrace
from conftest import both_modes, rules_that_cannot_fire
from stagetrace import conventions as c
from stagetrace.common import wire
from stagetrace.exporter import spans as sp
from stagetrace.exporter.keep import PendingBatches, RecentDecisions

export_mode = both_modes

REQUEST_STAGES = ("decode", "infer.queue", "infer", "prep", "forward", "post")


class ThreadBatcher:
    """A small dynamic batcher: requests put (ticket, payload, reply) on a queue; one worker takes up to
    ``max_size`` of them, waiting at most ``max_wait_s`` for the batch to fill."""

    def __init__(self, max_size: int = 16, max_wait_s: float = 0.005, forward_s: float = 0.004) -> None:
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self.forward_s = forward_s
        self.queue: queue.Queue = queue.Queue()
        self.batches: list[list[int]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _take(self) -> list | None:
        first = self.queue.get()
        if first is None:
            return None
        items = [first]
        deadline = time.monotonic() + self.max_wait_s
        while len(items) < self.max_size:
            try:
                item = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self.queue.put(None)
                break
            items.append(item)
        return items

    def _run(self) -> None:
        while (items := self._take()) is not None:
            with stagetrace.batch("infer", [t for t, _, _ in items], max_size=self.max_size):
                with stagetrace.stage("prep"):
                    time.sleep(0.001)
                with stagetrace.stage("forward", kind="gpu"):
                    time.sleep(self.forward_s)
            self.batches.append([payload for _, payload, _ in items])
            for _, payload, reply in items:
                reply.put(payload * 2)

    def submit(self, payload: int) -> int:
        reply: queue.Queue = queue.Queue()
        self.queue.put((stagetrace.enqueue("infer.queue"), payload, reply))
        return reply.get(timeout=30)

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(10)


def by_trace(spans):
    out = defaultdict(list)
    for s in spans:
        out[s.context.trace_id].append(s)
    return out


def check_members(h, n_requests: int) -> None:
    """Every member's trace holds its own stages once plus the batch's stages once, nested under its own
    batch stage, and the batch spans link to exactly the members' batch stages."""
    spans = h.spans()
    traces = by_trace(spans)
    members = {tid: ss for tid, ss in traces.items() if any(s.name.startswith("request") for s in ss)}
    batches = {tid: ss for tid, ss in traces.items() if tid not in members}
    assert len(members) == n_requests
    linked = set()
    for ss in batches.values():
        (root,) = [s for s in ss if s.parent is None]
        assert root.name == "infer" and root.attributes[c.BATCH_SIZE] == len(root.links)
        assert {s.name for s in ss} == {"infer", "prep", "forward"}
        for link in root.links:
            linked.add((link.context.trace_id, link.context.span_id))
    heads = set()
    for tid, ss in members.items():
        names = Counter(s.name for s in ss if s.name != f"request-{tid}")
        assert {n: names[n] for n in REQUEST_STAGES} == dict.fromkeys(REQUEST_STAGES, 1), names
        by_id = {s.context.span_id: s for s in ss}
        (root,) = [s for s in ss if s.parent is None]
        head = next(s for s in ss if s.name == "infer")
        heads.add((tid, head.context.span_id))
        assert head.parent.span_id == root.context.span_id
        assert by_id[next(s for s in ss if s.name == "forward").parent.span_id] is head
        assert by_id[next(s for s in ss if s.name == "prep").parent.span_id] is head
        (link,) = head.links
        (batch_root,) = [s for s in batches[link.context.trace_id] if s.parent is None]
        assert link.context.span_id == batch_root.context.span_id
        batch_id = head.attributes[c.BATCH_ID]
        assert all(s.attributes[c.BATCH_ID] == batch_id for s in ss if s.name in ("infer.queue", "prep", "forward"))
        wait = next(s for s in ss if s.name == "infer.queue")
        assert wait.end_time <= head.start_time
        split = wait.attributes[c.BATCH_FORMATION_MS] + wait.attributes[c.BATCH_BUSY_MS]
        assert split == pytest.approx((wait.end_time - wait.start_time) / 1e6, abs=0.01)
    assert heads == linked


def test_200_concurrent_requests_through_a_thread_batcher(make_harness):
    h = make_harness()
    batcher = ThreadBatcher(max_size=16)
    results = {}
    tracer = h.tracer

    def request(i: int) -> None:
        with tracer.start_as_current_span("request") as span:
            span.update_name(f"request-{span.get_span_context().trace_id}")
            with stagetrace.stage("decode"):
                time.sleep(0.001)
            out = batcher.submit(i)
            with stagetrace.stage("post"):
                results[i] = out

    threads = [threading.Thread(target=request, args=(i,)) for i in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    batcher.stop()
    assert results == {i: 2 * i for i in range(200)}
    assert max(len(b) for b in batcher.batches) <= 16 and len(batcher.batches) < 200
    check_members(h, 200)
    verdicts = h.wait_verdicts(200)
    assert len(verdicts) == 200
    points = h.metric_points(c.METRIC_BATCH_SIZE)
    (point,) = points
    assert point.attributes == {c.STAGE: "infer"}
    assert point.count == len(batcher.batches) and point.sum == 200
    (fill,) = h.metric_points(c.METRIC_BATCH_FILL)
    assert fill.sum == pytest.approx(200 / 16)


def test_a_member_is_charged_the_batch_time_it_lived_never_another_members(make_harness):
    """Two requests in one batch: each breakdown holds its own decode time and the batch's time once."""
    h = make_harness()
    batcher = ThreadBatcher(max_size=2, max_wait_s=1.0, forward_s=0.030)
    tracer = h.tracer
    decode_ms = {0: 5, 1: 25}

    def request(i: int) -> None:
        with tracer.start_as_current_span("request") as span:
            span.update_name(f"request-{span.get_span_context().trace_id}")
            with stagetrace.stage("decode"):
                time.sleep(decode_ms[i] / 1000)
            batcher.submit(i)
            with stagetrace.stage("post"):
                pass

    threads = [threading.Thread(target=request, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    batcher.stop()
    assert [sorted(b) for b in batcher.batches] == [[0, 1]]
    verdicts = sorted(h.wait_verdicts(2), key=lambda v: v.breakdown["decode"])
    assert len(verdicts) == 2
    fast, slow = verdicts
    for v, own in zip((fast, slow), (5, 25)):
        assert own <= v.breakdown["decode"] < own + 15
        assert 30 <= v.breakdown["forward"] < 60  # the whole batch's forward, once
        # everything in the trace adds up to its total: the batch is not counted twice
        assert sum(v.breakdown.values()) + v.untracked_ms == pytest.approx(v.total_ms, abs=0.5)
    # the request that arrived first waited for the second to form the batch (max size 2)
    assert fast.breakdown["infer.queue"] > slow.breakdown["infer.queue"]
    assert fast.breakdown["infer.queue"] >= 15
    spans = h.spans()
    forward = [s for s in spans if s.name == "forward" and c.BATCH_SHARE_MS in s.attributes]
    assert len(forward) == 2
    for s in forward:
        wall_ms = (s.end_time - s.start_time) / 1e6
        assert s.attributes[c.BATCH_SHARE_MS] == pytest.approx(wall_ms / 2, abs=0.01)


def test_asyncio_batcher(make_harness):
    h = make_harness()
    tracer = h.tracer

    async def main() -> dict[int, int]:
        q: asyncio.Queue = asyncio.Queue()

        async def worker() -> None:
            while True:
                first = await q.get()
                items = [first]
                await asyncio.sleep(0.005)
                while not q.empty() and len(items) < 8:
                    items.append(q.get_nowait())
                async with stagetrace.batch("infer", [t for t, _, _ in items], max_size=8):
                    with stagetrace.stage("prep"):
                        time.sleep(0.001)
                    async with stagetrace.stage("forward", kind="gpu"):
                        await asyncio.sleep(0.003)
                for _, payload, fut in items:
                    fut.set_result(payload + 1)

        async def request(i: int) -> int:
            with tracer.start_as_current_span("request") as span:
                span.update_name(f"request-{span.get_span_context().trace_id}")
                with stagetrace.stage("decode"):
                    pass
                fut = asyncio.get_running_loop().create_future()
                await q.put((stagetrace.enqueue("infer.queue"), i, fut))
                out = await fut
                with stagetrace.stage("post"):
                    return out

        task = asyncio.create_task(worker())
        outs = await asyncio.gather(*(request(i) for i in range(40)))
        task.cancel()
        return dict(enumerate(outs))

    assert asyncio.run(main()) == {i: i + 1 for i in range(40)}
    check_members(h, 40)


def test_a_ticket_abandoned_while_queued(make_harness):
    h = make_harness()
    with h.tracer.start_as_current_span("request"):
        ticket = stagetrace.enqueue("infer.queue")
        time.sleep(0.01)  # the client went away: the request ends without its batch
    with stagetrace.batch("infer", [ticket]) as b:  # the worker gets to it later
        with stagetrace.stage("forward"):
            pass
    assert b.size == 1
    spans = h.spans()
    (wait,) = [s for s in spans if s.name == "infer.queue"]
    assert wait.attributes[c.BATCH_ABANDONED] is True
    assert (wait.end_time - wait.start_time) / 1e6 >= 10
    (root,) = [s for s in spans if s.name == "infer" and s.parent is None]
    assert root.links == () or len(root.links) == 0  # the request was gone when the batch ran
    drops = {p.attributes[c.DROP_REASON]: p.value for p in h.metric_points(c.METRIC_DROPPED)}
    assert drops == {"batch_ticket_unused": 1, "batch_ticket_late": 1}


def test_tickets_reused_or_foreign_are_counted_never_raised(make_harness):
    h = make_harness()
    with h.tracer.start_as_current_span("request"):
        ticket = stagetrace.enqueue("infer.queue")
        with stagetrace.batch("infer", [ticket, "not a ticket", None]) as first:
            pass
        with stagetrace.batch("infer", [ticket]) as second:
            pass
    assert (first.size, second.size) == (1, 1)  # what each execution was handed
    drops = {p.attributes[c.DROP_REASON]: p.value for p in h.metric_points(c.METRIC_DROPPED)}
    assert drops == {"batch_not_a_ticket": 2, "batch_ticket_reused": 1}
    heads = [s for s in h.spans() if s.name == "infer" and s.parent is not None]
    assert len(heads) == 1  # one membership, from the first batch


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="items must be >= 1"):
        stagetrace.enqueue("q", items=0)
    with pytest.raises(TypeError, match="items must be an int"):
        stagetrace.enqueue("q", items=1.5)
    with pytest.raises(ValueError, match="max_size must be >= 1"):
        stagetrace.batch("b", [], max_size=0)
    with pytest.raises(TypeError, match="iterable of tickets"):
        stagetrace.batch("b", 3)
    with pytest.raises(ValueError, match="stage kind"):
        stagetrace.batch("b", [], kind="fast")


def test_a_batch_that_raises_marks_every_member_and_reraises_unchanged(make_harness):
    h = make_harness()
    boom = RuntimeError("CUDA out of memory")
    tickets = []
    roots = []
    for _ in range(3):
        span = h.tracer.start_span("request")
        roots.append(span)
        from opentelemetry.trace import use_span

        with use_span(span, end_on_exit=False):
            tickets.append(stagetrace.enqueue("infer.queue"))
    with pytest.raises(RuntimeError) as raised:
        with stagetrace.batch("infer", tickets):
            with stagetrace.stage("forward"):
                raise boom
    assert raised.value is boom
    for span in roots:
        span.end()
    spans = h.spans()
    heads = [s for s in spans if s.name == "infer"]
    assert len(heads) == 4  # the batch span and one stage per member
    for s in heads:
        assert s.status.status_code.name == "ERROR"
    forwards = [s for s in spans if s.name == "forward"]
    assert len(forwards) == 4
    assert all(s.events and s.events[0].attributes["exception.message"] == "CUDA out of memory" for s in forwards)


def test_stagetrace_off_batch_api_is_inert():
    ticket = stagetrace.enqueue("infer.queue", items=3)
    with stagetrace.batch("infer", [ticket], max_size=12) as b:
        pass
    assert (b.size, b.items, b.fill) == (1, 3, 0.25)


def test_a_batch_of_300_links_every_member_in_chunks(make_harness):
    h = make_harness()
    tickets, roots = [], []
    from opentelemetry.trace import use_span

    for _ in range(300):
        span = h.tracer.start_span("request")
        with use_span(span, end_on_exit=False):
            tickets.append(stagetrace.enqueue("infer.queue"))
        roots.append(span)
    with stagetrace.batch("infer", tickets, max_size=512):
        pass
    for span in roots:
        span.end()
    spans = h.spans()
    (root,) = [s for s in spans if s.name == "infer" and s.parent is None]
    chunks = [s for s in spans if s.name == "infer members"]
    assert len(root.links) == 128 and sorted(len(s.links) for s in chunks) == [44, 128]
    assert all(s.parent.span_id == root.context.span_id for s in chunks)
    linked = {(lk.context.trace_id, lk.context.span_id) for s in [root, *chunks] for lk in s.links}
    heads = {(s.context.trace_id, s.context.span_id) for s in spans if s.name == "infer" and s.parent is not None}
    assert len(heads) == 300 and linked == heads


def test_a_members_share_follows_its_tickets_items_not_their_count(harness):
    """One request files two tickets (2 + 1 items), another one ticket of 1 item: of a batch of 4 items the
    first is charged 3/4 of each stage, the second 1/4."""
    from opentelemetry.trace import use_span

    requests = []
    tickets = []
    for items in ((2, 1), (1,)):
        span = harness.tracer.start_span(f"request-{sum(items)}")
        with use_span(span, end_on_exit=False):
            tickets += [stagetrace.enqueue("infer.queue", items=n) for n in items]
        requests.append(span)
    with stagetrace.batch("infer", tickets):
        with stagetrace.stage("forward"):
            time.sleep(0.002)
    for span in requests:
        span.end()
    spans = harness.spans()
    names = {s.context.trace_id: s.name for s in spans if s.name.startswith("request-")}
    shares = {
        names[s.context.trace_id]: s.attributes[c.BATCH_SHARE_MS] / ((s.end_time - s.start_time) / 1e6)
        for s in spans
        if s.name == "forward" and c.BATCH_SHARE_MS in s.attributes
    }
    assert shares == {"request-3": pytest.approx(0.75, abs=0.01), "request-1": pytest.approx(0.25, abs=0.01)}
    assert {s.attributes[c.BATCH_ITEMS] for s in spans if c.BATCH_SHARE_MS in s.attributes} == {4}


def test_batch_span_is_kept_when_a_member_is(make_harness, monkeypatch):
    """The members' keep reasons do not depend on timing (a loaded host can make any request slow or
    diagnosed): one failed, the other is healthy under rules that cannot fire and a threshold it cannot reach."""
    monkeypatch.setenv("STAGETRACE_HEALTHY_SAMPLE", "0")
    h = make_harness(slow_threshold_ms=600_000, thresholds=rules_that_cannot_fire())
    from opentelemetry.trace import StatusCode, use_span

    def run_batch(failed: bool) -> None:
        span = h.tracer.start_span("request")
        with use_span(span, end_on_exit=False):
            ticket = stagetrace.enqueue("infer.queue")
        with stagetrace.batch("infer", [ticket]):
            with stagetrace.stage("forward"):
                pass
        if failed:
            span.set_status(StatusCode.ERROR)
        span.end()  # the member's request ends after its batch, as members do

    run_batch(failed=True)  # errored member: kept, and its batch with it
    run_batch(failed=False)  # healthy member, healthy share 0: neither exported
    spans = h.spans()
    assert [s.name for s in spans if s.name == "request"] == ["request"]
    batch_roots = [s for s in spans if s.name == "infer" and s.parent is None]
    (member_head,) = [s for s in spans if s.name == "infer" and s.parent is not None]
    assert len(batch_roots) == 1 and batch_roots[0].context.trace_id == member_head.links[0].context.trace_id


# --- the pure parts ------------------------------------------------------------------------------------


def test_pending_batches_wait_for_members_bounded():
    decisions = RecentDecisions()
    pending = PendingBatches(decisions, wait_s=5, max_pending=2)
    spans = [("span",)]
    assert pending.offer(100, [1, 2], spans, now=0, fallback=False) == []
    assert pending.member_decided(1, kept=False) == []
    assert pending.member_decided(2, kept=True) == spans and len(pending) == 0
    assert decisions.known(100) is True
    # all members dropped: the batch is dropped
    pending.offer(101, [3, 4], spans, now=0, fallback=True)
    pending.member_decided(3, kept=False)
    assert pending.member_decided(4, kept=False) == [] and decisions.known(101) is False
    assert pending.offer(106, [], spans, now=0, fallback=True) == spans  # no traced member: on its own
    # members decided before the batch arrived
    decisions.remember(5, kept=True)
    assert pending.offer(102, [5], spans, now=0, fallback=False) == spans
    # expiry falls back to the healthy share; overflow settles the oldest
    pending.offer(103, [6], spans, now=0, fallback=True)
    pending.offer(104, [7], [("b",)], now=1, fallback=False)
    assert pending.offer(105, [8], [("c",)], now=2, fallback=False) == spans  # 103 settled, fallback kept
    assert pending.expire(now=6.5) == [] and len(pending) == 1  # 104 expired (at 6), dropped; 105 waits
    assert pending.member_decided(7, kept=True) == []  # too late for 104
    assert pending.expire(now=0, everything=True) == [] and len(pending) == 0


def test_batch_spans_chunks_links():
    links = tuple((i + 1, i + 1, 1, "", {}) for i in range(300))
    root = wire.check_span(
        (
            "infer",
            9,
            10,
            0,
            False,
            1,
            0,
            1,
            {c.BATCH_ID: "x", c.BATCH_SIZE: 300},
            (),
            links,
            0,
            "",
            "s",
            "",
            1,
            "",
            0,
            0,
            0,
        )
    )
    ids = iter(range(1000, 2000))
    out = sp.batch_spans(root, lambda: next(ids))
    assert [len(s.links) for s in out] == [128, 128, 44]
    assert [s.span_id for s in out] == [10, 1000, 1001]
    assert all(s.parent_span_id == 10 for s in out[1:])
    assert out[1].attributes == {c.BATCH_ID: "x"}
    assert sp.batch_spans(wire.replace_span(root, links=links[:5]), lambda: 1) == [
        wire.replace_span(root, links=links[:5])
    ]


def test_continuous_batching_folds_each_members_steps_with_exact_totals(make_harness):
    """A decode step run as batch() over the sequences in it, a thousand steps a generation: each member keeps
    its first few memberships whole and one composite wait and one composite 'decode' stage for the rest,
    whose totals are exactly the batch runs it lived; the request holds O(1) for its steps."""
    from stagetrace.settings import KEEP_REPEATS

    h = make_harness()
    tracer = h.tracer
    steps = 1000
    lived: dict[int, list[tuple[float, float]]] = defaultdict(list)  # trace id -> its batches' (inside, around) s
    held: dict[int, int] = {}

    async def main() -> None:
        q: asyncio.Queue = asyncio.Queue()

        async def worker() -> None:
            while True:
                items = [await q.get()]
                while not q.empty():
                    items.append(q.get_nowait())
                before = time.perf_counter()
                with stagetrace.batch("decode", [t for t, _, _ in items], max_size=4, kind="gpu"):
                    inside = time.perf_counter()
                    with stagetrace.stage("forward", kind="gpu"):
                        time.sleep(0.0002)
                    inside_end = time.perf_counter()
                after = time.perf_counter()
                for _, trace_id, fut in items:
                    lived[trace_id].append((inside_end - inside, after - before))
                    fut.set_result(None)

        async def generation() -> None:
            with tracer.start_as_current_span("generate") as span:
                trace_id = span.get_span_context().trace_id
                for _ in range(steps):
                    fut = asyncio.get_running_loop().create_future()
                    await q.put((stagetrace.enqueue("decode.queue"), trace_id, fut))
                    await fut
                record = stagetrace._state.runtime.lookup_trace(trace_id)
                held[trace_id] = len(record.memberships) + len(record.stages)

        task = asyncio.create_task(worker())
        await asyncio.gather(*(generation() for _ in range(3)))
        task.cancel()

    asyncio.run(main())
    verdicts = {int(v.trace_id, 16): v for v in h.wait_verdicts(3)}
    assert set(verdicts) == set(lived)
    spans = h.spans()
    for trace_id, runs in lived.items():
        assert len(runs) == steps
        assert held[trace_id] <= 2 * KEEP_REPEATS + 2  # its kept memberships and two composites, not a ticket a step
        v = verdicts[trace_id]
        # every step's run counted once, as the member lived it: between the time inside each batch's block and
        # the time around it (the composite's sum and the whole ones')
        inner, outer = (sum(run[i] for run in runs) * 1e3 for i in (0, 1))
        assert inner <= v.breakdown["decode"] <= outer
        own = [s for s in spans if s.context.trace_id == trace_id]
        assert len(own) < 30, len(own)
        (run,) = [s for s in own if s.name == "decode" and c.COMPRESSED_COUNT in s.attributes]
        assert run.attributes[c.COMPRESSED_COUNT] == steps - KEEP_REPEATS
        (wait,) = [s for s in own if s.name == "decode.queue" and c.COMPRESSED_COUNT in s.attributes]
        assert wait.attributes[c.COMPRESSED_COUNT] == steps - KEEP_REPEATS
        whole = [s for s in own if s.name == "decode" and c.COMPRESSED_COUNT not in s.attributes]
        assert len(whole) == KEEP_REPEATS and all(s.attributes.get(c.BATCH_ID) for s in whole)


def test_a_running_request_does_not_keep_finished_members_of_its_batches_alive(make_harness):
    """A batch a live request's tickets still reach (its first memberships) must not hold the records of the
    other, finished requests it served: continuous batching would chain every request of a day that way."""
    import gc

    from stagetrace.capture.records import TraceRecord

    h = make_harness()
    tracer = h.tracer
    finished: list[int] = []

    async def main() -> None:
        q: asyncio.Queue = asyncio.Queue()
        release = asyncio.Event()

        async def worker() -> None:
            while True:
                items = [await q.get()]
                while not q.empty():
                    items.append(q.get_nowait())
                with stagetrace.batch("decode", [t for t, _ in items]):
                    pass
                futures = [fut for _, fut in items]
                del items  # the worker itself holds no request past its batch
                for fut in futures:
                    fut.set_result(None)

        async def generation(steps: int, wait_at_end: bool) -> None:
            with tracer.start_as_current_span("generate") as span:
                for _ in range(steps):
                    fut = asyncio.get_running_loop().create_future()
                    await q.put((stagetrace.enqueue("decode.queue"), fut))
                    await fut
                if wait_at_end:
                    await release.wait()
                else:
                    finished.append(span.get_span_context().trace_id)

        task = asyncio.create_task(worker())
        alive = asyncio.create_task(generation(2, wait_at_end=True))  # in the first batches, then stays
        await asyncio.gather(*(generation(6, wait_at_end=False) for _ in range(20)))
        h.wait_verdicts(20)
        h.flush()  # the helper thread's last batch released
        gc.collect()
        held = [o for o in gc.get_objects() if type(o) is TraceRecord and o.trace_id in finished]
        release.set()
        await alive
        task.cancel()
        assert held == [], f"{len(held)} finished requests' records still reachable"

    asyncio.run(main())
