# The C types of signals.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source and
# the fallback), and the C-level calls it makes into other compiled modules: a window's bounds found by bisect
# on the series' own lists, its samples summed and compared as C doubles, without a Python call between; a
# stage's fields read and set as the members of its C type.
import cython

from stagetrace.common.decimals cimport round_to
from stagetrace.analysis.causes cimport blocked_enough
from stagetrace.analysis.stage_record cimport ShippedStage
from stagetrace.common.schedstat cimport not_gil_ms, schedstat_delta


cdef bint _COMPILED


cdef class LagSeries:
    cdef public Py_ssize_t _max
    cdef public list _times
    cdef public list _values

    @cython.locals(times=list, values=list, i=cython.Py_ssize_t, value=cython.double)
    cpdef _extend_checked(self, object flat)

    @cython.locals(times=list)
    cpdef list window(self, object start_ns, object end_ns)


# (its len() a C slot, asked for every trace; the blocks a window overlaps a C call from the core)
cdef class LoopBlockSeries:
    cdef public object _max
    cdef public dict _ends
    cdef public dict _blocks
    cdef public Py_ssize_t _count

    cpdef list overlapping(self, object thread, object start_ns, object end_ns)


@cython.locals(lo=cython.Py_ssize_t, hi=cython.Py_ssize_t, mid=cython.Py_ssize_t, step=cython.Py_ssize_t,
               at=cython.longlong, t=cython.longlong)
cpdef Py_ssize_t index_left(list times, object at_ns) except -1

cpdef Py_ssize_t index_right(list times, object at_ns) except -1


@cython.locals(wall_ms=cython.double, cpu_ms=cython.double, rq_ms=cython.double, blocked=cython.double)
cpdef resolve_cpu(ShippedStage stage, object gil_wait_bound_ms=*)

@cython.locals(times=list, values=list, before=cython.Py_ssize_t, after=cython.Py_ssize_t, grew=cython.double)
cpdef object cumulative_change(LagSeries series, object start_ns, object end_ns)

@cython.locals(outer=cython.Py_ssize_t, inner=cython.Py_ssize_t, n=cython.Py_ssize_t)
cpdef object _nearest(list times, object at_ns, object tolerance_ns, bint start)

@cython.locals(times=list, span_ms=cython.double, used_ms=cython.double, counts=list)
cpdef object process_load(LagSeries cpu, LagSeries run_queue, LagSeries in_flight, object start_ns, object end_ns,
                          object cpus)

@cython.locals(times=list, values=list, n=cython.Py_ssize_t, lo=cython.Py_ssize_t, hi=cython.Py_ssize_t,
               i=cython.Py_ssize_t, total=cython.double, longest=cython.double, lag=cython.double)
cpdef object sampler_mean_ms(LagSeries series, object start_ns, object end_ns, double period_s,
                             object min_samples=*, object proof_ms=*)

@cython.locals(times=list, values=list, lo=cython.Py_ssize_t, hi=cython.Py_ssize_t, i=cython.Py_ssize_t)
cpdef object max_loop_lag_ms(LagSeries series, object start_ns, object end_ns)

cpdef resolve_others(ShippedStage stage, LagSeries run_queue, LagSeries cpu, object offset_ns)

@cython.locals(stage=ShippedStage)
cpdef resolve_stages(object stages, object series, object offset_ns, object gil_wait_bound_ms, object th)

cpdef object trace_signals(object series, object start_ns, object end_ns, double period_s,
                           object gil_wait_bound_ms, object cpus, object gpu_utilization, object blocked_by)
