"""Figures at edges the mutation run showed no other test pinned, on hand-computed inputs: the quantile
sketch's zero mark and a merge of two sketches that share a bucket (the report's quantiles), and a stream's
trailers passing through the ASGI wrappers after its body (what the server is handed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from stagetrace.analysis.streams import StreamFields
from stagetrace.capture import streams
from stagetrace.report.sketch import ZERO_BELOW, Bucket, QuantileSketch
from test_capture_edges import START, TRACE_ID, Clock, body, new_trace, serve

# --- the sketch ------------------------------------------------------------------------------------------------


def test_sketches_sharing_a_bucket_merge_their_counts():
    """[1, 1] and [1, 100]: the 1s of both fall in bucket 0, which must hold 2 + 1 = 3 after the merge. The
    median (rank 1.5 of 4) then lies among the three 1s (bucket 0's midpoint, 0.99, clamped up to the least
    value seen: 1.0); had the merge replaced the shared bucket's count with the other sketch's (1), it would
    be the 100. The existing merge test's parts share no bucket."""
    a, b = QuantileSketch(), QuantileSketch()
    for sketch, values in ((a, (1.0, 1.0)), (b, (1.0, 100.0))):
        for value in values:
            sketch.add(value)
    a.merge(b)
    assert (a.count, a.zeros, a.sum, a.min, a.max) == (4, 0, 103.0, 1.0, 100.0)
    assert a.quantile(0.5) == a.quantile(0.75) == 1.0  # ranks 1.5 and 2.25: the second and third 1
    assert a.quantile(1.0) == 100.0  # rank 3: bucket 231's midpoint (100.49) clamped to the largest value seen


@pytest.mark.parametrize(
    ("value", "zeros", "median"),
    [
        (0.0, 1, 0.0),
        (ZERO_BELOW, 1, 0.0),  # exactly the zero mark: a zero, as bucket_key reads it
        (2e-9, 0, 2e-9),  # just past it: a bucket of its own (its midpoint clamped to the one value seen)
    ],
    ids=["zero", "at-the-mark", "past-it"],
)
def test_a_value_at_the_zero_mark_is_counted_as_a_zero_as_a_database_sends_it(value, zeros, median):
    """A value of at most 1e-9 (``ZERO_BELOW``) is a zero; ``add`` counts it as ``add_bucket`` does the same value
    bucketed by ``bucket_key``'s formula (which gives it no bucket). An edge: the report's rounded figures hide
    a 1e-9 ms difference, only the sketch's own count and quantile show it."""
    added, sent = QuantileSketch(), QuantileSketch()
    added.add(value)
    sent.add_bucket(Bucket(sent.bucket_key(value), 1, value, value, value))
    assert (added.count, added.zeros, added.quantile(0.5)) == (1, zeros, median)
    assert (sent.count, sent.zeros, sent.quantile(0.5)) == (1, zeros, median)


# --- a stream's trailers ---------------------------------------------------------------------------------------


def test_a_stream_s_trailers_reach_the_server_unchanged_after_its_last_chunk(monkeypatch):
    """A response announcing trailers: chunk "a" handed at 100 (send returns at 102), the empty last body (no
    chunk: one clock read, 105), then ``http.response.trailers``. Once the stream is timed, a message that is
    not a body is passed on as it is, never replaced: the server gets all four. One chunk, first and last at
    100, waited 2; the empty last body ends the stream complete."""
    monkeypatch.setattr(streams, "_perf_ns", Clock(100, 102, 105))
    t = new_trace()
    rt = SimpleNamespace(lookup_trace={TRACE_ID: t}.get)
    trailers = {"type": "http.response.trailers", "headers": [(b"x-checksum", b"1")], "more_trailers": False}
    sent = [{**START, "trailers": True}, body(b"a", True), body(b"", False), trailers]
    out, _ = serve(rt, [*sent, "receive"], [{"type": "http.disconnect"}])
    assert out == sent
    f = StreamFields(*t.stream.packed())
    assert (f.chunks, f.first_ns, f.last_ns, f.send_wait_ns, f.disconnected) == (1, 100, 100, 2, False)
