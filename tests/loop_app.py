"""The app the lived-wait tests serve in their own uvicorn process: an ``async def`` endpoint whose 40 ms
``decode`` stage holds the event loop, so concurrent requests wait for it, before and after their server
spans begin. stagetrace is configured at import (the embedded JSON lines file, STAGETRACE_OUTPUT_DIR)."""

import time

from fastapi import FastAPI

import stagetrace

stagetrace.configure("loop-test")
app = FastAPI()


@app.get("/work")
async def work() -> dict:
    with stagetrace.stage("decode"):  # sync work on the loop's thread: it holds the loop
        end = time.perf_counter() + 0.040
        while time.perf_counter() < end:
            pass
    return {}


stagetrace.instrument_fastapi(app)
