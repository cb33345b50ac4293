"""``gpu_stage``, ``h2d`` and ``d2h``: GPU stages timed with CUDA events recorded on the current stream.

The request thread only records events (no query, no synchronize); the helper thread reads them once they have
completed. Without CUDA (or before the application initialised it) the same calls time wall clock and still
note copy sizes and whether the source was pinned.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from stagetrace._safety import report_internal_error
from stagetrace.capture.records import StageRecord
from stagetrace.capture.stage import _STAGE_KEY, NULL_STAGE, _get_context, enter_stage, exit_stage, validate_stage_name
from stagetrace.conventions import D2H_BYTES


class Movable(Protocol):
    """What a copy stage needs of its tensor: ``to()`` (and ``numel``/``element_size`` for the bytes)."""

    def to(self, *args: Any, **kwargs: Any) -> Any: ...


T = TypeVar("T")
M = TypeVar("M", bound=Movable)


def _gpu_start(rec: StageRecord | None, device: Any) -> None:
    if rec is None:
        return
    gpu = getattr(rec.runtime, "gpu", None)
    if gpu is None:
        return
    trace = rec.trace
    if trace is not None and len(trace.stages) >= rec.runtime.max_stages_per_trace:
        return  # the stage will be dropped at the per-trace bound: no events to waste on it
    if rec.repeat is not None:
        return  # it folds into its composite with its host time: no events to read
    try:
        gpu.start(rec, gpu.backend.device_index(device) if device is not None else _default_device(gpu))
    except Exception:
        report_internal_error("GPU stage start")
        rec.gpu = None


def _default_device(gpu: Any) -> int | None:
    return gpu.backend.default_device() if gpu.backend.usable() else None


def _gpu_finish(rec: StageRecord | None) -> None:
    if rec is None or rec.gpu is None:
        return
    try:
        rec.runtime.gpu.finish(rec)
    except Exception:
        report_internal_error("GPU stage end")
        rec.gpu = None


class GpuStage:
    """What ``gpu_stage()`` returns: a decorator and (async) context manager, like ``stage()``."""

    __slots__ = ("device", "kind", "name")

    def __init__(self, name: str, kind: str = "gpu", device: Any = None) -> None:
        self.name = validate_stage_name(name)
        self.kind = kind
        self.device = device

    def __enter__(self) -> Any:
        rec = enter_stage(self.name, self.kind, self)
        _gpu_start(rec, self.device)
        return rec or NULL_STAGE

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        rec = _get_context().get(_STAGE_KEY)
        if rec is not None and rec.owner is self and not rec.end_ns:
            _gpu_finish(rec)
            exit_stage(rec, exc)

    async def __aenter__(self) -> Any:
        rec = enter_stage(self.name, self.kind, self, sync=False)
        _gpu_start(rec, self.device)
        return rec or NULL_STAGE

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    def __call__(self, fn: Any) -> Any:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                async with GpuStage(self.name, self.kind, self.device):
                    return await fn(*args, **kwargs)

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with GpuStage(self.name, self.kind, self.device):
                return fn(*args, **kwargs)

        return wrapper


def gpu_stage(name: str, device: Any = None) -> GpuStage:
    """A stage charged its GPU time: CUDA events on the current stream of ``device`` (default: the current
    CUDA device), resolved off-thread. Use it around the model's forward pass."""
    return GpuStage(name, "gpu", device)


def _note_copy(rec: StageRecord | None, tensor: Any, kind: str) -> None:
    """Bytes, and for an H2D copy whether the source was pinned: asked only once the application has
    initialised CUDA (``Tensor.is_pinned`` can create a CUDA context), else left unknown."""
    if rec is None:
        return
    try:
        nbytes = int(tensor.numel()) * int(tensor.element_size())
        if kind == "h2d":
            rec.h2d_bytes = nbytes
            gpu = getattr(rec.runtime, "gpu", None)
            rec.h2d_pinned = gpu.backend.is_pinned(tensor) if gpu is not None else None
        else:
            rec.set_attribute(D2H_BYTES, nbytes)
    except Exception:
        report_internal_error("copy metadata")


def timed_copy(name: str, kind: str, tensor: Any, event_device: Any, copy: Callable[[], T]) -> T:
    """Run ``copy()`` (the caller's own ``to()`` call, arguments untouched) as an ``h2d`` / ``d2h`` stage:
    bytes, pinned-ness, and CUDA events around it on ``event_device``'s current stream. Returns exactly
    what ``copy()`` returns."""
    rec = enter_stage(name, kind)
    _gpu_start(rec, event_device)
    try:
        out = copy()
    except BaseException as e:
        _gpu_finish(rec)
        _note_copy(rec, tensor, kind)
        exit_stage(rec, e)
        raise
    _gpu_finish(rec)
    _note_copy(rec, tensor, kind)  # after the copy, which is what initialises CUDA in a fresh process
    exit_stage(rec, None)
    return out


def h2d(tensor: M, device: Any, non_blocking: bool = True, *, name: str = "h2d") -> M:
    """``tensor.to(device, non_blocking=...)`` as an ``h2d`` stage: bytes, whether the source was pinned,
    and the copy's GPU time. A pageable source makes a non-blocking copy synchronous (PAGEABLE_H2D)."""
    return timed_copy(name, "h2d", tensor, device, lambda: tensor.to(device, non_blocking=non_blocking))


def d2h(tensor: M, non_blocking: bool = False, *, name: str = "d2h") -> M:
    """``tensor.to("cpu")`` as a ``d2h`` stage. The copy's GPU time is measured between events on the source
    stream, so the host time spent waiting for earlier kernels (inference) is not charged to it."""
    device = getattr(tensor, "device", None)
    return timed_copy(name, "d2h", tensor, device, lambda: tensor.to("cpu", non_blocking=non_blocking))


__all__ = ["d2h", "gpu_stage", "h2d"]
