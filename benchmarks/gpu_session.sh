#!/usr/bin/env bash
# One prepared session on a GPU machine, in this order, each step with its own time limit, everything it
# prints kept under $OUT (one file per step, plus summary.txt):
#   env, the NVML probe (idle vs loaded, sample period, clock, UUID), the CUDA tests, clock-anchor accuracy
#   with 0 and 2 busy threads, the capture probe, the dtype probe, and benchmarks/gpu_check.py.
# Under 10 minutes on one H200 even if every step ran to its limit (570 s together). The GPU machine has torch, pytest and nvidia-ml-py but not OpenTelemetry and
# no network: run scripts/gpu_wheels.sh here first and carry .whl with the run; this script installs them.
#
#   device run (carry .whl):  bash benchmarks/gpu_session.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/install.txt" 2>&1 || echo "wheel install failed (see install.txt)"
  export PYTHONPATH="/tmp/site:src${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
fi

: >"$OUT/summary.txt"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  local verdict=ok
  [ $rc -eq 124 ] && verdict="TIMED OUT after ${limit}s"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && verdict="rc=$rc"
  printf '%-10s %-22s %4ss\n' "$name" "$verdict" "$((SECONDS - t0))" | tee -a "$OUT/summary.txt"
  tail -n 25 "$OUT/$name.txt"
  echo
}

step env 20 bash -c "nvidia-smi; $PY -V; $PY -c 'import torch, pynvml, opentelemetry.sdk, stagetrace; \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0)); \
print(\"stagetrace\", stagetrace.__version__)'"
step nvml 40 "$PY" benchmarks/gpu_probes.py nvml
step cuda-tests 150 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_gpu_path.py tests/test_nvml.py
step anchors 60 "$PY" benchmarks/gpu_probes.py anchors
step capture 90 "$PY" benchmarks/gpu_probes.py capture
step dtype 30 "$PY" benchmarks/gpu_probes.py dtype
step gpu-check 180 "$PY" benchmarks/gpu_check.py --json "$OUT/gpu-check.json"
echo "results in $OUT"
cat "$OUT/summary.txt"
