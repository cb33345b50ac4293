"""A corpus of scenario apps, one per diagnosis rule, each with a healthy twin that must fire nothing.

Used by the test suite (``tests/test_accuracy_corpus.py`` runs each scenario once) and by
``benchmarks/diagnosis_accuracy.py`` (each scenario many times, counting how often the right code fired on
the requests that lived its cause, and how often a wrong code fired at all).
"""

from __future__ import annotations

from scenarios.collect import Collector
from scenarios.corpus import SCENARIOS, Scenario, Workload
from scenarios.run import Outcome, run_in_own_process, run_once

__all__ = ["SCENARIOS", "Collector", "Outcome", "Scenario", "Workload", "run_in_own_process", "run_once"]
