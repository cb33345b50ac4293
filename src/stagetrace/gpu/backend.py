"""The few ``torch.cuda`` calls stagetrace makes, behind one object so that tests can substitute a fake with
the same signatures and errors, and so that no other module touches CUDA."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from typing import Any

from stagetrace._safety import at_fork_in_child

CAPTURE_MODE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal (Global 0, ThreadLocal 1, Relaxed 2)


class TorchCudaBackend:
    """Never initialises CUDA or its driver: nothing GPU-side happens until the application has initialised
    CUDA itself (``torch.cuda.is_initialized()``). ``torch.cuda.is_available()`` would run ``cuInit`` (which
    poisons a later fork), ``current_device()`` runs torch's lazy init, and ``Tensor.is_pinned()`` can create
    a context on device 0; none of them is called before that.

    ``torch_module``: the module to use (tests pass a fake); default ``torch`` if the application imported it.
    """

    def __init__(self, torch_module: Any = None) -> None:
        self._torch = torch_module
        self._usable = False
        # A forked child of a process that used CUDA cannot use it (torch calls that a bad fork).
        at_fork_in_child(self, "_after_fork")

    def _after_fork(self) -> None:
        self._usable = False

    @property
    def torch(self) -> Any:
        return self._torch if self._torch is not None else sys.modules.get("torch")

    def usable(self) -> bool:
        if self._usable:
            return True
        torch = self.torch
        if torch is None:
            return False
        try:
            self._usable = bool(torch.cuda.is_initialized())
        except Exception:
            return False
        return self._usable

    def device_index(self, device: Any) -> int | None:
        """The CUDA device index for a tensor, a torch.device or a string; None for anything not CUDA, and
        for a bare ``"cuda"`` before the application initialised CUDA (its current device is not known
        without initialising)."""
        torch = self.torch
        if torch is None:
            return None
        dev = getattr(device, "device", device)
        try:
            dev = torch.device(dev)
        except (TypeError, RuntimeError):
            return None
        if dev.type != "cuda":
            return None
        if dev.index is not None:
            return dev.index
        return self.default_device() if self.usable() else None

    def is_pinned(self, tensor: Any) -> bool | None:
        """Whether a host tensor is in pinned memory; None (unknown) before CUDA is initialised."""
        if not self.usable():
            return None
        return bool(tensor.is_pinned())

    def current_stream(self, device_index: int | None = None) -> Any:
        return self.torch.cuda.current_stream(device_index)

    def new_side_stream(self, device_index: int) -> Any:
        """A stream of stagetrace's own for clock anchors. ``torch.cuda.Stream()`` hands out streams from a
        small round-robin pool, which can be one the application computes on (then it is never idle); a
        stream created through the runtime is ours alone. The pool's is the fallback."""
        torch = self.torch
        with torch.cuda.device(device_index):
            handle = _create_stream()
            if handle:
                return torch.cuda.ExternalStream(handle, device=torch.device("cuda", device_index))
            return torch.cuda.Stream(device=device_index)

    def new_event(self, device_index: int) -> Any:
        with self.torch.cuda.device(device_index):
            return self.torch.cuda.Event(enable_timing=True)

    def on_device(self, device_index: int) -> Any:
        """A context that makes ``device_index`` current for the calling thread: ``Event.query()`` has no
        device guard, so a query from the helper thread would otherwise open a context on device 0."""
        return self.torch.cuda.device(device_index)

    def is_capturing(self) -> bool:
        try:
            return bool(self.torch.cuda.is_current_stream_capturing())
        except Exception:
            return False

    def graph_class(self) -> Any:
        return getattr(self.torch.cuda, "CUDAGraph", None)

    def device_uuid(self, device_index: int) -> str | None:
        try:
            uuid = str(self.torch.cuda.get_device_properties(device_index).uuid)
        except Exception:
            return None
        return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"

    def default_device(self) -> int:
        return int(self.torch.cuda.current_device())

    def use_thread_local_capture_mode(self) -> bool:
        """Put the calling thread in thread-local stream-capture mode, so that its event queries can never
        invalidate a global-mode CUDA-graph capture running on another thread (what PyTorch does for its
        NCCL watchdog). torch has no Python binding for it: the CUDA runtime torch loaded is called through
        ctypes. False where that runtime cannot be found; the capture guard still applies."""
        return _thread_local_capture_mode()


_capture_mode_state = threading.local()


def _cudart_function(name: str, argtypes: list[Any]) -> Any:
    """A function of the CUDA runtime library already mapped into this process (the one torch uses: the
    runtime's per-thread state, such as the capture mode, is per library instance), or None."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
            fn = getattr(lib, name)
        except (OSError, AttributeError):
            continue
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        return fn
    return None


def _thread_local_capture_mode() -> bool:
    done = getattr(_capture_mode_state, "done", None)
    if done is not None:
        return done
    ok = False
    with contextlib.suppress(Exception):
        fn = _cudart_function("cudaThreadExchangeStreamCaptureMode", [ctypes.POINTER(ctypes.c_int)])
        if fn is not None:
            mode = ctypes.c_int(CAPTURE_MODE_THREAD_LOCAL)
            ok = fn(ctypes.byref(mode)) == 0  # cudaSuccess; `mode` now holds the previous one
    _capture_mode_state.done = ok
    return ok


def _create_stream() -> int:
    """A new non-blocking stream on the current device, through the runtime; 0 where that is not possible."""
    with contextlib.suppress(Exception):
        fn = _cudart_function("cudaStreamCreateWithFlags", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint])
        if fn is not None:
            handle = ctypes.c_void_p()
            if fn(ctypes.byref(handle), 1) == 0 and handle.value:  # cudaStreamNonBlocking
                return int(handle.value)
    return 0
