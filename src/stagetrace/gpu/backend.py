"""The few ``torch.cuda`` calls stagetrace makes, behind one object so that tests can substitute a fake with
the same signatures and errors, and so that no other module touches CUDA."""

from __future__ import annotations

import sys
from typing import Any


class TorchCudaBackend:
    """Never initialises CUDA: ``usable()`` is true only once the application itself has."""

    def __init__(self) -> None:
        self._usable = False
        self._unavailable = False  # no CUDA in this build/host: never changes, so checked once

    @property
    def torch(self) -> Any:
        return sys.modules.get("torch")

    def usable(self) -> bool:
        if self._usable:
            return True
        torch = self.torch
        if torch is None or self._unavailable:
            return False
        try:
            if not torch.cuda.is_available():
                self._unavailable = True
                return False
            self._usable = bool(torch.cuda.is_initialized())
        except Exception:
            return False
        return self._usable

    def device_index(self, device: Any) -> int | None:
        """The CUDA device index for a tensor, a torch.device or a string; None for anything not CUDA."""
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
        return dev.index if dev.index is not None else torch.cuda.current_device()

    def current_stream(self, device_index: int | None = None) -> Any:
        return self.torch.cuda.current_stream(device_index)

    def new_side_stream(self, device_index: int) -> Any:
        return self.torch.cuda.Stream(device=device_index)

    def new_event(self, device_index: int) -> Any:
        with self.torch.cuda.device(device_index):
            return self.torch.cuda.Event(enable_timing=True)

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
