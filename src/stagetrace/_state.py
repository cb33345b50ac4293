"""The active runtime, read on every stage entry: one module attribute lookup, None when not configured or
disabled, so an unconfigured or disabled stagetrace costs one branch."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stagetrace.runtime import Runtime

runtime: Runtime | None = None
