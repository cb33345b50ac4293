"""GPU check: one process, a minute or two on one GPU, printing a table and writing every figure as JSON.

    python benchmarks/gpu_check.py [--requests 10] [--mib 64] [--json FILE] [--dry-run]
    python benchmarks/gpu_check.py --report WORKDIR --out OUTDIR   (the GPU session's files and summary)

Every row passes only on a measurement, and each has a control that shows the measurement can see what it
looks for (a row whose control fails fails too):

(a) synchronisations stagetrace adds. The request path (H2D, forward, D2H) runs under torch.profiler, plain
    and instrumented, each request inside a ``record_function`` marker; the CUDA runtime calls that
    synchronise the host are counted when CUPTI says the request thread made them inside a marker. CUPTI's
    thread is ``FunctionEvent.device_resource_id`` (``FunctionEvent.thread`` is the profiler's own counter,
    and a runtime call outside any op, such as ``Event.query``, gets the id of the thread that collected the
    profile). Controls: the plain run's blocking D2H syncs once a request; in a profile of their own the
    request thread and a second thread each make K ``Event.query`` and K ``Event.synchronize`` calls, inside
    the marker's time, and each thread must be charged exactly its own K (a filter that charged another
    thread's calls, or a profiler that dropped these calls, fails here). The H2D and forward also run under
    ``torch.cuda.set_sync_debug_mode("error")``, whose control is a blocking copy that must raise.
(b) GPU time per stage against CUPTI's kernel and memcpy records of the same requests (within 5 % or 20 us);
    the classic host timer beside.
(c) the request thread's CPU per ``gpu_stage`` in the steady state (a request's few GPU stages), set
    against what any CUDA-event timer pays (``current_stream`` and two ``Event.record``, measured bare: the
    control) and ``stage()``: what stagetrace adds for the GPU on top of both may not exceed what a
    ``stage()`` costs. The request thread may neither create events nor throw them away unread, in those
    rounds nor in a request that repeats one GPU stage 100 times (a discarded event is replaced by a new one).
(d) a pageable H2D copy is diagnosed (PAGEABLE_H2D), a pinned one is not.
(e) NVML: torch's device found in NVML's own enumeration by PCI bus (by UUID and name where torch has no
    PCI fields) and stagetrace's UUID equal to NVML's for it; the sample period and timestamp clock, with
    the newest driver sample's age in that clock; utilisation only from real samples: stagetrace's value
    for a busy trace against the driver's samples read here independently over the same window, and high
    (the control: the GPU was kept busy).
(f) clock anchors: each placed GPU span against CUPTI's timestamps at the boundaries where the stream was
    busy (the stage's start event completes as the work before it ends): the error must be within the
    span's own error bar, the profile's clock alignment and 10 us. Control: the host clock at the same
    boundary is milliseconds off (the comparison can tell). Anchors must be recorded with the GIL held.
(g) errors stagetrace logged on its own threads (contained): none.

``--dry-run`` runs the same check on CPU against tests/fakes.py (FakeGpu, FakeProfiler, FakeNvml) in place
of CUDA, CUPTI and NVML. Exits 0 when every row passes, 1 when one fails, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
QUERY = "cudaEventQuery"
CONTROL_CALLS = (QUERY, "cudaEventSynchronize")
REQUEST_MARK = "stagetrace-check.request"
CLOCK_MARK = "stagetrace-check.clock"
PLACEMENT_SLACK_NS = 10_000  # an event and the kernel after it on a busy stream, back to back
SUMMARY_LIMIT = 4000  # characters of the session's summary, printed last
TAIL_CHARS = 300  # of a failed step's output, in the summary's FAILING list


# --- records ------------------------------------------------------------------------------------------


class Row(NamedTuple):
    check: str
    result: str
    target: str
    ok: bool


class ThreadIds(NamedTuple):
    """The ids a host thread's CUDA runtime calls can carry in a profile (``device_resource_id``): kineto
    maps CUPTI's thread id (the low 32 bits of ``pthread_self()``, ``threading.get_ident()``) to the system
    thread id for a thread that recorded an op under the profiler, and leaves it as it is for any other."""

    native: int
    ident: int

    @classmethod
    def current(cls) -> ThreadIds:
        return cls(threading.get_native_id(), threading.get_ident())

    def matches(self, tid: int) -> bool:
        low = self.ident & 0xFFFFFFFF
        return tid in (self.native, low, low - (1 << 32))


class RuntimeCall(NamedTuple):
    name: str
    thread: int  # CUPTI's thread (FunctionEvent.device_resource_id)
    start_us: float


class DeviceOp(NamedTuple):
    name: str
    start_us: float
    end_us: float


class Marker(NamedTuple):
    name: str
    start_us: float
    end_us: float


class Profile(NamedTuple):
    """What a check reads of a profile, in the profile's clock (µs since it began)."""

    calls: list[RuntimeCall]
    device: list[DeviceOp]
    markers: list[Marker]


class RequestTruth(NamedTuple):
    """One request's device activity as CUPTI recorded it (µs, the profile's clock)."""

    h2d_start: float
    h2d_end: float
    k0: float  # first kernel's start
    k1: float  # last kernel's end
    d2h_start: float
    d2h_end: float

    def ms(self) -> dict[str, float]:
        return {
            "h2d": (self.h2d_end - self.h2d_start) / 1e3,
            "infer": (self.k1 - self.k0) / 1e3,
            "d2h": (self.d2h_end - self.d2h_start) / 1e3,
        }


class ClockMark(NamedTuple):
    """A marker entered between two host readings of the epoch clock: its profile timestamp lies between."""

    before_ns: int
    after_ns: int
    profile_us: float


class Placed(NamedTuple):
    """One instrumented request's GPU-placed spans (epoch ns), and the host clock at its d2h call."""

    infer_start: int
    infer_end: int
    d2h_start: int
    error_ns: int  # the largest error bar stagetrace gave these spans
    host_d2h_ns: int


class SyncCounts(NamedTuple):
    plain: Counter[str]  # runtime calls the request thread made inside request markers, plain run
    traced: Counter[str]  # the same, instrumented run
    requests: int
    control_made: int  # K: each thread's calls of each CONTROL_CALLS name in the attribution control
    control_own: Counter[str]  # the request thread's, charged to it
    control_other: Counter[str]  # the second thread's, charged to it
    control_leaked: Counter[str]  # charged to the request thread beyond its own K (another thread's)


