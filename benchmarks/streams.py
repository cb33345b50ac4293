"""The cost of a stream: spans exported and request-thread instructions per token, side by side in one run.

    python benchmarks/streams.py [--tokens 200,2000,20000] [--no-uvicorn]   # spans exported (< 1 min)
    python benchmarks/streams.py --instructions [N]    # valgrind: instructions a token (N and 2N, default 2000)
    icount --threads -- python benchmarks/streams.py --instructions N   # the same workloads, counted by icount

Target (issue 23): "a 2,000-token stream exports at most ~50 spans and costs the request thread no more per
token than one stage".

**Spans exported.** A FastAPI ``StreamingResponse`` whose generator (sync, run a ``next()`` at a time on the
thread pool; or async, on the event loop) runs, after a ``prefill`` stage, per token a ``decode_step`` and a
``detokenize`` stage (~50 us of busy work each) and yields a chunk. Driven in this process by Starlette's
``TestClient`` (the ASGI app hands the server every chunk, ``more_body=True``) and, unless ``--no-uvicorn``,
by uvicorn on 127.0.0.1 read by an httpx stream. Every trace is kept (``healthy_sample=1.0``, no export
budget) and exported to an in-memory exporter; every span of the trace is counted (FastAPI's own, the
``threadpool.wait`` stages of the sync generator's hops, composites and their slowest occurrences). The
verdict's ``decode_step`` must equal the true sum of its occurrences (each occurrence's own stage record,
read as it ends), and the occurrences the spans account for (real ones plus the composite's count) must be
every token.

**Instructions a token** (``--instructions``; CPU times on this VM move +-20 %, instruction counts well
under 1 %). Each workload runs N and 2N tokens under valgrind's callgrind, one thread counted apart from
the others; the difference cancels start-up, and the request (main) thread's count is read, since the
helper thread and samplers wake on wall time, which valgrind stretches (the GIL sampler is off, the helper
thread ships when flushed). A token is one iteration of a generator consumed under a ``pipeline()`` root:

  bare           the loop alone, no stages;
  folded         ``with stagetrace.stage("decode_step")`` + ``with stagetrace.stage("detokenize")`` a token,
                 compression on (the default): past the first three, each occurrence folds into a composite;
  unfolded       the same with compression off (``records.KEEP_REPEATS`` patched out of reach and
                 ``max_stages_per_trace`` raised): every occurrence an ordinary stage, the same loop;
  *-made-once    folded / unfolded with the two ``Stage`` objects made before the loop, not per token;
  pipeline0/5    a root alone, and a root with five distinct stages (``benchmarks/overhead.py``'s way to
                 price one stage: (root + 5 stages - root) / 5), one root a "token";
  send           an ASGI ``send`` of a body chunk (``more_body=True``), on an event loop, inside a root;
  send-observed  the same through the stream capture's wrapper (``capture/streams.observe``: the chunk
                 timed, ``StreamStats.chunk_handed``), past 1,024 chunks when N >= 1024 (the gap sample's
                 reservoir regime, a long stream's steady state).

Target: (folded - bare) a token <= 2 x one stage, i.e. a folded occurrence costs no more than an ordinary
stage. Run under ``icount --threads``, ``--instructions N`` runs each workload in a child process of its
own (icount prints each child's threads with its command line; thread 1 is the request thread): run it with
N and 2N and take the differences.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

os.environ["STAGETRACE_HEALTHY_SAMPLE"] = "1.0"  # every trace kept
os.environ["STAGETRACE_EXPORT_BUDGET"] = "off"

import stagetrace

BUSY_US = 50  # busy work a stage, per token


def busy(us: int) -> None:
    end = time.perf_counter_ns() + us * 1000
    while time.perf_counter_ns() < end:
        pass


# --- spans exported ---------------------------------------------------------------------------------------


class TrueSum:
    """What ``decode_step`` really took: each occurrence's own record (start and end as the stage took them)."""

    def __init__(self) -> None:
        self.ns = 0
        self.count = 0

    def add(self, rec: Any) -> None:
        self.ns += rec.end_ns - rec.start_ns
        self.count += 1


