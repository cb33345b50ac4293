# The stage record as a C type where Cython compiles the exporter (an augmenting .pxd: the .py stays the source
# and the fallback). Its fields are C struct members: stored by its compiled __init__, read as members by the
# compiled modules that declare a stage as one (``cimport`` this type), through a property-like descriptor by
# everything else. Every field is an object: the values the wire carries (None where unset), unchanged; but for
# its wall time, a C double.

cdef class ShippedStage:
    cdef public object name
    cdef public object kind
    cdef public object span_id
    cdef public object parent_span_id
    cdef public object parent_stage_id
    cdef public object start_ns
    cdef public object end_ns
    cdef public object cpu_start
    cdef public object cpu_end
    cdef public object on_event_loop
    cdef public object error
    cdef public object attributes
    cdef public object gpu_ms
    cdef public object gpu_utilization
    cdef public object h2d_bytes
    cdef public object h2d_pinned
    cdef public object queue_saturated
    cdef public object batch
    cdef public object compressed
    cdef public object example
    cdef public object worker_pid
    cdef public object offload
    cdef public object cpu_ms
    cdef public object runqueue_ms
    cdef public object blocked_ms
    cdef public object not_gil_ms
    cdef public object others_runqueue_ms
    cdef public object others_cpu_ms
    cdef public double wall_ms