class HotPath(NamedTuple):
    stage_us: float
    floor_us: float  # current_stream + two Event.record on pooled events, no stagetrace
    gpu_stage_us: float
    events_churned: int  # created or thrown away unread by the request thread, in the measured rounds
    events_churned_repeated: int  # the same, in a request repeating one GPU stage 100 times

    @property
    def own_us(self) -> float:
        return self.gpu_stage_us - self.stage_us - self.floor_us


class NvmlDevice(NamedTuple):
    uuid: str
    name: str
    pci: tuple[int, int, int] | None  # domain, bus, device


class TorchDevice(NamedTuple):
    raw_uuid: str  # str(torch.cuda.get_device_properties(i).uuid)
    name: str
    pci: tuple[int, int, int] | None  # where torch reports it


class NvmlReading(NamedTuple):
    period_ms: float
    clock: str
    newest_age_ms: float | None  # now minus the newest driver sample, in the detected clock
    driver_samples: int
    stand_ins: int
    busy: float | None  # stagetrace's utilisation of the busy trace
    busy_expected: float | None  # the driver's samples over the same window, read here
    busy_samples: int  # driver samples overlapping that window
    idle: float | None


# --- pure analysis ------------------------------------------------------------------------------------


def read_profile(events: Iterable[Any]) -> Profile:
    """torch.profiler's FunctionEvents (or FakeFunctionEvents, the same fields) sorted into runtime calls
    (by CUPTI's thread), device activity and this check's markers."""
    calls, device, markers = [], [], []
    for e in events:
        start, end = float(e.time_range.start), float(e.time_range.end)
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            device.append(DeviceOp(e.name, start, end))
        elif e.name.startswith("stagetrace-check."):
            markers.append(Marker(e.name, start, end))
        elif e.name.startswith("cuda"):
            calls.append(RuntimeCall(e.name, int(e.device_resource_id), start))
    return Profile(calls, device, markers)


def calls_on(profile: Profile, thread: ThreadIds, names: Iterable[str], *, inside: str | None = None) -> Counter[str]:
    """The runtime calls ``thread`` made, by name; with ``inside``, only those within a marker of that name."""
    wanted = set(names)
    spans = [(m.start_us, m.end_us) for m in profile.markers if m.name == inside]
    out: Counter[str] = Counter()
    for call in profile.calls:
        inside_ok = inside is None or any(a <= call.start_us <= b for a, b in spans)
        if call.name in wanted and thread.matches(call.thread) and inside_ok:
            out[call.name] += 1
    return out


def sync_rows(counts: SyncCounts) -> list[Row]:
    rows = []
    for name in SYNC_CALLS:
        plain, traced = counts.plain[name], counts.traced[name]
        rows.append(
            Row(
                f"(a) {name} per {counts.requests} requests: plain / stagetrace",
                f"{plain} / {traced}",
                "0 added",
                traced <= plain,
            )
        )
    own_syncs = sum(counts.plain[name] for name in SYNC_CALLS)
    rows.append(
        Row(
            "(a) control: the plain run's own syncs on the request thread",
            str(own_syncs),
            f">= {counts.requests}",
            own_syncs >= counts.requests,
        )
    )
    rows.append(
        Row(
            "(a) cudaEventQuery on the request thread (stagetrace)",
            str(counts.traced[QUERY]),
            "0",
            counts.traced[QUERY] == 0,
        )
    )
    k = counts.control_made
    for name in CONTROL_CALLS:
        own, other, leaked = counts.control_own[name], counts.control_other[name], counts.control_leaked[name]
        rows.append(
            Row(
                f"(a) control: {name} charged by thread: own / other's / other's to request thread",
                f"{own} / {other} / {leaked}",
                f"{k} / {k} / 0",
                own == k and other == k and leaked == 0,
            )
        )
    return rows


def truth_per_request(
    device_ops: Iterable[DeviceOp | tuple[str, float, float]], gap_us: float = 50.0
) -> list[RequestTruth]:
    """Device activity cut into requests: each is an HtoD memcpy, the kernels after it and a DtoH memcpy
    (a memset is not a kernel; a copy out with no kernel before it is no request). DtoH records that follow
    one another within ``gap_us`` are one copy (a copy to pageable memory may be staged in pieces)."""
    out: list[RequestTruth] = []
    h2d: tuple[float, float] | None = None
    d2h: tuple[float, float] | None = None
    k0 = k1 = None

    def close() -> None:
        nonlocal h2d, d2h
        if h2d is not None and d2h is not None and k0 is not None and k1 is not None:
            out.append(RequestTruth(h2d[0], h2d[1], k0, k1, d2h[0], d2h[1]))
            h2d = None
        d2h = None

    for name, start, end in sorted(device_ops, key=lambda op: op[1]):
        lowered = name.lower()
        is_d2h = "memcpy" in lowered and "dtoh" in lowered
        if d2h is not None and not (is_d2h and start - d2h[1] <= gap_us):
            close()
        if "memcpy" in lowered and "htod" in lowered:
            h2d, k0, k1 = (start, end), None, None
        elif h2d is None:
            continue
        elif is_d2h:
            if k0 is None:
                h2d = None  # a copy out with no kernel: no request
            else:
                d2h = (start, end) if d2h is None else (d2h[0], max(d2h[1], end))
        elif "memcpy" not in lowered and "memset" not in lowered:
            k0 = start if k0 is None else min(k0, start)
            k1 = end if k1 is None else max(k1, end)
    close()
    return out


def within(measured: float, truth: float, pct: float = 5.0, abs_ms: float = 0.02) -> bool:
    return abs(measured - truth) <= max(truth * pct / 100, abs_ms)


