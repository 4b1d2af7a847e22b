# The gpufleet image: one image for the router, the GPU workers and Flower (compose.yaml
# gives each its command). On x86_64, PyPI's default torch wheel is the CUDA build, which
# is what GPU hosts need; the NVIDIA driver comes from the host through the NVIDIA
# Container Toolkit. See docs/deploy.md.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src

# Dependencies first, in a layer of their own: torch and its CUDA libraries are several
# GB, and a change to gpufleet's code should not download them again. Empty packages
# stand in for the code so that pip can resolve `.[flower,demo]` from pyproject.toml.
COPY pyproject.toml README.md ./
RUN mkdir placement worker tasks \
    && touch placement/__init__.py worker/__init__.py tasks/__init__.py \
    && pip install ".[flower,demo]" \
    && pip uninstall -y gpufleet \
    && rm -rf placement worker tasks build ./*.egg-info

# Then gpufleet itself (the Lua scripts travel as package data).
COPY placement ./placement
COPY worker ./worker
COPY tasks ./tasks
RUN pip install --no-deps . \
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
