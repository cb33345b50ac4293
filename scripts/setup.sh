#!/usr/bin/env bash
# One-time, idempotent set-up on a fresh machine: system packages the tests use (when run as root),
# a virtual environment in .venv, and stagetrace with every extra, pinned to the tested set.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(prometheus chromium chromium-driver docker-compose)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING" || true
# constraints.txt pins the OpenTelemetry set and the CPU build of torch 2.13.0 (a looser pin pulls CUDA).
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]" 2>&1 | grep -v "^WARNING" || true
.venv/bin/python -c "import stagetrace, torch, fastapi, opentelemetry.sdk; print('stagetrace', stagetrace.__version__, 'ready')"
.venv/bin/python -c "from stagetrace._compiled import status; print(status())"  # compiled, or why not
