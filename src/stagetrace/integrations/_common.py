"""What every integration needs: a configured runtime, and a clear error when an extra is missing."""

from __future__ import annotations

import importlib
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
        from stagetrace.setup import configure

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
