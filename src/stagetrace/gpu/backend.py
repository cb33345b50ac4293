"""The few ``torch.cuda`` calls stagetrace makes, behind one object so that tests can substitute a fake with
the same signatures and errors, and so that no other module touches CUDA."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import sys
import threading
from typing import Any

from stagetrace._safety import at_fork_in_child

CAPTURE_MODE_GLOBAL = 0  # cudaStreamCaptureModeGlobal, every thread's default
CAPTURE_MODE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal
CAPTURE_MODE_RELAXED = 2  # cudaStreamCaptureModeRelaxed

_MIG_NAME = re.compile(r"\bMIG\b")


def nvml_uuid(raw: str, *, device_name: str = "", visible_devices: str = "") -> str:
    """NVML's form of the UUID torch reports for a device.

    ``torch.cuda.get_device_properties(i).uuid`` prints CUDA's 16 bytes as bare 8-4-4-4-12 hex, which NVML
    knows as ``GPU-<hex>`` for a whole GPU and ``MIG-<hex>`` for a MIG instance. Nothing in the bytes says
    which: a MIG instance is recognised by CUDA's device name ("NVIDIA A100-SXM4-40GB MIG 1g.5gb") or by
    ``CUDA_VISIBLE_DEVICES`` naming MIG instances. (``NvmlSampler`` also tries ``MIG-<hex>`` when NVML does
    not know ``GPU-<hex>``, for a MIG instance whose name does not say so.) A string that already carries a
    prefix is kept."""
    raw = raw.strip()
    if raw.startswith(("GPU-", "MIG-")):
        return raw
    mig = bool(_MIG_NAME.search(device_name)) or visible_devices.strip().startswith("MIG-")
    return ("MIG-" if mig else "GPU-") + raw


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
        self._event_record: Any = None  # cudaEventRecord called with the GIL held; False: not available
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

    def event_created(self, event: Any) -> bool:
        """Whether torch has created the event's CUDA event (it does so at the first ``record``)."""
        return bool(getattr(event, "cuda_event", 1))

    def record_holding_gil(self, event: Any, stream: Any) -> bool:
        """Record ``event`` on ``stream`` through the CUDA runtime torch uses, without releasing the GIL;
        False (nothing recorded) where that is not possible: no runtime found, or the event not created yet.

        ``Event.record`` releases the GIL around ``cudaEventRecord``; with a CPU-bound Python thread beside
        it, getting the GIL back takes a whole switch interval (5 ms), so a clock anchor's window that holds
        a record can never be tight. ``cudaEventRecord`` is asynchronous and takes microseconds, as long as
        ``Event.query`` (which torch calls with the GIL held) does."""
        fn = self._event_record
        if fn is None:
            fn = self._event_record = (
                _cudart_function("cudaEventRecord", [ctypes.c_void_p, ctypes.c_void_p], hold_gil=True) or False
            )
        handle = getattr(event, "cuda_event", 0)
        if fn is False or not handle:
            return False
        if fn(handle, stream.cuda_stream) != 0:
            _clear_last_error()  # the runtime's per-thread last error must not surface in a later torch call
            return False
        return True

    def device_uuid(self, device_index: int) -> str | None:
        """The device's UUID in NVML's form (``nvml_uuid``), for matching torch's device to NVML's."""
        try:
            props = self.torch.cuda.get_device_properties(device_index)
            raw = str(props.uuid)
            name = str(getattr(props, "name", ""))
        except Exception:
            return None
        return nvml_uuid(raw, device_name=name, visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""))

    def default_device(self) -> int:
        return int(self.torch.cuda.current_device())

    def use_thread_local_capture_mode(self) -> bool:
        """Put the calling thread in thread-local stream-capture mode, so that its event queries can never
        invalidate a global-mode CUDA-graph capture running on another thread (what PyTorch does for its
        NCCL watchdog). torch has no Python binding for it: the CUDA runtime torch loaded is called through
        ctypes. False where that runtime cannot be found; the capture guard still applies."""
        return _thread_local_capture_mode()


_capture_mode_state = threading.local()


def mapped_function(library: str, name: str, argtypes: list[Any], *, hold_gil: bool = False) -> Any:
    """A function of a shared library already mapped into this process (its path in /proc/self/maps
    contains ``library``), returning a C int; None where there is none. Nothing is loaded: the library
    must be there already. ``hold_gil``: the call keeps the GIL (``ctypes.PyDLL``) instead of releasing it
    around the call as ``ctypes.CDLL`` does."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if library in line}
    except OSError:
        return None
    loader = ctypes.PyDLL if hold_gil else ctypes.CDLL
    for path in sorted(paths):
        try:
            lib = loader(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_GLOBAL)
            fn = getattr(lib, name)
        except (OSError, AttributeError):
            continue
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
        return fn
    return None


def _cudart_function(name: str, argtypes: list[Any], *, hold_gil: bool = False) -> Any:
    """A function of the CUDA runtime library torch uses (the runtime's per-thread state, such as the
    capture mode and the last error, is per library instance), or None."""
    return mapped_function("libcudart.so", name, argtypes, hold_gil=hold_gil)


def _clear_last_error() -> None:
    with contextlib.suppress(Exception):
        fn = _cudart_function("cudaGetLastError", [])
        if fn is not None:
            fn()


def exchange_capture_mode(mode: int) -> int | None:
    """Set the calling thread's stream-capture mode (``CAPTURE_MODE_*``) through the CUDA runtime torch
    loaded, and return the previous one; None where the runtime cannot be reached."""
    with contextlib.suppress(Exception):
        fn = _cudart_function("cudaThreadExchangeStreamCaptureMode", [ctypes.POINTER(ctypes.c_int)])
        if fn is not None:
            value = ctypes.c_int(mode)
            if fn(ctypes.byref(value)) == 0:  # cudaSuccess; `value` now holds the previous mode
                return value.value
    return None


def _thread_local_capture_mode() -> bool:
    done = getattr(_capture_mode_state, "done", None)
    if done is not None:
        return done
    ok = exchange_capture_mode(CAPTURE_MODE_THREAD_LOCAL) is not None
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
