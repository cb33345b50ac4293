#!/usr/bin/env bash
# Wheels that the GPU machine lacks (it has torch, pytest, nvidia-ml-py, protobuf, grpcio and requests, and
# no network): the OpenTelemetry set stagetrace needs, for its Python 3.12, downloaded here into .whl/
# (git-ignored). benchmarks/gpu_session.sh installs them there; the run carries .whl.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
# The versions constraints.txt pins, plus what they need that the machine's image does not hold.
OTEL=$(grep -E '^opentelemetry-(api|sdk|proto|exporter-otlp-proto-(common|grpc|http)|instrumentation|semantic-conventions)==' constraints.txt)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $OTEL "googleapis-common-protos>=1.52,<2" "importlib-metadata>=6,<9" "zipp>=3.20" "wrapt>=1.0,<2" \
  "typing-extensions>=4.5"
ls .whl
