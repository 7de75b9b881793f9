#!/usr/bin/env bash
# The `gpu` tests on the H200 device machine (no network: what it lacks comes as the carried
# wheel folders .whl-serve, .whl and .redis, see docs/h200-wheels.sh). Arguments go to pytest:
#   bash docs/h200-gpu-tests.sh tests/test_ops_gpu.py tests/test_layer_ops_gpu.py   (or tests/: every file with gpu tests)
# A device call runs at most 10 minutes. The cost is Triton compiling every kernel on a fresh
# machine, so files run in parallel processes (GPU_TEST_WORKERS, default 8; 1 = one process):
# each compiles its own kernels at once and all share Triton's on-disk cache.
set -uo pipefail
source "$(dirname "$0")/h200-triton-cache.sh" && tcache_restore
W=${WHEELS:-.}
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $W/.whl-serve/*.whl $W/.whl/fla_core*.whl >/tmp/pip-gpu-tests.log 2>&1 || { tail /tmp/pip-gpu-tests.log; exit 1; }
mkdir -p /tmp/rx && for f in $W/.redis/*.deb; do dpkg -x "$f" /tmp/rx; done
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:/tmp/rx/usr/bin:$PATH
export LD_LIBRARY_PATH=/tmp/rx/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
N=${GPU_TEST_WORKERS:-8}
PAR=() && [ "$N" -gt 1 ] && python3 -c "import xdist" 2>/dev/null && PAR=(-n "$N" --dist loadfile)
# a folder stands for its files that hold `gpu` tests: the others import what this machine lacks
# (schemathesis, psutil, nixl, ...) and would fail to collect, though -m gpu deselects their tests
FILES=()
for arg in "$@"; do
    if [ -d "$arg" ]; then FILES+=($(grep -l "mark.gpu" "$arg"/test_*.py)); else FILES+=("$arg"); fi
done
timeout "${GPU_TEST_SECONDS:-520}" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=25 "${PAR[@]}" "${FILES[@]}"
status=$?
[ -n "${OUT:-}" ] && tcache_save "$OUT"
exit $status
