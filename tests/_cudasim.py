"""Set up a process that runs CUDA kernels under Numba's simulator (NUMBA_ENABLE_CUDASIM=1).

Two things, both about the simulator rather than the kernels under test:

* it runs one OS thread per CUDA thread, so threads should switch often, or every
  ``syncthreads()`` waits out the default 5 ms interval;
* its ``cuda.shared.array`` looks up "the array for this source line" and creates it
  when missing without a lock, so two threads of a block that arrive together can each
  create their own copy and no longer share it. Under load that made a correct kernel
  give wrong results about one run in six. The lookup is repeated here under a lock,
  keyed as the simulator keys it: the caller's (file name, line). What races and the
  fix to offer upstream: ``tests/cudasim/test_sim_shared_arrays.py``, whose stress test
  fails on every launch without this lock.
"""

from __future__ import annotations

import sys
import threading


def prepare_simulator() -> None:
    sys.setswitchinterval(1e-4)
    import numpy as np
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    if getattr(FakeCUDAShared, "_streampack_locked", False):
        return
    unlocked = FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory: not per line
            # (Numba's own simulator takes no alignment argument.)
            extra = () if alignment is None else (alignment,)
            return unlocked(self, shape, dtype, *extra)
        # The simulator's key, traceback.extract_stack(...)[-2][0:2], is this pair.
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            found = self._allocations.get(caller)
            if found is None:
                if isinstance(dtype, types.Type):
                    dtype = numpy_support.as_dtype(dtype)
                found = self._allocations[caller] = np.empty(shape, dtype)
        return found

    FakeCUDAShared.array = array
    FakeCUDAShared._streampack_locked = True
