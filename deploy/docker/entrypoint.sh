#!/bin/sh
# ei-entrypoint ROLE [ARGS...]: run one Evolving Infra service in the container.
#
# Roles: auth (write NATS credentials, once, and the server's config into $EI_CREDS_DIR), nats, stream
# (create the partition's JetStream stream as the launcher, once NATS is up: no service may),
# kvdirectory, planner, router, worker; anything else is run as a command
# (e.g. `evolving-infra replay ...`). Every service reads its settings from EI_* variables
# (shared/config.py). Variables used here:
#   WORKERS        number of worker replicas (node ids w0..w<WORKERS-1>)      default 2
#   SPLIT          initial PD split: collocated | xPyD with x+y = WORKERS      default: EI_POLICY's (static:2P2D),
#                  else up's for WORKERS nodes (2: 1P1D, 4: 2P2D)
#   EI_CREDS_DIR   credentials volume (auth writes, services read)            default /creds
#   EI_CREDS_OUT   auth: folders router, planner, kvdirectory, launcher, workers, each another service's /creds;
#                  auth copies the clock origin and that identity's seed(s) into each   default /creds-out
#   EI_NATS_AUTH   nkeys (default) | off (NATS open inside the compose network)
#   EI_IMAGE       no longer read (renamed EI_IMAGE_REPO): auth refuses to start a stack while it is set (status 2)
#   EI_IMAGE_REPO, EI_TARGET  the image compose runs (REPO:TARGET; TARGET sim, torch, or pinned VERSION-sim,
#                  VERSION-torch), passed in by docker-compose.yml: auth refuses an EI_ENGINE of the other variant
#                  (status 2) and names the image to start
#   EI_CLOCK_ORIGIN  set here from $EI_CREDS_DIR/clock_origin (written by the auth job) unless given
#   EI_API_KEY_ID_SALT  router: set here from $EI_CREDS_DIR/api-key-id.salt (the auth job writes one per volume, 0600,
#                  and copies it to the router's only) unless given: the salt of the key ids in the router's log
#   EI_POLICY      serving system, as `evolving-infra up --policy`: evolving | static[:xPyD] | dynamo | arrow
#                  (default evolving); each service gets its part from `evolving-infra deploy-args`, up's own code
#   EI_ENGINE      sim | torch (the model folder mounted at /models; the profile, tokenizer, served model name
#                  and context limit follow from it as with `up --engine torch --model DIR`)   default sim
#   EI_MODEL_DIR   EI_ENGINE=torch: the model folder in the container                       default /models
#   EI_BLOCK_SIZE  kvdirectory, router: set here to the block_size of the profile up resolves (EI_PROFILE; with
#                  EI_ENGINE=torch and EI_PROFILE the default, torch-tiny-cpu), the workers'; another is refused
#   up's other settings, each passed to deploy-args as up's flag (empty or unset: up's default; the services get
#   what `up` gives them):
#   EI_GPU_KV_TOKENS   up --gpu-kv-tokens: each worker's GPU KV (L1) tokens, which bound the longest request the
#                      router serves (max_model_len); unset: the profile's (torch-tiny-cpu: 1024)
#   EI_HOST_KV_TOKENS  up --host-kv-tokens: each worker's host KV (L2) tokens
#   EI_SERVED_MODEL_NAME  up --served-model-name: the model name(s) the router serves, comma-separated (/v1/models
#                      lists each); unset with EI_ENGINE=torch: the folder's name, "models" for /models
#   EI_DTYPE           up --dtype (EI_ENGINE=torch): float32 | bfloat16 | float16
#   EI_LOG_REQUESTS    up --log-requests: 1/true/yes/on (router and workers log each request), 0/false/no/off
#   EI_OTLP_TRACES_ENDPOINT  up --otlp-traces-endpoint URL: every service exports OTLP/HTTP traces there
#   EI_FENCE_AFTER_S   up --fence-after-s S: wall seconds without a node's state after which the router fences the
#                      node and the planner counts it dead (router --fence-after-s, planner --silent-after-s: one
#                      time); unset: both services' default, 3
#   EI_TOOL_CALL_PARSER  up --enable-auto-tool-choice --tool-call-parser NAME (vLLM's flags; hermes: Qwen2.5/3,
#                      Hermes): the router answers tool_choice auto with tool_calls; unset: auto is vLLM's 400
#   worker --profile P: refused unless P's block_size is that profile's
#   auth checks EI_POLICY / SPLIT / EI_ENGINE and the settings above first (deploy-args env): a refused one ends
#   it with status 2, before NATS or any service (which restart on failure) starts
#   EI_LOOKUP_TIMEOUT_S  the router's --lookup-timeout-s (wall s; compose passes it to the router only, which
#                  reads it itself: not checked by auth); empty or unset: the router's default (0.5)
#   EI_SHUTDOWN_GRACE_S, EI_MAX_BUFFERED_OUTPUT_TOKENS, EI_SLOW_CLIENT_GRACE_S, EI_STREAM_STALL_TIMEOUT_S,
#   EI_MAX_ACTIVE_BRANCHES, EI_TRUST_REQUEST_CHAT_TEMPLATE: the router's --shutdown-grace-s etc., passed and read
#                  the same way
set -eu
# PID 1 of the container until the exec below: the kernel drops a signal PID 1 has no handler for, so
# without this `docker compose stop` waited out its 10 s and killed a container still waiting for
# its credentials or clock origin (up to 60 s each). exec resets the trap; the service sets its own.
trap 'exit 143' TERM
trap 'exit 130' INT
role=${1:-}
[ $# -gt 0 ] && shift
WORKERS=${WORKERS:-2}
SPLIT=${SPLIT:-}  # empty: the policy set's (static:2P2D) or up's default for WORKERS nodes
POLICY=${EI_POLICY:-evolving}
ENGINE=${EI_ENGINE:-sim}
CREDS=${EI_CREDS_DIR:-/creds}
CREDS_OUT=${EI_CREDS_OUT:-/creds-out}  # auth: one folder per identity (router, planner, kvdirectory, launcher, workers)
AUTH=${EI_NATS_AUTH:-nkeys}

UP_SETTINGS="EI_GPU_KV_TOKENS EI_HOST_KV_TOKENS EI_SERVED_MODEL_NAME EI_DTYPE EI_LOG_REQUESTS EI_OTLP_TRACES_ENDPOINT EI_FENCE_AFTER_S EI_TOOL_CALL_PARSER"
# compose passes an unset one as empty; a service reads EI_<FIELD> itself, and an empty number or boolean is
# an invalid value there (EI_GPU_KV_TOKENS, EI_LOG_REQUESTS, the router's EI_LOOKUP_TIMEOUT_S)
ROUTER_SETTINGS="EI_LOOKUP_TIMEOUT_S EI_SHUTDOWN_GRACE_S EI_MAX_BUFFERED_OUTPUT_TOKENS EI_SLOW_CLIENT_GRACE_S EI_STREAM_STALL_TIMEOUT_S EI_MAX_ACTIVE_BRANCHES EI_TRUST_REQUEST_CHAT_TEMPLATE"
for var in EI_BLOCK_SIZE $ROUTER_SETTINGS $UP_SETTINGS; do
    eval "[ -n \"\${$var:-}\" ] || unset $var"
done

block_size_of() {  # block_size_of PROFILE SAID_AS: the profile's block_size on stdout; one line and status 1 if unreadable
    python -c 'import sys
from shared.profile import ProfileError, load_profile
try:
    print(load_profile(sys.argv[1]).block_size)
except ProfileError as e:
    sys.exit(f"{sys.argv[2]}: {sys.argv[3]}: {e}")' "$1" "$role" "$2"
}

profile_block_size() {  # EI_BLOCK_SIZE := the profile's block_size, which every worker uses; exit 2 on another
    profile=${EI_PROFILE:-gb300-glm52}
    block_size_of "$profile" "EI_PROFILE=$profile" >/dev/null || exit 2  # unreadable: one line naming EI_PROFILE
    # the profile as up resolves it (EI_ENGINE=torch with the default EI_PROFILE: torch-tiny-cpu), whose block
    # size deploy-args gives these services and the workers; EI_PROFILE's refused a torch stack's own size
    resolved=$(deploy_args env) || exit 2
    eval "$resolved"
    profile=$EI_DEPLOY_PROFILE bs=$EI_DEPLOY_BLOCK_SIZE
    if [ -n "${EI_BLOCK_SIZE:-}" ] && [ "$EI_BLOCK_SIZE" != "$bs" ]; then
        echo "$role: EI_BLOCK_SIZE=$EI_BLOCK_SIZE differs from the block size $bs of profile $profile; the router," \
            "directory and workers must use one block size: set EI_BLOCK_SIZE=$bs (or leave it unset) or an EI_PROFILE" \
            "whose block_size is the size you want" >&2
        exit 2
    fi
    export EI_BLOCK_SIZE="$bs"
}

log_requests() {  # up's --log-requests when EI_LOG_REQUESTS is on (as the services read it), nothing when off
    case $(printf %s "${EI_LOG_REQUESTS:-}" | tr '[:upper:]' '[:lower:]') in
      1|true|yes|on) echo --log-requests ;;
      ""|0|false|no|off) ;;
      *) echo "$role: EI_LOG_REQUESTS=$EI_LOG_REQUESTS: 1, true, yes or on (or 0, false, no, off; empty = off)" >&2; return 2 ;;
    esac
}

