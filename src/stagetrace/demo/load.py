"""The demo's load generator, run as its own process (as real clients are). Prints one line per completed
request (``ok <ms>`` or ``err <status>``) so the parent can draw a progress bar and compare what the clients
lived with what the traces say; bounded in count and time.

    python -m stagetrace.demo.load URL PATH REQUESTS CONCURRENCY PAYLOAD_FILE

Each of ``CONCURRENCY`` threads keeps one keep-alive connection (``TimedConnection``) and sends its share of
the requests one after another. A request is timed from just before it is sent to the kernel's receive time
of the response's last segment, so what a client thread waits for a CPU or for its own process's GIL after
the response arrived is not counted: on a busy host that wait is the client's, not the server's.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux: the kernel's receive time of each segment
_TIMESTAMP_SPACE = socket.CMSG_SPACE(16) if hasattr(socket, "CMSG_SPACE") else 0


class TimedConnection:
    """One keep-alive HTTP/1.1 connection to a server that answers with ``Content-Length`` bodies.

    ``exchange`` returns the response's status and the milliseconds from just before the request was sent
    to the kernel's receive time of its last segment (``SO_TIMESTAMPNS``); where the kernel gives no
    timestamp, to the moment the last segment was read."""

    def __init__(self, host: str, port: int, timeout_s: float = 60.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._stamped = _TIMESTAMP_SPACE > 0
        if self._stamped:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            except OSError:
                self._stamped = False
        self.host = host

    def exchange(
        self, method: str, path: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()
    ) -> tuple[int, float]:
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers) + "\r\n"
        sent_ns = time.time_ns()
        self.sock.sendall(head.encode("latin-1") + body)
        data, last_ns = b"", sent_ns
        while True:
            if self._stamped:
                chunk, ancillary, _, _ = self.sock.recvmsg(65536, _TIMESTAMP_SPACE)
            else:
                chunk, ancillary = self.sock.recv(65536), []
            if not chunk:
                raise ConnectionError("the server closed the connection mid-response")
            last_ns = time.time_ns()
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= 16:
                    sec, nsec = struct.unpack("qq", raw[:16])
                    last_ns = sec * 1_000_000_000 + nsec
            data += chunk
            status = _complete_response(data)
            if status is not None:
                return status, (last_ns - sent_ns) / 1e6

    def close(self) -> None:
        self.sock.close()


def _complete_response(data: bytes) -> int | None:
    """The status of a whole response in ``data``, or None while more is to come."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        return None
    lines = head.split(b"\r\n")
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length is None:
        raise ConnectionError("a response without Content-Length (this client reads only those)")
    if len(body) < length:
        return None
    return int(lines[0].split()[1])


def run(url: str, path: str, n: int, concurrency: int, payload: bytes, deadline_s: float = 600) -> int:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    deadline = time.monotonic() + deadline_s
    lock = threading.Lock()
    remaining = [n]
    failures = [0]
    headers = (("Content-Type", "application/octet-stream"),)

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
        conn: TimedConnection | None = None
        try:
            while take():
                try:
                    conn = conn or TimedConnection(host, port)
                    status, ms = conn.exchange("POST", path, payload, headers)
                except (OSError, ValueError) as e:
                    report(f"err {type(e).__name__}", True)
                    if conn is not None:
                        conn.close()
                    conn = None
                    continue
                report(f"ok {ms:.2f}" if status == 200 else f"err {status}", status != 200)
        finally:
            if conn is not None:
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
