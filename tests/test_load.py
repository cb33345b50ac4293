"""The load test, short: 200 concurrent clients for a few seconds against a real uvicorn server on
127.0.0.1 (the 1,000-client, 60 s version is benchmarks/load.py)."""

from __future__ import annotations

from stagetrace.testing import load


def test_under_concurrent_load_no_verdict_is_lost_or_mixed_and_nothing_is_dropped(tmp_path):
    result = load.run(duration_s=5, concurrency=200, out_dir=tmp_path, max_requests=3000)
    ok = result["sent"]["ok"]
    assert ok > 200 and result["sent"]["errors"] == 0
    assert result["requests_traced"] == ok  # every request has its trace
    assert result["traces"] == ok
    assert result["roots_with_verdict"] == ok  # and its verdict
    assert result["mixed_traces"] == 0 and result["requests_in_several_traces"] == 0
    assert result["stats"]["verdicts"] == ok
    assert result["stats"]["dropped"] == {}  # under the caps nothing is dropped
    rss = [r for r in result["rss_mb"] if r]
    assert rss and max(rss) < 2 * rss[0] + 100  # bounded (the benchmark shows the series)