def gpu_time_rows(
    truth: list[RequestTruth], measured: list[dict[str, float]], host: dict[str, list[float]], requests: int
) -> list[Row]:
    rows = [
        Row(
            "(b) requests matched: CUPTI / stagetrace",
            f"{len(truth)} / {len(measured)}",
            f"{requests} / {requests}",
            len(truth) == len(measured) == requests,
        )
    ]
    for stage in ("h2d", "infer", "d2h"):
        if not truth or not measured:
            rows.append(Row(f"(b) {stage}", "no data", "within 5 %", False))
            continue
        t = statistics.median(r.ms()[stage] for r in truth)
        m = statistics.median(v.get(stage, 0.0) for v in measured)
        classic = f"{statistics.median(host[stage]):.3f}" if host.get(stage) else "-"
        rows.append(
            Row(
                f"(b) {stage} ms: CUPTI / stagetrace / classic host timer",
                f"{t:.3f} / {m:.3f} ({(m - t) / t * 100 if t else 0:+.1f} %) / {classic}",
                "within 5 % (or 20 us)",
                within(m, t),
            )
        )
    return rows


def profile_to_epoch(marks: Iterable[ClockMark]) -> tuple[float, float]:
    """(offset, error) in ns such that epoch ns = profile µs * 1000 + offset, within +- error: each mark's
    profile timestamp was taken between its two host readings, so every mark bounds the offset; the
    tightest bounds are kept (an inconsistent set widens the error instead of failing)."""
    lows, highs = [], []
    for m in marks:
        lows.append(m.before_ns - m.profile_us * 1000)
        highs.append(m.after_ns - m.profile_us * 1000)
    if not lows:
        raise ValueError("no clock marks")
    lo, hi = max(lows), min(highs)
    return (lo + hi) / 2, abs(hi - lo) / 2


def placement_rows(
    placed: list[Placed], truth: list[RequestTruth], offset_ns: float, align_ns: float, requests: int
) -> tuple[list[Row], dict[str, Any]]:
    """Each placed span's error at the boundaries where its stream was busy: the infer stage's start event
    completes as the H2D copy ends, its end event and the d2h stage's start event as the last kernel ends."""
    errors, allowed, host = [], [], []
    for p, t in zip(placed, truth):
        for at_ns, truth_us in ((p.infer_start, t.h2d_end), (p.infer_end, t.k1), (p.d2h_start, t.k1)):
            errors.append(at_ns - (truth_us * 1000 + offset_ns))
            allowed.append(p.error_ns + align_ns + PLACEMENT_SLACK_NS)
        host.append(p.host_d2h_ns - (t.k1 * 1000 + offset_ns))
    ok = bool(errors) and all(abs(e) <= a for e, a in zip(errors, allowed))
    worst = max((abs(e) for e in errors), default=0.0)
    bar = statistics.median(p.error_ns for p in placed) if placed else 0.0
    host_off = statistics.median(abs(h) for h in host) if host else 0.0
    tolerance = max(allowed, default=0.0)
    rows = [
        Row(
            "(f) GPU spans placed / requests matched to CUPTI",
            f"{len(placed)} / {min(len(placed), len(truth))}",
            f"{requests} / {requests}",
            len(placed) == requests and len(truth) >= requests,
        ),
        Row(
            "(f) placement vs CUPTI: |error| p50 / max; error bar p50; clock alignment (us)",
            f"{statistics.median(abs(e) for e in errors) / 1e3 if errors else 0:.1f} / {worst / 1e3:.1f}; "
            f"{bar / 1e3:.1f}; {align_ns / 1e3:.1f}",
            "|error| <= bar + alignment + 10",
            ok,
        ),
        Row(
            "(f) control: the host clock at the d2h call vs CUPTI (ms)",
            f"{host_off / 1e6:.2f}",
            f">= {10 * tolerance / 1e6:.2f} (10x the tolerance)",
            bool(host) and host_off >= 10 * tolerance,
        ),
    ]
    figures = {
        "errors_us": [round(e / 1e3, 2) for e in errors],
        "error_bar_us": round(bar / 1e3, 2),
        "alignment_us": round(align_ns / 1e3, 2),
        "host_offset_ms": round(host_off / 1e6, 3),
    }
    return rows, figures


def hot_path_rows(hot: HotPath) -> list[Row]:
    return [
        Row(
            "(c) per stage, request-thread CPU: stage() / torch's own calls (control) / gpu_stage (us)",
            f"{hot.stage_us:.2f} / {hot.floor_us:.2f} / {hot.gpu_stage_us:.2f}",
            "floor > 0",
            hot.floor_us > 0,
        ),
        Row(
            "(c) stagetrace's own share of a gpu_stage: gpu_stage - stage() - torch's (us)",
            f"{hot.own_us:.2f}",
            f"<= stage() ({hot.stage_us:.2f})",
            hot.own_us <= hot.stage_us,
        ),
        Row(
            "(c) events created or discarded unread: measured rounds / a request repeating a GPU stage 100x",
            f"{hot.events_churned} / {hot.events_churned_repeated}",
            "0 / 0",
            hot.events_churned == 0 and hot.events_churned_repeated == 0,
        ),
    ]


def uuid_row(torch_dev: TorchDevice, stagetrace_uuid: str | None, nvml_devices: list[NvmlDevice]) -> Row:
    """torch's device found in NVML's enumeration by PCI bus where torch reports it, else by its UUID's hex
    and name; stagetrace's UUID must be NVML's for that device (prefix and all)."""
    if torch_dev.pci is not None:
        found = [d for d in nvml_devices if d.pci == torch_dev.pci]
        how = "PCI bus"
    else:
        found = [d for d in nvml_devices if d.uuid.endswith(torch_dev.raw_uuid) and d.name == torch_dev.name]
        how = "UUID hex and name"
    nvml_uuid = found[0].uuid if len(found) == 1 else None
    result = f"{len(found)} of {len(nvml_devices)} by {how}: NVML {nvml_uuid}, stagetrace {stagetrace_uuid}"
    return Row(
        "(e) torch's device in NVML's enumeration; stagetrace's UUID = NVML's",
        result,
        "1 match, equal",
        nvml_uuid is not None and nvml_uuid == stagetrace_uuid,
    )


