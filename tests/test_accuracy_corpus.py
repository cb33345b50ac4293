"""Each scenario of the accuracy corpus (``tests/scenarios/``) once, against a real uvicorn: the rule fires on
requests that lived its cause, and a healthy twin keeps the rule silent. How often, over many runs, is what
``benchmarks/diagnosis_accuracy.py`` measures; this keeps every scenario working."""

from __future__ import annotations

import pytest

from scenarios import SCENARIOS, run_once

try:
    import torch

    HAS_CUDA = bool(torch.cuda.is_available())
except Exception:  # pragma: no cover - torch is a test dependency
    HAS_CUDA = False


def marks(scenario):
    out = [pytest.mark.slow]
    if scenario.needs_gpu:
        out += [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and NVML")]
    return out


@pytest.mark.parametrize("scenario", [pytest.param(s, id=s.name, marks=marks(s)) for s in SCENARIOS])
def test_scenario(spare_cpus, collector, scenario):  # the host is checked before the collector starts its exporter
    outcome = run_once(scenario, collector.wait_verdicts)
    assert outcome.verdicts == scenario.requests
    if scenario.rule is None:
        assert outcome.lived == 0 and outcome.twin_fired == 0, outcome  # its counterpart's rule stays silent
    else:
        assert outcome.lived >= 1, "the scenario's requests must live its cause"
        assert outcome.right >= 1, outcome
