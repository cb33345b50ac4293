#!/usr/bin/env bash
# The mutation run over every module of capture/, analysis/, exporter/ and report/ that turns inputs into a
# figure a user reads ([tool.mutmut] in pyproject.toml: which modules, which tests), then each module's score
# and the survivors. Not in CI (44 minutes on a quiet 2-core machine, 2026-12-06). CONTRIBUTING.md, "Mutation
# testing", lists the survivors and why each is equivalent or accepted.
#
#   scripts/mutation.sh            # the whole run (mutants/ is reused: only changed code is mutated again)
#   scripts/mutation.sh 'stagetrace.report.sketch*'   # some mutants again, after adding tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# the mutants are the sources: no process of the run may load the compiled modules built beside them
export STAGETRACE_PURE_PYTHON=1
"$PY" -m pip show mutmut >/dev/null 2>&1 || "$PY" -m pip install -q "mutmut==3.8.1"
"$PY" -m mutmut run --max-children "${MUTMUT_CHILDREN:-2}" "$@" || true  # its exit status says nothing of the score
"$PY" -m mutmut results 2>/dev/null | grep -E ": (survived|no tests)" || true
"$PY" scripts/mutation_scores.py --min "${MUTATION_MIN_SCORE:-0.9}"
