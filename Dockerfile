# The pdserve image: router, prefill and decode all run from it (see compose.yaml).
#   docker build -t pdserve .                                  # CUDA torch from PyPI (GPU hosts)
#   docker build -t pdserve:cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
# The PyPI torch wheels bring their own CUDA runtime, so a slim Python base is enough; the
# host needs the NVIDIA driver and the NVIDIA container toolkit.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://pypi.org/simple"
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PDSERVE_CACHE=/home/pdserve/.cache/pdserve

# torch first (the largest layer, rarely changes), then pdserve's dependencies from
# pyproject.toml, the gpu extra included (a layer kept while only the code changes), then pdserve
RUN pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
WORKDIR /opt/pdserve
COPY pyproject.toml README.md ./
RUN python -c "import subprocess, sys, tomllib; \
project = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
deps = project['dependencies'] + project['optional-dependencies']['gpu']; \
subprocess.check_call([sys.executable, '-m', 'pip', 'install', *deps])"
COPY . .
RUN pip install --no-deps . && useradd --create-home --uid 1000 pdserve

USER pdserve
WORKDIR /home/pdserve
EXPOSE 8000 50051
CMD ["pdserve", "--help"]
