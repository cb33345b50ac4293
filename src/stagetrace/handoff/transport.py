"""The two ways a batch of wire messages reaches the exporter's work.

``ProcessTransport`` (the default): an exporter process started with the application's interpreter
(``python -m stagetrace.exporter``), fed through an anonymous pipe; results come back on a second pipe.
It is supervised from the helper thread: a dead exporter is restarted (at most a few times a minute), and
what it had not acknowledged is counted in ``stagetrace.dropped{reason="exporter_restart"}``.

``InlineTransport`` (``STAGETRACE_EXPORT_PROCESS=off``): the same ``ExporterCore`` called on the helper
thread, for environments that forbid subprocesses.
"""

from __future__ import annotations

import logging
import marshal
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from stagetrace._compiled import EXPORTER_VARIABLE
from stagetrace._safety import at_fork_in_child, logger, report_internal_error
from stagetrace.common import wire
from stagetrace.common.channel import FrameReader, NonBlockingWriter, encode_frame, make_pipe
from stagetrace.exporter.core import ExporterCore
from stagetrace.exporter.metrics import MetricsRecorder, replay
from stagetrace.exporter.outputs import LocalOutputs
from stagetrace.handoff.shipper import DATA_KINDS, Shipper
from stagetrace.settings import RECORDS_PER_FRAME, Settings

_WINDOW_KINDS = frozenset({wire.SIGNAL, wire.LOOP_BLOCKS})  # what a trace's analysis reads of its window


def encode_batch(messages: list[tuple[Any, ...]]) -> tuple[bytes, int]:
    """``marshal`` (C, no code on decode) of the batch; a message holding a value marshal cannot take (an
    enum, an object in an attribute) is made plain, or left out and counted when even that fails."""
    try:
        return marshal.dumps(messages), 0
    except ValueError:
        pass
    kept, lost = [], 0
    for msg in messages:
        try:
            marshal.dumps(msg)
            kept.append(msg)
        except ValueError:
            try:
                plain = wire.plain(msg)
                marshal.dumps(plain)
                kept.append(plain)
            except ValueError:
                lost += 1
    return marshal.dumps(kept), lost


class InlineTransport:
    def __init__(self, shipper: Shipper, core: ExporterCore) -> None:
        self.shipper = shipper
        self.core = core

    def send(self, messages: list[tuple[Any, ...]]) -> None:
        for msg in messages:
            if msg[0] == wire.FLUSH:
                self.shipper.flushed(msg[1], ok=self.core.flush(msg[2]))
                continue
            self.core.handle_or_count(msg)

    def poll(self) -> None:
        self.core.tick(time.monotonic())

    def close(self, timeout_s: float) -> bool:
        self.core.finish()
        return self.core.flush(timeout_s)


