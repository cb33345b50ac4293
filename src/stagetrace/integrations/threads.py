"""Context into worker threads: ``ThreadPoolExecutor.submit`` (and so ``loop.run_in_executor``) runs the
function in a copy of the submitter's context, so stages in workers land in the request's trace.
(``asyncio.to_thread`` and starlette's ``run_in_threadpool`` already copy it.)"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
from typing import Any

from stagetrace.integrations._common import Patch


def _make_submit(original: Any) -> Any:
    @functools.wraps(original)
    def submit(self: Any, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        ctx = contextvars.copy_context()
        return original(self, ctx.run, fn, *args, **kwargs)

    return submit


SUBMIT = Patch(concurrent.futures.ThreadPoolExecutor, "submit", _make_submit)


def propagate_context_to_threads() -> None:
    SUBMIT.apply()


def stop_propagating_context() -> None:
    SUBMIT.restore()
