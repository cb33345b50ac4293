#!/usr/bin/env bash
# Wheels that the GPU machine lacks, for its Python 3.12, downloaded here into .whl/ (git-ignored); the
# device run carries .whl and benchmarks/gpu_session.sh installs those whose distribution the image lacks.
# The machine has no network. Its image holds torch, pytest, nvidia-ml-py, protobuf, grpcio, requests,
# packaging, wrapt, typing-extensions and zipp (/work/.library/device/KINDS.md, "Python packages already
# there"), so none of those is downloaded: a copy in front of the image's would replace them.
# The set: the OpenTelemetry versions constraints.txt pins, the two beta packages the OTLP exporters
# require at the semantic conventions' version (opentelemetry-exporter-otlp-common and -http-transport,
# which constraints.txt does not list), and googleapis-common-protos. Then every requirement of every
# wheel is checked against the wheels and the image's list: the script fails on one that neither meets.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
IMAGE_HAS="protobuf grpcio requests packaging wrapt typing-extensions zipp urllib3 certifi idna charset-normalizer"
mkdir -p .whl
rm -f .whl/*.whl  # this script's folder: one version of each package (two stop the install there)
OTEL=$(grep -E '^opentelemetry-(api|sdk|proto|exporter-otlp-proto-(common|grpc|http)|instrumentation|semantic-conventions)==' constraints.txt)
BETA=$(grep -E '^opentelemetry-semantic-conventions==' constraints.txt | cut -d= -f3)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $OTEL "opentelemetry-exporter-otlp-common==$BETA" "opentelemetry-exporter-http-transport==$BETA" \
  "googleapis-common-protos>=1.52,<2"
"$PY" - "$IMAGE_HAS" .whl/*.whl <<'EOF'
import re, sys, zipfile
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

image = {canonicalize_name(n) for n in sys.argv[1].split()}
wheels = {}
for path in sys.argv[2:]:
    name, version, _build, _tags = parse_wheel_filename(path.rsplit("/", 1)[-1])
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        reqs = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:")]
    wheels[canonicalize_name(name)] = (version, reqs)
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                               "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
missing = []
for name, (_version, reqs) in sorted(wheels.items()):
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        dep = canonicalize_name(req.name)
        if dep in image:
            continue
        have = wheels.get(dep)
        if have is None or not req.specifier.contains(have[0], prereleases=True):
            missing.append(f"{name} needs {req} (wheel: {have[0] if have else None})")
for line in missing:
    print("unmet:", line)
print(f"{len(wheels)} wheels in .whl; {len(missing)} requirements unmet")
sys.exit(1 if missing else 0)
EOF
ls .whl
