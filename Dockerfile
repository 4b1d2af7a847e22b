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

# --- the dependencies, in a stage of their own -------------------------------------------
# torch and its CUDA libraries are several GB: a change to gpufleet's code should not
# install them again, and wheels copied in for an offline build must not stay in the
# image. Empty packages stand in for the code so that pip can resolve `.[flower,demo]`
# from pyproject.toml; `wheel[s]` copies ./wheels when there is one (README.md keeps the
# copy from being empty).
FROM ${BASE_IMAGE} AS deps
ARG PIP_ARGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# gpufleet lives in a virtual environment of its own: a distribution's Python refuses
# `pip install` into the system (PEP 668), and this works the same on any base.
RUN python3 -m venv /opt/gpufleet
WORKDIR /src
COPY pyproject.toml README.md ./
COPY README.md wheel[s] ./wheels/
RUN mkdir placement worker tasks \
    && touch placement/__init__.py worker/__init__.py tasks/__init__.py \
    && /opt/gpufleet/bin/pip install $PIP_ARGS ".[flower,demo]" "setuptools>=69" \
    && /opt/gpufleet/bin/pip uninstall -y gpufleet

# --- the image ---------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/gpufleet \
    PATH=/opt/gpufleet/bin:$PATH
COPY --from=deps /opt/gpufleet /opt/gpufleet

# Then gpufleet itself (the Lua scripts travel as package data), built with the
# environment's own setuptools: no index needed.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY placement ./placement
COPY worker ./worker
COPY tasks ./tasks
RUN pip install --no-deps --no-build-isolation --no-index . \
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
