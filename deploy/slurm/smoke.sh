#!/usr/bin/env bash
# A three-node Slurm cluster on this machine (Debian's slurmctld + slurmd, node names n1..n3 on
# localhost), the repository's sbatch script submitted with --nodes=3, a replay of real Claude Code
# sessions against its router, then `scancel --batch --signal=TERM` (the documented drain): every process of the
# job must be gone.
# Needs root and `apt-get install slurmctld slurmd slurm-client munge`; uses the project's .venv. Slurm's daemons and
# a munged of its own (its socket in the run's folder: the system's munged, or another run's, is neither needed nor
# touched) are stopped at exit, whatever the outcome.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PY:-$REPO/.venv/bin/python}
EI=${EI:-$REPO/.venv/bin/evolving-infra}
free_ports() {  # N distinct free ports (all held open while chosen, so none repeats)
    "$PY" -c 'import socket, sys
ss = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in ss: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in ss))' "$1"
}
D=$(mktemp -d /tmp/ei-slurm.XXXXXX)
chmod 755 "$D"
export SLURM_CONF=$D/slurm.conf
read -r CTLD_PORT P1 P2 P3 ROUTER_PORT NATS_PORT <<<"$(free_ports 6)"
log() { echo "[slurm-smoke $(date +%H:%M:%S)] $*"; }
mkdir -p "$D/state" "$D/spool" "$D/munge"
MUNGE_SOCKET=$D/munge/munge.socket
cat >"$SLURM_CONF" <<CONF
ClusterName=eismoke
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SlurmdParameters=config_overrides
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd-%n.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd-%n.log
ReturnToService=2
KillWait=15
MpiDefault=none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$P1 CPUs=8 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$P2 CPUs=8 State=UNKNOWN
NodeName=n3 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$P3 CPUs=8 State=UNKNOWN
PartitionName=ei Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP
CONF
JOB=""
cleanup() {
    set +e
    [ -n "$JOB" ] && scancel "$JOB" 2>/dev/null
    scontrol shutdown >/dev/null 2>&1
    sleep 1
    for f in "$D"/slurmd-*.pid "$D"/slurmctld.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
    for p in $(grep -lzx "EI_RUN_DIR=$D/run" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do kill -9 "$p" 2>/dev/null; done
    # this run's munged, last (slurmctld and slurmd use it to their end). Before, the script started the system's
    # munged when none ran and left it running after every run
    if [ -s "$D/munge/munged.pid" ]; then
        local m
        m=$(cat "$D/munge/munged.pid")
        kill "$m" 2>/dev/null
        for _ in $(seq 50); do kill -0 "$m" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -rf "$D"
}
trap cleanup EXIT
trap 'exit 1' TERM INT

# munged (Debian's; its key, /etc/munge/munge.key, is made at install) on a socket of this run's (slurm.conf's
# AuthInfo): its folder the munge user's, 0711 (munged wants the socket's folder executable by all)
log "munged (socket $MUNGE_SOCKET)"
chown munge:munge "$D/munge"
chmod 711 "$D/munge"
runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCKET" --pid-file="$D/munge/munged.pid" \
    --log-file="$D/munge/munged.log" --seed-file="$D/munge/munged.seed"
log "slurmctld + slurmd n1 n2 n3 (conf $SLURM_CONF)"
slurmctld -i
for n in n1 n2 n3; do slurmd -N "$n"; done
for _ in $(seq 100); do [ "$(sinfo -h -o %T -p ei 2>/dev/null | sort -u)" = "idle" ] && break; sleep 0.3; done
sinfo -p ei

RUN=$D/run
log "sbatch --nodes=3 deploy/slurm/evolving-infra.sbatch (router :$ROUTER_PORT, nats :$NATS_PORT)"
JOB=$(EI_HOME=$REPO EI_PYTHON=$PY EI_RUN_DIR=$RUN ROUTER_PORT=$ROUTER_PORT NATS_PORT=$NATS_PORT SPLIT=1P1D SPEEDUP=20 \
      sbatch --parsable --nodes=3 --output="$D/job-%j.out" deploy/slurm/evolving-infra.sbatch)
log "job $JOB"
ok=""
for _ in $(seq 240); do
    if grep -q READY "$D/job-$JOB.out" 2>/dev/null; then ok=1; break; fi
    if ! squeue -h -j "$JOB" >/dev/null 2>&1 || [ -z "$(squeue -h -j "$JOB")" ]; then break; fi
    sleep 0.5
done
cat "$D/job-$JOB.out" 2>/dev/null
[ -n "$ok" ] || { log "job not ready"; tail -20 "$RUN"/*.log; exit 1; }
squeue -j "$JOB" -o "%i %T %D %N"
nodes=$(curl -fsS "http://127.0.0.1:$ROUTER_PORT/v1/cluster" | "$PY" -c 'import json,sys; print(sorted(n["node"] for n in json.load(sys.stdin)["nodes"]))')
log "router sees nodes $nodes"
[ "$nodes" = "['w0', 'w1']" ] || exit 1
steps=$(squeue -h -s -j "$JOB" -o "%i %N")
log "job steps: $steps"

log "replay 3 Claude Code sessions"
TRACE=$("$PY" -c 'from evolving_infra.launcher import demo_trace_path; print(demo_trace_path())')
"$EI" replay "$TRACE" --router-url "http://127.0.0.1:$ROUTER_PORT" --speedup 20 --sessions 3 --max-requests-per-branch 4 \
    --concurrency 3 --out "$D/replay" 2>&1 | tail -12
"$PY" - "$D/replay/report.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"requests sent {r['requests_sent']}, completed {r['requests_completed']}, failed {r['requests_failed']}")
assert r["requests_sent"] > 0 and r["requests_completed"] == r["requests_sent"] and r["requests_failed"] == 0
PYEOF

job_pids() {  # every process started for the job (they inherit EI_RUN_DIR)
    grep -lzx "EI_RUN_DIR=$RUN" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | tr '\n' ' ' || true
}
pids=$(job_pids)
n=$(echo $pids | wc -w)
[ "$n" -ge 6 ] || { log "expected >= 6 job processes (nats, directory, planner, router, 2 workers), found $n: $pids"; exit 1; }
log "scancel --batch --signal=TERM $JOB, the drain (job processes: $pids)"
named=$(ps -o pid=,args= -p "${pids// /,}" 2>/dev/null | sed 's/^ */  /' || true)  # to name any left behind
scancel --batch --signal=TERM "$JOB"
for _ in $(seq 120); do [ -z "$(squeue -h -j "$JOB" 2>/dev/null)" ] && break; sleep 0.5; done
[ -z "$(squeue -h -j "$JOB" 2>/dev/null)" ] || { log "job still queued"; exit 1; }
log "job $JOB left the queue"
# a zombie (state Z, exited but not yet reaped by its parent, e.g. "[srun] <defunct>") runs nothing
alive() { kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" != Z ]; }
still() { local l="" p; for p in $pids $(job_pids); do alive "$p" && l="$l $p"; done; echo $l; }
# The job leaves the queue when slurmd has signalled its steps; a process may still be exiting then
# (CI saw one gone a few ms after a check 1 s later, on 2 busy cores): each must be gone within 10 s.
left=$(still)
for i in $(seq 40); do [ -z "$left" ] && break; sleep 0.25; left=$(still); done
[ -z "$left" ] || {
    log "processes left 10 s after the job left the queue:$left"
    for p in $left; do echo "$named" | awk -v p="$p" '$1 == p' ; done
    ps -o pid,ppid,stat,args -p "${left// /,}"; exit 1; }
if curl -fsS "http://127.0.0.1:$ROUTER_PORT/healthz" >/dev/null 2>&1; then log "router still answers"; exit 1; fi
grep -h '"service stopped"\|service stopped' "$RUN"/*.log | wc -l | xargs -I{} echo "[slurm-smoke] services that logged a clean stop: {}"
log "OK"
