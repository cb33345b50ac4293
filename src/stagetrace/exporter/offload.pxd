# The C types of offload.py's locals where Cython compiles it (an augmenting .pxd: the .py stays the source and
# the fallback): every trace's stages are scanned for a call handed to a process pool, their fields read as
# the members of the stage's C type.
import cython

from stagetrace.analysis.stage_record cimport ShippedStage


@cython.locals(st=ShippedStage, child=ShippedStage)
cpdef list place_offloads(object stages, object new_span_id)

@cython.locals(st=ShippedStage)
cpdef _claim_worker_stages(list stages, dict runs)
