"""Start-up does no work it need not: what ``benchmarks/startup.py`` times (serve and a
rank started together, seconds to the first batch), caught here without timing anything.

- Each process the service starts (``serve``, ``worker``, ``consume``) imports none of
  the optional heavy libraries (torch, pyarrow, ...) nor the decoder and the audit; a
  worker, none of the corpus readers.
- A second process with a warm Numba cache loads every kernel of the warm-up and
  compiles none (Numba's dispatcher stats).
- A worker that does not audit loads the planning and gathering kernels only, not the
  check and expand ones (a consumer's), which are a quarter of the warm-up's loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPTIONAL = ("torch", "pyarrow", "transformers", "tokenizers", "matplotlib", "fsspec")
NOT_AT_START = {"streampack.decoder", "streampack.auditing"}
KERNELS = """
import json
from streampack.kernels import pack_cpu
from streampack.service.worker import _warm_up

def loaded():
    return {
        name: len(f.signatures) for name, f in vars(pack_cpu).items() if hasattr(f, "stats")
    }

_warm_up()
worker = loaded()
from streampack.packing import warm_up_kernels
warm_up_kernels()
dispatchers = [f for f in vars(pack_cpu).values() if hasattr(f, "stats")]
print(json.dumps({
    "worker": worker,
    "all": loaded(),
    "compiled": sum(sum(f.stats.cache_misses.values()) for f in dispatchers),
    "from_cache": sum(sum(f.stats.cache_hits.values()) for f in dispatchers),
}))
"""


def _run(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("role", ["serve", "worker", "consume"])
def test_a_service_process_imports_no_optional_library_nor_the_audit(role):
    module = f"streampack.service.{role}"
    loaded = set(_run(f"import json, sys, {module}\nprint(json.dumps(sorted(sys.modules)))"))
    assert not {m for m in loaded if m.split(".")[0] in OPTIONAL}
    assert not loaded & NOT_AT_START
    if role == "worker":  # it packs what the producer sends: no corpus reader, no windows
        assert not {m for m in loaded if m.startswith(("streampack.corpus", "streampack.windows"))}


def test_a_second_process_loads_every_kernel_from_the_cache_and_compiles_none():
    _run(KERNELS)  # compiles into the cache what is not there yet (a fresh machine)
    second = _run(KERNELS)
    assert second["compiled"] == 0
    assert second["from_cache"] == sum(second["all"].values()) > 0
    worker = second["worker"]
    assert worker["plan_next_fit"] and worker["gather_ranges"] and worker["gather_ranges_masked"]
    assert worker["check_compact"] == worker["fill_compact"] == worker["fill_rows"] == 0
    assert second["all"]["check_compact"] and second["all"]["fill_compact"]
