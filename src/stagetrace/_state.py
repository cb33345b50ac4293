"""The active runtime, read on every stage entry: one module attribute lookup, None when not configured or
disabled, so an unconfigured or disabled stagetrace costs one branch."""

from __future__ import annotations

from typing import Any

runtime: Any = None