deploy_args() {  # deploy_args SERVICE: SERVICE's flags for EI_POLICY/EI_ENGINE/..., one a line, as `up` sets them; exit 2 if refused
    model=""
    [ "$ENGINE" = torch ] && model=${EI_MODEL_DIR:-/models}
    lr=$(log_requests) || exit 2
    set -- "$1" --policy "$POLICY" --nodes "$WORKERS" ${SPLIT:+--split "$SPLIT"} \
        --profile "${EI_PROFILE:-gb300-glm52}" --engine "$ENGINE" ${model:+--model "$model"} \
        ${EI_GPU_KV_TOKENS:+--gpu-kv-tokens "$EI_GPU_KV_TOKENS"} ${EI_HOST_KV_TOKENS:+--host-kv-tokens "$EI_HOST_KV_TOKENS"} \
        ${EI_DTYPE:+--dtype "$EI_DTYPE"} ${EI_OTLP_TRACES_ENDPOINT:+--otlp-traces-endpoint "$EI_OTLP_TRACES_ENDPOINT"} \
        ${EI_FENCE_AFTER_S:+--fence-after-s "$EI_FENCE_AFTER_S"} $lr \
        ${EI_TOOL_CALL_PARSER:+--enable-auto-tool-choice --tool-call-parser "$EI_TOOL_CALL_PARSER"}
    if [ -n "${EI_SERVED_MODEL_NAME:-}" ]; then  # comma-separated (a served name has no comma): one argument each
        set -f; IFS=,
        # shellcheck disable=SC2086
        set -- "$@" --served-model-name $EI_SERVED_MODEL_NAME
        unset IFS; set +f
    fi
    evolving-infra deploy-args "$@" || exit 2
}

