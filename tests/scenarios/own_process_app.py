"""A corpus scenario's app served in a process of its own (``python -m uvicorn
scenarios.own_process_app:app``): no thread of the harness shares its GIL, as in a deployed service. The
scenario is named by ``STAGETRACE_SCENARIO``; stagetrace is configured from the environment (the server
helper's JSON lines file), and the scenario's background load runs from import until the process ends."""

import os

import stagetrace
from scenarios.corpus import SCENARIOS

_scenario = next(s for s in SCENARIOS if s.name == os.environ["STAGETRACE_SCENARIO"])
stagetrace.configure(f"accuracy-{_scenario.name}")
workload = _scenario.build()
stagetrace.instrument_fastapi(workload.app)
# The process is the scenario: its background load ends with it. The context stays referenced: a
# generator-based one collected at once would run its exit and stop the load.
background_load = workload.running()
background_load.__enter__()
app = workload.app
