#!/usr/bin/env bash
# Bring the compose stack up on a private Docker engine, replay real Claude Code sessions against
# the published router port, recreate the nats container (its JetStream stream must outlive it), take it
# down and check that nothing is left running.
#
# Needs root, Debian's docker.io + docker-compose (+ debootstrap for the base image) and the
# project's venv (evolving-infra on PATH or $EI). No registry is needed: the image is built from a
# debootstrapped Debian bookworm with python3 (cached as a tar in $EI_CACHE, default
# ~/.cache/evolving-infra) and a wheelhouse built here (deploy/docker/wheelhouse.sh).
#   deploy/docker/compose-smoke.sh            # WORKERS=2 SPLIT=1P1D, 3 sessions
#   PY=/other/.venv/bin/python EI=/other/.venv/bin/evolving-infra PYTHONPATH=$PWD deploy/docker/compose-smoke.sh
# The image holds this checkout's wheel, but replay ($EI) runs the code that its venv imports: a venv installed
# editable (pip install -e) from another checkout runs that checkout's replay unless PYTHONPATH points at this
# one, as in the second line (the run says so when the two differ).
#
# Runs at once do not meet (two checkouts, or CI lanes, may run it together): each has its own dockerd
# (socket, exec root, pid file in a mktemp folder), router port (a free one unless ROUTER_PORT) and output
# folder. The engine's data root is $EI_CACHE/docker-data while no other run holds it (a lock, held by this
# run's dockerd until it exits), so that a later run reuses the image layers; a run that finds it held
# takes its own data root in the mktemp folder, built from scratch and removed at exit. EI_DOCKER_DATA=DIR
# names the shared one (default $EI_CACHE/docker-data); the base image's tar is written once, by rename.
# A run killed outright (SIGKILL: no cleanup) leaves its dockerd holding the lock: a later run that finds the
# run named in $EI_DOCKER_DATA.owner gone, and that run's own dockerd still holding the lock, stops that engine
# (compose down, TERM, KILL after 30 s) and takes the shared root; killed with its process group (kill -9
# -PGID), the run leaves its containerd shims (their own session) holding it, with their containers: a later
# run kills those whose argv names that run's folder, and their containers' first processes, and takes it.
# Any other holder (a live run's) leaves the shared root to it, as before. The cleanup stops this run's dockerd whether or
# not its socket appeared (EI_SMOKE_DOCKERD_WAIT_S, default 20, is how long the run waits for it). The build
# context's deploy/docker/wheelhouse is per checkout (each run writes the checkout's wheel there and the
# Dockerfile copies it): runs from one checkout take turns on it (a lock on the folder, from the wheel to the
# end of docker build); the rest of such runs goes on at once.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
EI=${EI:-$REPO/.venv/bin/evolving-infra}
PY=${PY:-$REPO/.venv/bin/python}
CACHE=${EI_CACHE:-$HOME/.cache/evolving-infra}
SESSIONS=${SESSIONS:-3}
export WORKERS=${WORKERS:-2} SPLIT=${SPLIT:-1P1D} EI_SPEEDUP=${EI_SPEEDUP:-20}
# compose tags the image REPO:TARGET (docker-compose.yml); EI_TARGET set, so that a caller's EI_TARGET=torch is not it
export EI_IMAGE_REPO=evolving-infra-smoke EI_TARGET=sim BASE_IMAGE=ei-base:bookworm-python3
export ROUTER_PORT=${ROUTER_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
DOCKER=${EI_SMOKE_DOCKER:-/usr/bin/docker}  # Debian's client (a newer client elsewhere on PATH talks to it too)
COMPOSE="docker-compose -p eismoke"
log() { echo "[compose-smoke $(date +%H:%M:%S)] $*"; }
if [ -n "${EI_IMAGE:-}" ]; then  # renamed EI_IMAGE_REPO; compose passes it on, and the auth job refuses a stack that has it
    log "EI_IMAGE=$EI_IMAGE is no longer read (renamed EI_IMAGE_REPO, the repository without a tag; the tag is EI_TARGET);" \
        "this smoke builds and runs its own image $EI_IMAGE_REPO:$EI_TARGET and unsets EI_IMAGE"
    unset EI_IMAGE
fi
if [ "${EI_ENGINE:-sim}" != sim ]; then  # compose passes it on: the auth job would refuse it on the sim image, after the build
    log "EI_ENGINE=$EI_ENGINE: this smoke builds and runs the sim image ($EI_IMAGE_REPO:$EI_TARGET), which serves EI_ENGINE=sim only"
    exit 2
fi
# the package $EI (the venv's console script) imports: another checkout's when the venv is installed editable
# from there and PYTHONPATH does not put this one first; asked from / (python -c puts its working folder, here
# this checkout, first on sys.path, a console script does not)
code=$(cd / && "$PY" -c 'import evolving_infra, os; print(os.path.dirname(os.path.dirname(os.path.realpath(evolving_infra.__file__))))' 2>/dev/null || true)
if [ -n "$code" ] && [ "$code" != "$(realpath "$REPO")" ]; then
    log "replay runs the code in $code (what $PY imports), not this checkout's ($REPO): PYTHONPATH=$REPO runs this one's"
fi
D=$(mktemp -d /tmp/ei-docker.XXXXXX)
export DOCKER_HOST=unix://$D/docker.sock
DOCKERD=""

running() {  # running PID: the process exists and is not a zombie (an exited child not yet waited for)
    local state
    state=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) && [ -n "$state" ] && [ "$state" != Z ]
}
stop_dockerd() {  # stop_dockerd PID: TERM (it stops its containers and containerd), 30 s, then KILL
    kill "$1" 2>/dev/null
    for _ in $(seq 150); do running "$1" || return 0; sleep 0.2; done
    kill -9 "$1" 2>/dev/null
}
cleanup() {
    set +e
    [ -S "$D/docker.sock" ] && $COMPOSE down -v --remove-orphans >/dev/null 2>&1
    # the engine whether or not its socket appeared: one that never made it (the 20 s wait below) kept running,
    # and on the shared data root it held the lock for good; gone before its data root is
    if [ -n "$DOCKERD" ]; then stop_dockerd "$DOCKERD"; wait "$DOCKERD" 2>/dev/null; fi
    rm -rf "$D" 2>/dev/null
}
trap cleanup EXIT

