"""A streamed response, timed where the server is handed each body chunk: how many, when the first went,
the gaps between them, how long ``send`` kept the application waiting (a slow consumer), and whether the
client went away. O(1) a stream, whatever its length: counts, sums, a histogram of the gaps on the
contract's millisecond buckets, and a bounded uniform sample of them for the percentiles.

The ASGI integration wraps ``send`` and ``receive`` of each HTTP request (``observe``); the record lives on
the request's ``TraceRecord`` (``stream``) and ships with it. Everything here runs on the request's own
task: no lock.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from random import random as _random
from typing import Any

from opentelemetry.trace import get_current_span

from stagetrace import _state
from stagetrace._safety import report_internal_error
from stagetrace.conventions import (
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_PROVIDER,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_RESPONSE_MODEL,
    MS_BUCKETS,
)

_perf_ns = time.perf_counter_ns
GAP_SAMPLE_SIZE = 1024  # gaps kept for the percentiles (all of them up to this, a uniform sample beyond)
_BUCKET_EDGES_NS = tuple(int(edge * 1_000_000) for edge in MS_BUCKETS)


class StreamStats:
    """What one response's body chunks did. Times are ``perf_counter_ns``, like stages'."""

    __slots__ = (
        "chunks",
        "disconnected",
        "first_ns",
        "gap_counts",
        "gap_max_ns",
        "gap_min_ns",
        "gap_sample",
        "gap_sum_ns",
        "last_ns",
        "send_wait_ns",
    )

    def __init__(self) -> None:
        self.chunks = 0
        self.first_ns = self.last_ns = 0
        self.gap_counts = [0] * (len(MS_BUCKETS) + 1)
        self.gap_sum_ns = self.gap_max_ns = self.gap_min_ns = 0
        self.gap_sample: list[int] = []
        self.send_wait_ns = 0
        self.disconnected = False

    def chunk_handed(self, at_ns: int, waited_ns: int) -> None:
        if self.chunks:
            gap = at_ns - self.last_ns
            self.gap_counts[bisect_left(_BUCKET_EDGES_NS, gap)] += 1
            self.gap_sum_ns += gap
            if gap > self.gap_max_ns:
                self.gap_max_ns = gap
            if gap < self.gap_min_ns or self.chunks == 1:
                self.gap_min_ns = gap
            sample = self.gap_sample
            if len(sample) < GAP_SAMPLE_SIZE:
                sample.append(gap)
            else:  # reservoir sampling: every gap so far equally likely to be in the sample
                slot = int(_random() * self.chunks)  # randrange's argument checks cost more than the rest
                if slot < GAP_SAMPLE_SIZE:
                    sample[slot] = gap
        else:
            self.first_ns = at_ns
        self.chunks += 1
        self.last_ns = at_ns
        self.send_wait_ns += waited_ns

    def packed(self) -> tuple[Any, ...] | None:
        """For the wire (``analysis.streams.StreamFields``), or None before any chunk went."""
        if not self.chunks:
            return None
        return (
            self.chunks,
            self.first_ns,
            self.last_ns,
            tuple(self.gap_counts),
            self.gap_sum_ns,
            self.gap_min_ns,
            self.gap_max_ns,
            tuple(self.gap_sample),
            self.send_wait_ns,
            self.disconnected,
        )


def _current_trace(rt: Any) -> Any:
    """The request's ``TraceRecord``, from the span current where the body is sent (its server span)."""
    ctx = get_current_span().get_span_context()
    return rt.lookup_trace(ctx.trace_id) if ctx.is_valid else None


def observe(rt: Any, send: Any, receive: Any) -> tuple[Any, Any]:
    """``send`` and ``receive`` of one HTTP request, wrapped: once a body message says more is to come (a
    stream; a response of one body is left alone), each non-empty chunk is timed as the application hands
    it to the server, and a disconnect before the last chunk is noted (Starlette listens for one while it
    streams, and a server reports one once the response is complete too: that is no client gone)."""
    holder: list[StreamStats | None] = [None]
    complete = [False]

    async def timed_send(message: Any) -> None:
        stats = holder[0]
        if stats is None:
            if message.get("type") == "http.response.body" and message.get("more_body"):
                stats = holder[0] = _attach(rt)
            if stats is None:
                await send(message)
                return
        if message.get("type") != "http.response.body":
            await send(message)
            return
        t0 = _perf_ns()
        try:
            await send(message)
        except OSError:
            stats.disconnected = True
            raise
        finally:
            if message.get("body"):
                stats.chunk_handed(t0, _perf_ns() - t0)
        if not message.get("more_body"):
            complete[0] = True

    async def noting_receive() -> Any:
        message = await receive()
        if message.get("type") == "http.disconnect" and not complete[0]:
            stats = holder[0]
            if stats is not None:
                stats.disconnected = True
        return message

    return timed_send, noting_receive


def _attach(rt: Any) -> StreamStats | None:
    try:
        trace = _current_trace(rt)
        if trace is None:
            return None
        stats = StreamStats()
        with trace.lock:
            if trace.closed:
                return None
            trace.stream = stats
        return stats
    except Exception:
        report_internal_error("stream timing")
        return None


def generation(
    model: str,
    *,
    provider: str | None = None,
    operation: str = "text_completion",
    response_model: str | None = None,
    output_tokens: int | None = None,
) -> None:
    """Say that the current request serves a generative model. Its local root then carries the ``gen_ai.*``
    attributes given here and, once its response streamed, the latencies vLLM and SGLang write on their
    request spans (``gen_ai.latency.*``, seconds), and OpenTelemetry's GenAI server metrics count it. Call
    it anywhere inside the request, again with ``output_tokens`` once known (otherwise the chunks count as
    tokens). Outside a request stagetrace holds, it does nothing."""
    if not isinstance(model, str) or not model:
        raise ValueError("stagetrace.generation() needs the model's name, a non-empty str")
    if output_tokens is not None and (not isinstance(output_tokens, int) or output_tokens < 0):
        raise ValueError(f"output_tokens must be an int >= 0, got {output_tokens!r}")
    for name, value in (("provider", provider), ("operation", operation), ("response_model", response_model)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    rt = _state.runtime
    if rt is None:
        return
    try:
        trace = _current_trace(rt)
        if trace is None:
            return
        said = {
            GEN_AI_REQUEST_MODEL: model,
            GEN_AI_OPERATION: operation,
            GEN_AI_PROVIDER: provider,
            GEN_AI_RESPONSE_MODEL: response_model,
            GEN_AI_OUTPUT_TOKENS: output_tokens,
        }
        with trace.lock:
            trace.gen_ai = {**(trace.gen_ai or {}), **{k: v for k, v in said.items() if v is not None}}
    except Exception:
        report_internal_error("stagetrace.generation")
