#!/usr/bin/env bash
# Start compose.yaml for real on this machine, with simulated GPUs, and check it from
# outside, as a user would:
#
#   scripts/compose-check.sh        (as root, or a user of the docker group; 5-15 minutes)
#   scripts/compose-check.sh --ha   (the same over compose.ha.yaml: Redis as a primary, two
#                                    replicas and three Sentinels; the primary is killed too)
#
# 1. A Docker engine: the running one, else dockerd started here (installed with apt when
#    missing; `--bridge=none --iptables=false`, which runs in a container sandbox), and
#    stopped at the end; and compose (Debian's docker-compose, installed when neither
#    `docker compose` nor docker-compose is there).
# 2. Images, without a registry when none answers: the base from debootstrap (Debian
#    bookworm: Python 3.11, redis-server), imported as gpufleet-base:bookworm and kept for
#    the next run; the gpufleet image built with no network from wheels prepared here
#    (`pip wheel`, which reads this machine's package index). With Docker Hub, the
#    Dockerfile's own base and redis:7.2-alpine.
# 3. The sim profile up (Redis, router, Flower, two GPU workers on simulated GPUs) as a
#    compose project of its own, on free ports, with random secrets, and three synthetic
#    models of 5 GiB on 2 x 8 GiB: they cannot all be resident, so calls evict.
# 4. A plain Celery client on this host calls every model; `gpufleet status` sees both
#    GPUs; Flower refuses a request without credentials; one GPU worker container is
#    killed and every call is still answered. With --ha the client runs in a container
#    on the project's network (the Sentinels name servers by service name), configured
#    from `gpufleet url --json`; then the Redis primary is SIGKILLed, every call is still
#    answered, `gpufleet status` names a replica as primary, and the old primary,
#    started again, rejoins as a replica.
# 5. Everything down: containers, volumes, network, the wheels; the engine if started here.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ha=""
case "${1:-}" in
  --ha) ha=1 ;;
  "") ;;
  *) printf 'usage: %s [--ha]\n' "$0" >&2; exit 2 ;;
