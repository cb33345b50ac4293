"""The app the multi-worker tests serve: stagetrace configured at import, as the README recommends."""

import os

from fastapi import FastAPI

import stagetrace

stagetrace.configure("fork-test")  # embedded default: STAGETRACE_OUTPUT_DIR, one file per process
app = FastAPI()


@app.get("/work")
def work() -> dict:
    with stagetrace.stage("compute"):
        sum(range(50_000))
    return {"pid": os.getpid()}


stagetrace.instrument_fastapi(app)
