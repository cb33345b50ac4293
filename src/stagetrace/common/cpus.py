"""How many CPUs the process may run on at once: the CPUs its affinity allows, less where a cgroup's CPU
quota (a container's limit: ``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1)
allows fewer. Read once by the exporter (which inherits the application's affinity and cgroup), to tell a
process that fills its CPUs from one that leaves them to others."""

from __future__ import annotations

import math
import os
from pathlib import Path

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def quota_cpus(v2: Path = _CGROUP_V2, v1: tuple[Path, Path] = _CGROUP_V1) -> float | None:
    """The CPU quota as a number of CPUs (``200000 100000``: 2.0), or None where there is none."""
    try:
        quota, _, period = v2.read_text().strip().partition(" ")
        if quota != "max":
            return int(quota) / int(period or 100000)
        return None
    except (OSError, ValueError):
        pass
    try:
        quota_us, period_us = int(v1[0].read_text()), int(v1[1].read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus(v2: Path = _CGROUP_V2, v1: tuple[Path, Path] = _CGROUP_V1) -> int | None:
    """None where the platform says neither (no affinity mask and no CPU count)."""
    try:
        allowed: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count()
    quota = quota_cpus(v2, v1)
    if quota is not None:
        limit = max(1, math.ceil(quota))
        allowed = limit if allowed is None else min(allowed, limit)
    return allowed
