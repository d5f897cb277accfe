"""Tests here run only inside a process started with ``NUMBA_ENABLE_CUDASIM=1``.

The simulator must be switched on before Numba is first imported, so
``tests/test_attention_cuda_sim.py`` starts a fresh pytest process for this folder with
the variable set; an ordinary test run skips collecting it.
"""

import os
import sys
from pathlib import Path

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from _cudasim import prepare_simulator

    prepare_simulator()
