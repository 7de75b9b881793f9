# pdserve images, two targets (docs/deploy.md says why this base):
#   docker build -t pdserve:latest .                         # `engine` (the default, last): GPU services
#   docker build -t pdserve-router:latest --target router .  # the router alone: no torch, no CUDA
#   docker build -t pdserve:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
#
# Base: python:3.11-slim plus gcc and libc headers. Triton compiles a small launcher with the C
# compiler at its first kernel launch (Python.h comes with the python image) and links the
# driver's libcuda.so.1, which the NVIDIA container toolkit mounts; the CUDA runtime libraries
# come from the torch wheel's nvidia-* packages, UCX from the nixl wheel. So no CUDA base image:
# the host needs the NVIDIA driver and the NVIDIA container toolkit, nothing else.
# Both targets run as the non-root user pdserve (uid PDSERVE_UID, 1000 by default): a mounted
# model must be readable by it (world-readable files, or build with your uid);
# `python -m pdserve.model_check DIR` says which file it cannot read.

FROM python:3.11-slim-bookworm AS base
ARG PDSERVE_UID=1000
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PDSERVE_CACHE=/home/pdserve/.cache/pdserve
RUN useradd --create-home --uid "$PDSERVE_UID" pdserve
WORKDIR /opt/pdserve

# ---- the router: its own short dependency list, pdserve without dependencies, torch absent
FROM base AS router
COPY deploy/router-requirements.txt /tmp/router-requirements.txt
RUN pip install -r /tmp/router-requirements.txt
COPY pyproject.toml README.md ./
COPY pdserve pdserve
COPY router router
COPY prefill_svc prefill_svc
COPY decode_svc decode_svc
COPY kvtransfer kvtransfer
# the build fails here if the router (or the healthchecks) still need torch
RUN pip install --no-deps . \
    && python -c "import router.server, pdserve.rpc, pdserve.model_check, sys; assert 'torch' not in sys.modules"
USER pdserve
WORKDIR /home/pdserve
EXPOSE 8000
CMD ["pdserve", "router", "--help"]

# ---- prefill, decode and engine (and everything else: the router runs from it too)
FROM base AS engine
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://pypi.org/simple"
# a C compiler for Triton's launcher (and fla's Triton kernels); nothing else from apt
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ENV CC=gcc \
    TRITON_CACHE_DIR=/home/pdserve/.cache/triton
# torch first (the largest layer, rarely changes), then pdserve's dependencies from
# pyproject.toml with the gpu extra (kept while only the code changes), then pdserve
RUN pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
COPY pyproject.toml README.md ./
RUN python -c "import subprocess, sys, tomllib; \
project = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
deps = project['dependencies'] + project['optional-dependencies']['gpu']; \
subprocess.check_call([sys.executable, '-m', 'pip', 'install', *deps])"
COPY . .
RUN pip install --no-deps . \
    && python -c "import pdserve.rpc, sys; assert 'torch' not in sys.modules" \
    && cc --version >/dev/null
USER pdserve
WORKDIR /home/pdserve
EXPOSE 8000 50051 50052
CMD ["pdserve", "--help"]
