#!/usr/bin/env bash
# One prepared session on a GPU machine. From a cold start it fits in 6 minutes even if every step ran to
# its limit (BUDGET below: the steps' limits are cut to what is left of it), so a rerun fits in the 15
# minutes of device time. It leaves 3 files under $OUT: session.json (every step's status and figures),
# log.txt (every step's output, joined) and summary.txt (under 4,000 characters), printed last; a step that
# fails also prints the end of its output (at most 1,200 characters) as it ends.
#
# Steps: install (the carried wheels the image lacks, into /tmp/site), env (device, versions, stagetrace's
# requirements met, the image's packages not shadowed), cuda-tests (tests/test_gpu*.py and test_nvml.py,
# -m "not slow"), anchors, capture, dtype (benchmarks/gpu_probes.py), gpu-check (benchmarks/gpu_check.py).
# The machine has torch, pytest and nvidia-ml-py but not OpenTelemetry, and no network: run
# scripts/gpu_wheels.sh here first and carry .whl.
#
#   device run (carry .whl, timeout_s 360):  bash benchmarks/gpu_session.sh
#   here, on CPU (fakes in place of CUDA):   bash benchmarks/gpu_session.sh --dry-run
set -u
cd "$(dirname "$0")/.."
DRY=()
[ "${1:-}" = "--dry-run" ] && DRY=(--dry-run)
OUT=${OUT:-gpu-out}
PY=${PYTHON:-python3}
BUDGET=${GPU_SESSION_BUDGET:-330}  # seconds for the whole session, the report included
KILL_AFTER=5                       # a step past its limit gets SIGTERM, then SIGKILL this much later
REPORT_RESERVE=15                  # kept back for the report
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
START=$SECONDS

step() {  # step NAME LIMIT COMMAND...: its output to $WORK/NAME.log, "rc seconds limit" to $WORK/NAME.status
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START) - REPORT_RESERVE - KILL_AFTER))
  [ "$limit" -gt "$left" ] && limit=$left
  echo "$name" >>"$WORK/steps.txt"
  if [ "$limit" -le 0 ]; then
    echo "not run: the session's budget was spent" >"$WORK/$name.log"
    echo "124 0 0" >"$WORK/$name.status"
    printf '%-10s not run: no time left\n' "$name"
    return
  fi
  local t0=$SECONDS
  timeout --kill-after="$KILL_AFTER" "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$?
  echo "$rc $((SECONDS - t0)) $limit" >"$WORK/$name.status"
  printf '%-10s rc=%-3s %4ss (limit %ss)\n' "$name" "$rc" "$((SECONDS - t0))" "$limit"
  if [ "$rc" -ne 0 ]; then
    tail -c 1200 "$WORK/$name.log"
    echo
  fi
}

install_wheels() {  # only the wheels whose distribution the image lacks: its own packages stay in use
  "$PY" - .whl/*.whl >"$WORK/wheels.txt" <<'EOF'
import importlib.metadata as md, re, sys
for path in sys.argv[1:]:
    name = re.sub(r"[-_.]+", "-", path.rsplit("/", 1)[-1].split("-")[0]).lower()
    try:
        print(f"kept the image's {name} {md.version(name)}, not {path}", file=sys.stderr)
    except md.PackageNotFoundError:
        print(path)
EOF
  [ -s "$WORK/wheels.txt" ] || return 0
  xargs "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site <"$WORK/wheels.txt"
}

if [ ${#DRY[@]} -eq 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  export -f install_wheels
  export PY WORK
  step install 30 bash -c install_wheels
  export PYTHONPATH="$PYTHONPATH:/tmp/site"  # after src; the image's packages are not in /tmp/site
fi
if [ ${#DRY[@]} -eq 0 ]; then
  step env 20 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,mig.mode.current --format=csv; \
    $PY benchmarks/gpu_probes.py env --json $WORK/env.json"
  TESTS=(-m "not slow" --junitxml "$WORK/cuda-tests.xml")
else
  step env 20 "$PY" benchmarks/gpu_probes.py env --dry-run --json "$WORK/env.json"
  TESTS=(-m "not slow" --collect-only)  # the same selection, collected: it proves the command, not the tests
fi
step cuda-tests 60 "$PY" -m pytest -q -p no:cacheprovider -rs "${TESTS[@]}" \
  tests/test_gpu.py tests/test_gpu_path.py tests/test_nvml.py
step anchors 25 "$PY" benchmarks/gpu_probes.py anchors "${DRY[@]}" --json "$WORK/anchors.json"
step capture 45 "$PY" benchmarks/gpu_probes.py capture "${DRY[@]}" --json "$WORK/capture.json"
step dtype 20 "$PY" benchmarks/gpu_probes.py dtype "${DRY[@]}" --json "$WORK/dtype.json"
step gpu-check 100 "$PY" benchmarks/gpu_check.py "${DRY[@]}" --json "$WORK/gpu-check.json"
timeout --kill-after=2 10 "$PY" benchmarks/gpu_check.py --report "$WORK" --out "$OUT" "${DRY[@]}" ||
  { echo "the report failed; the steps' status (rc seconds limit):"; tail -n 1 "$WORK"/*.status; }
rm -rf "$WORK"
