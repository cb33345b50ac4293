"""The demo's load generator, run as its own process (as real clients are). Prints one line per completed
request (``ok <ms>`` or ``err <status>``) so the parent can draw a progress bar and compare what the clients
lived with what the traces say; bounded in count and time.

    python -m stagetrace.demo.load URL PATH REQUESTS CONCURRENCY PAYLOAD_FILE

Each of ``CONCURRENCY`` threads keeps one keep-alive connection and sends its share of the requests one
after another, with the standard library's client: a client that does little between a response and the
next request, so its timings are the server's, not its own event loop's.
"""

from __future__ import annotations

import http.client
import sys
import threading
import time
from urllib.parse import urlsplit


def run(url: str, path: str, n: int, concurrency: int, payload: bytes, deadline_s: float = 600) -> int:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    deadline = time.monotonic() + deadline_s
    lock = threading.Lock()
    remaining = [n]
    failures = [0]

    def take() -> bool:
        with lock:
            if remaining[0] <= 0 or time.monotonic() > deadline:
                return False
            remaining[0] -= 1
            return True

    def report(line: str, failed: bool) -> None:
        with lock:
            failures[0] += failed
            print(line, flush=True)

    def client() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=60)
        try:
            while take():
                t0 = time.perf_counter()
                try:
                    conn.request("POST", path, body=payload, headers={"Content-Type": "application/octet-stream"})
                    response = conn.getresponse()
                    response.read()
                    status: int | str = response.status
                except (OSError, http.client.HTTPException) as e:
                    status = type(e).__name__
                    conn.close()
                    conn = http.client.HTTPConnection(host, port, timeout=60)
                ms = (time.perf_counter() - t0) * 1000
                ok = status == 200
                report(f"ok {ms:.2f}" if ok else f"err {status}", not ok)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, name=f"demo-client-{i}") for i in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures[0]


def main(argv: list[str]) -> int:
    url, path, n, concurrency, payload_file = argv
    with open(payload_file, "rb") as fh:
        payload = fh.read()
    return 1 if run(url, path, int(n), int(concurrency), payload) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
