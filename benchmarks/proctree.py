"""CPU time of a process and of its whole process tree, from ``/proc/<pid>/stat`` (Linux).

The tree is the process, its live descendants (an exporter process, workers) and, through ``cutime`` /
``cstime``, descendants that already ended and were waited for.
"""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def process_cpu_s(pid: int, *, with_waited_children: bool = False) -> float:
    fields = _stat(pid)
    if fields is None:
        return 0.0
    # after the ")": state(0) ppid(1) ... utime(11) stime(12) cutime(13) cstime(14)
    ticks = int(fields[11]) + int(fields[12])
    if with_waited_children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICKS


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def tree_cpu_s(pid: int) -> float:
    return process_cpu_s(pid, with_waited_children=True) + sum(process_cpu_s(p) for p in descendants(pid))
