"""How often each diagnosis rule names the right cause, and how often a wrong one fires.

    python benchmarks/diagnosis_accuracy.py [--runs 20] [--only NAME ...] [--explain] [--own-process]

Runs every scenario of the corpus in ``tests/scenarios/`` (one app per rule whose requests live its cause,
and a healthy twin of the same shape without it) ``--runs`` times against a real uvicorn on 127.0.0.1, with
clients in another process, and prints per scenario: the requests that lived the cause, the share of them
on which the rule fired ("right"), the share on which the verdict said what it measured but declined to name
a cause it could not tell from another ("undetermined": OFF_CPU_WAIT in the GIL and lock scenarios), and the
share of all requests on which a code fired that the scenario does not call for ("wrong", with the codes).
Target: right 100 %, wrong 0 %. ``--explain`` prints every verdict that missed or misread, with its stages'
CPU figures. Scenarios that need a CUDA device and NVML are reported as skipped without one.
``--own-process`` serves each scenario's app by uvicorn in a process of its own
(``tests/scenarios/own_process_app.py``) and reads the verdicts back from the spans it exported, as a
deployed service is served: by default the server shares this process, and its GIL, with the harness.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from scenarios import SCENARIOS, Collector, Outcome, Scenario, run_in_own_process, run_once
from scenarios.collect import explain


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def run_scenario(scenario: Scenario, runs: int, own_process: bool = False) -> tuple[list[Outcome], list[str]]:
    """The outcomes, and an explanation of every misread verdict."""
    outcomes, explained = [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="stagetrace-accuracy-") as scratch:
            if own_process:
                outcome, spans = run_in_own_process(scenario, Path(scratch))
            else:
                collector = Collector(Path(scratch) / "traces.jsonl", service="diagnosis-accuracy")
                try:
                    outcome = run_once(scenario, collector.wait_verdicts)
                finally:
                    collector.shutdown()
                spans = collector.spans() if outcome.misread else []
            outcomes.append(outcome)
            explained += [explain(v, spans) for v in outcome.misread]
    return outcomes, explained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=None, help="scenario names")
    parser.add_argument("--explain", action="store_true", help="print every verdict that missed or misread")
    parser.add_argument(
        "--own-process",
        action="store_true",
        help="serve each scenario's app by uvicorn in a process of its own (no harness thread beside it)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("STAGETRACE_HEALTHY_SAMPLE", "1.0")
    os.environ.setdefault("STAGETRACE_EXPORT_BUDGET", "off")
    gpu = cuda_available()
    print(
        f"diagnosis accuracy: {args.runs} runs of each scenario against uvicorn on 127.0.0.1"
        f"{' in its own process' if args.own_process else ''}, "
        f"{os.cpu_count()} CPUs, {'a' if gpu else 'no'} CUDA device"
    )
    print(
        f"{'scenario':28} {'rule':20} {'requests':>8} {'lived':>6} {'right':>7} {'undeterm.':>9} {'wrong':>7}  "
        "wrong codes"
    )
    all_ok = True
    for scenario in SCENARIOS:
        if args.only and scenario.name not in args.only:
            continue
        rule = scenario.rule or "(healthy twin)"
        if scenario.needs_gpu and not gpu:
            print(f"{scenario.name:28} {rule:20} {'skipped: needs a CUDA device and NVML':>40}")
            continue
        outcomes, explained = run_scenario(scenario, args.runs, args.own_process)
        requests = sum(o.verdicts for o in outcomes)
        lived = sum(o.lived for o in outcomes)
        right = sum(o.right for o in outcomes)
        undetermined = sum(o.undetermined for o in outcomes)
        wrong = sum(o.wrong for o in outcomes)
        codes = Counter(code for o in outcomes for code in o.wrong_codes)
        right_text = f"{right / lived:7.1%} {undetermined / lived:9.1%}" if lived else f"{'-':>7} {'-':>9}"
        print(
            f"{scenario.name:28} {rule:20} {requests:8d} {lived:6d} {right_text} {wrong / requests:7.1%}  "
            + ", ".join(f"{code} ({n} runs)" for code, n in codes.most_common())
        )
        all_ok = all_ok and wrong == 0 and (right == lived)
        if args.explain and explained:
            print("\n".join(explained))
    print("target: right 100 %, wrong 0 %:", "met" if all_ok else "NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
