#!/usr/bin/env bash
# The compose stack run for real (CI runs it after the tests): a Docker engine (started, and
# docker.io installed, where none answers), the images built locally where no registry serves
# them (a Debian 12 base with Python 3.11 and one with Redis, by mmdebstrap; kvserve's from
# ops/Dockerfile, offline, from a wheelhouse of this checkout's environment and the model file),
# then for each topology (aggregated, aggregated with 3 workers, disagg): `up`, the end-to-end
# suite (tests/services/test_compose_e2e.py) against the published gateway, `down -v`.
# Everything it started is stopped (the engine by PID); the images stay for the next run.
# A machine where no Docker engine can start gets one warning line, and this part is skipped;
# once an engine runs, any failure fails. Figures (time to the first answer per topology, image
# size, this script's time) go to $KVSERVE_COMPOSE_REPORT (default: build/compose-report.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
warn() { echo "test-compose: warning: $*" >&2; }
log() { echo "test-compose: $*" >&2; }
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
apt_install() {
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" \
    >/dev/null 2>&1 || { $SUDO apt-get update -qq >/dev/null 2>&1 \
    && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" \
    >/dev/null 2>&1; }
}

# ---- a Docker engine ------------------------------------------------------------------------
dockerd_pid=""
if ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null 2>&1 || apt_install docker.io || true
  if ! command -v dockerd >/dev/null 2>&1; then
    warn "no Docker engine (dockerd missing, docker.io not installable): compose stack NOT tested"
    exit 0
  fi
  $SUDO dockerd >/tmp/kvserve-dockerd.log 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  if ! docker info >/dev/null 2>&1; then
    kill "$dockerd_pid" 2>/dev/null || true
    warn "the Docker engine did not start (/tmp/kvserve-dockerd.log): compose stack NOT tested"
    exit 0
  fi
fi
if docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
else
  command -v docker-compose >/dev/null 2>&1 || apt_install docker-compose
  compose=(docker-compose)
fi

project="kvserve-ci-$$"
report=${KVSERVE_COMPOSE_REPORT:-build/compose-report.jsonl}
mkdir -p "$(dirname "$report")"
: >"$report"
cleanup() {
  "${compose[@]}" -p "$project" -f compose.yaml -f ops/compose.ci.yaml down -v --remove-orphans \
    >/dev/null 2>&1 || true
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null || true
    wait "$dockerd_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

# ---- images ---------------------------------------------------------------------------------
# The bases: Debian 12's own packages, as no registry answers here (a machine that can pull
# python:3.11-slim and redis:7 builds the same stack from those: KVSERVE_BASE_IMAGE unset).
debian_image() {  # name, packages...
  local name=$1
  shift
  docker image inspect "$name" >/dev/null 2>&1 && return 0
  command -v mmdebstrap >/dev/null 2>&1 || apt_install mmdebstrap
  log "building $name from Debian's packages ($*)"
  local tar
  tar=$(mktemp --suffix=.tar)
  # Without documentation, manual pages and translations (the licences stay).
  mmdebstrap --quiet --variant=minbase --include="$(IFS=,; echo "$*")" \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    bookworm "$tar"
  docker import -c 'ENV LANG=C.UTF-8' "$tar" "$name" >/dev/null
  rm -f "$tar"
}
debian_image kvserve-base:bookworm python3.11 python3.11-venv python3.11-dev python3-pip g++ \
  ca-certificates passwd
debian_image kvserve-redis:bookworm redis-server

# The wheelhouse: this checkout's environment as wheels (torch from the local CPU build), the
# extra CA certificates of this host, the model file (ops/offline/README.md).
mkdir -p ops/offline/wheels ops/offline/models ops/offline/certs
# torch exactly as installed here (2.13.0+cpu): never a CUDA build of the same version.
torch_version=$(.venv/bin/python -c 'import torch; print(torch.__version__)')
.venv/bin/python -m pip wheel -q -w ops/offline/wheels . "torch==$torch_version" setuptools wheel \
  "async-timeout>=4.0.3" 2>&1 | grep -v "is ignored" >&2 || true  # the base's 3.11.2 needs it
rm -f ops/offline/wheels/kvserve-*.whl  # the image installs this checkout's sources
model=$(.venv/bin/python -c 'from kvserve.shared.config import default_model_path as p; print(p())')
cp -u "$model" ops/offline/models/
find ops/offline/certs -name '*.crt' -delete
for crt in /usr/local/share/ca-certificates/*.crt; do
  [ -e "$crt" ] && cp "$crt" ops/offline/certs/
done

export KVSERVE_BASE_IMAGE=kvserve-base:bookworm KVSERVE_REDIS_IMAGE=kvserve-redis:bookworm \
  KVSERVE_OFFLINE=1
free_port() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
export KVSERVE_PORT KVSERVE_STORE_PORT KVSERVE_OTLP_HTTP_PORT
KVSERVE_PORT=$(free_port) KVSERVE_STORE_PORT=$(free_port) KVSERVE_OTLP_HTTP_PORT=$(free_port)
dc() { "${compose[@]}" -p "$project" -f compose.yaml -f ops/compose.ci.yaml "$@"; }

t0=$(date +%s)
dc build -q gateway
# The classic builder keeps each build stage as an image: all but the newest (the next build's
# cache) go.
docker images -q --filter label=kvserve.stage=build | tail -n +2 | xargs -r docker rmi -f \
  >/dev/null 2>&1 || true
size=$(docker image inspect -f '{{.Size}}' kvserve:latest)
echo "{\"image\": \"kvserve:latest\", \"bytes\": $size, \"build_s\": $(($(date +%s) - t0))}" \
  >>"$report"
log "kvserve:latest: $((size / 1000000)) MB, built in $(($(date +%s) - t0)) s"

# ---- each topology --------------------------------------------------------------------------
run_topology() {  # profile, worker services (comma list), extra `up` arguments...
  local profile=$1 workers=$2
  shift 2
  log "up: $profile $*"
  export COMPOSE_PROFILES=$profile
  local up_at
  up_at=$(date +%s.%N)
  # Jaeger is left out (no image for it here): the services are named.
  dc up -d --no-build "$@" gateway otel-collector ${workers//,/ }
  KVSERVE_COMPOSE_URL="http://127.0.0.1:$KVSERVE_PORT" KVSERVE_COMPOSE_PROJECT=$project \
    KVSERVE_COMPOSE_SINK="http://127.0.0.1:$KVSERVE_OTLP_HTTP_PORT" \
    KVSERVE_COMPOSE_WORKERS=$workers KVSERVE_COMPOSE_REPORT=$report \
    KVSERVE_COMPOSE_UP_AT=$up_at \
    .venv/bin/python -m pytest -q -p no:cacheprovider -m compose tests/services/test_compose_e2e.py \
    || { dc logs --tail 40 >&2; return 1; }
  dc down -v --remove-orphans >/dev/null 2>&1
}
run_topology aggregated worker
run_topology aggregated worker --scale worker=3
run_topology disagg prefill,decode
echo "{\"test_compose_s\": $(($(date +%s) - started))}" >>"$report"
log "done in $(($(date +%s) - started)) s; figures in $report"
