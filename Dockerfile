# syntax=docker/dockerfile:1
# One image for the scheduler, the workers and the CLI (console scripts mmcast-scheduler, mmcast-worker, mmcast):
#   docker build -t mmcast:0.1.0 .
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04 -t mmcast:0.1.0-cuda .
#   docker run --rm mmcast:0.1.0 mmcast make-tiny-model /tmp/tiny
# A BASE_IMAGE without python3.11 gets it from its apt sources (Ubuntu 22.04 has it in universe).
# TORCH_INDEX_URL: the pip index torch comes from (empty = PyPI, whose Linux wheels bundle CUDA; point it at the
# PyTorch CPU wheel index for a CPU-only image about 4x smaller).
ARG BASE_IMAGE=python:3.11-slim
ARG BUILDER_IMAGE=python:3.11-slim

FROM ${BUILDER_IMAGE} AS builder
WORKDIR /src
# .dockerignore keeps only the two distributions' files (pyproject.toml, client/, README.md, LICENSE and the Python
# packages): the generated protobuf code is committed under mmcast/v1, so the build needs no protoc.
# Two wheels: mmcast-client (the SDK, mmcast/v1, the mmcast command) and mmcast (the services), which requires it.
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./client .

FROM ${BASE_IMAGE} AS runtime
ARG TORCH_INDEX_URL=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN if ! command -v python3.11 >/dev/null 2>&1; then \
      apt-get update \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3.11 -m venv /opt/mmcast \
    && groupadd --system --gid 10001 mmcast \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/mmcast --create-home --shell /usr/sbin/nologin mmcast
ENV PATH=/opt/mmcast/bin:$PATH \
    VIRTUAL_ENV=/opt/mmcast
COPY --from=builder /wheels /tmp/wheels
# torch first, pinned as the server distribution pins it, so the wheels' dependency resolution keeps it. DL3013: the
# other install is this project's own two wheels, built above, in one call so that the server's mmcast-client
# requirement is the wheel beside it; their dependencies are pinned in pyproject.toml and client/pyproject.toml.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==2.13.0" \
    && pip install --no-cache-dir /tmp/wheels/mmcast_client-*.whl /tmp/wheels/mmcast-*.whl \
    && rm -rf /tmp/wheels

# glibc reads these at start-up: large protobuf buffers are then reused instead of mmap'd and page-faulted anew
# (a 16 MiB protobuf round trip: 24 ms with the defaults, 5 ms with these).
ENV MALLOC_MMAP_THRESHOLD_=4294967296 \
    MALLOC_TRIM_THRESHOLD_=4294967296 \
    MALLOC_TOP_PAD_=67108864 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/home/mmcast

USER 10001:10001
WORKDIR /home/mmcast
# scheduler gRPC, worker gRPC, scheduler metrics, worker metrics, torch.distributed rendezvous
EXPOSE 50051 50061 9400 9401 29500
# No entrypoint wrapper: the command names the role (CUDA base images set one; clear it).
ENTRYPOINT []
CMD ["mmcast-scheduler"]
