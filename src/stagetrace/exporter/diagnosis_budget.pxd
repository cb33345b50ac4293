# The C types of diagnosis_budget.py's classes where Cython compiles it (an augmenting .pxd: the .py stays the
# source and the fallback): every trace asks the budget whether to diagnose it and says what its diagnosis
# took, through C calls from the exporter's core (core.pxd), what the budget counts C struct members.

cdef class DiagnosisBudget:
    cdef public object cpu_share
    cdef public object share
    cdef public object _max_kinds
    cdef public object _window_start
    cdef public object _window_clocks
    cdef public object _window
    cdef public object _floors
    cdef public object _traces
    cdef public object _diagnosed
    cdef public object _diagnosis_ns

    cpdef choose(self, object kind, object trace_id, bint kept)
    cpdef spent(self, object cpu_ns)