lock_holders() {  # lock_holders FILE: the pids that have FILE open (this script has it closed meanwhile)
    find /proc/[0-9]*/fd -maxdepth 1 -lname "$1" 2>/dev/null | cut -d/ -f3 | sort -u
}
cmdline() { tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline"; }
reclaim_stale_lock() {  # the shared data root's lock held by the engine of a run that is gone: stop that engine
    local pid dir dpid lock holders p kids
    read -r pid dir <"$DATA.owner" 2>/dev/null || return 1  # written by the run that took the lock
    [ -n "$pid" ] && [ -d "$dir" ] || return 1
    # (no `| grep -q` here: under pipefail its early exit may SIGPIPE the writer and fail a match)
    if running "$pid" && [[ $(cmdline "$pid") == *compose-smoke* ]]; then return 1; fi  # that run is alive
    lock=$(readlink -f "$DATA.lock")
    exec 9>&-  # not this script's among the lock's holders (nor its subshells'): opened again to take it
    dpid=$(cat "$dir/dockerd.pid" 2>/dev/null || true)
    # that run's own engine (its argv names this data root and that run's folder), still holding the lock
    if [ -n "$dpid" ] && running "$dpid" && [[ $(cmdline "$dpid") == *"--data-root $DATA --exec-root $dir/exec "* ]] \
            && [[ " $(lock_holders "$lock" | tr "\n" " ")" == *" $dpid "* ]]; then
        log "$DATA is held by the engine (pid $dpid) of a run that is gone (pid $pid, $dir): stopping it"
        [ -S "$dir/docker.sock" ] && DOCKER_HOST=unix://$dir/docker.sock timeout 120 $COMPOSE down -v --remove-orphans >/dev/null 2>&1
        stop_dockerd "$dpid"
        sleep 1  # its containerd and shims end after it
    fi
    # what is left holding it: a dockerd killed outright (with its process group: kill -9 -PGID, a cancelled job)
    # leaves its containerd shims (argv: -address DIR/exec/containerd/...) and their containers running; each
    # shim's children are its containers' first processes (killing one ends its container's pid namespace)
    holders=$(lock_holders "$lock")
    for p in $holders; do
        running "$p" || continue  # ended since
        [[ $(cmdline "$p") == *"$dir/"* ]] || { log "$DATA is held by pid $p ($(cmdline "$p" | cut -c1-100)), not of that run"; return 1; }
    done
    if [ -n "$holders" ]; then
        log "$DATA is held by what is left of the engine of a run that is gone (pid $pid, $dir): killing pids" \
            $holders "and their containers"
        for p in $holders; do
            kids=$(cat /proc/"$p"/task/*/children 2>/dev/null || true)
            # shellcheck disable=SC2086
            kill -9 $kids "$p" 2>/dev/null
        done
    fi
    exec 9>>"$DATA.lock"
    flock -w 30 9 || return 1
    # that run's engine's mounts (network namespaces) under its folder, then the folder
    awk -v d="$dir/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done
    rm -rf "$dir"
}

# image layers persist between runs in the shared data root (a rebuild is then cached); one dockerd at a time
# may use a data root (two corrupt it), so the lock says which run has it: fd 9 is inherited by dockerd, which
# holds it until it exits, whatever ends this script (the script closes its own fd 9 once dockerd has it, so
# that no other command of a killed run holds it). A run killed outright (SIGKILL: no cleanup) leaves its dockerd
# (or, killed with its process group, its containerd shims) holding it: a later run finds that run gone
# ($DATA.owner: its pid and folder) and stops what is left of its engine.
DATA=${EI_DOCKER_DATA:-$CACHE/docker-data}
mkdir -p "$DATA"
exec 9>>"$DATA.lock"
if flock -n 9 || reclaim_stale_lock; then
    echo "$$ $D" >"$DATA.owner"
else
    log "$DATA is in use by another run: a data root of this run's own ($D/data, removed at exit; no cached layers)"
    exec 9>&-
    DATA=$D/data
    mkdir -p "$DATA"
fi
log "dockerd (data root $DATA)"
dockerd --data-root "$DATA" --exec-root "$D/exec" -H "unix://$D/docker.sock" --pidfile "$D/docker.pid" \
    --bridge=none >"$D/dockerd.log" 2>&1 &
DOCKERD=$!
echo "$DOCKERD" >"$D/dockerd.pid"
exec 9>&-
wait_s=${EI_SMOKE_DOCKERD_WAIT_S:-20}
for _ in $(seq $((wait_s * 5))); do $DOCKER version >/dev/null 2>&1 && break; sleep 0.2; done
$DOCKER version >/dev/null 2>&1 || { log "no engine socket within $wait_s s"; tail -20 "$D/dockerd.log"; exit 1; }

mkdir -p "$CACHE"
BASE_TAR=$CACHE/debian-bookworm-python3.tar
if [ ! -s "$BASE_TAR" ]; then
    log "debootstrap bookworm + python3 (cached in $BASE_TAR)"
    root=$(mktemp -d /tmp/ei-rootfs.XXXXXX)
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" http://deb.debian.org/debian >"$D/debootstrap.log" 2>&1 \
        || { tail -20 "$D/debootstrap.log"; exit 1; }
    tmp=$(mktemp "$BASE_TAR.XXXXXX")  # another run may write it at the same time: each its own file, one rename
    tar -C "$root" -c . >"$tmp" && mv "$tmp" "$BASE_TAR" || { rm -f "$tmp"; exit 1; }
    rm -rf "$root"
fi
# imported once per tar: every `docker import` makes a new image id (its creation time), which made every build
# below miss docker's layer cache and left the previous image untagged; the label ties the image to its tar
tar_key=$(stat -c %s-%Y "$BASE_TAR")
if [ "$($DOCKER image inspect -f '{{index .Config.Labels "ei.base-tar"}}' "$BASE_IMAGE" 2>/dev/null)" != "$tar_key" ]; then
    $DOCKER import --change "LABEL ei.base-tar=$tar_key" "$BASE_TAR" "$BASE_IMAGE" >/dev/null
fi

own_wheel() {
    rm -f deploy/docker/wheelhouse/evolving_infra-*.whl
    SOURCE_DATE_EPOCH=315532800 "$PY" -m pip wheel --quiet --no-deps --wheel-dir deploy/docker/wheelhouse . 2>&1 | grep -v "^WARNING: Location" || true
}
# the build context's deploy/docker/wheelhouse is this checkout's, whichever run builds from it: one run at a time
# writes it and builds the image from it (two at once removed and rewrote each other's wheel under the other's
# docker build); a lock on the folder itself (fd 8), held until the build has read it
exec 8<deploy/docker/wheelhouse
if ! flock -n 8; then
    log "another run from this checkout is building its image from deploy/docker/wheelhouse: waiting for it"
    flock -w 1200 8 || { log "deploy/docker/wheelhouse still in use after 20 min"; exit 1; }
fi
log "wheel of this checkout (fixed timestamps: unchanged sources give the same bytes, so docker reuses its layers)"
own_wheel
# the dependencies' wheels, fetched when the image's offline install (the Dockerfile's pip command) would miss one:
# none yet, or a dependency this checkout added (bcrypt): before, any numpy wheel counted as a full wheelhouse
if ! "$PY" -m pip install --dry-run --quiet --no-index --find-links deploy/docker/wheelhouse --ignore-installed evolving-infra \
        >/dev/null 2>&1; then
    log "wheelhouse (dependencies)"
    PYTHON=$PY deploy/docker/wheelhouse.sh
    own_wheel  # wheelhouse.sh built this checkout's wheel with the build's timestamps
fi
log "docker build (base $BASE_IMAGE, offline from the wheelhouse)"
# tagged $EI_IMAGE_REPO:sim and $EI_IMAGE_REPO:<version>-sim, as build.sh tags every image
DOCKER=$DOCKER deploy/docker/build.sh "$EI_TARGET" -q --network none >/dev/null
exec 8<&-  # the build has read the wheelhouse: another run from this checkout may write it
# the image this tag named before (another checkout's wheel) is now untagged: ~780 MB each in $DATA, which held
# 12 of them (5.9 GB) after a day of runs; layers the new image shares (the base, the venv) stay
$DOCKER image rmi evolving-infra:smoke >/dev/null 2>&1 || true  # this script's tag before REPO:TARGET (~780 MB kept)
$DOCKER image prune -f >/dev/null

log "up: WORKERS=$WORKERS SPLIT=$SPLIT, router on 127.0.0.1:$ROUTER_PORT"
$COMPOSE up -d --scale worker="$WORKERS" --no-build || { $COMPOSE ps; $COMPOSE logs --tail 30; exit 1; }
ok=""
for _ in $(seq 180); do
    if curl -fsS "http://127.0.0.1:$ROUTER_PORT/healthz" >/dev/null 2>&1; then ok=1; break; fi
    sleep 1
done
if [ -z "$ok" ]; then $COMPOSE ps; $COMPOSE logs --tail 30; exit 1; fi
$COMPOSE ps
for m in GET POST; do  # vLLM's /ping, the SageMaker-style check: /health's answer, on the published port
    curl -fsS -X "$m" "http://127.0.0.1:$ROUTER_PORT/ping" >/dev/null || { log "$m /ping did not answer 200"; exit 1; }
done
nodes=$(curl -fsS "http://127.0.0.1:$ROUTER_PORT/v1/cluster" | "$PY" -c 'import json,sys; print(sorted(n["node"] for n in json.load(sys.stdin)["nodes"]))')
log "router sees nodes $nodes"
expected=$("$PY" -c "print(sorted(f'w{i}' for i in range($WORKERS)))")
[ "$nodes" = "$expected" ] || { log "expected $expected"; $COMPOSE logs --tail 30 worker; exit 1; }

if [ "${EI_POLICY:-evolving}" = evolving ]; then  # the system `up` runs, not the services' defaults (a baseline)
    routing=$(curl -fsS "http://127.0.0.1:$ROUTER_PORT/v1/cluster" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["policy"])')
    [ "$routing" = ttft ] || { log "router routing $routing, expected ttft (EI_POLICY=evolving)"; exit 1; }
    # grep reads the whole log (not -q): under pipefail, -q's early exit SIGPIPEs docker-compose and fails the check
    $COMPOSE logs planner | grep -c '"policy": "evolving"' >/dev/null || { log "planner is not the evolving one"; $COMPOSE logs --tail 20 planner; exit 1; }
    log "policy evolving: router ttft, planner evolving"
fi
held=$($COMPOSE exec -T router ls /creds | tr -d '\r' | tr '\n' ' ')  # its own seed and the stack's API key id salt only (auth copies them there)
[ "$held" = "api-key-id.salt clock_origin router.nk " ] || { log "router's /creds holds: $held (expected api-key-id.salt clock_origin router.nk)"; exit 1; }

$COMPOSE logs stream | grep -c "JetStream stream EI_" >/dev/null || { log "no JetStream stream"; $COMPOSE logs stream; exit 1; }
if $COMPOSE logs | grep "no JetStream stream"; then log "a service runs without the JetStream stream (at most once)"; exit 1; fi

log "replay $SESSIONS Claude Code sessions"
TRACE=$("$PY" -c 'from evolving_infra.launcher import demo_trace_path; print(demo_trace_path())')
OUT=$(mktemp -d /tmp/ei-smoke-out.XXXXXX)
"$EI" replay "$TRACE" --router-url "http://127.0.0.1:$ROUTER_PORT" --speedup "$EI_SPEEDUP" --sessions "$SESSIONS" \
    --max-requests-per-branch 4 --concurrency "$SESSIONS" --out "$OUT" 2>&1 | tail -15
"$PY" - "$OUT/report.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"requests sent {r['requests_sent']}, completed {r['requests_completed']}, failed {r['requests_failed']}")
assert r["requests_sent"] > 0 and r["requests_completed"] == r["requests_sent"] and r["requests_failed"] == 0
PYEOF
curl -fsS "http://127.0.0.1:$ROUTER_PORT/metrics" >"$OUT/metrics.txt"
grep -q '^ei_router_ttft_seconds_count' "$OUT/metrics.txt" || { log "no TTFT histogram on the router's /metrics"; exit 1; }

# the stream outlives a recreated nats container (its JetStream store is the nats-store volume): the one-shot
# stream job made it once, and without the store the services would wait for it, warning, until someone ran it again
streams() {  # the JetStream streams nats-server holds (its monitoring port, inside the container)
    $COMPOSE exec -T nats python -c 'import json, urllib.request as u; print(json.load(u.urlopen("http://127.0.0.1:8222/jsz", timeout=2))["streams"])' | tr -d '\r'
}
before=$(streams)
log "recreate nats (the stream job not run again; $before stream(s) before)"
$COMPOSE up -d --no-deps --force-recreate nats >/dev/null 2>&1
# (nats-server answers on its monitoring port before JetStream has read its store back: 0 streams a moment)
for _ in $(seq 60); do after=$(streams 2>/dev/null) && [ "$after" = "$before" ] && break; sleep 1; done
[ "${after:-0}" -ge 1 ] && [ "$after" = "$before" ] || { log "after nats was recreated: ${after:-no} stream(s), $before before"; $COMPOSE logs --tail 20 nats; exit 1; }
log "nats recreated: $after stream(s) kept"

log "down"
$COMPOSE down -v --remove-orphans
left=$($DOCKER ps -aq | wc -l)
[ "$left" -eq 0 ] || { log "$left containers left after down"; $DOCKER ps -a; exit 1; }
rm -rf "$OUT"
log "OK"
