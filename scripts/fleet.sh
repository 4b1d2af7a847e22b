#!/usr/bin/env bash
# The fleet command of gpufleet: install it, then run a whole fleet on this machine.
#
#   scripts/fleet.sh [gpufleet up options...]     e.g. scripts/fleet.sh --flower
#
# Embedded defaults: a bundled redis-server on 127.0.0.1 (unless GPUFLEET_REDIS_URL is
# set), one worker per GPU, or two simulated 8 GiB GPUs when there is none. It makes two
# demo calls to MiniLM (the first loads it, the second takes the fast path), then serves
# until Ctrl-C, which stops every process it started.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

[[ -x .venv/bin/python ]] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

if ! command -v nvidia-smi >/dev/null 2>&1; then
  # No GPU here: take the CPU build of PyTorch first, so the project's `torch` dependency
  # is already met and pip does not pull a multi-GB CUDA build. GPU hosts skip this.
  python -m pip install -q torch==2.13.0
fi
python -m pip install -q -e '.[demo,flower]'

exec gpufleet up --demo "$@"
