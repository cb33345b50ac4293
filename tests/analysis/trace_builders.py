"""Stage samples and a one-call diagnosis, shared by the rule tests."""

from __future__ import annotations

from stagetrace.analysis import DiagnosisThresholds, StageSample, TraceSignals, analyse_trace, diagnose

MS = 1_000_000


def run(stages, total_ms=100, signals=TraceSignals(), thresholds=DiagnosisThresholds()):
    """The diagnoses of a trace of ``stages`` under a root of ``total_ms``, by code."""
    a = analyse_trace(0, int(total_ms * MS), stages, 200)
    return {d.code: d for d in diagnose(a, stages, signals, thresholds)}


def cpu(name, start, end, **kw):
    """A stage from ``start`` to ``end`` ms (kind ``cpu`` unless ``kind=`` says otherwise)."""
    return StageSample(name, kw.pop("kind", "cpu"), int(start * MS), int(end * MS), **kw)


def offload(
    name="tokenize", queue=0.0, send=1.0, run=10.0, ret=1.0, *, start=0.0, in_flight=1, max_workers=2, seq=5,
    args_bytes=1000, result_bytes=100, span_id=900, worker_pid=4242, run_fields=None,
):  # fmt: skip
    """A call handed to a process pool as the exporter places it: the offload stage (its facts) and its four
    children back to back from ``start`` (ms), zero-length ones left out as the exporter leaves them."""
    from stagetrace.analysis.offload import QUEUE, RETURN, RUN, SEND, OffloadInfo

    info = OffloadInfo("ProcessPoolExecutor", max_workers, in_flight, args_bytes, result_bytes, "fork", worker_pid, seq)
    edges = [start, start + queue, start + queue + send, start + queue + send + run, start + queue + send + run + ret]
    out = [StageSample(name, "offload", int(edges[0] * MS), int(edges[-1] * MS), span_id, offload=info)]
    for i, (child, kind) in enumerate(((QUEUE, "wait"), (SEND, "io"), (RUN, "cpu"), (RETURN, "io"))):
        if edges[i + 1] > edges[i] or child == RUN:
            extra = dict(worker_pid=worker_pid, **(run_fields or {})) if child == RUN else {}
            out.append(
                StageSample(child, kind, int(edges[i] * MS), int(edges[i + 1] * MS), span_id + 1 + i, span_id, **extra)
            )
    return out