def nvml_rows(r: NvmlReading) -> list[Row]:
    age_ok = r.newest_age_ms is not None and -r.period_ms <= r.newest_age_ms <= 2000 + 2 * r.period_ms
    age = f"{r.newest_age_ms:.0f}" if r.newest_age_ms is not None else "-"
    real = r.busy is not None and r.busy_expected is not None and r.busy_samples > 0
    return [
        Row(
            "(e) NVML sample period (ms) / clock / newest driver sample's age (ms)",
            f"{r.period_ms:.1f} / {r.clock} / {age}",
            "5..2000 / - / <= 2000 + 2 periods",
            5 <= r.period_ms <= 2000 and age_ok,
        ),
        Row(
            "(e) utilisation of a busy trace: stagetrace / driver samples read here (n)",
            f"{_fmt(r.busy)} / {_fmt(r.busy_expected)} ({r.busy_samples})",
            "equal within 0.05, from >= 1 sample",
            real and abs((r.busy or 0) - (r.busy_expected or 0)) <= 0.05,
        ),
        Row(
            "(e) control: the busy trace's utilisation / an idle trace's",
            f"{_fmt(r.busy)} / {_fmt(r.idle)}",
            ">= 0.5 / -",
            r.busy is not None and r.busy >= 0.5,
        ),
    ]


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_table(rows: list[Row], title: str) -> str:
    width = max(len(r.check) for r in rows)
    lines = [title, f"{'check':{width}}  {'result':46}  {'target':24}  ok"]
    lines += [f"{r.check:{width}}  {r.result:46}  {r.target:24}  {'yes' if r.ok else 'NO'}" for r in rows]
    return "\n".join(lines)


# --- the check (the same flow on a CUDA device and on the fakes) ------------------------------------------


class ErrorCounter(logging.Handler):
    """Errors stagetrace logged from its own threads (internal errors are contained and logged)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.threadName}: {record.getMessage()}")


def run_check(rig: Any, requests: int) -> tuple[list[Row], dict[str, Any]]:
    """Every row and figure for ``rig`` (``CudaRig`` or ``FakeRig``: the device, its profiler and NVML)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import stagetrace

    os.environ["STAGETRACE_HEALTHY_SAMPLE"] = "1.0"  # every trace's spans, not a share of the healthy ones
    os.environ["STAGETRACE_EXPORT_BUDGET"] = "off"
    errors = ErrorCounter()
    logging.getLogger("stagetrace").addHandler(errors)
    exporter = InMemorySpanExporter()
    verdicts: list[Any] = []
    handle = stagetrace.configure(
        "gpu-check", span_exporter=exporter, on_verdict=verdicts.append, set_global=False, gpu=rig.gpu_flag
    )
    support = rig.attach(handle)
    figures: dict[str, Any] = {"device": rig.describe()}
    rows: list[Row] = []
    try:
        for _ in range(3):
            plain_request(rig)
            with stagetrace.pipeline("request"):
                traced_request(rig, [])
        handle.force_flush(60)
        _wait(lambda: bool(support.timer.anchors(0)), 10, handle)

        # (a) syncs, (b) GPU time, (f) placement: the same profiled requests
        me = ThreadIds.current()
        plain = rig.read(_profiled(rig, requests, lambda: plain_request(rig)))
        verdicts.clear()
        exporter.clear()
        host_marks: list[int] = []
        clock_marks: list[ClockMark] = []

        def traced() -> None:
            with stagetrace.pipeline("request"):
                traced_request(rig, host_marks)

        traced_profile = rig.read(_profiled(rig, requests, traced, clock_marks))
        handle.force_flush(60)
        counts = SyncCounts(
            calls_on(plain, me, SYNC_CALLS, inside=REQUEST_MARK),
            calls_on(traced_profile, me, (*SYNC_CALLS, QUERY), inside=REQUEST_MARK),
            requests,
            *_attribution_control(rig, me, k=20),
        )
        rows += sync_rows(counts)
        rows.append(_sync_debug_row(rig))
        figures["syncs"] = {
            "plain": dict(counts.plain),
            "traced": dict(counts.traced),
            "control_k": counts.control_made,
            "control_own": dict(counts.control_own),
            "control_other": dict(counts.control_other),
            "control_leaked": dict(counts.control_leaked),
        }

        truth = truth_per_request(traced_profile.device)
        roots = sorted((s for s in exporter.get_finished_spans() if s.name == "request"), key=lambda s: s.start_time)
        by_trace = {v.trace_id: v for v in verdicts if v.root_name == "request"}
        measured = [
            dict(by_trace[f"{r.context.trace_id:032x}"].breakdown)
            for r in roots
            if f"{r.context.trace_id:032x}" in by_trace
        ]
        host_times = classic_host_times(rig, requests)
        rows += gpu_time_rows(truth, measured, host_times, requests)
        figures["gpu_time_ms"] = {"cupti": [t.ms() for t in truth], "stagetrace": measured, "classic_host": host_times}

        offset_ns, align_ns = profile_to_epoch(clock_marks)
        placed = _placed(exporter.get_finished_spans(), roots, host_marks)
        place_rows, figures["placement"] = placement_rows(placed, truth, offset_ns, align_ns, requests)
        rows += place_rows
        timer = support.timer
        rows.append(
            Row(
                "(f) anchors kept / rejected; records with the GIL held / through torch",
                f"{len(timer.anchors(0))} / {timer.anchors_rejected}; "
                f"{timer.records_holding_gil} / {timer.records_through_torch}",
                "kept > 0; held > 0",
                bool(timer.anchors(0)) and timer.records_holding_gil > 0,
            )
        )
        rows.append(
            Row(
                "(f) helper thread in thread-local capture mode",
                str(timer.thread_local_capture),
                "True",
                bool(timer.thread_local_capture),
            )
        )

        # (c) hot path
        hot = _hot_path(rig, support, handle)
        rows += hot_path_rows(hot)
        figures["hot_path_us"] = hot._asdict() | {"own": hot.own_us}

        # (d) pageable copy diagnosed, pinned not
        verdicts.clear()
        for name, pinned in (("pageable", False), ("pinned", True)):
            with stagetrace.pipeline(name):
                stagetrace.h2d(rig.source(pinned), rig.device)
        handle.force_flush(60)
        codes = {v.root_name: list(v.diagnosis_codes) for v in verdicts}
        ok = "PAGEABLE_H2D" in codes.get("pageable", ()) and "PAGEABLE_H2D" not in codes.get("pinned", ())
        rows.append(
            Row("(d) PAGEABLE_H2D on the pageable copy, not on the pinned one", str(codes), "pageable only", ok)
        )

        # (e) NVML
        sampler = support.samplers.get(0)
        nvml_devices = rig.nvml_devices()
        rows.append(uuid_row(rig.torch_device(), support.backend.device_uuid(0), nvml_devices))
        figures["nvml"] = {"devices": [d._asdict() for d in nvml_devices], "torch": rig.torch_device()._asdict()}
        if sampler is None:
            rows.append(Row("(e) NVML sampler", "not running", "running", False))
        else:
            reading = _nvml_reading(rig, sampler, handle, exporter, verdicts)
            rows += nvml_rows(reading)
            figures["nvml"]["reading"] = reading._asdict()
    finally:
        handle.shutdown()
        logging.getLogger("stagetrace").removeHandler(errors)
    rows.append(
        Row(
            "(g) errors stagetrace logged (contained)",
            str(len(errors.messages)) + (f": {errors.messages[0][:60]}" if errors.messages else ""),
            "0",
            not errors.messages,
        )
    )
    figures["errors"] = errors.messages[:20]
    return rows, figures


