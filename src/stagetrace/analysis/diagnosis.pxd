# The C types of diagnosis.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source and
# the fallback): a stage's fields read as the members of its C type (there every stage the exporter analyses
# is a ShippedStage; from the sources, any StageLike).
import cython

from stagetrace.analysis.stage_record cimport ShippedStage


@cython.locals(s=ShippedStage)
cpdef frozenset _available(object stages, object signals, object th)
