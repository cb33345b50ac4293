"""``enqueue()`` and ``batch()``: one execution that serves many requests, seen in each request's trace.

On the request side ``enqueue`` opens the request's wait stage and returns a ticket, which travels with the
payload into the user's own queue. On the worker, ``batch`` ends each ticket's wait when the batch starts
and opens the batch's own trace, whose root is the batch span; the stages run inside it are recorded once,
there. Each member trace keeps its tickets; when a member trace is shipped, the helper thread expands them
into the member's own copies of the batch's stages (``handoff.fanout``). The worker pays a few attribute
writes per ticket, never a copy per member per stage.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from stagetrace import _state
from stagetrace._safety import report_internal_error
from stagetrace.capture.records import Repeat, StageRecord
from stagetrace.capture.stage import (
    _SPAN_KEY,
    _close_root,
    _cv_reset,
    _get_context,
    _getrandbits,
    _open_root,
    _perf_ns,
    describe_exception,
    enter_stage,
    validate_kind,
    validate_stage_name,
)
from stagetrace.conventions import BATCH_FILL, BATCH_ID, BATCH_ITEMS, BATCH_MAX_SIZE, BATCH_SIZE
from stagetrace.settings import KEEP_REPEATS, MAX_TRACKED_BATCHERS

_claim_lock = threading.Lock()
# The latest finished run of each batcher (by name) in this process, to tell a member's wait for its
# batch to form from its wait for the previous batch to get off the GPU.
_last_runs: dict[str, tuple[int, int]] = {}


def _positive_int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{what} must be >= 1, got {value}")
    return value


class MembershipFold:
    """A request's memberships of batches through one wait (its name, under one parent) past the first
    ``KEEP_REPEATS``: continuous batching runs a batch per decode step, thousands a generation. The later
    waits fold into one composite wait (formation and busy time summed) and the batch runs into one
    composite stage named after the batch, with exact totals; their inner stages are not copied into the
    member (their time is the composite's). The request holds this, not a ticket per step. Changed only
    under the member trace's lock."""

    __slots__ = ("busy_ms", "formation_ms", "kept", "parent_span_id", "parent_stage_id", "run", "run_span_id", "wait")

    def __init__(self, wait: StageRecord) -> None:
        self.kept = 0  # memberships kept whole
        self.parent_span_id, self.parent_stage_id = wait.parent_span_id, wait.parent_stage_id
        self.run_span_id = _getrandbits(64) or 1  # the composite run's: the batch spans link to it
        self.wait: Repeat | None = None
        self.run: Repeat | None = None
        self.formation_ms = self.busy_ms = 0.0

    def keeps(self) -> bool:
        """Whether one more membership stays whole (the first ``KEEP_REPEATS`` do)."""
        if self.kept < KEEP_REPEATS:
            self.kept += 1
            return True
        return False

    def add_wait(self, trace: Any, wait: StageRecord, end_ns: int, info: tuple[Any, ...]) -> None:
        composite = self.wait
        if composite is None:
            composite = self.wait = Repeat.started(
                wait.name, wait.kind, self.parent_span_id, self.parent_stage_id, _getrandbits(64) or 1
            )
            trace.stages.append(composite)
        composite.add(wait.start_ns, end_ns)
        self.formation_ms += info[8]
        self.busy_ms += info[9]
        composite.batch = (*info[:8], self.formation_ms, self.busy_ms)

    def add_run(self, trace: Any, batch: Batch) -> None:
        composite = self.run
        if composite is None:
            composite = self.run = Repeat.started(
                batch.name, batch.kind, self.parent_span_id, self.parent_stage_id, self.run_span_id
            )
            trace.stages.append(composite)
        composite.add(batch.start_ns, batch.end_ns, batch.error)


class Ticket:
    """A request's place in a batcher's queue: put it in the queue with the request's payload and hand it
    to ``stagetrace.batch()`` on the worker. Cheap, holds no lock, and harmless when never used (the wait
    then ends with the request, marked abandoned)."""

    __slots__ = ("batch", "fold", "items", "member", "used", "wait")

    def __init__(self, wait: StageRecord | None, items: int) -> None:
        self.wait = wait  # the request's wait stage; None outside a trace or with stagetrace off
        self.fold: MembershipFold | None = None  # set when this membership folds (past the first few)
        self.items = items
        self.used = False
        self.batch: Batch | None = None  # the batch that served it
        self.member: tuple[int, int, int] | None = None  # (index, member items, member batch span id)

    def __repr__(self) -> str:
        state = "served" if self.batch is not None else "used" if self.used else "queued"
        return f"<stagetrace.Ticket items={self.items} {state}>"


def enqueue(name: str, items: int = 1) -> Ticket:
    """Start the current request's wait for a batch; ``items`` is how much of the batch it will fill
    (images, sequences). Returns the ticket for ``batch()``."""
    name = validate_stage_name(name)
    items = _positive_int(items, "items")
    if _state.runtime is None:
        return Ticket(None, items)
    try:
        span = _get_context().get(_SPAN_KEY)
        if span is None or not span.get_span_context().is_valid:
            return Ticket(None, items)  # no request to attribute the batch to
        ticket = Ticket(None, items)
        rec = enter_stage(name, "wait", ticket, sync=False, foldable=False)  # batch() ends it, not exit_stage
        if rec is None:
            return ticket
        _cv_reset(rec.token)  # the wait is not the current span: the request goes on (and awaits) beside it
        rec.token = None
        ticket.wait = rec
        trace = rec.trace
        if trace is not None:
            with trace.lock:
                if not trace.closed:
                    folds = trace.member_folds
                    if folds is None:
                        folds = trace.member_folds = {}
                    key = (name, rec.parent_span_id)
                    fold = folds.get(key)
                    if fold is None:
                        fold = folds[key] = MembershipFold(rec)
                    if fold.keeps():
                        if trace.memberships is None:
                            trace.memberships = []
                        trace.memberships.append(ticket)
                    else:
                        ticket.fold = fold
        return ticket
    except Exception:
        report_internal_error("enqueue")
        return Ticket(None, items)


class Batch:
    """What ``stagetrace.batch()`` returns: a (sync or async) context manager around one execution."""

    __slots__ = (
        "_root",
        "end_ns",
        "error",
        "folded_runs",
        "id",
        "items",
        "kind",
        "max_size",
        "members",
        "name",
        "packed_sources",
        "size",
        "span_id",
        "start_ns",
        "tickets",
        "trace",
        "trace_id",
    )

    def __init__(self, name: str, tickets: Iterable[Ticket], max_size: int | None = None, kind: str = "cpu") -> None:
        self.name = validate_stage_name(name)
        self.kind = validate_kind(kind)
        self.max_size = None if max_size is None else _positive_int(max_size, "max_size")
        try:
            self.tickets = list(tickets)
        except TypeError:
            raise TypeError(
                "stagetrace.batch() takes an iterable of tickets from stagetrace.enqueue(), "
                f"got {type(tickets).__name__}"
            ) from None
        served = [t for t in self.tickets if type(t) is Ticket]
        self.size = len(served)
        self.items = sum(t.items for t in served)
        self.id = ""
        self.trace_id = self.span_id = 0
        self.start_ns = self.end_ns = 0
        self.error: tuple[str, str, str] | None = None
        self.members: list[tuple[int, int, int, str, int, int]] = []  # for the batch span's links
        self.folded_runs: list[tuple[Any, MembershipFold]] = []  # (member trace, fold): runs to add at exit
        self.trace: Any = None  # the batch's own TraceRecord, where its stages are recorded once
        self.packed_sources: dict[int, list[Any]] = {}  # its stages packed once for all members (helper thread)
        self._root: Any = None

    @property
    def fill(self) -> float | None:
        """Items over ``max_size``; None when the batcher's max size was not given."""
        return self.items / self.max_size if self.max_size else None

    # --- context manager -----------------------------------------------------------------------------
    def __enter__(self) -> Batch:
        self.start_ns = _perf_ns()
        rt = _state.runtime
        if rt is not None:
            try:
                self._begin(rt)
            except Exception:
                report_internal_error("batch entry")
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.end_ns = _perf_ns()
        if self._root is None:
            return
        try:
            if exc is not None:
                self.error = describe_exception(exc)
            if self.name in _last_runs or len(_last_runs) < MAX_TRACKED_BATCHERS:
                _last_runs[self.name] = (self.start_ns, self.end_ns)
            for trace, fold in self.folded_runs:
                with trace.lock:
                    if not trace.closed:
                        fold.add_run(trace, self)
        except Exception:
            report_internal_error("batch exit")
        # Its members' traces are theirs to release: a batch their tickets still reach (a request's first
        # memberships) must not keep other, finished requests' records alive through it.
        self.tickets = []
        self.folded_runs = []
        _close_root(self._root, exc)

    async def __aenter__(self) -> Batch:
        return self.__enter__()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.__exit__(exc_type, exc, tb)

    # --- membership ----------------------------------------------------------------------------------
    def _begin(self, rt: Any) -> None:
        self._root = _open_root(rt, self.name, self, new_trace=True)
        span = self._root.span
        sc = span.get_span_context()
        self.trace_id, self.span_id = sc.trace_id, sc.span_id
        self.id = format(self.span_id, "016x")
        attributes: dict[str, Any] = {BATCH_ID: self.id, BATCH_SIZE: self.size, BATCH_ITEMS: self.items}
        if self.max_size:
            attributes[BATCH_MAX_SIZE] = self.max_size
            attributes[BATCH_FILL] = round(self.items / self.max_size, 4)
        span.set_attributes(attributes)
        self.trace = rt.lookup_trace(self.trace_id)
        if self.trace is not None:
            self.trace.batch = self
        groups = self._claim(rt)
        previous = _last_runs.get(self.name)
        for index, group in enumerate(groups):
            member_items = sum(t.items for t in group)
            # A request folds a membership only when every ticket it has in this batch folds (several a step,
            # beams): one kept ticket and the run is expanded whole, the folded tickets adding their waits.
            fold = group[0].fold if all(t.fold is not None for t in group) else None
            member_span_id = fold.run_span_id if fold is not None else (_getrandbits(64) or 1)
            member = (index, member_items, member_span_id)
            joined = False
            for ticket in group:
                joined = self._end_wait(rt, ticket, member, previous) or joined
            wait = group[0].wait
            if joined and fold is not None and wait is not None:
                # Folded into the member's composite: no link, so that a generation thousands of steps long
                # does not keep thousands of batch traces with it (a batch no kept member links to is
                # exported at the healthy share).
                self.folded_runs.append((wait.trace, fold))
            elif joined and wait is not None and wait.trace is not None:
                state = wait.trace.trace_state
                self.members.append(
                    (
                        wait.trace_id,
                        member_span_id,
                        int(wait.trace.trace_flags or 0),
                        state.to_header() if state else "",
                        index,
                        member_items,
                    )
                )

    def _claim(self, rt: Any) -> list[list[Ticket]]:
        """The usable tickets, one group per member trace (a request with several tickets in one batch is
        one member); a reused ticket or anything else is counted and left out."""
        groups: dict[Any, list[Ticket]] = {}
        for ticket in self.tickets:
            if type(ticket) is not Ticket:
                rt.metrics.dropped("batch_not_a_ticket")
                continue
            with _claim_lock:
                reused = ticket.used
                ticket.used = True
            if reused:
                rt.metrics.dropped("batch_ticket_reused")
                continue
            key = ticket.wait.trace_id if ticket.wait is not None else id(ticket)
            groups.setdefault(key, []).append(ticket)
        return list(groups.values())

    def _end_wait(self, rt: Any, ticket: Ticket, member: tuple[int, int, int], previous: Any) -> bool:
        """End the ticket's wait at the batch's start, split into formation and the previous batch's run.
        False when the request had already finished (cancelled while queued)."""
        wait = ticket.wait
        if wait is None:
            return False
        start = self.start_ns
        busy_ns = 0
        if previous is not None:
            busy_ns = max(0, min(previous[1], start) - max(previous[0], wait.start_ns))
        wait_ns = max(0, start - wait.start_ns)
        # a plain tuple in BatchInfo's field order (building the NamedTuple per ticket costs the worker)
        info = (
            self.id,
            self.size,
            self.items,
            member[0],
            member[1],
            self.max_size or 0,
            0,
            0,
            (wait_ns - busy_ns) / 1e6,
            busy_ns / 1e6,
        )
        trace = wait.trace
        if trace is None:  # a request whose root stagetrace does not hold: the wait goes on its own
            wait.end_ns = start
            wait.batch = info
            ticket.batch = self
            rt.shipper.submit_lone_stage(wait)
            return False
        with trace.lock:
            if trace.closed or trace.root_ended:
                late = True
            else:
                late = False
                wait.end_ns = start
                wait.batch = info
                ticket.member = member
                ticket.batch = self
                if ticket.fold is not None:
                    ticket.fold.add_wait(trace, wait, start, info)
        if late:
            rt.metrics.dropped("batch_ticket_late")
            return False
        return True

    def __repr__(self) -> str:
        return f"<stagetrace.Batch {self.name!r} size={self.size} items={self.items}>"


def batch(name: str, tickets: Iterable[Ticket], max_size: int | None = None, *, kind: str = "cpu") -> Batch:
    """One execution of a dynamic batcher serving the requests behind ``tickets``.

    ``with stagetrace.batch("infer", tickets, max_size=16):`` ends each request's wait, and every stage
    opened inside the block (``stage``, ``gpu_stage``, ``h2d``, ``d2h``, nested) is recorded once and
    appears in each member's trace under a ``name`` stage of ``kind``; the batch span, in a trace of its
    own, links to every member. ``max_size`` (in items) gives the fill. Works in threads and asyncio tasks.
    """
    return Batch(name, tickets, max_size, kind)


__all__ = ["Batch", "Ticket", "batch", "enqueue"]
