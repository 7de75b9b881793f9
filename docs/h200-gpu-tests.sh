#!/usr/bin/env bash
# The `gpu` tests on the H200 device machine (no network: what it lacks comes as the carried
# wheel folders .whl-serve, .whl and .redis, see docs/h200-wheels.sh). Arguments go to pytest:
#   bash docs/h200-gpu-tests.sh tests/test_ops_gpu.py tests/test_layer_ops_gpu.py
# A device call runs at most 10 minutes: split the suite over calls by file.
set -uo pipefail
W=${WHEELS:-.}
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $W/.whl-serve/*.whl $W/.whl/fla_core*.whl >/tmp/pip-gpu-tests.log 2>&1 || { tail /tmp/pip-gpu-tests.log; exit 1; }
mkdir -p /tmp/rx && for f in $W/.redis/*.deb; do dpkg -x "$f" /tmp/rx; done
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:/tmp/rx/usr/bin:$PATH
export LD_LIBRARY_PATH=/tmp/rx/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -m pytest -m gpu -q -p no:cacheprovider --durations=25 "$@"
