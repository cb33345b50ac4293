"""What every integration needs: a configured runtime, and a clear error when an extra is missing."""

from __future__ import annotations

import importlib
import threading
from typing import Any

from stagetrace import _state
from stagetrace._safety import logger
from stagetrace.settings import disabled_from_env


def require(module: str, feature: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(
            f"{feature} needs the `{module}` package, which is not installed. Install it with: "
            f"pip install 'stagetrace[{extra}]'"
        ) from e


def ensure_configured() -> Any:
    """The active runtime, configuring stagetrace with its defaults (OTEL_* or the embedded file) if the
    application has not called ``configure()`` yet. None when stagetrace is disabled."""
    if _state.runtime is None:
        from stagetrace.configuration import configure

        if disabled_from_env():
            return None
        logger.info("stagetrace: not configured yet; configuring with defaults")
        configure()
    return _state.runtime


class Patch:
    """One attribute replaced on a class or module, restorable. ``apply`` is idempotent."""

    def __init__(self, owner: Any, name: str, make: Any) -> None:
        self.owner = owner
        self.name = name
        self.make = make
        self.original: Any = None
        self.applied = False

    def apply(self) -> None:
        if self.applied:
            return
        self.original = getattr(self.owner, self.name)
        if getattr(self.original, "__stagetrace_wrapped__", False):
            return
        wrapper = self.make(self.original)
        wrapper.__stagetrace_wrapped__ = True
        wrapper.__wrapped__ = self.original
        setattr(self.owner, self.name, wrapper)
        self.applied = True

    def restore(self) -> None:
        if self.applied:
            setattr(self.owner, self.name, self.original)
            self.applied = False


class Occupancy:
    """Tasks handed to a worker pool and not finished yet, counted by our own wrappers, per pool.

    A pool's own state lags behind a burst: anyio yields before a task takes its token, and a new executor
    thread takes a while to pick its task up, so at submission every arrival of a burst finds the pool
    looking free. Counting what was handed over says, at submission and deterministically, whether every
    worker is already spoken for: then the wait that follows is a queue, not dispatch latency.
    """

    __slots__ = ("_counts", "_lock")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()

    def enter(self, pool: object) -> int:
        """Count one more task for ``pool``; returns how many were there before it."""
        key = id(pool)
        with self._lock:
            before = self._counts.get(key, 0)
            self._counts[key] = before + 1
        return before

    def leave(self, pool: object) -> None:
        key = id(pool)
        with self._lock:
            left = self._counts.get(key, 0) - 1
            if left > 0:
                self._counts[key] = left
            else:
                self._counts.pop(key, None)

    def __len__(self) -> int:
        return len(self._counts)
