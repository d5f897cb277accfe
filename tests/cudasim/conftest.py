"""Tests here run in a process that has a CUDA target: the simulator or a real GPU.

* ``NUMBA_ENABLE_CUDASIM=1``: the simulator must be switched on before Numba is first
  imported, so ``tests/attention/test_attention_cuda_sim.py`` starts a fresh pytest process for
  this folder with the variable set.
* ``STREAMPACK_CUDA_DEVICE=1``: the same suite compiled for and run on a real GPU
  (``make test-gpu``, on a machine that has one).

An ordinary test run skips collecting this folder.
"""

import os
import sys
from pathlib import Path

simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
if not simulated and os.environ.get("STREAMPACK_CUDA_DEVICE") != "1":
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if simulated:
        from _cudasim import prepare_simulator

        prepare_simulator()
        # The simulator's copy of this comparison runs in tests/attention/test_decoder_cuda_sim.py.
        collect_ignore = ["test_device_decoder.py"]