nodes() { i=0; out=""; while [ "$i" -lt "$WORKERS" ]; do out="${out:+$out,}w$i"; i=$((i + 1)); done; echo "$out"; }

creds_for() {  # EI_NATS_CREDS for instance $1 (nkeys mode)
    if [ "$AUTH" != off ]; then
        export EI_NATS_CREDS="$CREDS/$1.nk"
        i=0; while [ ! -s "$EI_NATS_CREDS" ] && [ "$i" -lt 60 ]; do sleep 1; i=$((i + 1)); done
    fi
}

# one simulated clock for every container: the auth job writes its origin once per volume
if [ "$role" != auth ] && [ -z "${EI_CLOCK_ORIGIN:-}" ]; then
    i=0; while [ ! -s "$CREDS/clock_origin" ] && [ "$i" -lt 60 ]; do sleep 1; i=$((i + 1)); done
    [ -s "$CREDS/clock_origin" ] && EI_CLOCK_ORIGIN=$(cat "$CREDS/clock_origin") && export EI_CLOCK_ORIGIN
fi

case "$role" in
  auth)
    # the system every service will run, checked once here, before NATS: a refused EI_POLICY, SPLIT or model
    # ends this one-shot job (status 2, one line; compose: "service auth didn't complete successfully") instead
    # of every service exiting 2 and being restarted (restart: on-failure) without end
    if [ -n "${EI_IMAGE:-}" ]; then  # compose passes it (docker-compose.yml) so that this can say so
        # EI_IMAGE (REPO:TAG) became EI_IMAGE_REPO + EI_TARGET: a stack started with EI_IMAGE set ran the default
        # image without a word; the value split as the two new variables (a registry's port is no tag)
        repo=$EI_IMAGE tag="" its_tag=""
        case ${EI_IMAGE##*/} in *:*) repo=${EI_IMAGE%:*} tag=${EI_IMAGE##*:} ;; esac
        # not "${tag:+ ... image's ...}": a ' inside a quoted ${...} is a literal to dash but opens a quote to bash
        [ -n "$tag" ] && its_tag=" (its tag $tag: EI_TARGET=sim or torch, the image's variant)"
        echo "auth: EI_IMAGE=$EI_IMAGE is no longer read (renamed EI_IMAGE_REPO: the repository, without a tag; the" \
            "tag is EI_TARGET, sim or torch): this stack runs ${EI_IMAGE_REPO:-evolving-infra}:${EI_TARGET:-sim};" \
            "unset EI_IMAGE and set EI_IMAGE_REPO=$repo$its_tag" >&2
        exit 2
    fi
    case $AUTH in  # every role tests `!= off`: another value (password, a typo) ran nkeys without a word
      nkeys|off) ;;
      *) echo "auth: EI_NATS_AUTH=$AUTH: nkeys (per-service credentials, the default) or off (NATS open inside the" \
             "compose network); up's password mode is its embedded server's only" >&2; exit 2 ;;
    esac
    # the image's variant (compose's EI_TARGET: sim or torch, after a pinned version's VERSION-) against EI_ENGINE,
    # before deploy-args: a torch stack on the sim image failed there with deploy-args's "pip install" advice (not
    # the fix in a container), and EI_TARGET=torch without EI_ENGINE=torch served the sim engine without a word
    repo=${EI_IMAGE_REPO:-evolving-infra} target=${EI_TARGET:-}
    pin="" variant=$target
    case $target in *-*) pin=${target%-*}- variant=${target##*-} ;; esac
    if [ "$ENGINE" = torch ] && [ "$variant" = sim ]; then
        echo "auth: EI_ENGINE=torch but EI_TARGET=$target: the sim image ($repo:$target) has no torch engine; build and" \
            "start the stack with EI_TARGET=${pin}torch (image $repo:${pin}torch), e.g. EI_TARGET=${pin}torch EI_ENGINE=torch" \
            "MODEL_DIR=/path/to/hf-model docker compose up" >&2
        exit 2
    fi
    if [ "$ENGINE" = sim ] && [ "$variant" = torch ]; then
        echo "auth: EI_TARGET=$target (the torch image, $repo:$target) but EI_ENGINE=sim: the stack would serve the" \
            "simulated engine, not a model; set EI_ENGINE=torch and MODEL_DIR=/path/to/hf-model, or EI_TARGET=${pin}sim" \
            "for the sim engine" >&2
        exit 2
    fi
    if ! resolved=$(deploy_args env); then
        # no EI_TARGET (the image started without compose) and no torch: the sim image; deploy-args's "pip install"
        # advice is not the fix in a container
        if [ "$ENGINE" = torch ] && ! python -c 'import torch' >/dev/null 2>&1; then
            echo "auth: EI_ENGINE=torch in an image without the torch engine (the sim target): build and start the" \
                "stack with EI_TARGET=torch (image $repo:torch), e.g. EI_TARGET=torch EI_ENGINE=torch docker compose up" >&2
        fi
        exit 2
    fi
    eval "$resolved"
    echo "auth: $EI_DEPLOY_POLICY; split $EI_DEPLOY_SPLIT, profile $EI_DEPLOY_PROFILE"
    [ -s "$CREDS/clock_origin" ] || python -c 'import time; print(repr(time.time()))' > "$CREDS/clock_origin"
    # the salt of the API key ids in the router's log (services.router.ingress.key_id), once per volume as the clock
    # origin: without one each router made its own at each start, so an id could not be mapped to its key; with it
    # the ids agree across restarts, and an operator who reads this file (0600, the router's volume only) finds a
    # key's id (README, "A key's id")
    [ -s "$CREDS/api-key-id.salt" ] || (umask 077 && rm -f "$CREDS/api-key-id.salt" && python -c 'import secrets; print(secrets.token_hex(16))' > "$CREDS/api-key-id.salt")
    if [ "$AUTH" = off ]; then
        echo "auth: off (NATS open inside the compose network)"
    elif [ -s "$CREDS/nats.conf" ] && [ "$(cat "$CREDS/nodes" 2>/dev/null)" = "$(nodes)" ]; then
        echo "auth: credentials for $(nodes) already in $CREDS"
    else
        evolving-infra auth gen --dir "$CREDS" --nodes "$(nodes)" --routers router --partition "${EI_PARTITION:-p0}"
        nodes > "$CREDS/nodes"
    fi
    # nats-server's limits as up's embedded server sets them (shared/natsserver.py limits_conf: max_payload 16 MiB,
    # max_pending 256 MiB; nats-server's own are 1 MiB and 64 MiB), in both auth modes, written at every start with
    # the nkeys config (only the keys are kept), so a volume an older image made gets them too. Without them a prefill
    # dispatch past 1 MiB (~250k prompt tokens) was refused here and not under up
    python -c 'from shared.natsserver import limits_conf; print(limits_conf(), end="")' > "$CREDS/nats-limits.conf" || exit 2
    if [ "$AUTH" != off ]; then
        printf 'listen: 0.0.0.0:4222\nhttp: 0.0.0.0:8222\njetstream { store_dir: "/var/lib/ei/jetstream" }\ninclude nats-limits.conf\ninclude nats-auth.conf\n' > "$CREDS/nats.conf"
    fi
    # each service's own volume (compose mounts it at the service's /creds): the clock origin and only that
    # identity's seed, so that the router (its port published) cannot read the admin, launcher or other seeds
    for dir in "$CREDS_OUT"/*/; do
        [ -d "$dir" ] || continue
        who=$(basename "$dir")
        cp "$CREDS/clock_origin" "$dir/clock_origin"
        [ "$who" = router ] && cp -p "$CREDS/api-key-id.salt" "$dir/api-key-id.salt"
        find "$dir" -maxdepth 1 -name '*.nk' -delete
        [ "$AUTH" = off ] && continue
        case "$who" in
          workers)  # this WORKERS's seeds only: a larger WORKERS's older ones stay in $CREDS after regeneration
            for node in $(nodes | tr , ' '); do cp -p "$CREDS/worker-$node.nk" "$dir"; done ;;
          router|planner|kvdirectory|launcher) cp -p "$CREDS/$who.nk" "$dir" ;;
          *) echo "auth: $dir: no identity named $who (router, planner, kvdirectory, launcher, workers)" >&2; exit 2 ;;
        esac
        echo "auth: $who's credentials in its own volume"
    done
    ;;
  nats)
    # a soft cap on the server's Go heap (shared/natsserver.py GO_MEMORY_LIMIT, `up`'s): without one its memory grew
    # past 1.6 GiB in 300 s of steady load while its stream held 192 MiB; a GOMEMLIMIT set on the service is kept
    export GOMEMLIMIT="${GOMEMLIMIT:-512MiB}"
    if [ "$AUTH" = off ]; then
        exec nats-server -c "$CREDS/nats-limits.conf" -js -sd /var/lib/ei/jetstream -a 0.0.0.0 -p 4222 -m 8222 "$@"
    fi
    exec nats-server -c "$CREDS/nats.conf" "$@"
    ;;
  stream)
    launcher=""
    [ "$AUTH" != off ] && launcher="$CREDS/launcher.nk"
    # the URL through the environment, not argv: a password in it stays out of the process list
    export EI_NATS_URL="${EI_NATS_URL:-nats://nats:4222}"
    exec evolving-infra auth stream --partition "${EI_PARTITION:-p0}" --creds "$launcher" "$@"
    ;;
  kvdirectory|planner|router)
    [ "$role" = planner ] || profile_block_size
    flags=$(deploy_args "$role") || exit 2
    creds_for "$role"
    set -f; IFS='
'
    # shellcheck disable=SC2086  # one flag a line: split on newlines only, no globbing
    set -- $flags "$@"
    unset IFS; set +f
    [ "$role" = router ] && set -- --host 0.0.0.0 "$@"
    # the stack's key-id salt (the auth job's, in this router's volume), through the environment: never in argv
    if [ "$role" = router ] && [ -z "${EI_API_KEY_ID_SALT:-}" ] && [ -s "$CREDS/api-key-id.salt" ]; then
        EI_API_KEY_ID_SALT=$(cat "$CREDS/api-key-id.salt")
        export EI_API_KEY_ID_SALT
    fi
    exec python -m "services.$role" --instance "$role" "$@"
    ;;
  worker)
    n=${EI_REPLICA:-$(python /usr/local/lib/ei/replica.py)}
    node="w$((n - 1))"
    if [ "$((n - 1))" -ge "$WORKERS" ]; then
        echo "worker: replica $n but WORKERS=$WORKERS (scale the service and set WORKERS to the same number)" >&2; exit 2
    fi
    # a --profile in ARGS must share EI_PROFILE's block size, the
    # router's and directory's (profile_block_size), or every request fails with 500 'block size mismatch'
    own="" prev=""
    for a in "$@"; do
        case "$a" in --profile=*) own=${a#--profile=} ;; *) [ "$prev" = --profile ] && own=$a ;; esac
        prev=$a
    done
    resolved=$(deploy_args env) || exit 2
    eval "$resolved"  # EI_DEPLOY_SPLIT: SPLIT, or the policy set's, or up's default for WORKERS nodes
    # the cluster's profile as up resolves it (EI_ENGINE=torch with the default EI_PROFILE: torch-tiny-cpu), the
    # one deploy-args gives the router and directory: comparing with EI_PROFILE let a gb300-glm52 worker (64) join
    # a torch stack of 8-token blocks
    cluster=$EI_DEPLOY_PROFILE
    said="EI_PROFILE=$cluster"
    [ "$cluster" = "${EI_PROFILE:-gb300-glm52}" ] || said="profile $cluster (EI_ENGINE=$ENGINE's, as up's)"
    if [ -n "$own" ] && [ "$own" != "$cluster" ]; then
        own_bs=$(block_size_of "$own" "--profile $own") || exit 2
        cluster_bs=$EI_DEPLOY_BLOCK_SIZE
        if [ "$own_bs" != "$cluster_bs" ]; then
            echo "worker: --profile $own has block size $own_bs but $said (the router's and KV directory's)" \
                "has $cluster_bs; every request would fail with 'block size mismatch': set EI_PROFILE=$own for the whole" \
                "stack (compose: EI_PROFILE=$own docker compose up)" >&2
            exit 2
        fi
    fi
    # the phase this worker starts in: collocated during the evolving planner's warm-up (its first split; SPLIT comes
    # after it), else SPLIT's (EI_DEPLOY_LAUNCH_SPLIT, as up launches its workers)
    SPLIT=$EI_DEPLOY_SPLIT
    launch=${EI_DEPLOY_LAUNCH_SPLIT:-$SPLIT}
    phase=both
    case "$launch" in
      *P*D) x=${launch%%P*}; if [ "$((n - 1))" -lt "$x" ]; then phase=prefill; else phase=decode; fi ;;
    esac
    flags=$(deploy_args worker) || exit 2
    creds_for "worker-$node"
    set -f; IFS='
'
    # shellcheck disable=SC2086
    set -- $flags "$@"
    unset IFS; set +f
    exec python -m services.worker --instance "worker-$node" --node "$node" --phase "$phase" "$@"
    ;;
  ""|--help|-h)
    echo "usage: ei-entrypoint auth|nats|stream|kvdirectory|planner|router|worker [ARGS...] | COMMAND [ARGS...]"
    ;;
  *)
    exec "$role" "$@"
    ;;
esac
