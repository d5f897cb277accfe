import os
from pathlib import Path

# Compiled kernels are cached across runs; CI and `make test` set the same directory.
os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".numba_cache"))
