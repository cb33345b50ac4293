# The C types of schedstat.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source
# and the fallback). A reading's fields are then read by a walk over its bytes in C integers.
import cython

cdef bint _COMPILED
cdef int _MAX_DIGITS


@cython.locals(s0=cython.longlong, s1=cython.longlong, s2=cython.longlong, e0=cython.longlong,
               e1=cython.longlong, e2=cython.longlong)
cpdef tuple schedstat_delta(object start, object end)


@cython.locals(first=cython.longlong, second=cython.longlong, third=cython.longlong, value=cython.longlong,
               digits=cython.int, field=cython.int, byte=cython.uchar, padded=bytes)
cpdef tuple _fields_by_bytes(bytes reading)
