# The C types of keep.py's classes where Cython compiles it (an augmenting .pxd: the .py stays the source and the
# fallback). Every trace is remembered and offered to the pending batches: through C calls from the exporter's
# core (core.pxd), its ``len()`` a C slot, what the two hold C struct members.

cdef class RecentDecisions:
    cdef public object _max
    cdef public object _kept

    cpdef remember(self, object trace_id, bint kept)


cdef class PendingBatches:
    cdef public object decisions
    cdef public object wait_s
    cdef public object max_pending
    cdef public object _pending
    cdef public object _by_member

    cpdef list member_decided(self, object member_id, bint kept)


cpdef decide_before_diagnosis(bint sampled, bint errored, bint slow, object healthy_share, object trace_id)

cpdef decide(object verdict, bint errored, object healthy_share, object trace_id)
