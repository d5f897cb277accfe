#!/usr/bin/env bash
# The GPU checks of the CUDA attention in one run: `make test-gpu` (the CUDA scenario
# suite, the tiled kernels among it, and the audit compiled for the GPU), then the GPU
# benchmark with every kernel side by side (per_query, tiled exact, tiled TF32, SDPA with
# the dense mask, FlexAttention with the document mask), then a summary of the machine
# code checks (HMMA in the TF32 forward, no local memory: inspect_sass()).
#
#     OUT=DIR bash benchmarks/gpu_check.sh      # from the repository root
#
# Writes into $OUT (default ./gpu-check): versions.json, test-gpu.log and
# gpu_attention.json. Exits 0 only when the tests and every check passed. BENCH_ARGS adds
# benchmark options (e.g. "--repeats 50", or a small shape for a smoke run).
#
# It runs on a machine with no package index too: without .venv it points make's .venv
# at the machine's own python3 (PYTHON=..., which must hold numba-cuda, PyTorch and
# pytest) and marks make's install stamps current, so make installs nothing; streampack
# is imported from the checkout. Wheels found in .whl/ are installed first into
# /tmp/streampack-site, e.g. the numba-cuda this project pins (pyproject's `cuda` extra)
# for that python when the machine has another:
#     pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --platform manylinux_2_28_x86_64 -d .whl numba-cuda==0.30.4
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/streampack-numba-cache}

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/streampack-site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/streampack-site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ ! -x .venv/bin/python ]; then
    real=$(command -v "$PYTHON") || { echo "no $PYTHON on this machine" >&2; exit 2; }
    mkdir -p .venv/bin
    printf '#!/bin/sh\nexec %s "$@"\n' "$real" >.venv/bin/python
    chmod +x .venv/bin/python
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    touch .venv/bin/streampack && touch .venv/.test-extras  # nothing for make to install
fi

.venv/bin/python - "$OUT/versions.json" <<'EOF'
import json, sys
from importlib import metadata

names = ["numpy", "numba", "numba-cuda", "llvmlite", "torch", "triton", "cuda-bindings"]
found = {}
for name in names:
    try:
        found[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        found[name] = None
found["python"] = sys.version.split()[0]
found["numba-cuda pinned"] = "0.30.4"
print(json.dumps(found, indent=2))
open(sys.argv[1], "w").write(json.dumps(found, indent=2) + "\n")
EOF

# -i: the benchmark runs even when a test fails; the outcome is read back below
timeout 540 make -i test-gpu GPU_BENCH_ARGS="--out $OUT/gpu_attention.json ${BENCH_ARGS:-}" 2>&1 \
    | tee "$OUT/test-gpu.log"

.venv/bin/python - "$OUT" <<'EOF'
import json, re, sys
from pathlib import Path

out = Path(sys.argv[1])
log = (out / "test-gpu.log").read_text(errors="replace")
summaries = re.findall(r"^=*\s*(\d+ passed.*|.*\bfailed\b.*|.*\berror\b.*) in [\d.]+s", log, re.M)
tests_ok = bool(summaries) and all("failed" not in s and "error" not in s for s in summaries)
print("tests:", summaries or "no pytest summary found", "->", "ok" if tests_ok else "FAILED")
bench_ok = False
path = out / "gpu_attention.json"
if path.exists():
    report = json.loads(path.read_text())
    bench_ok = bool(report.get("passed"))
    print("machine code (inspect_sass):")
    for kernel, check in report.get("sass", {}).items():
        print(f"  {kernel}: {check}")
    for name, entry in report.get("kernels", {}).items():
        print(f"  {name}: forward {entry['forward_s'] * 1e3:.3f} ms, "
              f"backward {entry['backward_s'] * 1e3:.3f} ms")
    torch = report.get("torch")
    print("  torch:", json.dumps(torch) if not isinstance(torch, dict) else "")
    if isinstance(torch, dict):
        for name in ("sdpa_dense_mask", "flex_attention_tf32"):
            print(f"    {name}: {torch.get(name)}")
else:
    print("no gpu_attention.json: the benchmark did not finish")
print("GPU CHECK", "PASSED" if tests_ok and bench_ok else "FAILED")
sys.exit(0 if tests_ok and bench_ok else 1)
EOF
