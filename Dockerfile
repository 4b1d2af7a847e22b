# The gpufleet image: one image for the router, the GPU workers and Flower (compose.yaml
# gives each its command). On x86_64, PyPI's default torch wheel is the CUDA build, which
# is what GPU hosts need; the NVIDIA driver comes from the host through the NVIDIA
# Container Toolkit. See docs/deploy.md.
#
# Build arguments, for hosts without Docker Hub or PyPI (scripts/compose-check.sh uses
# both): BASE_IMAGE, any image with Python 3.10+ and its venv module (a local mirror, or
# a Debian bookworm made with debootstrap and `docker import`); PIP_ARGS, extra pip
# arguments, e.g. `--no-index --find-links /src/wheels` with the wheels in ./wheels.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG PIP_ARGS=""

# gpufleet lives in a virtual environment of its own: a distribution's Python refuses
# `pip install` into the system (PEP 668), and this works the same on any base.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/gpufleet \
    PATH=/opt/gpufleet/bin:$PATH
RUN python3 -m venv /opt/gpufleet

WORKDIR /src

# Dependencies first, in a layer of their own: torch and its CUDA libraries are several
# GB, and a change to gpufleet's code should not download them again. Empty packages
# stand in for the code so that pip can resolve `.[flower,demo]` from pyproject.toml.
# `wheel[s]` copies ./wheels when there is one (README.md keeps the copy from being empty).
COPY pyproject.toml README.md ./
COPY README.md wheel[s] ./wheels/
RUN mkdir placement worker tasks \
    && touch placement/__init__.py worker/__init__.py tasks/__init__.py \
    && pip install $PIP_ARGS ".[flower,demo]" \
    && pip uninstall -y gpufleet \
    && rm -rf placement worker tasks build ./*.egg-info

# Then gpufleet itself (the Lua scripts travel as package data).
COPY placement ./placement
COPY worker ./worker
COPY tasks ./tasks
RUN pip install $PIP_ARGS --no-deps . \
    && cd / && rm -rf /src

# An unprivileged user; /cache/huggingface is where transformers keeps downloaded weights
# (compose mounts a volume there, which takes this directory's owner).
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin gpufleet \
    && mkdir -p /cache/huggingface \
    && chown -R gpufleet:gpufleet /cache

WORKDIR /app
COPY models.yaml ./models.yaml

ENV GPUFLEET_MODELS=/app/models.yaml \
    HF_HOME=/cache/huggingface

USER gpufleet
EXPOSE 5555

# compose.yaml sets the real command of each service.
CMD ["gpufleet", "--help"]
