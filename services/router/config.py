"""Router configuration: one frozen Struct; flags ``--field-name``, env ``EI_FIELD_NAME``, TOML ``[router]``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import msgspec
from msgspec import Meta

from shared.config import CommonConfig

if TYPE_CHECKING:
    from services.router.policy import RoutingPolicy



LOOKUP_TIMEOUT_HINT = "--lookup-timeout-s / EI_LOOKUP_TIMEOUT_S (wall seconds, not scaled by --speedup)"
"""Named in the router's 'kv.lookup failed' warning: which setting the timeout it ran out was, and its clock (a
demo at --speedup 50 on a host at load ~6 logged the warning with only 'TimeoutError': 0.5 wall s, 25 s of the
cluster clock)."""


class RouterConfig(CommonConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of the router service (HTTP ingress + routing)."""

    host: Annotated[str, Meta(description="HTTP listen address")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="HTTP listen port; 0 = a free port chosen by the kernel")] = 8000
    port_file: Annotated[
        str, Meta(description="if set, write the bound HTTP port (decimal, newline) to this file once listening")
    ] = ""
    listen_fd: Annotated[
        int,
        Meta(ge=-1, description="serve HTTP on this inherited listening TCP socket (a file descriptor) instead of binding "
             "--host/--port: a supervisor that holds the port across restarts (evolving-infra up does) keeps it open while "
             "the router drains, exits and starts again, so connections made meanwhile wait in its accept queue and are "
             "served by the next router instead of being refused; with it a SIGTERM's drain (or the stop, with nothing "
             "open or on SIGINT) stops accepting connections at once (they wait for the next router); a request on a "
             "keep-alive connection already open is served in the drain's first half (half of --shutdown-grace-s; later: "
             "503 'router draining' with Retry-After, as it could not finish) with 'Connection: close', and the "
             "connections left idle are closed at the drain's end (the stop closes them at once); -1 = bind --host/--port"),
    ] = -1
    routing: Annotated[
        str,
        Meta(
            description="prefill routing policy by name: ttft (predicted TTFT, paper Eq. 7; the evolving set's) | "
            "cache-aware (SGLang gateway) | dynamo-kv (Dynamo KV router cost) | round-robin | sticky (branch affinity)"
        ),
    ] = "cache-aware"
    profile: Annotated[
        str,
        Meta(description="ttft: hardware/model profile (shared/profiles name or TOML path) whose Eq. 1/2 coefficients "
             "predict a node until the planner publishes its fitted models"),
    ] = "gb300-glm52"
    profile_clock: Annotated[
        Literal["cluster", "wall"],
        Meta(description="ttft: what --profile's times are: cluster = simulated seconds, as written (a sim engine's "
             "profile); wall = wall seconds measured at speed-up 1 (a real engine's, --engine torch): its Eq. 1/2 "
             "coefficients and link latencies x --speedup, its link bandwidths / --speedup, and so are "
             "--ttft-fetch-base-s, --ttft-fetch-per-token-s and --ttft-copy-price-s-per-token (evolving-infra up "
             "passes wall for --engine torch)"),
    ] = "cluster"
    ttft_chunk_tokens: Annotated[
        int, Meta(ge=0, description="ttft: prefill tokens per iteration in the replay; 0 = the profile's (8192)")
    ] = 0
    ttft_fetch_base_s: Annotated[
        float, Meta(ge=0, description="ttft: τ(x) fixed part, s on --profile-clock's clock (wall: x --speedup, as the "
                    "profile's times; paper: 0.45)")
    ] = 0.45
    ttft_fetch_per_token_s: Annotated[
        float, Meta(ge=0, description="ttft: τ(x) per fetched token, s on --profile-clock's clock (wall: x --speedup; "
                    "paper: 1e-6)")
    ] = 1e-6
    ttft_fetch_min_tokens: Annotated[
        int, Meta(ge=0, description="ttft: no fetch below this many tokens (recomputed instead; paper: 512)")
    ] = 512
    ttft_copy_price_s_per_token: Annotated[
        float, Meta(ge=0, description="ttft: κ, copy price charged per fetched token, s on --profile-clock's clock "
                    "(wall: x --speedup, as τ; the paper gives no value)")
    ] = 1e-7
    ttft_state_max_age_s: Annotated[
        float, Meta(gt=0, description="ttft: wall seconds (x --speedup on the router's clock, as --fence-after-s: "
                    "workers publish node.state on wall-clock timers) after which a node's state is not trusted "
                    "(paper: 5)")
    ] = 5.0
    ttft_prune_above: Annotated[
        int,
        Meta(
            ge=0,
            description="ttft: with more prefill candidates than this, score only those whose lower bound can win "
            "(same decision; the debug route log still scores all)",
        ),
    ] = 16
    dynamo_overlap_score_credit: Annotated[
        float, Meta(ge=0, description="dynamo-kv: credit per block cached in GPU memory (Dynamo default 1.0)")
    ] = 1.0
    dynamo_host_cache_hit_weight: Annotated[
        float, Meta(ge=0, le=1, description="dynamo-kv: credit per block cached in host memory (Dynamo default 0.75)")
    ] = 0.75
    dynamo_prefill_load_scale: Annotated[float, Meta(ge=0, description="dynamo-kv: s, weight of the prefill term (Dynamo default 1.0)")] = 1.0
    dynamo_temperature: Annotated[
        float, Meta(ge=0, description="dynamo-kv: softmax temperature; 0 = argmin (Dynamo default)")
    ] = 0.0
    sticky_ttl_s: Annotated[
        float, Meta(gt=0, description="sticky: simulated seconds a branch's binding lives after its last request (SGLang gateway: 600)")
    ] = 600.0
    seed: Annotated[int, Meta(description="seed of randomized policies (dynamo-kv with temperature > 0)")] = 0
    tokenizer: Annotated[str, Meta(description="sim (built-in, deterministic) or hf:<local path to tokenizer.json or model folder>")] = "sim"
    model: Annotated[
        str,
        Meta(description="model name served: the first id of GET /v1/models and every response's model, whichever "
             "served name or alias the request gave (vLLM: the first --served-model-name); a request naming a model "
             "this router does not serve gets 404"),
    ] = "evolving-infra-sim"
    model_names: Annotated[
        list[str],
        Meta(description="other served names, comma-separated: GET /v1/models lists them after --model and a request's "
             "model may give any; responses name --model (vLLM's --served-model-name after the first: "
             "show_available_models lists each, a response names the first; evolving-infra up passes them)"),
    ] = msgspec.field(default_factory=list)
    model_aliases: Annotated[
        list[str],
        Meta(description="other names a request's model may give, comma-separated, not listed in GET /v1/models; "
             "responses name --model (vLLM, started without --served-model-name, serves the model path as typed; "
             "evolving-infra up passes the --model folder as typed and resolved when --served-model-name is not set)"),
    ] = msgspec.field(default_factory=list)
    block_size: Annotated[int, Meta(ge=1, description="tokens per KV block; must equal the directory's and the engines'")] = 64
    cache_threshold: Annotated[
        float, Meta(ge=0.0, le=1.0, description="cache-aware: match rate above which the longest-match node wins (gateway CLI default)")
    ] = 0.3
    balance_abs_threshold: Annotated[
        int, Meta(ge=0, description="cache-aware: in-flight spread (requests) above which load is imbalanced (gateway CLI default)")
    ] = 64
    balance_rel_threshold: Annotated[
        float, Meta(ge=1.0, description="cache-aware: max load / min load above which load is imbalanced (gateway CLI default)")
    ] = 1.5
    decode_binding: Annotated[
        Literal["dispatch", "prefill-start"],
        Meta(
            description="when a PD request's decode node is chosen: prefill-start = when its prefill starts on the "
            "prefill node (route.bind; paper Eq. 7, sees decode load and KV room at that moment) | dispatch = "
            "with the prefill node"
        ),
    ] = "prefill-start"
    decode_routing: Annotated[
        Literal["least-loaded", "round-robin"],
        Meta(
            description="which decode node a PD request is bound to (not when: --decode-binding): least-loaded = the "
            "--routing policy's own rule (the least loaded decode node: running + waiting + this router's in flight, "
            "ties to the lowest node id; ttft: among those with KV room for the request; dynamo-kv: its KV cost) | "
            "round-robin = the eligible decode nodes in turn, in node-id order, a re-binding (a decode node handed "
            "the request back) taking the next one; each router keeps its own turn (SGLang Model Gateway PD mode: "
            "the paper's baselines, evolving-infra up --policy static / dynamo / arrow, as simulate runs them)"
        ),
    ] = "least-loaded"
    fence_after_s: Annotated[
        float, Meta(gt=0, description="wall seconds without a node.state after which a node is fenced out (measured on the "
                    "monotonic clock: a step of the wall clock fences no node), counted only while the bus delivers to the "
                    "router (other nodes' states, the PONGs of its PINGs; a gap between two counts at most a third of it): "
                    "a hung nats-server fences no node while the workers' state interval (--idle-state-interval-s, 1 s) plus a third "
                    "of it stays below it, a node dead while the bus is slow is fenced")
    ] = 3.0
    forget_node_after_s: Annotated[
        float,
        Meta(ge=0, description="wall seconds without a node.state (measured on the monotonic clock, as --fence-after-s) after "
             "which a fenced node has left for good: its GPU KV "
             "memory no longer counts toward max_model_len (/v1/models, /tokenize) and the 400 of a request no node can hold "
             "(nor does a 0, an older worker's unknown capacity, turn that cap off); until then a silent node counts, so a "
             "restarting one does not lower the cap; one that reports again counts at once; one that holds no request is "
             "then forgotten (no longer listed by /v1/cluster nor in ei_router_routed_total; it is recorded afresh if it "
             "reports again); as the KV directory's --forget-node-after-s; 0 = never"),
    ] = 300.0
    bus_outage_wait_s: Annotated[
        float,
        Meta(
            ge=0,
            description="wall seconds a new request waits for a route while NATS is down or just reconnected (node states "
            "still coming back) before it fails with 503; in-flight requests are not fenced during that time",
        ),
    ] = 30.0
    lookup_timeout_s: Annotated[
        float, Meta(gt=0, description="wall seconds to wait for the directory's kv.lookup reply before routing without cache "
                    "info; not scaled by --speedup: it bounds a round trip that takes wall time (a few ms; more on a "
                    "CPU-starved host), and a request that waits it out waits that x --speedup in router-clock seconds")
    ] = 0.5
    split_get_timeout_s: Annotated[
        float, Meta(ge=0, description="wall seconds to keep asking the planner (split.get) at start before using node-reported phases")
    ] = 30.0
    no_route_wait_s: Annotated[
        float, Meta(ge=0, description="wall seconds a request waits for an eligible node (retried every 50 ms) before 503 "
                    "'no live ... node'; 0 = answer at once")
    ] = 5.0
    requeue_wait_s: Annotated[
        float,
        Meta(ge=0, description="wall seconds work handed back or re-dispatched after its node failed (a phase switch, a "
             "fenced node) waits for an eligible node (retried at every node state) before the request fails with 503 "
             "naming what is missing ('no live decode node ...'); long enough for a supervisor to restart the node "
             "(evolving-infra up: ~2 s) and the router to fence it first (--fence-after-s); time while NATS is down or settling "
             "after an outage does not count; 0 = fail at once"),
    ] = 30.0
    request_timeout_s: Annotated[
        float, Meta(gt=0, description="wall seconds a request may wait for its next output chunk before it fails with 504")
    ] = 600.0
    shutdown_grace_s: Annotated[
        float,
        Meta(ge=0, description="wall seconds a SIGTERM lets the requests in flight finish (a drain): from the signal "
             "new requests get 503 'router draining' (on a --listen-fd socket new connections wait for the next router "
             "and requests on open ones are served in the drain's first half, see --listen-fd) and /healthz (and /readyz on --metrics-port) 503, while the "
             "requests already taken stream on (route.bind and hand-backs answered, heartbeats sent); then, or when none "
             "is left, the router stops, what is still open failing with 503 'router shutting down' (its work aborted on "
             "its nodes). A second SIGTERM, or SIGINT (Ctrl-C) at any time, stops at once; 0 = stop at once on SIGTERM "
             "too. The default fits the router's stop_grace_period in docker-compose.yml (50 s: this, then the stop's "
             "17 s at most). Requests whose nodes stopped cannot finish, yet are waited for: a scancel (the job's "
             "workers stop at the same moment) keeps the router up for the whole grace, then the stop, against Slurm's "
             "KillWait (30 s by default); under `evolving-infra up` a killed router is restarted once it exited, and Ctrl-C of up "
             "stops it with SIGINT"),
    ] = 20.0
    max_buffered_output_tokens: Annotated[
        int,
        Meta(ge=0, description="output tokens the router holds for their clients, across all requests, that the clients "
             "have not taken yet (a stream whose client reads slower than its tokens come, or not at all: its socket "
             "and the HTTP server's write buffer full); above it the request with the most unread tokens is aborted on "
             "its nodes as a client disconnect is, its stream ends with an error event 'client too slow: N output "
             "tokens unread' (--slow-client-grace-s) and ei_router_slow_client_aborts_total counts it; a client that "
             "keeps up has at most a chunk unread and is never chosen while a slower one holds more; a token held "
             "takes ~660 bytes at one token per chunk (the workers' --stream-interval 1), ~75 at 16 (the default cap: "
             "~43 MB at most without logprobs; a chunk with top_logprobs holds more per token); 0 = no cap (each stream buffers up to its max_tokens)"),
    ] = 65_536
    slow_client_grace_s: Annotated[
        float,
        Meta(gt=0, description="wall seconds a stream aborted for --max-buffered-output-tokens has to read what its "
             "connection still holds and the error event; then its connection is reset"),
    ] = 10.0
    stream_stall_timeout_s: Annotated[
        float,
        Meta(ge=0, description="wall seconds one send of a stream may wait for its client to read: then the request is "
             "aborted as too slow (slow_client_aborts, finished abort) and its connection reset at once. The HTTP server "
             "(uvicorn) pauses a send once its write buffer for the connection passes 64 KiB and resumes it below 16 KiB, "
             "so a send waits while ~48 KiB drain: the default aborts a client that took less than ~48 KiB in 120 s "
             "(under ~0.4 KB/s, beyond the kernel's socket buffers), such as one that keeps the connection open and "
             "reads nothing; a client reading faster is served whole. Every other response's sends too: a whole "
             "generation body's stall aborts its request the same way, any other response's resets its connection "
             "(e.g. one pipelined behind a big unread body on a keep-alive connection). 0 = never (such a stream "
             "stays pending, such a response's task waits, while its client holds the connection)"),
    ] = 120.0
    max_prompt_tokens: Annotated[int, Meta(ge=1, description="longest accepted prompt (tokens)")] = 1_048_576
    max_output_tokens: Annotated[int, Meta(ge=1, description="largest accepted max_tokens (a default one is cut to it)")] = 131_072
    max_context_tokens: Annotated[
        int, Meta(ge=0, description="largest accepted prompt + max_tokens (the model's context, e.g. a torch engine's; an unset "
                  "max_tokens is cut to the rest); 0 = no limit")
    ] = 0
    model_vocab_size: Annotated[
        int, Meta(ge=0, description="the model's vocabulary size (a torch engine's config.json vocab_size): a prompt or "
                  "logit_bias token id at or past it, or past the tokenizer's, gets 400 naming it; 0 = the tokenizer's only")
    ] = 0
    chat_default_max_tokens: Annotated[
        int, Meta(ge=1, description="max_tokens of a chat request that sets neither max_tokens nor max_completion_tokens")
    ] = 256
    enable_auto_tool_choice: Annotated[
        bool,
        Meta(description="vLLM's: serve tool_choice 'auto' (and tools sent without tool_choice, which vLLM makes 'auto'): "
             "the output is read for the calls of --tool-call-parser's format and answered as message.tool_calls / "
             "delta.tool_calls, finish_reason 'tool_calls' when the model stopped after a call; needs "
             "--tool-call-parser. Off, such a request gets vLLM's 400 ('\"auto\" tool choice requires "
             "--enable-auto-tool-choice and --tool-call-parser to be set'); tool_choice 'none' is served either way"),
    ] = False
    trust_request_chat_template: Annotated[
        bool,
        Meta(description="vLLM's: render a request's own Jinja chat template (chat_template, or chat_template_kwargs."
             "chat_template) on /v1/chat/completions and /tokenize, in the same sandbox as the model's; off, such a "
             "request gets vLLM's 400 ('Chat template is passed with request, but --trust-request-chat-template is not "
             "set...'). A template is code the router runs for the client: it renders in 2 child processes (1 GiB address "
             "space each, 2 s a render: past it a 400; over 64 KiB: a 400); Jinja's sandbox is still trusted"),
    ] = False
    tool_call_parser: Annotated[
        str,
        Meta(description="vLLM's: the tool-call format the model writes, for --enable-auto-tool-choice: hermes "
             "(<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>: Qwen2.5/Qwen3, Hermes); empty = none"),
    ] = ""
    max_body_bytes: Annotated[int, Meta(ge=1024, description="largest accepted HTTP request body (bytes); larger gets 413")] = 64 * 1024 * 1024
    api_keys_file: Annotated[
        str, Meta(description="file of accepted API keys, one per line (# comments); with keys set, requests need 'Authorization: Bearer <key>' (else 401)")
    ] = ""
    api_keys: Annotated[
        str, Meta(description="accepted API keys, comma-separated (set it through the environment, EI_API_KEYS, not a flag); empty and no file = open")
    ] = ""
    api_keys_reload_file: Annotated[
        str, Meta(description="file read on SIGHUP in place of api_keys_file: its keys and api_keys_reload_keys become the accepted "
                  "ones; the keys at start still come from api_keys_file and api_keys, so a restart does not need this file "
                  "(up sets it to its --api-keys-file and the keys it last checked in EI_API_KEYS); also read once when the SIGHUP handler "
                  "is set, after the start (a SIGHUP during the start is ignored; a file that cannot be read leaves the start keys); "
                  "empty = SIGHUP reads api_keys_file")
    ] = ""
    api_key_id_salt: Annotated[
        str, Meta(description="secret the API key ids in the log are made with (HMAC-SHA256; set it through the environment, "
                  "EI_API_KEY_ID_SALT, not a flag); empty = random per process (ids stable for the router's life); up "
                  "gives its routers one per cluster, in LOG_DIR/api-key-id.salt")
    ] = ""
    api_keys_reload_keys: Annotated[
        str, Meta(description="with api_keys_reload_file: keys accepted beside that file's after a SIGHUP, comma-separated "
                  "(set it through the environment, EI_API_KEYS_RELOAD_KEYS; up: its own EI_API_KEYS)")
    ] = ""
    api_key_public_paths: Annotated[
        list[str], Meta(description="paths served without an API key, comma-separated")
    ] = msgspec.field(default_factory=lambda: ["/livez", "/healthz", "/health", "/ping", "/metrics"])
    api_key_max_inflight: Annotated[
        int, Meta(ge=0, description="requests one API key may have in flight (streams until they end); one more gets 429; 0 = unlimited")
    ] = 256
    allowed_origins: Annotated[
        list[Annotated[str, Meta(pattern=r"^(\*|[A-Za-z][A-Za-z0-9+.-]*://[^/\s\[\]\"',]+)$")]],
        Meta(description="CORS: origins a browser may call from, comma-separated (e.g. https://app.example:8443, or *); "
             "empty = no CORS headers and no preflight answer (vLLM's --allowed-origins, a JSON list there)"),
    ] = msgspec.field(default_factory=list)
    allowed_methods: Annotated[
        list[str], Meta(description="CORS: methods allowed cross-origin, comma-separated (* = all); only with allowed_origins")
    ] = msgspec.field(default_factory=lambda: ["*"])
    allowed_headers: Annotated[
        list[str], Meta(description="CORS: request headers allowed cross-origin, comma-separated (* = all); only with allowed_origins")
    ] = msgspec.field(default_factory=lambda: ["*"])
    allow_credentials: Annotated[
        bool, Meta(description="CORS: allow credentials (cookies, Authorization) cross-origin; only with allowed_origins")
    ] = False
    header_timeout_s: Annotated[
        float, Meta(gt=0, description="wall seconds a connection may take to send a complete request head; then it is closed (slowloris)")
    ] = 10.0
    body_timeout_s: Annotated[
        float, Meta(gt=0, description="wall seconds to receive a whole request body; then 408 and the connection is closed")
    ] = 30.0
    max_id_len: Annotated[int, Meta(ge=1, le=4096, description="longest accepted X-Branch-Id / X-Parent-Branch-Id / X-Agent-Id")] = 256
    max_ended_branches: Annotated[int, Meta(ge=0, description="ended branch ids remembered (a request on one -> 400, its end or tool call -> 410)")] = 100_000
    max_active_branches: Annotated[
        int,
        Meta(ge=1, description="most active branches (X-Branch-Id) kept: a new branch past it evicts the least recently "
             "active one with no request in flight (one with a tool-call hint running only when no other is idle), expired as by --branch-ttl-s (resumable; the directory is told to "
             "release its counts; counted branches_evicted, ei_router_branches_evicted_total)"),
    ] = 65_536
    branch_ttl_s: Annotated[
        float,
        Meta(gt=0, description="simulated seconds without a request after which a branch expires (as the directory's "
             "--branch-ttl-s; measured on the monotonic clock: a step of the wall clock expires no branch); its next "
             "request is a resume: accepted, re-announced (BranchStart)"),
    ] = 1800.0
    log_requests: Annotated[
        bool,
        Meta(description="log one info line per request when it is accepted (request accepted: rid, branch and its kind, parent "
             "and agent when sent, prompt_tokens, max_tokens, stream) and one when it ends (request finished: rid, status, finish_reason as counted in "
             "ei_router_requests_finished_total, prompt/cached/output tokens, ttft_s and e2e_s in router-clock seconds (wall "
             "seconds x --speedup, as ei_router_ttft_seconds; wall seconds at --speedup 1), prefill and decode node; "
             "request rejected: a request refused before it was accepted, and a 401 / 404 / 429 on another path, with its "
             "path); vLLM's --enable-log-requests"),
    ] = False
    max_tool_hold_s: Annotated[
        float, Meta(gt=0, description="longest hold of a tool-call hint (POST /v1/branches/{id}/tool-call), simulated s")
    ] = 14400.0

    def __post_init__(self) -> None:
        if self.tool_call_parser:  # imported only then: simulate builds a RouterConfig per run and never parses calls
            from services.router.toolcalls import check_parser

            check_parser(self.tool_call_parser)
        if self.enable_auto_tool_choice and not self.tool_call_parser:  # vLLM refuses it at start too
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (known: hermes)")
        if self.allow_credentials and "*" in self.allowed_origins:
            # Starlette's CORS middleware would answer any origin with that origin and
            # Access-Control-Allow-Credentials: true (a literal * with credentials is refused by
            # browsers, Fetch standard §3.2.5), so every web page could send a visitor's credentials
            raise ValueError("allow_credentials with allowed_origins '*' would let any web page send credentialed requests; list the origins")

    def routing_policy(self, **extra: object) -> "RoutingPolicy":
        """The ``--routing`` policy the router runs: :meth:`policy_options` with ``--profile-clock`` and
        ``--speedup``, so that the ttft policy's profile is on the cluster clock (a ``wall`` profile, a torch
        worker's measured at speed-up 1, predicts its times x ``--speedup``: ``shared.profile.on_cluster_clock``),
        binding decode nodes by ``--decode-routing`` (``services.router.policy.with_decode_routing``: round-robin
        wraps the policy in ``RoundRobinDecode``).

        Args:
            extra: more options for ``make_policy`` (the service's ``ttft_breakdown``).

        Raises:
            ValueError: an unknown policy, a bad option, or a profile that cannot be loaded (``ProfileError``).
        """
        from services.router.policy import make_policy, with_decode_routing

        policy = make_policy(self.routing, **self.policy_options(), profile_clock=self.profile_clock, speedup=self.speedup, **extra)
        return with_decode_routing(policy, self.decode_routing)

    def policy_options(self) -> dict[str, object]:
        """Every policy knob, for ``make_policy(routing, **options)`` (each policy takes its own)."""
        return {
            "cache_threshold": self.cache_threshold,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
            "block_size": self.block_size,
            "profile": self.profile,
            "ttft_chunk_tokens": self.ttft_chunk_tokens,
            "ttft_fetch_base_s": self.ttft_fetch_base_s,
            "ttft_fetch_per_token_s": self.ttft_fetch_per_token_s,
            "ttft_fetch_min_tokens": self.ttft_fetch_min_tokens,
            "ttft_copy_price_s_per_token": self.ttft_copy_price_s_per_token,
            "ttft_state_max_age_s": self.ttft_state_max_age_s,
            "ttft_prune_above": self.ttft_prune_above,
            "dynamo_overlap_score_credit": self.dynamo_overlap_score_credit,
            "dynamo_host_cache_hit_weight": self.dynamo_host_cache_hit_weight,
            "dynamo_prefill_load_scale": self.dynamo_prefill_load_scale,
            "dynamo_temperature": self.dynamo_temperature,
            "sticky_ttl_s": self.sticky_ttl_s,
            "seed": self.seed,
        }