class ProcessTransport:
    """``config``: called at every (re)start, in the process that starts the exporter, so that a forked
    worker's exporter describes that worker (its pid, its own output file)."""

    def __init__(
        self,
        shipper: Shipper,
        *,
        settings: Settings,
        config: Callable[[], dict[str, Any]],
        local: LocalOutputs,
        app_metrics: MetricsRecorder,
    ) -> None:
        self.shipper = shipper
        self.settings = settings
        self._config = config
        self.local = local
        self.app_metrics = app_metrics
        self.proc: subprocess.Popen[bytes] | None = None
        self._writer: NonBlockingWriter | None = None
        self._results_fd = -1
        self._restarts: list[float] = []
        self._gave_up = False
        self._last_liveness = 0.0
        at_fork_in_child(self, "_forget_after_fork")
        self._start()

    # --- lifecycle ------------------------------------------------------------------------------------
    def _start(self) -> None:
        to_exporter_r, to_exporter_w = make_pipe()
        results_r, results_w = make_pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "stagetrace.exporter", str(to_exporter_r), str(results_w)],
                pass_fds=(to_exporter_r, results_w),
                stdin=subprocess.DEVNULL,
                close_fds=True,
                # Its own session: a terminal's Ctrl-C reaches the application, which then shuts down
                # and flushes, not the exporter half-way. It still ends with the application.
                start_new_session=True,
                # the one process that may run the compiled modules (``stagetrace._compiled``)
                env={**os.environ, EXPORTER_VARIABLE: "1"},
            )
        except OSError:
            for fd in (to_exporter_r, to_exporter_w, results_r, results_w):
                os.close(fd)
            raise
        os.close(to_exporter_r)  # the child's ends
        os.close(results_w)
        self.proc = proc
        self._writer = NonBlockingWriter(to_exporter_w, self.settings.channel_buffer_bytes)
        os.set_blocking(results_r, False)
        self._results_fd = results_r
        self._reader = FrameReader()
        self._shipped = 0  # data records written to this exporter
        self._acked = 0  # ... of which it acknowledged handling
        self._writer.write(encode_frame(marshal.dumps((wire.CONFIG, self._config()))), force=True)

    def _forget_after_fork(self) -> None:
        """In a forked child: the parent's exporter is not ours. Close our copies of its pipes (so it sees
        end-of-file when the parent goes) without touching the process itself."""
        self._close_pipes(read_first=False)
        self.proc = None

    def _close_pipes(self, *, read_first: bool) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._results_fd >= 0:
            if read_first:
                self._read_results()
            try:
                os.close(self._results_fd)
            except OSError:
                pass
            self._results_fd = -1

    def _died(self) -> None:
        lost = max(0, self._shipped - self._acked)
        code = self.proc.returncode if self.proc is not None else None
        self._drop_channel()
        if lost:
            self.app_metrics.dropped("exporter_restart", lost)
        self.shipper.abandon_flushes()
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 60.0]
        if len(self._restarts) >= self.settings.exporter_restarts_per_minute:
            self._gave_up = True
            logger.warning(
                "stagetrace: the exporter process ended (exit %s) again, %d traces in flight lost; it is not "
                "restarted: traces are dropped and counted from now on",
                code,
                lost,
            )
            return
        logger.warning(
            "stagetrace: the exporter process ended (exit %s); %d traces in flight lost, restarting", code, lost
        )
        self._restarts.append(now)
        try:
            self._start()
        except Exception:
            report_internal_error("exporter restart")
            self._gave_up = True

    def _drop_channel(self) -> None:
        self._close_pipes(read_first=True)
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.kill()
                proc.wait(1.0)  # reaped: no zombie
            except Exception:
                pass

    def close(self, timeout_s: float) -> bool:
        """End of input, then wait for the exporter to flush and exit (reading its results meanwhile, so
        that it never blocks on a full results pipe); past the deadline it is killed."""
        proc, writer = self.proc, self._writer
        if proc is None or writer is None:
            return True
        deadline = time.monotonic() + timeout_s
        while writer.pending and not writer.broken and time.monotonic() < deadline:
            writer.pump()
            self._read_results()
            time.sleep(0.002)
        writer.close()
        self._writer = None
        ok = True
        while proc.poll() is None:
            self._read_results()
            if time.monotonic() >= deadline:
                proc.kill()
                ok = False
                break
            time.sleep(0.005)
        proc.wait(2.0)
        self._close_pipes(read_first=True)
        self.proc = None
        return ok and proc.returncode == 0

    # --- sending --------------------------------------------------------------------------------------
    def send(self, messages: list[tuple[Any, ...]]) -> None:
        if self.proc is None and not self._gave_up:
            try:
                self._start()
            except Exception:
                report_internal_error("exporter start")
                self._gave_up = True
        data = [m for m in messages if m[0] in DATA_KINDS]
        writer = self._writer
        if writer is None or self._gave_up:
            self._without_exporter(messages, len(data))
            return
        # Samples and loop blocks first (a trace is judged against those of its window, and the helper drains
        # them after taking the traces, so they are never later than the trace), then the records in frames
        # of a bounded number, each taken or refused whole, then metric events and flush markers (after the
        # data they flush).
        leading = [m for m in messages if m[0] in _WINDOW_KINDS]
        trailing = [m for m in messages if m[0] not in DATA_KINDS and m[0] not in _WINDOW_KINDS]
        if leading:
            writer.write(encode_frame(encode_batch(leading)[0]), force=True)
        for start in range(0, len(data), RECORDS_PER_FRAME):
            if not self._send_records(writer, data[start : start + RECORDS_PER_FRAME]):
                writer = self._writer  # the exporter died and was restarted: the rest goes to the new one
                if writer is None or self._gave_up:
                    self.app_metrics.dropped("exporter_unavailable", max(0, len(data) - start - RECORDS_PER_FRAME))
                    return
        if trailing:
            writer.write(encode_frame(encode_batch(trailing)[0]), force=True)

    def _without_exporter(self, messages: list[tuple[Any, ...]], records: int) -> None:
        """No exporter (it kept dying): records are dropped and counted, metric events go straight to the
        metric readers that live here, and flushes answer at once that they failed."""
        self.app_metrics.dropped("exporter_unavailable", records)
        for msg in messages:
            if msg[0] == wire.METRIC:
                replay(self.local.metrics, list(msg[1]))
            elif msg[0] == wire.FLUSH:
                self.shipper.flushed(msg[1], ok=False)

    def _send_records(self, writer: NonBlockingWriter, records: list[tuple[Any, ...]]) -> bool:
        """False: the exporter is gone (and is being restarted)."""
        payload, lost = encode_batch(records)
        if lost:
            self.app_metrics.dropped("unencodable", lost)
        if writer.write(encode_frame(payload)):
            self._shipped += len(records) - lost
            return True
        if writer.broken:
            self._shipped += len(records) - lost  # these went down with the exporter: counted as in flight
            self._died()
            return False
        # The channel is full (the exporter is behind): the records are dropped and counted.
        self.app_metrics.dropped("channel_full", len(records) - lost)
        return True

    # --- results --------------------------------------------------------------------------------------
    def poll(self) -> None:
        if self._writer is not None:
            self._writer.pump()
            if self._writer.broken:
                self._died()
                return
        self._read_results()
        now = time.monotonic()
        if now - self._last_liveness >= 0.2:
            self._last_liveness = now
            if self.proc is not None and self.proc.poll() is not None:
                self._died()

    def _read_results(self) -> None:
        fd = self._results_fd
        if fd < 0:
            return
        while True:
            try:
                data = os.read(fd, 1 << 20)
            except BlockingIOError:
                return
            except OSError:
                return
            if not data:
                return
            for payload in self._reader.feed(data):
                try:
                    batch = pickle.loads(payload)
                except Exception:
                    report_internal_error("exporter results")
                    continue
                for msg in batch:
                    self._dispatch(msg)

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        try:
            if kind == wire.SPANS:
                self.local.export(msg[1])
            elif kind == wire.VERDICT:
                self.local.verdict(msg[1])
            elif kind == wire.METRIC:
                replay(self.local.metrics, msg[1])
            elif kind == wire.LOG:
                _, level, name, text = msg
                logging.getLogger(name).log(level, "%s", text)
            elif kind == wire.ACK:
                self._acked = max(self._acked, msg[1])
            elif kind == wire.FLUSH:
                _, seq, ok = msg
                ok = self.local.flush(self.settings.shutdown_timeout_s) and ok
                self.shipper.flushed(seq, ok=ok)
        except Exception:
            report_internal_error("exporter result dispatch")