def plain_request(rig: Any) -> None:
    """H2D, forward, blocking D2H: the application without stagetrace."""
    with rig.no_grad():
        rig.forward(rig.source().to(rig.device, non_blocking=True)).to("cpu")


def traced_request(rig: Any, host_marks: list[int] | None) -> Any:
    """The same as stages; the host clock noted as the D2H is called. ``host_marks`` None: no D2H."""
    import stagetrace

    with rig.no_grad():
        xd = stagetrace.h2d(rig.source(), rig.device)
        with stagetrace.gpu_stage("infer"):
            y = rig.forward(xd)
        if host_marks is None:
            return y
        host_marks.append(time.time_ns())
        return stagetrace.d2h(y)


def classic_host_times(rig: Any, n: int) -> dict[str, list[float]]:
    """The same requests under the classic host timer (``InferencePipelineProfiler``), for comparison."""
    import stagetrace

    classic = stagetrace.InferencePipelineProfiler()
    host: dict[str, list[float]] = {"h2d": [], "infer": [], "d2h": []}
    with rig.no_grad():
        for _ in range(n):
            rig.synchronize()
            classic.start()
            xd = rig.source().to(rig.device, non_blocking=True)
            classic.record_stage("h2d")
            y = rig.forward(xd)
            classic.record_stage("infer")
            y.to("cpu")
            classic.record_stage("d2h")
            for k, v in classic.analyze_and_report()["stage_breakdown_ms"].items():
                host[k].append(v)
    return host


def _wait(cond: Callable[[], bool], timeout_s: float, handle: Any) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        handle.force_flush(1)
        time.sleep(0.02)
    return cond()


def _profiled(rig: Any, n: int, request: Callable[[], None], clock_marks: list[ClockMark] | None = None) -> Any:
    """``n`` requests under the profiler, each inside a request marker, each followed by a clock mark."""
    rig.synchronize()
    with rig.profile() as prof:
        for _ in range(n):
            with rig.record_function(REQUEST_MARK):
                request()
            if clock_marks is not None:
                before = time.time_ns()
                with rig.record_function(CLOCK_MARK):
                    after = time.time_ns()
                clock_marks.append(ClockMark(before, after, 0.0))
        rig.synchronize()
    if clock_marks is not None:  # the marks' profile timestamps, in the order they were taken
        stamps = sorted(m.start_us for m in rig.read(prof).markers if m.name == CLOCK_MARK)
        clock_marks[:] = [m._replace(profile_us=s) for m, s in zip(clock_marks, stamps)]
    return prof


def _attribution_control(rig: Any, me: ThreadIds, k: int) -> tuple[int, Counter[str], Counter[str], Counter[str]]:
    """The request thread and a second thread each make ``k`` of every CONTROL_CALLS call, the second one
    while the request thread is inside a request marker: each must be charged exactly its own."""
    other: list[ThreadIds] = []

    def calls() -> None:
        event = rig.timing_event()
        for _ in range(k):
            event.query()
        for _ in range(k):
            event.synchronize()

    def second() -> None:
        other.append(ThreadIds.current())
        calls()

    rig.synchronize()
    with rig.profile() as prof:
        with rig.record_function(REQUEST_MARK):
            calls()
            t = threading.Thread(target=second)
            t.start()
            t.join()
        rig.synchronize()
    profile = rig.read(prof)
    own = calls_on(profile, me, CONTROL_CALLS, inside=REQUEST_MARK)
    beyond_own = calls_on(profile, me, CONTROL_CALLS) - Counter(dict.fromkeys(CONTROL_CALLS, k))
    return k, own, calls_on(profile, other[0], CONTROL_CALLS), beyond_own


def _sync_debug_row(rig: Any) -> Row:
    """The H2D and forward under set_sync_debug_mode("error"); control: a blocking copy must raise."""
    import stagetrace

    def first_error(fn: Callable[[], Any]) -> str | None:
        with rig.sync_debug("error"):
            try:
                fn()
            except RuntimeError as e:
                return str(e).splitlines()[0][:50]
        return None

    def h2d_and_forward() -> None:
        with stagetrace.pipeline("sync-debug"):
            traced_request(rig, None)

    ours, control = first_error(h2d_and_forward), first_error(rig.blocking_copy)
    rig.synchronize()
    return Row(
        "(a) set_sync_debug_mode('error'): H2D + forward / control (a blocking copy)",
        f"{ours or 'none'} / {'raised' if control else 'did not raise'}",
        "none / raised",
        ours is None and control is not None,
    )


def _placed(spans: Iterable[Any], roots: list[Any], host_marks: list[int]) -> list[Placed]:
    from stagetrace import conventions as c

    by_trace: dict[int, dict[str, Any]] = {}
    for s in spans:
        by_trace.setdefault(s.context.trace_id, {})[s.name] = s
    out = []
    for root, host in zip(roots, host_marks[-len(roots) :] if roots else []):
        stages = by_trace.get(root.context.trace_id, {})
        infer, d2h = stages.get("infer"), stages.get("d2h")
        if infer is None or d2h is None or c.GPU_PLACEMENT_ERROR_US not in infer.attributes:
            continue
        bars = [s.attributes.get(c.GPU_PLACEMENT_ERROR_US, 0.0) for s in (infer, d2h)]
        out.append(Placed(infer.start_time, infer.end_time, d2h.start_time, int(max(bars) * 1000), host))
    return out


