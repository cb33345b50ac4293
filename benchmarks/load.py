"""The long load test (issue 7, item 4): 1,000 concurrent clients for 60 s against a real uvicorn server on
127.0.0.1, then the checks (see benchmarks/harness.py). Bounded; stops by itself.

    python benchmarks/load.py [--seconds 60] [--concurrency 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import harness as load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--concurrency", type=int, default=1000)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        r = load.run(args.seconds, args.concurrency, Path(tmp))
    rss = [x for x in r["rss_mb"] if x]
    third = rss[len(rss) // 3] if rss else 0.0
    print(f"load: {args.concurrency} concurrent clients for {args.seconds:.0f} s against uvicorn on 127.0.0.1")
    print(
        f"  requests ok / errors          {r['sent']['ok']} / {r['sent']['errors']} "
        f"({r['sent']['ok'] / r['elapsed_s']:.0f} req/s)"
    )
    print(f"  traces / with verdict         {r['traces']} / {r['roots_with_verdict']}")
    print(f"  requests traced               {r['requests_traced']}")
    print(f"  mixed traces / split requests {r['mixed_traces']} / {r['requests_in_several_traces']}")
    print(f"  verdicts counted in process   {r['stats'].get('verdicts')}")
    print(f"  stagetrace.dropped            {r['stats'].get('dropped') or 'none'}")
    if rss:
        print(
            f"  server RSS MB: start {rss[0]:.0f}, at 1/3 {third:.0f}, end {rss[-1]:.0f}, max {max(rss):.0f}, "
            f"median {statistics.median(rss):.0f}"
        )
    sent = r["sent"]
    print(f"  client errors by kind         {sent.get('reasons') or 'none'}")
    ok = (
        not any(k.startswith("HTTP") for k in sent.get("reasons", {}))  # the app never answered with an error
        and sent["errors"] <= sent["ok"] // 100  # rare transport errors between client and server
        and sent["ok"] <= r["requests_traced"] == r["roots_with_verdict"] == r["stats"].get("verdicts")
        and r["mixed_traces"] == 0
        and not r["stats"].get("dropped")
    )
    print(f"checks: {'PASS' if ok else 'FAIL'}; memory end / at 1/3: {rss[-1] / third:.2f} x" if rss else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
