"""The demo's load generator, run as its own process (as real clients are). Prints one line per completed
request (``ok <ms>``, ``ok <ms> <first event ms> <events>`` for a stream of server-sent events, or
``err <status>``) so the parent can draw a progress bar and compare what the clients lived with what the
traces say; bounded in count and time.

    python -m stagetrace.demo.load URL PATH REQUESTS CONCURRENCY PAYLOAD_FILE [CONTENT_TYPE]

Each of ``CONCURRENCY`` threads keeps one keep-alive connection (``TimedConnection``) and sends its share of
the requests one after another. A request is timed from just before it is sent to the kernel's receive time
of the response's last segment, so what a client thread waits for a CPU or for its own process's GIL after
the response arrived is not counted: on a busy host that wait is the client's, not the server's. A streamed
response (``Transfer-Encoding: chunked``) is read to its end, and its first event timed the same way: to the
receive time of the segment that completed it.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable
from typing import NamedTuple
from urllib.parse import urlsplit

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux: the kernel's receive time of each segment
_TIMESTAMP_SPACE = socket.CMSG_SPACE(16) if hasattr(socket, "CMSG_SPACE") else 0


class Timed(NamedTuple):
    """One exchange as its client lived it (milliseconds from just before the request was sent)."""

    status: int
    ms: float  # to the receive time of the response's last segment
    first_event_ms: float | None  # to that of the segment that completed its first server-sent event
    events: int  # server-sent events in the body (each ends with a blank line)


class TimedConnection:
    """One keep-alive HTTP/1.1 connection to a server that answers with ``Content-Length`` bodies or
    chunked ones (a stream).

    ``exchange`` returns the response's status and the milliseconds from just before the request was sent
    to the kernel's receive time of its last segment (``SO_TIMESTAMPNS``); where the kernel gives no
    timestamp, to the moment the last segment was read. ``timed`` returns the same and, for a stream of
    server-sent events, when the first was complete and how many came."""

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
        timed = self.timed(method, path, body, headers)
        return timed.status, timed.ms

    def timed(self, method: str, path: str, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()) -> Timed:
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{name}: {value}\r\n" for name, value in headers) + "\r\n"
        response = _Response()
        sent_ns = time.time_ns()
        self.sock.sendall(head.encode("latin-1") + body)
        while True:
            if self._stamped:
                chunk, ancillary, _, _ = self.sock.recvmsg(65536, _TIMESTAMP_SPACE)
            else:
                chunk, ancillary = self.sock.recv(65536), []
            if not chunk:
                raise ConnectionError("the server closed the connection mid-response")
            at_ns = time.time_ns()
            for level, kind, raw in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(raw) >= 16:
                    sec, nsec = struct.unpack("qq", raw[:16])
                    at_ns = sec * 1_000_000_000 + nsec
            if response.feed(chunk, at_ns):
                assert response.status is not None
                first = None if response.first_event_ns is None else (response.first_event_ns - sent_ns) / 1e6
                return Timed(response.status, (at_ns - sent_ns) / 1e6, first, response.events)

    def close(self) -> None:
        self.sock.close()


class _Response:
    """A response read as it arrives: its head, then a body of ``Content-Length`` bytes or of chunks
    (``Transfer-Encoding: chunked``), the server-sent events of a ``text/event-stream`` counted as they
    complete. Incremental: each byte of the body is looked at once, however long the stream."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.status: int | None = None
        self.events = 0
        self.first_event_ns: int | None = None
        self._left = 0  # body bytes (Content-Length) or bytes of the current chunk still to come
        self._state = "head"  # head, body, size, data, data_end, trailer, done
        self._tail = b""  # the body's last byte so far: an event's blank line can straddle two reads
        self._events = False  # a text/event-stream body

    def feed(self, data: bytes, at_ns: int) -> bool:
        """Take what was read at ``at_ns``; True once the response is complete."""
        self.buf += data
        buf = self.buf
        while True:
            state = self._state
            if state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return False
                self._head(bytes(buf[:end]))
                del buf[: end + 4]
            elif state in ("body", "data"):
                take = bytes(buf[: self._left])
                del buf[: len(take)]
                self._left -= len(take)
                self._body(take, at_ns)
                if self._left:
                    return False
                self._state = "done" if state == "body" else "data_end"
            elif state == "data_end":
                if len(buf) < 2:
                    return False
                del buf[:2]
                self._state = "size"
            elif state in ("size", "trailer"):
                eol = buf.find(b"\r\n")
                if eol < 0:
                    return False
                line = bytes(buf[:eol])
                del buf[: eol + 2]
                if state == "trailer":
                    self._state = "trailer" if line else "done"
                else:
                    self._left = int(line.split(b";")[0], 16)
                    self._state = "data" if self._left else "trailer"
            else:
                return True

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        self.status = int(lines[0].split()[1])
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip()
        self._events = fields.get(b"content-type", b"").lower().startswith(b"text/event-stream")
        if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
            self._state = "size"
        elif b"content-length" in fields:
            self._left = int(fields[b"content-length"])
            self._state = "body"
        else:
            raise ConnectionError("a response with neither Content-Length nor chunks (this client reads only those)")

    def _body(self, data: bytes, at_ns: int) -> None:
        if not data or not self._events:
            return
        ended = (self._tail + data).count(b"\n\n")
        if ended and not self.events:
            self.first_event_ns = at_ns
        self.events += ended
        self._tail = data[-1:]


def run(
    url: str,
    path: str,
    n: int,
    concurrency: int,
    payload: bytes,
    deadline_s: float = 600,
    content_type: str = "application/octet-stream",
) -> int:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    deadline = time.monotonic() + deadline_s
    lock = threading.Lock()
    remaining = [n]
    failures = [0]
    headers = (("Content-Type", content_type),)

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
                    timed = conn.timed("POST", path, payload, headers)
                except (OSError, ValueError) as e:
                    report(f"err {type(e).__name__}", True)
                    if conn is not None:
                        conn.close()
                    conn = None
                    continue
                report(_line(timed), timed.status != 200)
        finally:
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=client, name=f"demo-client-{i}") for i in range(max(1, concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures[0]


def _line(timed: Timed) -> str:
    if timed.status != 200:
        return f"err {timed.status}"
    if timed.first_event_ms is None:
        return f"ok {timed.ms:.2f}"
    return f"ok {timed.ms:.2f} {timed.first_event_ms:.2f} {timed.events}"


def main(argv: list[str]) -> int:
    url, path, n, concurrency, payload_file, *rest = argv
    with open(payload_file, "rb") as fh:
        payload = fh.read()
    content_type = rest[0] if rest else "application/octet-stream"
    return 1 if run(url, path, int(n), int(concurrency), payload, content_type=content_type) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
