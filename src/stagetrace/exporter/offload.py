"""Calls handed to process pools, placed in their traces: each offload stage's raw readings become its four
children (``offload.queue``, ``offload.send``, ``offload.run``, ``offload.return``: ``analysis.offload``),
its facts the ``OffloadInfo`` its span and the rules read, and the worker's own stages hang under its run."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stagetrace.analysis.offload import (
    CHILD_KINDS,
    QUEUE,
    RETURN,
    RUN,
    SEND,
    OffloadFields,
    offload_info,
    split_offload,
)
from stagetrace.analysis.stage_record import ShippedStage


def place_offloads(stages: Sequence[ShippedStage], new_span_id: Callable[[], int]) -> list[ShippedStage]:
    """``stages`` with each offload's children after it (once: a placed offload holds its ``OffloadInfo``)."""
    for st in stages:  # (a loop: compiled, a generator in any() is an object and a resumption a stage)
        if type(st.offload) is OffloadFields:
            break
    else:
        return list(stages)
    out: list[ShippedStage] = []
    runs: dict[int, int | None] = {}
    for st in stages:
        out.append(st)
        fields = st.offload
        if type(fields) is not OffloadFields:
            continue
        st.offload = offload_info(fields)
        split = split_offload(fields, st.end_ns)
        if split is None:  # the worker never reported: the stage alone, with its error
            continue
        for name, (start, end) in zip((QUEUE, SEND, RUN, RETURN), split):
            if end <= start and name != RUN:
                continue
            span_id = fields.run_span_id if name == RUN else new_span_id()
            child = ShippedStage.added(name, CHILD_KINDS[name], span_id, st.span_id, start, end)
            child.parent_stage_id = st.span_id
            if name == RUN:
                child.worker_pid = fields.worker_pid
                child.cpu_start, child.cpu_end = fields.run_cpu_start, fields.run_cpu_end
                runs[fields.run_span_id] = fields.worker_pid
            out.append(child)
    _claim_worker_stages(out, runs)
    return out


def _claim_worker_stages(stages: list[ShippedStage], runs: dict[int, int | None]) -> None:
    """The stages a worker recorded, found under their call's run (their parents' span ids lead there): each
    marked with the worker's pid (the worker ships them unmarked, saving it a copy a stage), the outermost
    made children of the run (they had no stage around them there). Children come before their parents in a
    trace's stages (a stage is kept as it ends), so the search goes round until nothing more is found."""
    owner = dict(runs)
    found = True
    while found:
        found = False
        for st in stages:
            if st.span_id in owner or st.parent_span_id not in owner:
                continue
            owner[st.span_id] = st.worker_pid = owner[st.parent_span_id]
            if not st.parent_stage_id and st.parent_span_id in runs:
                st.parent_stage_id = st.parent_span_id
            found = True


__all__ = ["place_offloads"]
