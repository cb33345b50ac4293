"""Containment: no exception from stagetrace's own code may reach the application."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("stagetrace")

F = TypeVar("F", bound=Callable[..., Any])


class RateLimitedLog:
    """At most ``per_interval`` records per ``interval_s`` for one key; the rest are counted, so an error on
    every request costs a counter increment, not a log line. What a window left out is said once: on the
    window's next record, or by ``report_suppressed`` when the window has closed with none (called
    periodically) and at shutdown (``final``), so that a count is never lost with a quiet end."""

    def __init__(self, per_interval: int = 5, interval_s: float = 60.0) -> None:
        self._per_interval = per_interval
        self._interval_s = interval_s
        self._lock = threading.Lock()
        # key -> [window_start, emitted, suppressed, level]
        self._windows: dict[str, list[float | int]] = {}

    def allow(self, key: str, level: int = logging.WARNING) -> tuple[bool, int]:
        """Returns (emit now?, records suppressed in the window that just closed)."""
        now = time.monotonic()
        with self._lock:
            w = self._windows.get(key)
            if w is None or now - w[0] >= self._interval_s:
                suppressed = int(w[2]) if w else 0
                self._windows[key] = [now, 1, 0, level]
                return True, suppressed
            if w[1] < self._per_interval:
                w[1] += 1
                return True, 0
            w[2] += 1
            return False, 0

    def log(self, level: int, key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        emit, suppressed = self.allow(key, level)
        if not emit:
            return
        if suppressed:
            msg = msg + f" ({suppressed} similar messages suppressed)"
        logger.log(level, msg, *args, exc_info=exc_info)

    def report_suppressed(self, *, final: bool = False) -> int:
        """Log, per key, the records left out of a window that has closed (every window's with ``final``);
        returns how many were reported."""
        now = time.monotonic()
        said = []
        with self._lock:
            for key, w in list(self._windows.items()):
                closed = now - w[0] >= self._interval_s
                if w[2] and (closed or final):
                    said.append((key, int(w[2]), int(w[3]), now - w[0]))
                    w[2] = 0
                if closed:
                    del self._windows[key]
        for key, n, level, seconds in said:
            logger.log(
                level,
                "stagetrace: %d more %s records were not logged in the last %.0f s (at most %d per %.0f s)",
                n,
                key,
                min(seconds, self._interval_s),
                self._per_interval,
                self._interval_s,
            )
        return sum(n for _, n, _, _ in said)


internal_errors = RateLimitedLog()


def report_internal_error(where: str) -> None:
    internal_errors.log(logging.ERROR, where, "stagetrace internal error in %s (contained)", where, exc_info=True)


def at_fork_in_child(obj: object, method: str) -> None:
    """Call ``obj.<method>()`` in a forked child, without keeping ``obj`` alive for it."""
    ref = weakref.ref(obj)

    def hook() -> None:
        target = ref()
        if target is not None:
            getattr(target, method)()

    os.register_at_fork(after_in_child=hook)


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, msg: str, *args: Any) -> None:
    """One warning per process for a feature that switched itself off."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(msg, *args)