def make_app(telemetry: str, truth: TrueSum) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    def token(i: int) -> str:
        """One token's work, the same in both generators: a model step and a detokenize, then its chunk."""
        with stagetrace.stage("decode_step") as rec:
            busy(BUSY_US)
        truth.add(rec)
        with stagetrace.stage("detokenize"):
            busy(BUSY_US)
        return f"data: {i}\n\n"

    @app.get("/sync")
    def generate_sync(n: int) -> Any:
        with stagetrace.stage("prefill"):
            busy(4 * BUSY_US)

        def body():
            for i in range(n):
                yield token(i)

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.get("/async")
    async def generate_async(n: int) -> Any:
        with stagetrace.stage("prefill"):
            busy(4 * BUSY_US)

        async def body():
            for i in range(n):
                yield token(i)

        return StreamingResponse(body(), media_type="text/event-stream")

    stagetrace.instrument_fastapi(app, telemetry=telemetry)
    return app


class UvicornServer:
    def __init__(self, app: Any) -> None:
        import uvicorn
        from harness import free_port

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    def get(self, path: str, n: int) -> str:
        import httpx

        chunks = []
        with (
            httpx.Client(timeout=120) as client,
            client.stream("GET", f"http://127.0.0.1:{self.port}{path}", params={"n": n}) as response,
        ):
            for text in response.iter_text():
                chunks.append(text)
        return "".join(chunks)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def span_count_main(token_counts: list[int], use_uvicorn: bool) -> int:
    from fastapi.testclient import TestClient
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from stagetrace import conventions as c
    from stagetrace.settings import KEEP_REPEATS

    exporter = InMemorySpanExporter()
    verdicts: list[Any] = []
    # Every trace kept by the healthy share (1.0), not by being slow: a high threshold keeps the log quiet.
    settings = stagetrace.Settings(slow_threshold_ms=600_000.0)
    assert settings.healthy_sample == 1.0 and settings.export_budget_per_s is None
    handle = stagetrace.configure(
        "bench-streams", span_exporter=exporter, on_verdict=verdicts.append, set_global=False, settings=settings
    )
    truth = TrueSum()
    apps = {t: make_app(t, truth) for t in ("auto", "contrib")}
    clients = {t: TestClient(app) for t, app in apps.items()}
    servers: dict[str, UvicornServer] = {}
    runs: list[tuple[str, str, str, int]] = []  # driver, generator, telemetry, tokens
    for tokens in token_counts:
        for kind in ("sync", "async"):
            runs.append(("TestClient", kind, "auto", tokens))
    middle = 2000 if 2000 in token_counts else token_counts[len(token_counts) // 2]
    for kind in ("sync", "async"):
        runs.append(("TestClient", kind, "contrib", middle))
    if use_uvicorn:
        servers["auto"] = UvicornServer(apps["auto"])
        for kind in ("sync", "async"):
            runs.append(("uvicorn", kind, "auto", middle))

    rows = []
    try:
        for driver, kind, telemetry, tokens in runs:
            exporter.clear()
            verdicts.clear()
            truth.__init__()
            t0 = time.perf_counter()
            if driver == "uvicorn":
                body = servers[telemetry].get(f"/{kind}", tokens)
            else:
                body = clients[telemetry].get(f"/{kind}", params={"n": tokens}).text
            wall = time.perf_counter() - t0
            assert body.count("data:") == tokens, (driver, kind, body[:200])
            deadline = time.monotonic() + 60
            while not verdicts and time.monotonic() < deadline:
                handle.force_flush(1)
                time.sleep(0.01)
            assert handle.force_flush(30)
            (verdict,) = verdicts
            spans = [s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == verdict.trace_id]
            composites = [s for s in spans if c.COMPRESSED_COUNT in s.attributes]
            # what the trace would have exported without compression: every occurrence a span
            uncompressed = sum(
                s.attributes.get(c.COMPRESSED_COUNT, 1) for s in spans if not s.attributes.get(c.COMPRESSED_SLOWEST)
            )
            decode = [s for s in spans if s.name == "decode_step"]
            counted = sum(
                s.attributes.get(c.COMPRESSED_COUNT, 1) for s in decode if not s.attributes.get(c.COMPRESSED_SLOWEST)
            )
            roots = [s for s in spans if s.parent is None or s.parent.is_remote]
            chunks = roots[0].attributes.get(c.STREAM_CHUNKS) if len(roots) == 1 else None
            names: dict[str, int] = {}
            for s in spans:
                names[s.name] = names.get(s.name, 0) + 1
            rows.append(
                dict(
                    driver=driver,
                    kind=kind,
                    telemetry="FastAPI's own" if telemetry == "auto" else "contrib",
                    tokens=tokens,
                    wall=wall,
                    spans=len(spans),
                    composites=len(composites),
                    uncompressed=uncompressed,
                    chunks=chunks,
                    counted=counted,
                    occurrences=truth.count,
                    verdict_ms=verdict.breakdown.get("decode_step", 0.0),
                    true_ms=truth.ns / 1e6,
                    names=names,
                )
            )
    finally:
        for server in servers.values():
            server.stop()
        handle.shutdown()

    print(
        f"spans exported by one streamed response (KEEP_REPEATS={KEEP_REPEATS}; per token a decode_step and a "
        f"detokenize stage of ~{BUSY_US} us, every trace exported); python {sys.version.split()[0]}"
    )
    header = (
        f"{'driver':10} {'generator':9} {'telemetry':13} {'tokens':>6} {'chunks':>6} {'spans':>5} "
        f"{'composites':>10} {'uncompressed':>12} {'decode_step counted':>19} {'verdict ms':>11} "
        f"{'true sum ms':>11} {'agree':>5}"
    )
    print(header)
    ok_spans = ok_sum = True
    for r in rows:
        agree = abs(r["verdict_ms"] - r["true_ms"]) <= 1e-6 * max(1.0, r["true_ms"]) and r["counted"] == r["tokens"]
        ok_sum &= agree and r["occurrences"] == r["tokens"] and r["chunks"] == r["tokens"]
        ok_spans &= r["spans"] <= 50
        print(
            f"{r['driver']:10} {r['kind']:9} {r['telemetry']:13} {r['tokens']:6d} {r['chunks'] or 0:6d} "
            f"{r['spans']:5d} {r['composites']:10d} {r['uncompressed']:12d} "
            f"{r['counted']:>10d} of {r['occurrences']:<6d} "
            f"{r['verdict_ms']:11.3f} {r['true_ms']:11.3f} {'yes' if agree else 'NO':>5}"
        )
    print(f"spans by name, {middle} tokens:")
    shown = set()
    for r in rows:
        key = (r["driver"], r["kind"], r["telemetry"])
        if key in shown or r["tokens"] != middle:
            continue
        shown.add(key)
        listed = ", ".join(f"{k} {n}" for n, k in sorted(r["names"].items(), key=lambda kv: -kv[1]))
        print(f"  {r['driver']}, {r['kind']} generator, {r['telemetry']}: {listed}")
    print(f"target: <= ~50 spans a stream (2,000 tokens), bounded at any length: {'PASS' if ok_spans else 'FAIL'}")
    print(f"target: the verdict counts every occurrence (decode_step = true sum): {'PASS' if ok_sum else 'FAIL'}")
    return 0 if ok_spans and ok_sum else 1


# --- instructions a token (--instructions) ------------------------------------------------------------------

WORKLOADS = {
    # name: description
    "bare": "generator loop, no stages",
    "folded": "decode_step + detokenize a token, compression on (default)",
    "unfolded": "the same, compression off (every occurrence an ordinary stage)",
    "folded-made-once": "folded, the Stage objects made once before the loop",
    "unfolded-made-once": "unfolded, the Stage objects made once before the loop",
    "pipeline0": "a pipeline() root alone (a 'token' is a root)",
    "pipeline5": "a root and five distinct stages",
    "send": "ASGI send of a body chunk, plain",
    "send-observed": "the same through the stream capture's send wrapper",
}
FIVE = ("receive", "decode", "to_tensor", "infer", "postprocess")


def _configure_for_counting(unfolded: bool) -> Any:
    from stagetrace.handoff import shipper

    # The helper thread works when the flush asks, not on its wall-clock schedule (which valgrind stretches).
    shipper.FLUSH_POLL_S = 1.0  # type: ignore[attr-defined]
    settings = stagetrace.Settings(
        gil_sampler_period_s=0,
        loop_lag_interval_s=3600.0,
        healthy_sample=1.0,
        export_budget_per_s=None,
        poll_interval_s=3600.0,
        shutdown_timeout_s=600.0,
        slow_threshold_ms=1e9,
        max_stages_per_trace=10**7 if unfolded else stagetrace.Settings().max_stages_per_trace,
    )
    if unfolded:
        from stagetrace.capture import records

        records.KEEP_REPEATS = 10**12  # type: ignore[misc]  # count_repeat never starts a composite
    return stagetrace.configure("bench-streams", set_global=False, settings=settings)


def _tokens_inline(n: int):
    for i in range(n):
        with stagetrace.stage("decode_step"):
            pass
        with stagetrace.stage("detokenize"):
            pass
        yield i


def _tokens_made_once(n: int):
    decode, detok = stagetrace.stage("decode_step"), stagetrace.stage("detokenize")
    for i in range(n):
        with decode:
            pass
        with detok:
            pass
        yield i


def _tokens_bare(n: int):
    for i in range(n):  # noqa: UP028  # the same loop as the others, without its stages
        yield i


async def _sends(n: int, observed: bool) -> None:
    from stagetrace import _state
    from stagetrace.capture import streams

    async def send(message: Any) -> None:
        return None

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    with stagetrace.pipeline("stream"):
        if observed:
            send, receive = streams.observe(_state.runtime, send, receive)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(n):
            await send({"type": "http.response.body", "body": b"data: token\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def instruction_workload(workload: str, n: int) -> None:
    """One counted run: ``n`` tokens of ``workload``, then everything flushed and shut down."""
    handle = _configure_for_counting(workload.startswith("unfolded"))
    gen = {
        "bare": _tokens_bare,
        "folded": _tokens_inline,
        "unfolded": _tokens_inline,
        "folded-made-once": _tokens_made_once,
        "unfolded-made-once": _tokens_made_once,
    }.get(workload)
    gc.collect()
    if gen is not None:
        with stagetrace.pipeline("stream"):
            for _ in gen(n):
                pass
    elif workload in ("pipeline0", "pipeline5"):
        names = FIVE if workload == "pipeline5" else ()
        for _ in range(n):
            with stagetrace.pipeline("request"):
                for name in names:
                    with stagetrace.stage(name):
                        pass
    else:
        asyncio.run(_sends(n, workload == "send-observed"))
    handle.force_flush(600)
    handle.shutdown()
    sys.stdout.flush()
    os._exit(0)


def _under_valgrind() -> bool:
    return "vgpreload" in os.environ.get("LD_PRELOAD", "")


def _thread_counts(directory: str) -> dict[str, int]:
    """The workload's main thread and its other threads, from callgrind's ``cg.<pid>-<thread>`` files (the
    exporter process is not traced)."""
    per_thread: dict[int, int] = {}
    for path in glob.glob(os.path.join(directory, "cg.*")):
        _, dash, thread = path.rsplit("cg.", 1)[1].partition("-")
        if not dash:
            continue
        with open(path) as f:
            per_thread[int(thread)] = next((int(line.split()[1]) for line in f if line.startswith("summary:")), 0)
    return {"request": per_thread.get(1, 0), "other": sum(v for t, v in per_thread.items() if t != 1)}


def _count(workload: str, n: int, env: dict[str, str]) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as directory:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--separate-threads=yes",
            f"--callgrind-out-file={directory}/cg.%p",
            f"--log-file={directory}/vg.%p",
            sys.executable,
            os.path.abspath(__file__),
            "--workload",
            workload,
            "--tokens",
            str(n),
        ]
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
        return _thread_counts(directory)


def _workload_env(out_dir: str) -> dict[str, str]:
    """The workloads' traces go to a temporary directory as JSON lines (the embedded default), nowhere else."""
    env = dict(
        os.environ,
        STAGETRACE_OUTPUT_DIR=out_dir,
        PYTHONHASHSEED="0",
        OTEL_METRICS_EXPORTER="none",
        OTEL_BSP_MAX_QUEUE_SIZE="1000000",  # the exporter's span queue holds an unfolded stream's every stage
    )
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    env.pop("OTEL_TRACES_EXPORTER", None)
    return env


def instructions_main(n: int, jobs: int) -> int:
    out_dir = tempfile.mkdtemp(prefix="stagetrace-streams-")
    env = _workload_env(out_dir)
    if _under_valgrind():
        # Under icount (valgrind following children): each workload in a child of its own, labelled by its
        # command line in icount's table; thread 1 of each is its request thread.
        print(f"each workload a child process, {n} tokens; run again with {2 * n} and take the differences")
        try:
            for workload in WORKLOADS:
                command = [sys.executable, os.path.abspath(__file__), "--workload", workload, "--tokens", str(n)]
                subprocess.run(command, env=env, check=True)
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        return 0
    if shutil.which("valgrind") is None:
        print("--instructions needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    from concurrent.futures import ThreadPoolExecutor

    jobs_list = [(w, size) for w in WORKLOADS for size in (n, 2 * n)]
    try:
        with ThreadPoolExecutor(jobs) as pool:
            counts = dict(zip(jobs_list, pool.map(lambda job: _count(job[0], job[1], env), jobs_list)))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    per = {w: {k: (counts[(w, 2 * n)][k] - counts[(w, n)][k]) / n for k in ("request", "other")} for w in WORKLOADS}

    def diff(a: str, b: str, part: str = "request") -> float:
        return per[a][part] - per[b][part]

    ordinary = diff("unfolded", "bare") / 2  # one ordinary stage, in this very loop
    ordinary_once = diff("unfolded-made-once", "bare") / 2
    pipeline_stage = diff("pipeline5", "pipeline0") / len(FIVE)  # overhead.py's way
    print(
        f"instructions a token on the request thread (callgrind; {n} and {2 * n} tokens, the difference over {n}), "
        f"python {sys.version.split()[0]}"
    )
    print(f"{'workload':20} {'description':62} {'request thread':>14} {'other threads':>13}")
    for w, label in WORKLOADS.items():
        print(f"{w:20} {label:62} {per[w]['request'] / 1e3:13.1f}k {per[w]['other'] / 1e3:12.1f}k")
    print()
    print("per stage occurrence (request thread, the bare loop subtracted), and as a multiple of one stage:")
    print(f"{'':58} {'instructions':>12} {'x ordinary':>10} {'x made once':>11} {'x pipeline':>10}")
    rows = [
        ("folded occurrence (compression on)", diff("folded", "bare") / 2),
        ("ordinary occurrence (compression off), same loop", ordinary),
        ("folded occurrence, Stage objects made once", diff("folded-made-once", "bare") / 2),
        ("ordinary occurrence, Stage objects made once", ordinary_once),
        ("one stage in a pipeline of five (overhead.py's way)", pipeline_stage),
        ("stream capture, per chunk (send wrapper + chunk_handed)", diff("send-observed", "send")),
    ]
    for label, value in rows:
        print(
            f"{label:58} {value / 1e3:11.1f}k {value / ordinary:10.2f} {value / ordinary_once:11.2f} "
            f"{value / pipeline_stage:10.2f}"
        )
    token = diff("folded", "bare")
    print()
    print(
        f"a token (two folded stages) = {token / 1e3:.1f}k instructions = {token / ordinary:.2f} x one ordinary "
        f"stage in the same loop, {token / pipeline_stage:.2f} x one stage of a pipeline"
    )
    ok = token <= 2 * ordinary
    print(
        f"target: a token's two stages <= 2 x one stage (a folded occurrence <= an ordinary one): "
        f"{'PASS' if ok else 'FAIL'} ({diff('folded', 'bare') / 2 / ordinary:.2f} x a stage of the same loop, "
        f"{diff('folded', 'bare') / 2 / pipeline_stage:.2f} x a stage of a pipeline)"
    )
    print(
        f"stream capture a chunk: {diff('send-observed', 'send') / 1e3:.1f}k instructions = "
        f"{diff('send-observed', 'send') / ordinary:.2f} x one stage"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="200,2000,20000", help="token counts of the span-count table")
    ap.add_argument("--no-uvicorn", action="store_true", help="TestClient only (no uvicorn rows)")
    ap.add_argument(
        "--instructions", nargs="?", type=int, const=2000, default=None, metavar="N", help="count instructions"
    )
    ap.add_argument("--jobs", type=int, default=2, help="valgrind runs at once (--instructions)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.workload:
        instruction_workload(args.workload, int(args.tokens))
    if args.instructions is not None:
        return instructions_main(args.instructions, args.jobs)
    return span_count_main([int(t) for t in args.tokens.split(",")], not args.no_uvicorn)


if __name__ == "__main__":
    raise SystemExit(main())
