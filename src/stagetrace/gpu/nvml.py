"""GPU utilisation from NVML, sampled on one background thread and matched to span windows afterwards.

Uses NVIDIA's ``nvidia-ml-py`` (module ``pynvml``). ``nvmlDeviceGetSamples`` returns the driver's buffered,
timestamped utilisation samples at low polling cost; where it is not supported, ``GetUtilizationRates`` is
polled and stamped with the poll time. Any NVML error (no library, no driver, MIG, not supported) switches
the feature off with one warning. NVML is never called on a request thread.
"""

from __future__ import annotations

import itertools
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from stagetrace._safety import logger, report_internal_error, warn_once


@dataclass(frozen=True, slots=True)
class WindowStats:
    mean: float
    min: float
    max: float
    coverage: float  # share of the window that samples covered, 0..1


def utilization_over_window(
    samples: Sequence[tuple[int, float]], period_us: float, start_us: int, end_us: int
) -> WindowStats | None:
    """Overlap-weighted utilisation over ``[start_us, end_us]``.

    Sample ``(ts, value)`` reports the share of time in ``(ts - period, ts]`` during which a kernel ran, so
    it weighs in by how much of that interval the window overlaps. A window shorter than one period still
    gets the enclosing sample(s), with a coverage that says so. Values are 0..1.
    """
    if end_us < start_us or period_us <= 0:
        return None
    if end_us == start_us:
        end_us = start_us + 1
    total_w = 0.0
    acc = 0.0
    lo, hi = 1.0, 0.0
    for ts, value in samples:
        s0 = ts - period_us
        overlap = min(end_us, ts) - max(start_us, s0)
        if overlap <= 0:
            continue
        total_w += overlap
        acc += overlap * value
        lo, hi = min(lo, value), max(hi, value)
    if total_w <= 0:
        return None
    return WindowStats(acc / total_w, lo, hi, min(1.0, total_w / (end_us - start_us)))


def _import_pynvml() -> Any:
    import warnings

    with warnings.catch_warnings():
        # The deprecated `pynvml` distribution's import hook warns even when nvidia-ml-py provides the module.
        warnings.simplefilter("ignore", FutureWarning)
        import pynvml

    return pynvml


