# The C types of breakdown.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source and
# the fallback): a stage's fields read as the members of its C type (there every stage the exporter analyses
# is a ShippedStage; from the sources, any StageLike). Its times stay Python ints: a C integer would refuse
# one past 2**63 that the sources judge (tests/test_compiled.py holds the two paths to the same verdicts).
import cython

from stagetrace.analysis.stage_record cimport ShippedStage


@cython.locals(st=ShippedStage, composites=cython.bint)
cpdef object analyse_trace(object root_start_ns, object root_end_ns, object stages, object slow_threshold_ms,
                           bint untracked_headline=*)


@cython.locals(ordered=list, n=cython.Py_ssize_t, i=cython.Py_ssize_t)
cpdef object union_length_ns(object intervals)
