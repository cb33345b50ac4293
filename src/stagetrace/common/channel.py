"""The byte channel between the application and its exporter process: framed batches over a pipe.

Why a pipe: it is anonymous (inherited by the one child, reachable by no other process or user on the
host, no file or socket path to protect), the kernel wakes the reader (no spinning), and with one write
per batch of traces (every poll interval, not per request) its syscall cost is spread over many requests.

Frames are ``MAGIC | length | crc32 | payload``. A reader that meets a bad frame (a torn write after a crash,
a corrupted byte) skips to the next magic and counts it, so one bad record never stops the stream.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import zlib

from stagetrace.settings import MAX_FRAME_BYTES

MAGIC = b"STG1"
_HEADER = struct.Struct("<4sII")
HEADER_SIZE = _HEADER.size
_F_SETPIPE_SZ = 1031  # Linux


def encode_frame(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


class FrameReader:
    """Incremental decoder: ``feed`` bytes as they arrive, get whole payloads back. ``malformed`` counts
    frames that were skipped (bad magic, length or checksum); ``pending`` is a partial frame still expected."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.malformed = 0

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """Whole payloads completed by ``data`` (a list, so that the buffer is consumed even when the
        caller stops early)."""
        out: list[bytes] = []
        buf = self._buf
        buf += data
        pos = 0
        while True:
            if len(buf) - pos < HEADER_SIZE:
                break
            magic, length, crc = _HEADER.unpack_from(buf, pos)
            if magic != MAGIC or length > MAX_FRAME_BYTES:
                self.malformed += 1
                pos = self._resync(buf, pos + 1)
                continue
            end = pos + HEADER_SIZE + length
            if len(buf) < end:
                break
            payload = bytes(buf[pos + HEADER_SIZE : end])
            if zlib.crc32(payload) != crc:
                self.malformed += 1
                pos = self._resync(buf, pos + 1)
                continue
            pos = end
            out.append(payload)
        del buf[:pos]
        return out

    @staticmethod
    def _resync(buf: bytearray, start: int) -> int:
        found = buf.find(MAGIC, start)
        return found if found >= 0 else max(start, len(buf) - len(MAGIC) + 1)

    def close(self) -> int:
        """At end of stream: a partial frame left over is one more malformed record."""
        if self._buf:
            self.malformed += 1
            self._buf.clear()
        return self.malformed


def make_pipe(size_bytes: int = 2**20) -> tuple[int, int]:
    """A pipe whose ends are not inherited by other children (Python's default), enlarged where the kernel
    allows so that a burst fits without the writer ever waiting."""
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, _F_SETPIPE_SZ, size_bytes)
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size: keep the default
    return r, w


class NonBlockingWriter:
    """Writes frames without ever blocking the caller: what the pipe cannot take now waits in a buffer of
    at most ``max_pending`` bytes, and a frame that would overflow it is refused whole (the caller counts
    it). Small control frames may be forced past the bound."""

    def __init__(self, fd: int, max_pending: int) -> None:
        self.fd = fd
        self.max_pending = max_pending
        self._pending = bytearray()
        self.broken = False
        os.set_blocking(fd, False)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def write(self, frame: bytes, *, force: bool = False) -> bool:
        """Queue ``frame`` and push what the pipe takes. False: refused (buffer full, or reader gone).
        ``force`` accepts a small control frame even past the bound."""
        if self.broken:
            return False
        if not force and len(self._pending) + len(frame) > self.max_pending:
            self.pump()
            if len(self._pending) + len(frame) > self.max_pending:
                return False
        self._pending += frame
        self.pump()
        return not self.broken

    def pump(self) -> None:
        pending = self._pending
        while pending and not self.broken:
            try:
                n = os.write(self.fd, pending[: 1 << 20])
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EPIPE, errno.EBADF):
                    self.broken = True
                    pending.clear()
                    return
                raise
            del pending[:n]

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