HOT_NAMES = ("s0", "s1", "s2", "s3")  # a request's few GPU stages, each once (a name repeated more folds)


def _hot_path(rig: Any, support: Any, handle: Any) -> HotPath:
    """Request-thread CPU per stage in the steady state (events reused from the pool): the least of
    ``rounds`` interleaved rounds of each kind (the least is the cost; the rest is the host's noise).
    ``gpu_stage`` and ``stage`` are bound once, as ``from stagetrace import gpu_stage`` does. Then the
    events the request thread had the pool create, for those rounds and for a request that repeats one
    GPU stage 100 times (a decode loop), after one such request to warm the pool (``_pool_churn``)."""
    import stagetrace

    gpu_stage, stage = stagetrace.gpu_stage, stagetrace.stage
    pipelines, rounds = rig.hot_pipelines, rig.hot_rounds
    n = pipelines * len(HOT_NAMES)
    events = [rig.timing_event() for _ in range(2 * len(HOT_NAMES))]

    def stages_us(make: Callable[[str], Any]) -> float:
        spent = 0
        for _ in range(pipelines):
            with stagetrace.pipeline("hot"):
                t0 = time.thread_time_ns()
                for name in HOT_NAMES:
                    with make(name):
                        pass
                spent += time.thread_time_ns() - t0
        if make is gpu_stage:
            handle.force_flush(60)  # the events come back to the pool before the next round
        return spent / n / 1000

    def floor_us() -> float:
        spent = 0
        for _ in range(pipelines):
            t0 = time.thread_time_ns()
            for i in range(len(HOT_NAMES)):
                stream = rig.current_stream()
                events[2 * i].record(stream)
                events[2 * i + 1].record(stream)
            spent += time.thread_time_ns() - t0
        rig.synchronize()
        return spent / n / 1000

    def repeated() -> None:
        with stagetrace.pipeline("decode"):
            for _ in range(100):
                with gpu_stage("step"):
                    pass
        handle.force_flush(60)

    rig.synchronize()
    for _ in range(2):  # warm: the pool then holds the events the pipelines in flight need
        stages_us(gpu_stage)
    measured: dict[str, list[float]] = {"gpu": [], "stage": [], "floor": []}
    with _pool_churn(support) as in_rounds:
        for _ in range(rounds):
            measured["gpu"].append(stages_us(gpu_stage))
            measured["stage"].append(stages_us(stage))
            measured["floor"].append(floor_us())
    repeated()
    with _pool_churn(support) as in_repeats:
        repeated()
    gpu_us, stage_us, floor = (min(measured[k]) for k in ("gpu", "stage", "floor"))
    return HotPath(stage_us, floor, gpu_us, sum(in_rounds.values()), sum(in_repeats.values()))


@contextlib.contextmanager
def _pool_churn(support: Any) -> Iterator[Counter[str]]:
    """Events the calling (request) thread had the pool create, and events it threw away unread (a
    discarded event cannot be reused: the pool creates another): in the steady state, none of either."""
    pool, backend, me = support.pool, support.pool.backend, threading.get_ident()
    churn: Counter[str] = Counter()
    new_event, discard = backend.new_event, pool.discard

    def counted_new(device: int) -> Any:
        churn["created"] += threading.get_ident() == me
        return new_event(device)

    def counted_discard(device: int, count: int) -> None:
        churn["discarded"] += count if threading.get_ident() == me else 0
        discard(device, count)

    backend.new_event, pool.discard = counted_new, counted_discard
    try:
        yield churn
    finally:
        del backend.new_event, pool.discard


