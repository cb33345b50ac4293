"""Automatic stages (opt-in, one switch: ``STAGETRACE_AUTO_STAGES=true`` or ``auto_stages.instrument()``).

Without decorating anything, these become stages:

| what | stage | kind |
|---|---|---|
| PIL image decode (``ImageFile.load``) and ``Image.resize`` | ``decode``, ``resize`` | cpu |
| ``torchvision.transforms.Compose.__call__`` | ``transforms`` | cpu |
| a Hugging Face tokenizer call (``PreTrainedTokenizerBase.__call__``) | ``tokenize`` | cpu |
| torch copies between host and device (``Tensor.to``) | ``h2d``, ``d2h`` | h2d, d2h |
| the forward of the outermost ``nn.Module`` call | ``forward`` | its device's: cpu, or gpu (**) |
| FastAPI's response serialisation (``serialize_response``) (*) | ``serialize`` | cpu |

(*) unless FastAPI's own telemetry already times it as ``fastapi.serialization``, which is then the stage.
(**) timed with CUDA events on the module's own device when it is a CUDA device; on any other device (MPS,
XPU, ``meta``, ...) a ``gpu`` stage timed on the host: no CUDA event can time that device's work, and the work
is the device's, not the CPU's, so the CPU rules do not judge it.

Only libraries that are installed are patched; ``uninstrument()`` restores every original. Nested calls
(a module inside a module, ``load`` inside ``resize``) become one stage, the outermost; a module called
inside another automatic stage (a torchvision transform inside ``transforms``) is part of it, and a module
with no parameters given no tensor is no ``forward``.
"""

from __future__ import annotations

import contextvars
import functools
import importlib.util
import itertools
from typing import Any

from opentelemetry.trace import get_current_span

from stagetrace._safety import report_internal_error
from stagetrace.capture.gpu import GpuStage, timed_copy
from stagetrace.capture.stage import Stage, enter_stage, exit_stage
from stagetrace.conventions import FOREIGN_STAGES
from stagetrace.integrations._common import Patch

_inside: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("stagetrace_auto", default=frozenset())


def _stage_wrapper(name: str, kind: str = "cpu", when: Any = None) -> Any:
    """A patch factory: time ``original`` as stage ``name`` unless one of the same name is already open,
    or ``when(self)`` says this call does no real work."""

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            inside = _inside.get()
            if name in inside or (when is not None and args and not when(args[0])):
                return original(*args, **kwargs)
            token = _inside.set(inside | {name})
            rec = enter_stage(name, kind)
            try:
                result = original(*args, **kwargs)
            except BaseException as e:
                exit_stage(rec, e)
                raise
            finally:
                _inside.reset(token)
            exit_stage(rec, None)
            return result

        return wrapper

    return make


def _serialize_response(original: Any) -> Any:
    """``serialize`` unless FastAPI's own ``fastapi.serialization`` span (read as a stage) already times it."""
    staged = Stage("serialize", "cpu")(original)

    @functools.wraps(original)
    async def serialize_response(*args: Any, **kwargs: Any) -> Any:
        span = get_current_span()
        scope = getattr(getattr(span, "instrumentation_scope", None), "name", None)
        if (scope, getattr(span, "name", None)) in FOREIGN_STAGES:
            return await original(*args, **kwargs)
        return await staged(*args, **kwargs)

    return serialize_response


def copy_kind(source_type: str, target: Any) -> str | None:
    """'h2d' / 'd2h' when a ``to()`` moves a tensor between host and a device, else None (dtype casts,
    same-device moves)."""
    if target is None:
        return None
    text = str(getattr(target, "type", target))
    target_type = text.split(":", 1)[0]
    if target_type not in ("cpu", "cuda", "xpu", "mps"):
        return None
    if source_type == "cpu" and target_type != "cpu":
        return "h2d"
    if source_type != "cpu" and target_type == "cpu":
        return "d2h"
    return None