class NvmlSampler:
    """Samples one device. ``nvml`` is the pynvml module (or a fake with the same API)."""

    def __init__(
        self,
        device_uuid: str | None,
        device_index: int = 0,
        *,
        poll_interval_s: float = 0.5,
        max_samples: int = 4096,
        nvml: Any = None,
        on_value: Callable[[float, str], None] | None = None,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        self.device_uuid = device_uuid
        self.device_index = device_index
        self.poll_interval_s = poll_interval_s
        self._nvml = nvml
        self._on_value = on_value
        self._on_drop = on_drop
        self._samples: deque[tuple[int, float]] = deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._handle: Any = None
        self._use_samples_api = True
        self._last_ts = 0
        self._clock_offset_us = 0  # added to NVML timestamps to get epoch µs
        self.period_us = poll_interval_s * 1e6
        self.memory_used_bytes: int | None = None
        self.driver_samples = 0  # samples read from the driver's buffer (nvmlDeviceGetSamples)
        self.stand_ins = 0  # readings of nvmlDeviceGetUtilizationRates stamped with the poll time
        self.newest_driver_sample_us: int | None = None  # epoch µs of the newest driver sample
        self.enabled = False
        self.hw_id = device_uuid or f"gpu{device_index}"
        self._pid = os.getpid()

    # --- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> bool:
        """Initialise NVML and start polling; False (with one warning) if NVML cannot serve utilisation."""
        try:
            nvml = self._nvml = self._nvml or _import_pynvml()
        except ImportError:
            warn_once(
                "nvml-missing",
                "stagetrace: GPU utilisation off: nvidia-ml-py is not installed (pip install 'stagetrace[gpu]')",
            )
            return False
        if self.device_uuid and self.device_uuid.startswith("MIG-"):
            warn_once("nvml-mig", "stagetrace: GPU utilisation off: %s", MIG_MESSAGE)
            return False
        try:
            nvml.nvmlInit()
            if self.device_uuid:
                self._handle = _handle_by_uuid(nvml, self.device_uuid)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(self.device_index)
            self._check_mig(nvml)
            self._poll_once()
        except nvml.NVMLError as e:
            warn_once("nvml-error", "stagetrace: GPU utilisation off: NVML error %s (%s)", type(e).__name__, e)
            return False
        except _MigUnsupported as e:
            warn_once("nvml-mig", "stagetrace: GPU utilisation off: %s", e)
            return False
        self.enabled = True
        self._thread = threading.Thread(target=self._run, name="stagetrace-nvml", daemon=True)
        self._thread.start()
        return True

    @property
    def clock_offset_us(self) -> int:
        """What is added to NVML's sample timestamps to make them epoch µs (``_detect_clock``)."""
        return self._clock_offset_us

    def _check_mig(self, nvml: Any) -> None:
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(self._handle)
        except nvml.NVMLError:
            return  # not supported on this GPU: no MIG
        if current == getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
            raise _MigUnsupported(MIG_MESSAGE)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)

    # --- polling (its own thread) ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self._poll_once()
            except Exception as e:
                nvml = self._nvml
                if isinstance(e, getattr(nvml, "NVMLError", ())) and getattr(e, "value", None) in (
                    getattr(nvml, "NVML_ERROR_NOT_FOUND", 6),
                ):
                    continue  # empty sample buffer: the GPU was idle
                warn_once("nvml-poll", "stagetrace: GPU utilisation off after an NVML error: %s", e)
                self.enabled = False
                return

    def _poll_once(self) -> None:
        nvml = self._nvml
        new: list[tuple[int, float]] = []
        stand_in = False
        if self._use_samples_api:
            try:
                _vtype, raw = nvml.nvmlDeviceGetSamples(self._handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, self._last_ts)
                new = [(int(s.timeStamp), _sample_value(s)) for s in raw]
                if new and self._last_ts == 0:
                    self._detect_clock(max(ts for ts, _ in new))
            except nvml.NVMLError as e:
                if getattr(e, "value", None) == nvml.NVML_ERROR_NOT_FOUND:
                    # Nothing new: the driver stops buffering samples while the GPU is idle. The current
                    # rate (0 when idle) stands in, so that windows over the idle spell have a value.
                    rates = nvml.nvmlDeviceGetUtilizationRates(self._handle)
                    new = [(time.time_ns() // 1000 - self._clock_offset_us, float(rates.gpu) / 100.0)]
                    stand_in = True
                elif getattr(e, "value", None) == nvml.NVML_ERROR_NOT_SUPPORTED:
                    self._use_samples_api = False
                    logger.info("stagetrace: nvmlDeviceGetSamples not supported; polling utilisation rates")
                else:
                    raise
        if not self._use_samples_api:
            rates = nvml.nvmlDeviceGetUtilizationRates(self._handle)
            new = [(time.time_ns() // 1000, float(rates.gpu) / 100.0)]
            stand_in = True
            self._clock_offset_us = 0
        if new:
            new.sort()
            shifted = [(ts + self._clock_offset_us, v) for ts, v in new]
            if stand_in:
                self.stand_ins += len(new)
            else:  # lastSeen follows the driver's own samples only (its clock may not be epoch)
                self._last_ts = max(self._last_ts, new[-1][0])
                self.driver_samples += len(new)
                self.newest_driver_sample_us = shifted[-1][0]
            with self._lock:
                before = len(self._samples)
                self._samples.extend(shifted)
                overflow = max(0, before + len(shifted) - (self._samples.maxlen or 0))
                if len(self._samples) >= 3:
                    recent = list(self._samples)[-32:]
                    gaps = [b[0] - a[0] for a, b in itertools.pairwise(recent) if b[0] > a[0]]
                    if gaps:
                        self.period_us = float(statistics.median(gaps))
            if overflow > 0 and self._on_drop is not None:
                self._on_drop("nvml_samples", overflow)
            if self._on_value is not None:
                self._on_value(shifted[-1][1], self.hw_id)
        try:
            self.memory_used_bytes = int(nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        except Exception:
            report_internal_error("NVML memory info")

    def _detect_clock(self, newest_ts_us: int) -> None:
        """NVML documents "CPU timestamp in microseconds"; seen in the wild as epoch µs and as µs since boot.
        Pick the clock the newest sample is closest to and convert to epoch µs."""
        now_epoch = time.time_ns() // 1000
        now_mono = time.monotonic_ns() // 1000
        try:
            now_boot = time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1000
        except (AttributeError, OSError):
            now_boot = now_mono
        candidates = {
            "epoch": (now_epoch, 0),
            "monotonic": (now_mono, now_epoch - now_mono),
            "boottime": (now_boot, now_epoch - now_boot),
        }
        name, (_, offset) = min(candidates.items(), key=lambda kv: abs(kv[1][0] - newest_ts_us))
        self._clock_offset_us = offset
        self.clock = name

    clock = "epoch"

    # --- queries (helper thread) -------------------------------------------------------------------
    def window(self, start_epoch_ns: int, end_epoch_ns: int) -> WindowStats | None:
        with self._lock:
            samples = list(self._samples)
        return utilization_over_window(samples, self.period_us, start_epoch_ns // 1000, end_epoch_ns // 1000)

    def covers(self, end_epoch_ns: int) -> bool:
        """Has the sample that covers this instant arrived? (It lands up to one period later.)"""
        if not self.enabled:
            return True
        with self._lock:
            newest = self._samples[-1][0] if self._samples else 0
        return newest * 1000 >= end_epoch_ns

    def settled(self, end_epoch_ns: int, now_epoch_ns: int | None = None) -> bool:
        """Worth no more waiting for: the covering sample arrived, or two polls have passed since
        ``end_epoch_ns`` (an idle GPU's sample buffer stops filling; the window then uses what there is)."""
        if self.covers(end_epoch_ns):
            return True
        now = time.time_ns() if now_epoch_ns is None else now_epoch_ns
        return now - end_epoch_ns >= 2 * max(self.period_us * 1000, self.poll_interval_s * 1e9)


MIG_MESSAGE = "the device is a MIG instance (or MIG is enabled), and NVML does not report utilisation for MIG"


class _MigUnsupported(Exception):
    pass


def _handle_by_uuid(nvml: Any, uuid: str) -> Any:
    """NVML's handle for ``uuid``. A MIG instance whose UUID came from torch as bare hex may have been given
    the ``GPU-`` prefix (``backend.nvml_uuid`` cannot always tell): when NVML does not know ``GPU-<hex>``
    but knows ``MIG-<hex>``, the device is a MIG instance and ``_MigUnsupported`` says so (rather than an
    NVML error about an unknown UUID)."""
    try:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    except nvml.NVMLError as e:
        unknown = getattr(e, "value", None) in (nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_ERROR_INVALID_ARGUMENT)
        if not (unknown and uuid.startswith("GPU-")):
            raise
        try:
            nvml.nvmlDeviceGetHandleByUUID("MIG-" + uuid[len("GPU-") :])
        except nvml.NVMLError:
            raise e from None
        raise _MigUnsupported(MIG_MESSAGE) from None


def _sample_value(sample: Any) -> float:
    """nvmlSample_t.sampleValue is a union; utilisation samples carry an unsigned int percentage."""
    v = sample.sampleValue
    for field in ("uiVal", "ulVal", "ullVal", "dVal"):
        value = getattr(v, field, None)
        if value is not None:
            return float(value) / 100.0
    return float(v) / 100.0