def _nvml_reading(rig: Any, sampler: Any, handle: Any, exporter: Any, verdicts: list[Any]) -> NvmlReading:
    """A busy trace (the GPU kept busy) and an idle one; the driver's samples read here, over the busy
    trace's window, independently of the sampler."""
    import stagetrace
    from stagetrace.gpu.nvml import utilization_over_window

    verdicts.clear()
    exporter.clear()
    with stagetrace.pipeline("nvml-busy"), stagetrace.gpu_stage("load"):
        rig.load(rig.load_seconds)
    with stagetrace.pipeline("nvml-idle"):
        time.sleep(rig.load_seconds)
    _wait(lambda: {"nvml-busy", "nvml-idle"} <= {v.root_name for v in verdicts}, 10, handle)
    by_root = {v.root_name: v.gpu_utilization for v in verdicts}
    busy_span = next((s for s in exporter.get_finished_spans() if s.name == "nvml-busy"), None)
    expected, overlapping = None, 0
    nvml = rig.nvml
    with contextlib.suppress(Exception):
        device = nvml.nvmlDeviceGetHandleByUUID(sampler.device_uuid)
        _vtype, raw = nvml.nvmlDeviceGetSamples(device, nvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
        from stagetrace.gpu.nvml import _sample_value

        samples = sorted((int(s.timeStamp) + sampler.clock_offset_us, _sample_value(s)) for s in raw)
        if busy_span is not None:
            start_us, end_us = busy_span.start_time // 1000, busy_span.end_time // 1000
            overlapping = sum(1 for ts, _ in samples if ts > start_us and ts - sampler.period_us < end_us)
            stats = utilization_over_window(samples, sampler.period_us, start_us, end_us)
            expected = stats.mean if stats is not None else None
    newest = sampler.newest_driver_sample_us
    return NvmlReading(
        period_ms=sampler.period_us / 1000,
        clock=sampler.clock,
        newest_age_ms=(time.time_ns() // 1000 - newest) / 1000 if newest is not None else None,
        driver_samples=sampler.driver_samples,
        stand_ins=sampler.stand_ins,
        busy=by_root.get("nvml-busy"),
        busy_expected=expected,
        busy_samples=overlapping,
        idle=by_root.get("nvml-idle"),
    )


# --- the device: CUDA, or the fakes (--dry-run) -------------------------------------------------------------


class CudaRig:
    """torch on CUDA device 0, torch.profiler (CUPTI) and nvidia-ml-py."""

    gpu_flag = True
    load_seconds = 1.2
    hot_pipelines, hot_rounds = 250, 5

    def __init__(self, torch: Any, mib: int) -> None:
        import pynvml

        self.torch = torch
        self.nvml = pynvml
        self.device = torch.device("cuda:0")
        torch.manual_seed(0)
        rows = max(1, mib * 2**20 // (4096 * 4))
        self.model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).to(self.device).eval()
        self.pinned = torch.randn(rows, 4096).pin_memory()
        self.pageable = torch.randn(rows, 4096)
        self.mib = mib

    def describe(self) -> dict[str, Any]:
        t = self.torch
        return {"name": t.cuda.get_device_name(0), "torch": t.__version__, "cuda": t.version.cuda, "mib": self.mib}

    def attach(self, handle: Any) -> Any:
        return handle.runtime.gpu

    def source(self, pinned: bool = True) -> Any:
        return self.pinned if pinned else self.pageable

    def forward(self, x: Any) -> Any:
        return self.model(x)

    def no_grad(self) -> Any:
        return self.torch.no_grad()

    def synchronize(self) -> None:
        self.torch.cuda.synchronize()

    def profile(self) -> Any:
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def read(self, prof: Any) -> Profile:
        return read_profile(prof.events())

    def record_function(self, name: str) -> Any:
        from torch.profiler import record_function

        return record_function(name)

    def timing_event(self) -> Any:
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def current_stream(self) -> Any:
        return self.torch.cuda.current_stream()

    @contextlib.contextmanager
    def sync_debug(self, mode: str) -> Iterator[None]:
        self.torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            self.torch.cuda.set_sync_debug_mode("default")

    def blocking_copy(self) -> None:
        self.torch.ones(4, device=self.device).to("cpu")

    def load(self, seconds: float) -> None:
        a = self.torch.randn(4096, 4096, device=self.device)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for _ in range(20):
                a = a @ a
                a = a / a.norm()
            self.torch.cuda.synchronize()

    def torch_device(self) -> TorchDevice:
        props = self.torch.cuda.get_device_properties(0)
        pci_fields = [getattr(props, f, None) for f in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
        pci = tuple(int(v) for v in pci_fields) if all(v is not None for v in pci_fields) else None
        return TorchDevice(str(props.uuid), str(props.name), pci)  # type: ignore[arg-type]

    def nvml_devices(self) -> list[NvmlDevice]:
        return nvml_enumeration(self.nvml)


def nvml_enumeration(nvml: Any) -> list[NvmlDevice]:
    """NVML's own list of devices (whole GPUs), with their UUIDs, names and PCI addresses."""
    nvml.nvmlInit()
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        pci = nvml.nvmlDeviceGetPciInfo(h)
        out.append(
            NvmlDevice(
                _text(nvml.nvmlDeviceGetUUID(h)),
                _text(nvml.nvmlDeviceGetName(h)),
                (int(pci.domain), int(pci.bus), int(pci.device)),
            )
        )
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class FakeRig:
    """The same surface over tests/fakes.py: FakeGpu (real-time device), FakeProfiler, FakeNvml."""

    gpu_flag = False
    load_seconds = 0.2
    hot_pipelines, hot_rounds = 60, 3
    device = "cuda:0"

    def __init__(self, model_ms: float = 3.0, copy_bytes: int = 80 << 20) -> None:
        import fakes

        self.fakes = fakes
        self.gpu = fakes.FakeGpu()
        self.backend = fakes.FakeCudaBackend(self.gpu)
        self.nvml = fakes.FakeNvml(utilization=0.05, period_ms=20)
        self.model_ms = model_ms
        self.copy_bytes = copy_bytes

    def describe(self) -> dict[str, Any]:
        return {"name": "FakeGpu (dry run)", "torch": None, "cuda": None, "mib": self.copy_bytes >> 20}

    def attach(self, handle: Any) -> Any:
        from stagetrace.gpu import attach_gpu

        return attach_gpu(handle.runtime, backend=self.backend, nvml=self.nvml, nvml_poll_interval_s=0.05)

    def source(self, pinned: bool = True) -> Any:
        return self.fakes.FakeTensor(self.gpu, self.copy_bytes, pinned=pinned)

    def forward(self, x: Any) -> Any:
        """``model_ms`` of kernels, and an output as large as the input."""
        self.fakes.fake_model(x, ms=self.model_ms)
        return self.fakes.FakeTensor(self.gpu, self.copy_bytes, "cuda:0")

    def no_grad(self) -> Any:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        self.gpu.default_stream.wait_host()

    def profile(self) -> Any:
        return self.fakes.FakeProfiler(self.gpu)

    def read(self, prof: Any) -> Profile:
        return read_profile(prof.events())

    def record_function(self, name: str) -> Any:
        prof = self.gpu.profiler
        return prof.record_function(name) if prof is not None else contextlib.nullcontext()

    def timing_event(self) -> Any:
        event = self.fakes.FakeEvent(self.gpu, enable_timing=True)
        event.record()
        return event

    def current_stream(self) -> Any:
        return self.gpu.current_stream()

    @contextlib.contextmanager
    def sync_debug(self, mode: str) -> Iterator[None]:
        self.gpu.sync_debug = mode
        try:
            yield
        finally:
            self.gpu.sync_debug = "default"

    def blocking_copy(self) -> None:
        self.fakes.FakeTensor(self.gpu, 16, "cuda:0").to("cpu")

    def load(self, seconds: float) -> None:
        self.nvml.set_utilization(0.95)
        self.gpu.current_stream().enqueue(seconds * 1e3)
        time.sleep(seconds)
        self.nvml.set_utilization(0.05)

    def torch_device(self) -> TorchDevice:
        return TorchDevice(self.fakes.fake_uuid(0), "NVIDIA H200", (0, 0x19, 0))

    def nvml_devices(self) -> list[NvmlDevice]:
        return nvml_enumeration(self.nvml)


# --- the session's report -----------------------------------------------------------------------------------


def session_report(work: Path, out: Path, *, dry_run: bool = False, limit: int = SUMMARY_LIMIT) -> str:
    """Join what the session's steps left in ``work`` into ``out``: session.json (every step's status and
    figures), log.txt (every step's output) and summary.txt (under ``limit`` characters), and return the
    summary. ``steps.txt`` names the steps in order; each left ``<name>.log``, ``<name>.status`` ("rc
    seconds limit") and, for its figures, ``<name>.json`` or a JUnit ``<name>.xml`` (the tests)."""
    names = (work / "steps.txt").read_text().split() if (work / "steps.txt").exists() else []
    steps: dict[str, Any] = {}
    logs = []
    for name in dict.fromkeys(names):
        status = work / f"{name}.status"
        rc, seconds, limit_s = [*(status.read_text().split() if status.exists() else []), "?", "?", "?"][:3]
        log_path = work / f"{name}.log"
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        figures: Any = None
        with contextlib.suppress(OSError, ValueError):
            figures = json.loads((work / f"{name}.json").read_text())
        if figures is None and ((work / f"{name}.xml").exists() or (dry_run and "collected" in log)):
            figures = test_figures(work / f"{name}.xml", log, dry_run=dry_run)
        steps[name] = {"rc": rc, "seconds": seconds, "limit_s": limit_s, "figures": figures, "tail": output_tail(log)}
        logs.append(f"===== {name}: rc={rc} {seconds}s (limit {limit_s}s)\n{log[-2_000_000:]}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "session.json").write_text(json.dumps({"dry_run": dry_run, "steps": steps}, indent=1, default=str))
    (out / "log.txt").write_text("\n".join(logs))
    summary = summarize(steps, limit)
    (out / "summary.txt").write_text(summary)
    return summary


def test_figures(junit: Path, log: str, *, dry_run: bool) -> dict[str, Any]:
    """The tests step's row: from pytest's JUnit file (passed, failed, errors, skipped; the real-CUDA
    tests, ``test_real_cuda_*``, must have run), or in a dry run from the count pytest collected."""
    import re
    import xml.etree.ElementTree as ET

    if dry_run:
        found = re.search(r"(\d+)(?:/\d+)? tests? collected", log)
        n = int(found.group(1)) if found else 0
        row = Row("(tests) collected, -m 'not slow' (dry run: not run)", str(n), "> 0", n > 0)
        return {"rows": [row._asdict()], "collected": n}
    counts: Counter[str] = Counter()
    cuda_run = 0
    with contextlib.suppress(OSError, ET.ParseError):
        for case in ET.parse(junit).iter("testcase"):
            kinds = {child.tag for child in case} & {"failure", "error", "skipped"}
            kind = next(iter(kinds), "passed")
            counts[kind] += 1
            cuda_run += kind != "skipped" and case.get("name", "").startswith("test_real_cuda")
    row = Row(
        "(tests) passed / failed / errors / skipped; real-CUDA tests run",
        f"{counts['passed']} / {counts['failure']} / {counts['error']} / {counts['skipped']}; {cuda_run}",
        "- / 0 / 0 / - ; >= 2",
        counts["passed"] > 0 and not counts["failure"] and not counts["error"] and cuda_run >= 2,
    )
    return {"rows": [row._asdict()], **counts, "cuda_run": cuda_run}


def output_tail(log: str, chars: int = TAIL_CHARS) -> str:
    """The end of a step's output on one line (its last lines joined by `` | ``): what a reader of the
    summary needs to see why a step failed without opening log.txt."""
    lines = [" ".join(line.split()) for line in log.strip().splitlines()]
    tail = " | ".join(line for line in lines[-6:] if line)
    return tail if len(tail) <= chars else "..." + tail[-(chars - 3) :]


def summarize(steps: dict[str, Any], limit: int = SUMMARY_LIMIT) -> str:
    """One line per step; under FAILING every step whose rc is not 0 (failed, timed out, killed or not
    run: it may have left no rows at all) with its rc and the end of its output, then the failing rows
    with their targets; then every row, cut to ``limit`` characters (failures first: they are what a
    rerun needs; session.json has everything)."""
    lines = ["step        status      time (limit)"]
    failing, every = [], []
    for name, step in steps.items():
        rc = step["rc"]
        verdict = {"0": "ok", "124": "TIMED OUT", "137": "KILLED"}.get(rc, f"rc={rc}")
        lines.append(f"{name:11} {verdict:11} {step['seconds']}s ({step['limit_s']}s)")
        if rc != "0":
            label = f"rc={rc}" + (f" {verdict}" if rc in ("124", "137") else "")
            failing.append(f"[{name} {label}] {step.get('tail') or '(no output)'}")
        for row in (step.get("figures") or {}).get("rows", ()):
            check, result = str(row["check"]), str(row["result"])
            every.append(f"{'ok' if row['ok'] else 'NO'} {check[:56]}: {result[:40]}")
            if not row["ok"]:
                failing.append(f"{check[:90]}: {result[:80]} [target {str(row['target'])[:40]}]")
    lines += [f"FAILING ({len(failing)}):", *failing] if failing else ["FAILING: none"]
    body = "\n".join([*lines, "ROWS:", *every])
    if len(body) > limit:
        body = body[: limit - 45].rsplit("\n", 1)[0] + "\n... (cut here; session.json has every row)"
    return body


# --- main ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10, help="requests in each profiled run")
    ap.add_argument("--mib", type=int, default=64, help="size of each copy")
    ap.add_argument("--json", help="write the rows and every figure here")
    ap.add_argument("--dry-run", action="store_true", help="run on CPU against tests/fakes.py")
    ap.add_argument("--report", metavar="WORKDIR", help="join a GPU session's step outputs (with --out)")
    ap.add_argument("--out", help="where --report writes session.json, log.txt and summary.txt")
    args = ap.parse_args(argv)
    if args.report:
        print(session_report(Path(args.report), Path(args.out or args.report), dry_run=args.dry_run))
        return 0
    if args.dry_run:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        rig: Any = FakeRig()
        args.requests = min(args.requests, 5)
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device; nothing to measure (run this on a GPU machine, or --dry-run)")
            return 2
        rig = CudaRig(torch, args.mib)
    rows, figures = run_check(rig, args.requests)
    d = figures["device"]
    print(format_table(rows, f"stagetrace GPU check on {d['name']}, torch {d['torch']}, {d['mib']} MiB copies"))
    if args.json:
        payload = {"rows": [r._asdict() for r in rows], "figures": figures}
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
