# The C types of breakdown.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source and
# the fallback): a stage's fields read as the members of its C type (there every stage the exporter analyses
# is a ShippedStage; from the sources, any StageLike).
import cython

from stagetrace.analysis.stage_record cimport ShippedStage


@cython.locals(st=ShippedStage, composites=cython.bint)
cpdef object analyse_trace(object root_start_ns, object root_end_ns, object stages, object slow_threshold_ms,
                           bint untracked_headline=*)
