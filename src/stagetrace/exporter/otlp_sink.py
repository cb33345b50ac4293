"""Kept spans to an OTLP/HTTP collector as bytes encoded from the wire tuples (``otlp_encoding``), sent
through the SDK exporter that the ``OTEL_*`` variables configured (its endpoint, headers, compression,
timeout, retries and TLS settings, all its own).

``WireBatchSink`` batches as the SDK's ``BatchSpanProcessor`` does, from the same ``OTEL_BSP_*``
variables: a bounded queue (a full one drops and counts, ``export_queue_full``), a worker thread that sends
a batch when ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` spans wait or every ``OTEL_BSP_SCHEDULE_DELAY``, and a
flush that waits for everything queued before it. Spans of traces the head sampler dropped are not sent,
as the SDK's processor does not send them.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.environment_variables import (
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE,
    OTEL_BSP_MAX_QUEUE_SIZE,
    OTEL_BSP_SCHEDULE_DELAY,
)

from stagetrace._safety import logger, report_internal_error
from stagetrace.common import wire
from stagetrace.exporter.otlp_encoding import TraceRequestEncoder

_FLAGS = wire.SPAN_INDEX["flags"]
_SAMPLED = 0x01  # TraceFlags.SAMPLED


def _bsp_setting(name: str, default: int) -> int:
    """An ``OTEL_BSP_*`` variable as the SDK reads it: an int, else the default (with a warning)."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        logger.warning("stagetrace: %s=%r is not an integer; using %d", name, raw, default)
        return default
    if value <= 0:
        logger.warning("stagetrace: %s=%r must be > 0; using %d", name, raw, default)
        return default
    return value


class WireBatchSink:
    """``send(bytes) -> bool`` is called on the sink's own thread, one request a batch."""

    def __init__(
        self,
        send: Callable[[bytes], bool],
        encoder: TraceRequestEncoder,
        on_drop: Callable[[str, int], None],
        *,
        max_queue_size: int | None = None,
        schedule_delay_s: float | None = None,
        max_export_batch_size: int | None = None,
        abandon: Callable[[], None] | None = None,
    ) -> None:
        self._send = send
        self._encoder = encoder
        self._on_drop = on_drop
        self._abandon = abandon
        self.max_queue_size = max_queue_size or _bsp_setting(OTEL_BSP_MAX_QUEUE_SIZE, 2048)
        self.schedule_delay_s = schedule_delay_s or _bsp_setting(OTEL_BSP_SCHEDULE_DELAY, 5000) / 1000
        self.max_export_batch_size = min(
            max_export_batch_size or _bsp_setting(OTEL_BSP_MAX_EXPORT_BATCH_SIZE, 512), self.max_queue_size
        )
        self._queue: deque[Sequence[Any]] = deque()
        self._cond = threading.Condition()
        self._enqueued = 0  # spans queued so far
        self._done = 0  # ... and sent (or given up on)
        self._last_send = time.monotonic()
        self._flush_wanted = False
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="stagetrace-otlp", daemon=True)
        self._thread.start()

    # --- the exporter core's side ----------------------------------------------------------------------
    def export(self, spans: Sequence[Sequence[Any]]) -> None:
        dropped = 0
        with self._cond:
            if self._stopped:
                return
            for span in spans:
                if not span[_FLAGS] & _SAMPLED:
                    continue
                if len(self._queue) >= self.max_queue_size:
                    dropped += 1
                    continue
                self._queue.append(span)
                self._enqueued += 1
            if len(self._queue) >= self.max_export_batch_size:
                self._cond.notify()
        if dropped:
            self._on_drop("export_queue_full", dropped)

    def flush(self, timeout_s: float) -> bool:
        """Everything queued before the call sent (or given up on), within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._enqueued
            self._flush_wanted = True
            self._cond.notify_all()
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(left)
        return True

    def shutdown(self, timeout_s: float = 30.0) -> bool:
        ok = self.flush(timeout_s)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(max(0.0, timeout_s))
        return ok

    def abandon(self) -> None:
        """Past the shutdown deadline: stop whatever request is retrying (the exporter's own shutdown)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._abandon is not None:
            self._abandon()

    # --- the worker ------------------------------------------------------------------------------------
    def _ready(self, now: float) -> bool:
        queued = len(self._queue)
        if queued >= self.max_export_batch_size:
            return True
        return queued > 0 and (self._flush_wanted or self._stopped or now - self._last_send >= self.schedule_delay_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                while not self._ready(now):
                    if self._queue:
                        self._cond.wait(max(0.001, self._last_send + self.schedule_delay_s - now))
                    else:
                        self._flush_wanted = False
                        if self._stopped:
                            return
                        self._last_send = now  # the next span waits at most one delay
                        self._cond.wait(self.schedule_delay_s)
                    now = time.monotonic()
                count = min(len(self._queue), self.max_export_batch_size)
                batch = [self._queue.popleft() for _ in range(count)]
                self._last_send = now
            self._export(batch)
            with self._cond:
                self._done += count
                self._cond.notify_all()

    def _export(self, batch: list[Sequence[Any]]) -> None:
        try:
            data = self._encoder.encode(batch)
        except Exception:
            data = self._encode_each(batch)
        if not data:
            return
        try:
            self._send(data)  # a failure is the exporter's to log, as on the SDK's own path
        except Exception:
            report_internal_error("OTLP export")

    def _encode_each(self, batch: list[Sequence[Any]]) -> bytes:
        """A batch that failed to encode: span by span, leaving out (and counting) those that cannot be."""
        good, bad = [], 0
        for span in batch:
            try:
                self._encoder.encode([span])
                good.append(span)
            except Exception:
                bad += 1
        if bad:
            self._on_drop("unencodable", bad)
        return self._encoder.encode(good) if good else b""
