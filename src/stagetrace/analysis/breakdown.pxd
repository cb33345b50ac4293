# The C types of breakdown.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source and
# the fallback): a stage's fields read as the members of its C type (there every stage the exporter analyses
# is a ShippedStage; from the sources, any StageLike), its times compared and subtracted as C integers (ns of
# one clock: within a long long for 292 years).
import cython

from stagetrace.analysis.stage_record cimport ShippedStage


@cython.locals(total=cython.longlong, cur_start=cython.longlong, cur_end=cython.longlong, start=cython.longlong,
               end=cython.longlong, ordered=list)
cpdef object union_length_ns(object intervals)


@cython.locals(st=ShippedStage, composites=cython.bint, start=cython.longlong, end=cython.longlong,
               total_ns=cython.longlong, own=cython.longlong, ms=cython.double, total_ms=cython.double)
cpdef object analyse_trace(long long root_start_ns, long long root_end_ns, object stages, object slow_threshold_ms,
                           bint untracked_headline=*)
