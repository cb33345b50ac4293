"""Concurrency: every verdict holds exactly its own trace's stages."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import defaultdict

import stagetrace
from conftest import both_modes
from stagetrace import conventions as c

export_mode = both_modes  # every test here runs with the exporter in a process and on a thread


def expected_stages(i: int) -> list[str]:
    return [f"s{j}" for j in range(i % 5 + 1)]


def check(harness, n):
    spans = harness.spans()
    verdicts = {v.trace_id: v for v in harness.verdicts}
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == n and len(verdicts) == n
    by_trace = defaultdict(list)
    for s in spans:
        if s.parent is not None:
            by_trace[s.context.trace_id].append(s)
    for root in roots:
        i = root.attributes["req.id"]
        stages = by_trace[root.context.trace_id]
        assert sorted(s.name for s in stages) == sorted(expected_stages(i))
        assert {s.attributes["req.id"] for s in stages} == {i}
        assert all(s.parent.span_id == root.context.span_id for s in stages)
        verdict = verdicts[format(root.context.trace_id, "032x")]
        assert set(verdict.breakdown) == set(expected_stages(i))
        assert list(root.attributes[c.STAGES]) == list(verdict.breakdown)


def test_200_concurrent_asyncio_requests(harness):
    async def request(i: int) -> None:
        async with stagetrace.pipeline("req"):
            from opentelemetry import trace

            trace.get_current_span().set_attribute("req.id", i)
            for name in expected_stages(i):
                async with stagetrace.stage(name) as s:
                    s.set_attribute("req.id", i)
                    await asyncio.sleep(random.random() * 0.003)

    async def main() -> None:
        await asyncio.gather(*(request(i) for i in range(200)))

    asyncio.run(main())
    check(harness, 200)


def test_16_threads_interleaving_stages(harness):
    per_thread = 25
    barrier = threading.Barrier(16)

    def worker(t: int) -> None:
        barrier.wait()
        for k in range(per_thread):
            i = t * per_thread + k
            with stagetrace.pipeline("req"):
                from opentelemetry import trace

                trace.get_current_span().set_attribute("req.id", i)
                for name in expected_stages(i):
                    with stagetrace.stage(name) as s:
                        s.set_attribute("req.id", i)
                        time.sleep(0)  # hand the GIL over mid-stage

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    check(harness, 16 * per_thread)
