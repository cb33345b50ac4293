# The C types of schedstat.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source
# and the fallback). A reading's fields are then read by a walk over its bytes' buffer in C integers, and
# handed back as a C tuple: no bytes object, no int and no tuple made for them.
import cython

cdef bint _COMPILED
cdef int _MAX_DIGITS


@cython.locals(s0=cython.longlong, s1=cython.longlong, s2=cython.longlong, e0=cython.longlong,
               e1=cython.longlong, e2=cython.longlong)
cpdef tuple schedstat_delta(object start, object end)


@cython.locals(first=cython.longlong, second=cython.longlong, third=cython.longlong, value=cython.longlong,
               digits=cython.int, field=cython.int, byte=cython.uchar, n=cython.Py_ssize_t,
               i=cython.Py_ssize_t, data=cython.p_uchar)
cpdef (long long, long long, long long) _fields_by_bytes(bytes reading)


@cython.locals(interval=cython.double)
cpdef double not_gil_ms(double blocked_ms, long long slices, double gil_wait_bound_ms)
