# The C types of aggregation.py's records and locals where Cython compiles it (an augmenting .pxd: the .py stays
# the source and the fallback). A histogram's point is a C struct of Python fields, a store's methods C calls
# from ``record_into``: an observation is a dict lookup, a bisect and a few additions, without a Python call.
import cython


cdef class _Histogram:
    cdef public tuple buckets
    cdef public list counts
    cdef public long long count
    cdef public double sum, min, max
    cdef public object exemplars, start_ns


cdef class _Number:
    cdef public object value, start_ns


cdef class MetricStore:
    cdef public object delta_kinds
    cdef public dict points
    cdef public dict edges
    cdef public object last_collection_ns

    @cython.locals(table=dict, h=_Histogram, buckets=tuple, index=cython.Py_ssize_t, hi=cython.Py_ssize_t,
                   mid=cython.Py_ssize_t, edge=cython.double)
    cpdef observe(self, object inst, object key, double value, object exemplar)

    @cython.locals(table=dict, h=_Histogram, index=cython.Py_ssize_t, counts=list)
    cpdef merge(self, object inst, object key, object histogram)

    @cython.locals(table=dict, n=_Number)
    cpdef add(self, object inst, object key, object amount)

    cpdef set(self, object inst, object key, object value)


cpdef record_into(MetricStore store, list observations, list additions, list merges)
