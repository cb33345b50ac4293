# The C types of diagnosis.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source and
# the fallback): a stage's fields read as the members of its C type (there every stage the exporter analyses
# is a ShippedStage; from the sources, any StageLike).
import cython

from stagetrace.analysis.stage_record cimport ShippedStage


@cython.locals(s=ShippedStage, have=cython.long)
cpdef long _available(object stages, object signals, object th) except? -1


@cython.locals(have=cython.long, requires=cython.long)
cpdef tuple diagnose(object analysis, object stages, object signals=*, object thresholds=*)


@cython.locals(s=ShippedStage, own=ShippedStage)
cpdef object event_loop_blocked(object a, object stages, object sig, object th)
