"""The demo's load generator, run as its own process (as real clients are). Prints one line per completed
request (``ok <ms>`` or ``err <status>``) so the parent can draw a progress bar; bounded in count and time.

    python -m stagetrace.demo.load URL PATH REQUESTS CONCURRENCY PAYLOAD_FILE
"""

from __future__ import annotations

import asyncio
import sys
import time


async def run(url: str, path: str, n: int, concurrency: int, payload: bytes, deadline_s: float = 600) -> int:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    deadline = time.monotonic() + deadline_s
    failures = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one() -> None:
            nonlocal failures
            async with sem:
                if time.monotonic() > deadline:
                    return
                t0 = time.perf_counter()
                try:
                    r = await client.post(path, content=payload)
                    ok = r.status_code == 200
                    status: int | str = r.status_code
                except httpx.HTTPError as e:
                    ok, status = False, type(e).__name__
                ms = (time.perf_counter() - t0) * 1000
                if not ok:
                    failures += 1
                print(f"ok {ms:.2f}" if ok else f"err {status}", flush=True)

        await asyncio.gather(*(one() for _ in range(n)))
    return failures


def main(argv: list[str]) -> int:
    url, path, n, concurrency, payload_file = argv
    with open(payload_file, "rb") as fh:
        payload = fh.read()
    return 1 if asyncio.run(run(url, path, int(n), int(concurrency), payload)) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
