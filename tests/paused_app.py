"""The app the paused-stage test (``tests/test_scenarios.py``) serves in its own uvicorn process, so that no
thread of the test process runs beside it: each request's 200 ms pure-Python stage asks the pauser (another
process, reading the FIFO named by ``PAUSER_FIFO``) to stop this process for a while mid-stage. stagetrace is
configured at import (the embedded JSON lines file, STAGETRACE_OUTPUT_DIR)."""

import os

from fastapi import FastAPI

import stagetrace
from scenarios.corpus import busy

stagetrace.configure("paused-test")
app = FastAPI()
_pauser: list[int] = []


@app.get("/tokenize")
def tokenize() -> dict:
    if not _pauser:
        _pauser.append(os.open(os.environ["PAUSER_FIFO"], os.O_WRONLY))
    with stagetrace.stage("tokenize"):
        os.write(_pauser[0], b"x")
        busy(200)  # on the wall clock: Python, the pause, and Python to 200 ms
    return {}


stagetrace.instrument_fastapi(app)