esac
# The host's Python: builds the wheels (3.11, as the base image) and runs the client and
# `gpufleet status`; scripts/test.sh's .venv has all it needs.
PYTHON=${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
say() { printf '\n==> %s\n' "$*"; }
fail() { printf 'compose-check: %s\n' "$*" >&2; exit 1; }

# The check's own settings only: a variable of the caller's shell (GPUFLEET_REDIS_ADDR, say)
# would override its .env and could join its workers to a real fleet.
while read -r name; do unset "$name"; done < <(compgen -e | grep -E '^(GPUFLEET_|REDIS_|FLOWER_|COMPOSE_)')
[[ -e wheels ]] && fail "./wheels exists: move it away (the check builds its own wheels there)"

started=$(date +%s)
work=$(mktemp -d /tmp/gpufleet-compose-check.XXXXXX)
made_wheels=""
project="gpufleet-check-$(date +%s)"
dockerd_pid=""
compose=()

cleanup() {
  local status=$?
  if ((${#compose[@]})); then
    "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1 || true
  fi
  [[ -n "$made_wheels" ]] && rm -rf wheels
  rm -rf "$work"
  if [[ -n "$dockerd_pid" ]]; then
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
  fi
  if ((status == 0)); then
    say "compose check passed in $(($(date +%s) - started)) s"
  else
    printf '\ncompose-check FAILED (exit %d); the last service logs are above\n' "$status" >&2
  fi
}
trap cleanup EXIT

# --- 1. a Docker engine -------------------------------------------------------------------
say "a Docker engine"
if ! docker info >/dev/null 2>&1; then
  if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    command -v apt-get >/dev/null || fail "no Docker engine, and no apt-get to install one"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      docker.io debootstrap iptables >/dev/null
  fi
  dockerd --iptables=false --ip-forward=false --ip-masq=false --bridge=none \
    >"$work/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$work/dockerd.log"; fail "dockerd did not start"; }
fi
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null; then
  # A fresh Debian host: docker.io brings the engine, not compose (Debian's package of it)
  command -v apt-get >/dev/null || fail "neither 'docker compose' nor docker-compose is installed"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    docker-compose >/dev/null
fi
if docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
elif command -v docker-compose >/dev/null; then
  compose=(docker-compose)
else
  fail "neither 'docker compose' nor docker-compose is installed"
fi
compose+=(-p "$project" -f compose.yaml)
[[ -n "$ha" ]] && compose+=(-f compose.ha.yaml)
compose+=(--env-file "$work/.env" --profile sim)
services=5  # redis, router, flower, sim0, sim1
[[ -n "$ha" ]] && services=10  # and redis-replica, redis-replica2, sentinel1-3

# --- 2. images ----------------------------------------------------------------------------
say "images"
image="gpufleet:check"
build=(docker build -t "$image")
if timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1 \
  && timeout 60 docker pull -q redis:7.2-alpine >/dev/null 2>&1; then
  redis_image="redis:7.2-alpine"
else
  echo "no registry answers: a Debian bookworm base from debootstrap, wheels from this machine"
  base="gpufleet-base:bookworm"
  if ! docker image inspect "$base" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || fail "debootstrap is needed to build a base image"
    rootfs="$work/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,redis-server,ca-certificates,procps \
      bookworm "$rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1 \
      || { tail -20 "$work/debootstrap.log"; fail "debootstrap failed"; }
    tar -C "$rootfs" -c . | docker import --change 'CMD ["bash"]' - "$base" >/dev/null
  fi
  python=$PYTHON
  "$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
    || fail "the wheels must be built by Python 3.11, the base image's: set PYTHON"
  # async-timeout: redis-py needs it below Python 3.11.3 (bookworm's is 3.11.2), where
  # this machine's Python may not
  made_wheels=1
  "$python" -m pip wheel -q --wheel-dir wheels ".[flower,demo]" torch==2.13.0 \
    "setuptools>=69" "async-timeout>=4.0.3"
  rm -f wheels/gpufleet-*.whl  # the image installs gpufleet from its source
  build+=(--network none --build-arg "BASE_IMAGE=$base"
    --build-arg "PIP_ARGS=--no-index --find-links /src/wheels")
  redis_image="$base"
fi
"${build[@]}" . >"$work/build.log" 2>&1 || { tail -30 "$work/build.log"; fail "docker build failed"; }

# --- 3. the sim profile up ----------------------------------------------------------------
say "the sim profile up as project $project"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
redis_port=$(free_port) flower_port=$(free_port) metrics_port=$(free_port)
password=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
flower_password=$(python3 -c 'import secrets; print(secrets.token_hex(8))')
cat >"$work/models.yaml" <<'YAML'
models:
  a: {source: synthetic, task: forward, memory: 5GiB}
  b: {source: synthetic, task: forward, memory: 5GiB}
  c: {source: synthetic, task: forward, memory: 5GiB}
YAML
cat >"$work/.env" <<ENV
REDIS_PASSWORD=$password
FLOWER_USER=admin
FLOWER_PASSWORD=$flower_password
REDIS_PORT=$redis_port
FLOWER_PORT=$flower_port
GPUFLEET_METRICS_HOST_PORT=$metrics_port
GPUFLEET_IMAGE=$image
REDIS_IMAGE=$redis_image
GPUFLEET_MODELS_FILE=$work/models.yaml
GPUFLEET_SIM_GPUS=2x8GiB
GPUFLEET_TORCH_THREADS=1
REDIS_HA_NET=172.30.$((RANDOM % 150 + 100))
ENV
chmod 600 "$work/.env"
"${compose[@]}" up -d --no-build
for _ in $(seq 90); do
  healthy=$(docker ps --filter "label=com.docker.compose.project=$project" \
    --filter health=healthy --format '{{.Names}}' | wc -l)
  ((healthy >= services)) && break
  sleep 2
done
docker ps --filter "label=com.docker.compose.project=$project" --format '{{.Names}}: {{.Status}}'
((healthy >= services)) || { "${compose[@]}" logs --tail 30; fail "the $services services are not all healthy"; }

# --- 4. from outside ----------------------------------------------------------------------
say "calls from a plain Celery client on this host, status, Flower, a killed GPU worker"
export GPUFLEET_CHECK_URL="redis://:$password@127.0.0.1:$redis_port/0"
export GPUFLEET_CHECK_FLOWER="http://127.0.0.1:$flower_port/tasks"
if [[ -n "$ha" ]]; then
  # On the project's network, with what `gpufleet url --json` prints for a plain client
  conf=$("${compose[@]}" exec -T router gpufleet url --json)
  client=(docker run --rm --network "${project}_default" -e "GPUFLEET_CHECK_CONF=$conf"
    -v "$PWD/scripts/compose_client.py:/check/compose_client.py:ro" "$image" python)
  status() { "${compose[@]}" exec -T router gpufleet status --json >"$work/status.json"; }
  script=/check/compose_client.py
else
  client=("$PYTHON")
  status() {
    GPUFLEET_REDIS_URL="$GPUFLEET_CHECK_URL" GPUFLEET_FLEET=default "$PYTHON" -m tasks.operator.cli \
      status --json >"$work/status.json"
  }
  script=scripts/compose_client.py
fi
calls() { "${client[@]}" "$script" calls || { "${compose[@]}" logs --tail 40; fail "calls $1"; }; }
calls ""
status
"$PYTHON" scripts/compose_client.py status "$work/status.json"
"$PYTHON" scripts/compose_client.py flower
"${compose[@]}" kill sim0
calls "after the kill"
if [[ -n "$ha" ]]; then
  say "the Redis primary SIGKILLed"
  "${compose[@]}" kill -s SIGKILL redis
  calls "after the primary's kill"
  status
  net=$(sed -n 's/^REDIS_HA_NET=//p' "$work/.env")  # the servers are .10, .11 and .12
  "$PYTHON" scripts/compose_client.py primary "$work/status.json" "$net.11:6379,$net.12:6379"
  "${compose[@]}" start redis
  rejoined() {  # the old primary follows the new one, its link up (in its own words)
    local info
    info=$("${compose[@]}" exec -T redis redis-cli info replication 2>/dev/null | tr -d '\r') \
      || return 1
    grep -qx "role:slave" <<<"$info" && grep -qx "master_link_status:up" <<<"$info"
  }
  for _ in $(seq 30); do rejoined && break; sleep 2; done
  rejoined || fail "the old primary did not rejoin as a replica"
  echo "the old primary is a replica again, its link up"
  calls "after the old primary rejoined"
fi
