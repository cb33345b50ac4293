"""One run of a scenario against a real uvicorn on 127.0.0.1, with clients in another process, and what its
verdicts say measured against what the scenario's requests lived."""

from __future__ import annotations

import gc
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import stagetrace
from scenarios.corpus import Scenario
from servers import exported_spans, hit, own_process_server, serve
from stagetrace.analysis import Verdict
from stagetrace.analysis.diagnosis import UNDETERMINED_BETWEEN
from stagetrace.report.loader import Span
from stagetrace.report.traces import verdict_for_trace


@dataclass(frozen=True)
class Outcome:
    """Per request: did it live the cause, did the rule fire, did a code fire that should not have."""

    verdicts: int
    lived: int  # requests that lived the scenario's cause
    right: int  # of those, how many carry the scenario's rule
    wrong: int  # requests carrying a code other than the rule and the scenario's allowed ones
    undetermined: int  # of the lived ones without the rule, those whose verdict declined to name a cause
    wrong_codes: tuple[str, ...]
    twin_fired: int  # on a healthy twin: requests carrying the rule whose cause it removed
    misread: tuple[Verdict, ...] = ()  # the verdicts that missed the rule or carried a wrong code


def judge(scenario: Scenario, verdicts: Sequence[Verdict]) -> Outcome:
    """A code that declines to name a cause (``UNDETERMINED_BETWEEN``) is not wrong where the scenario's rule is
    one of the causes it could not tell apart: it counts as undetermined, neither right nor wrong."""
    expected = {scenario.rule} if scenario.rule else set()
    declined = {code for code, causes in UNDETERMINED_BETWEEN.items() if scenario.rule in causes}
    ok = expected | scenario.allowed | declined
    lived = [v for v in verdicts if scenario.rule and scenario.lived(v)]
    wrong = [v for v in verdicts if set(v.diagnosis_codes) - ok]
    missed = [v for v in lived if scenario.rule not in v.diagnosis_codes]
    return Outcome(
        verdicts=len(verdicts),
        lived=len(lived),
        right=sum(1 for v in lived if scenario.rule in v.diagnosis_codes),
        wrong=len(wrong),
        undetermined=sum(1 for v in missed if declined & set(v.diagnosis_codes)),
        wrong_codes=tuple(sorted({code for v in wrong for code in v.diagnosis_codes} - ok)),
        twin_fired=sum(1 for v in verdicts if scenario.twin_of in v.diagnosis_codes),
        misread=(*missed, *(v for v in wrong if all(v is not m for m in missed))),
    )


def run_once(scenario: Scenario, verdicts: Callable[[int], list[Verdict]]) -> Outcome:
    """``verdicts(n)``: waits for and returns the configured stagetrace's first ``n`` verdicts of this run, in
    the order they came (the caller configured it: a ``scenarios.Collector``, as the suite and the benchmark do)."""
    gc.collect()  # a full collection during a run is a real stall: start each from a collected heap
    workload = scenario.build()
    stagetrace.instrument_fastapi(workload.app)
    with workload.running(), serve(workload.app) as base:
        # A fresh server's first request pays its lazy set-up (in no stage); the scenarios judge a warm one.
        if hit(base, workload.path, 1, 1) != [200] or len(verdicts(1)) != 1:
            raise RuntimeError(f"{scenario.name}: the warm-up request failed")
        statuses = hit(base, workload.path, scenario.requests, scenario.concurrency)
    return _judged(scenario, statuses, [v for v in verdicts(1 + scenario.requests)[1:] if v.route == workload.path])


def _judged(scenario: Scenario, statuses: list[int], got: list[Verdict]) -> Outcome:
    """The run's outcome, once every request answered and every one of them has its verdict."""
    if statuses != [200] * scenario.requests:
        raise RuntimeError(f"{scenario.name}: statuses {statuses}")
    if len(got) != scenario.requests:
        raise RuntimeError(f"{scenario.name}: {len(got)} verdicts for {scenario.requests} requests")
    return judge(scenario, got)


def run_in_own_process(scenario: Scenario, out_dir: Path) -> tuple[Outcome, list[Span]]:
    """``run_once`` with the scenario's app served by uvicorn in a process of its own
    (``scenarios.own_process_app``), as a deployed service is: no thread of the harness shares its GIL. Its
    spans are written to ``out_dir`` and the verdicts read back from them (``report.traces``), the warm-up
    request left out. Returns the outcome and the spans (for explaining a misread verdict)."""
    # benchmarks/harness.py, on the path of the suite and the benchmarks but not of the server process, which
    # imports this package for its corpus
    from harness import free_port, terminate, wait_for_port

    port = free_port()
    server = own_process_server(
        ["-m", "uvicorn", "scenarios.own_process_app:app", "--host", "127.0.0.1", "--port", str(port)],
        out_dir,
        STAGETRACE_SCENARIO=scenario.name,
    )
    path = scenario.build().path
    try:
        wait_for_port(port, server)
        base = f"http://127.0.0.1:{port}"
        if hit(base, path, 1, 1) != [200]:
            raise RuntimeError(f"{scenario.name}: the warm-up request failed")
        statuses = hit(base, path, scenario.requests, scenario.concurrency)
    finally:
        terminate(server, timeout_s=30)  # a graceful shutdown flushes every trace to out_dir
    spans = exported_spans(out_dir)
    traces: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    verdicts = sorted(
        (verdict_for_trace(trace, float("inf")) for trace in traces.values()),
        key=lambda v: min(s.start_ns for s in traces[v.trace_id]),
    )
    got = [v for v in verdicts if v.route == path][1:]  # the first is the warm-up
    return _judged(scenario, statuses, got), spans