def _tensor_to(original: Any) -> Any:
    """Host<->device copies become ``h2d`` / ``d2h`` stages; the call itself is the caller's, with every
    argument as given (device, dtype, ``non_blocking``, ``copy``, ``memory_format``, positional or not),
    so that instrumentation never changes what the program does (``nn.Module.to`` relies on it)."""

    @functools.wraps(original)
    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, str) or type(target).__name__ == "device":
            kind = copy_kind(self.device.type, target)
            if kind is not None and "copy" not in _inside.get():
                token = _inside.set(_inside.get() | {"copy"})
                try:
                    event_device = target if kind == "h2d" else self.device
                    return timed_copy(kind, kind, self, event_device, lambda: original(self, *args, **kwargs))
                finally:
                    _inside.reset(token)
        return original(self, *args, **kwargs)

    return to


def module_device(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Where a module's forward runs: the device of its first parameter or buffer, else of its first tensor
    argument; None for a module with neither (a torchvision transform given a PIL image)."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    for value in itertools.chain(args, kwargs.values()):
        device = getattr(value, "device", None)
        if device is not None and hasattr(value, "dtype"):
            return device
    return None


def module_device_type(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The type of ``module_device`` (``cpu``, ``cuda``, ``mps``, ...), or None."""
    device = module_device(module, args, kwargs)
    return None if device is None else str(getattr(device, "type", device))


def forward_stage(device: Any) -> Stage | GpuStage:
    """The ``forward`` stage for a module on ``device``: ``cpu`` on the CPU (judged by the CPU rules like any
    CPU stage); ``gpu`` timed with CUDA events on the current stream of the module's own CUDA device (not
    the current default device, which may be another one); ``gpu`` timed on the host on any other device
    (MPS, XPU, ``meta``, ...), where CUDA events cannot time the work, which is still the device's and not
    the CPU's."""
    device_type = str(getattr(device, "type", device))
    if device_type == "cpu":
        return Stage("forward", "cpu")
    if device_type == "cuda":
        return GpuStage("forward", "gpu", device)
    return Stage("forward", "gpu")


def _module_call(original: Any) -> Any:
    """The outermost module call is the ``forward`` stage, of the kind of the device it runs on
    (``forward_stage``). A module called inside another automatic stage (a torchvision transform inside
    ``transforms``, a layer inside the model's forward) is part of that stage, not a forward of its own."""

    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        inside = _inside.get()
        if inside:
            return original(self, *args, **kwargs)
        try:
            device = module_device(self, args, kwargs)
            stage = None if device is None else forward_stage(device)
        except Exception:  # an odd module or device: its call goes on, unstaged
            report_internal_error("automatic forward stage")
            stage = None
        if stage is None:
            return original(self, *args, **kwargs)
        token = _inside.set(inside | {"forward"})
        try:
            with stage:
                return original(self, *args, **kwargs)
        finally:
            _inside.reset(token)

    return __call__


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _patches() -> list[Patch]:
    found: list[Patch] = []
    if _available("PIL"):
        from PIL import Image, ImageFile

        found += [
            # load() on an image already decoded has no tiles left and returns at once: not a stage
            Patch(ImageFile.ImageFile, "load", _stage_wrapper("decode", when=lambda im: bool(im.tile))),
            Patch(Image.Image, "resize", _stage_wrapper("resize")),
        ]
    if _available("torchvision"):
        import torchvision.transforms as transforms

        found.append(Patch(transforms.Compose, "__call__", _stage_wrapper("transforms")))
    if _available("transformers"):
        import transformers

        found.append(Patch(transformers.PreTrainedTokenizerBase, "__call__", _stage_wrapper("tokenize")))
    if _available("torch"):
        import torch

        found += [
            Patch(torch.Tensor, "to", _tensor_to),
            Patch(torch.nn.Module, "__call__", _module_call),
        ]
    if _available("fastapi"):
        import fastapi.routing as routing

        found.append(Patch(routing, "serialize_response", _serialize_response))
    return found


_APPLIED: list[Patch] = []


def instrument() -> list[str]:
    """Patch what is installed; returns the patched targets' names."""
    if not _APPLIED:
        _APPLIED.extend(_patches())
    for p in _APPLIED:
        p.apply()
    return [f"{getattr(p.owner, '__name__', p.owner)}.{p.name}" for p in _APPLIED if p.applied]


def uninstrument() -> None:
    for p in _APPLIED:
        p.restore()
    _APPLIED.clear()
