"""Every thread of a simulated block gets the same ``cuda.shared.array`` (``tests/_cudasim.py``).

What races, for upstream (numba-cuda 0.30.4, ``numba_cuda/numba/cuda/simulator/kernelapi.py``,
and Numba's own ``numba/cuda/simulator/kernelapi.py``): the simulator runs one Python
thread per CUDA thread, and ``FakeCUDAShared.array`` finds "the array of this source
line" with a check-then-set on a plain dict, ``res = self._allocations.get(caller)``,
``if res is None: res = np.empty(shape, dtype); self._allocations[caller] = res``,
without a lock. A thread switch between the ``get`` and the store lets a second thread
of the block find nothing and make its own array; whichever store comes last wins, and
the thread that stored first writes and reads an array no other thread sees. A correct
kernel then gives wrong results or indexes garbage; a short ``sys.setswitchinterval``
(which the tests set, to make ``syncthreads`` cheap) makes it more likely. The fix:
hold a lock (as the simulator's atomics do) around the lookup and the store, or store
with ``self._allocations.setdefault(caller, np.empty(shape, dtype))``, which is one
atomic dict operation. (The same kind of race in ``swapped_cuda_module``, the swap of
the ``cuda`` module, was fixed upstream with per-module locks, NVIDIA/numba-cuda#690;
in 0.30.4 ``FakeCUDAShared.array`` still takes none.)

The stress below widens the race window so that it always opens: during the launch
``np.empty`` first sleeps, which hands the interpreter to the block's other threads
exactly between the lookup and the store. Without the lock of ``prepare_simulator``
every thread then makes its own array and the test fails on every launch; with it,
the others wait and find the first thread's array. Each thread writes its slot of
arrays made on three lines and sums every slot: the sums show both that threads share
and that arrays of different lines do not (the key is the caller's file and line, as
the simulator's).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from numba import cuda, int64

THREADS = 8
LAUNCHES = 3

pytestmark = pytest.mark.skipif(
    os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="a simulator race; a GPU shares for real"
)


@cuda.jit
def _sums_seen_by_each_thread(out):
    tid = cuda.threadIdx.x
    cuda.syncthreads()  # every thread reaches the allocations together
    a = cuda.shared.array(THREADS, int64)
    b = cuda.shared.array(THREADS, int64)
    c = cuda.shared.array(THREADS, int64)
    a[tid] = tid + 1
    b[tid] = 100 * (tid + 1)
    c[tid] = 10_000 * (tid + 1)
    cuda.syncthreads()
    total = 0
    for i in range(THREADS):
        total += a[i] + b[i] + c[i]
    out[tid] = total


def test_every_thread_of_a_block_shares_each_shared_array_even_when_allocation_yields(
    monkeypatch,
):
    allocate = np.empty

    def yielding_empty(*args, **kwargs):
        time.sleep(0.001)  # let the block's other threads run inside the race window
        return allocate(*args, **kwargs)

    expected = 10_101 * THREADS * (THREADS + 1) // 2
    for launch in range(LAUNCHES):
        out = np.zeros(THREADS, np.int64)
        with monkeypatch.context() as patch:
            patch.setattr(np, "empty", yielding_empty)
            _sums_seen_by_each_thread[1, THREADS](out)
        assert out.tolist() == [expected] * THREADS, f"launch {launch}"
