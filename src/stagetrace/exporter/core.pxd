# The exporter's core as a C type where Cython compiles it (an augmenting .pxd: the .py stays the source and the
# fallback): what it holds is read as C struct members in its per-trace methods (dozens of reads a trace,
# each a dictionary lookup on an instance of a plain class), and stays readable from Python as before; the
# methods a trace goes through call each other in C.

import cython

from stagetrace.analysis.stage_record cimport ShippedStage
from stagetrace.exporter.diagnosis_budget cimport DiagnosisBudget
from stagetrace.exporter.keep cimport PendingBatches, RecentDecisions, decide, decide_before_diagnosis
from stagetrace.exporter.signals cimport LoopBlockSeries


@cython.locals(st=ShippedStage)
cpdef bint _errored(object root, object stages, object others) except -1

@cython.locals(st=ShippedStage)
cpdef object _delayed_requests(object stages)


cdef class ExporterCore:
    cdef public object settings
    cdef public object outputs
    cdef public object _clocks
    cdef public object _diagnosis_clock_ns
    cdef public object metrics
    cdef public object series
    cdef public LoopBlockSeries loop_blocks
    cdef public object _gil_wait_bound_ms
    cdef public RecentDecisions decisions
    cdef public PendingBatches batches
    cdef public object budget
    cdef public object adjusted
    cdef public DiagnosisBudget diagnosis_budget
    cdef public object _new_span_id
    cdef public object handled
    cdef public object _slow_log
    cdef public object _malformed_log
    cdef public object _last_tick
    cdef public object cpus
    cdef public object _handlers

    cpdef _export(self, object spans)
    cpdef _analyse_and_export(self, object t)
    cpdef _resolve_cpu(self, object stages, object offset)
    cpdef object _signals(self, object start_ns, object end_ns, object gpu_utilization, tuple blocked_by=*)
