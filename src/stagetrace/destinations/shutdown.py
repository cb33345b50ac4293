"""Shutting export down within a deadline, even when the collector is down and an exporter is retrying."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from stagetrace._safety import logger


def shutdown_within(
    deadline_s: float, steps: Sequence[Callable[[], object]], abandon: Sequence[Callable[[], object]]
) -> bool:
    """Run ``steps`` (provider shutdowns) on a worker thread; past ``deadline_s`` call ``abandon`` (the
    exporters' own shutdown, which makes a retrying exporter give up) and return False."""

    def run() -> None:
        for step in steps:
            try:
                step()
            except Exception:
                logger.debug("stagetrace: shutdown step failed", exc_info=True)

    worker = threading.Thread(target=run, name="stagetrace-shutdown", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if not worker.is_alive():
        return True
    logger.warning("stagetrace: shutdown exceeded %.1f s (collector unreachable?); unsent spans dropped", deadline_s)
    for stop in abandon:
        try:
            stop()
        except Exception:
            logger.debug("stagetrace: exporter shutdown failed", exc_info=True)
    worker.join(1.0)
    return False
