# The C types of causes.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source and
# the fallback): a stage's fields read as the members of its C type (there every stage the exporter analyses
# is a ShippedStage; from the sources, any StageLike), and a C call from the modules that cimport it.
from stagetrace.analysis.stage_record cimport ShippedStage


cpdef bint blocked_enough(ShippedStage s, object th)
