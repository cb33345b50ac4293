"""A small dynamic batcher, instrumented with ``stagetrace.enqueue`` / ``stagetrace.batch``: the pattern of
Triton's dynamic batcher or Ray Serve's ``@serve.batch`` in a few lines, for the demo's optimized pipeline.

Requests (asyncio tasks) put their payload and a ticket on a queue; one worker thread takes up to
``max_size`` of them, waiting at most ``max_wait_s`` for the batch to fill, runs them as one batch and
hands each request its own result.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import stagetrace


class DynamicBatcher:
    def __init__(
        self,
        run_batch: Callable[[list[Any]], list[Any]],
        *,
        name: str = "infer.batch",
        max_size: int = 8,
        max_wait_s: float = 0.004,
    ) -> None:
        self.run_batch = run_batch
        self.name = name
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=f"batcher-{name}", daemon=True)
        self._thread.start()

    async def submit(self, payload: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((stagetrace.enqueue(f"{self.name}.queue"), payload, loop, future))
        return await future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _take(self) -> list[Any] | None:
        first = self._queue.get()
        if first is None:
            return None
        items = [first]
        deadline = time.monotonic() + self.max_wait_s
        while len(items) < self.max_size:
            timeout = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            items.append(item)
        return items

    def _serve(self) -> None:
        while (items := self._take()) is not None:
            try:
                with stagetrace.batch(self.name, [ticket for ticket, *_ in items], max_size=self.max_size):
                    results = self.run_batch([payload for _, payload, _, _ in items])
            except Exception as e:
                for _, _, loop, future in items:
                    loop.call_soon_threadsafe(_settle, future, None, e)
                continue
            for (_, _, loop, future), result in zip(items, results):
                loop.call_soon_threadsafe(_settle, future, result, None)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the request was cancelled while its batch ran
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
