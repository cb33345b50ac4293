# The C types of decimals.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source and
# the fallback). round_to's arithmetic then runs on C doubles and integers, without a call or an allocation
# until its result.
import cython

cdef tuple _SCALES
cdef double _LARGEST_SCALED, _TIE_MARGIN


@cython.locals(v=cython.double, scale=cython.double, scaled=cython.double, whole=cython.longlong, past_half=cython.double)
cpdef object round_to(object value, int digits=*)
