"""The router's Prometheus families, built at scrape time from the core's records (shell side).

Served on the router's HTTP port (``GET /metrics``) and on ``--metrics-port``
when set. Latencies are seconds of the router's cluster clock: simulated seconds under
``--speedup`` N (N of them per wall second), wall seconds at ``--speedup 1`` (the default).

Token rates as vLLM's dashboards draw them: ``rate(ei_router_generation_tokens_total[1m])``
(vLLM ``vllm:generation_tokens_total``, Dynamo's output sequence tokens) and
``rate(ei_router_prompt_tokens_total[1m])`` (``vllm:prompt_tokens_total``). Both count once per
request: prompt tokens when its first output token arrives (its ``usage.prompt_tokens``), output
tokens as they are sent (a non-streamed response's when it is sent; a stream's with each data
chunk), so over finished requests ``generation_tokens_total`` is the sum of their
``usage.completion_tokens``. ``ei_router_inter_token_latency_seconds`` is vLLM's
``inter_token_latency_seconds``: a chunk of k tokens after a gap g (router clock, chunk to chunk)
gives k samples of g/k, so ``--stream-interval`` > 1 spreads a chunk's gap over its tokens; its
``_sum / _count`` over a request is that request's ``ei_router_tpot_seconds`` sample (a per-request
mean, kept as is).

==================================================  =========  ==========================================================
name                                                type       meaning
==================================================  =========  ==========================================================
``ei_router_ttft_seconds``                          histogram  HTTP arrival → first output chunk, per request
``ei_router_tpot_seconds``                          histogram  (E2E − TTFT) / (output tokens − 1), served requests
``ei_router_e2e_seconds``                           histogram  HTTP arrival → last chunk, served requests
``ei_router_inter_token_latency_seconds``           histogram  per output token after the first: the gap between the
                                                               output chunks that brought it, over that chunk's tokens
``ei_router_input_sequence_tokens{model}``          histogram  prompt tokens per request (``usage.prompt_tokens``), at its
                                                               first output token; ``model`` the served name (``--model``)
``ei_router_output_sequence_tokens{model}``         histogram  output tokens per served request (the client's
                                                               ``usage.completion_tokens``), at its end
``ei_router_queue_seconds{node}``                   histogram  time queued on the prefill node (first chunk's queue_s)
``ei_router_ttft_prediction_abs_error_seconds``     histogram  abs(predicted − measured TTFT) of the routing policy
``ei_router_requests_total{code}``                  counter    generation requests (``POST`` completions, chat) by HTTP
                                                               status (a ``GET``'s 405: only in ``..._http_responses_total``)
``ei_router_requests_finished_total{reason}``       counter    requests that ended, once each, by the finish reason the
                                                               client saw: stop / length (served), error / abort (failed)
``ei_router_prompt_tokens_total``                   counter    prompt tokens of requests that got a first token
``ei_router_generation_tokens_total``               counter    output tokens sent to clients (``usage.completion_tokens``;
                                                               a stream that fails or is abandoned: what was sent)
``ei_router_cached_prompt_tokens_total``            counter    of those, tokens whose KV was reused (hit)
``ei_router_kv_hit_ratio``                          gauge      cached / prompt tokens so far (served KV hit rate)
``ei_router_routed_total{phase,node}``              counter    placements (prefill / decode) per node (a node the router
                                                               forgets, ``--forget-node-after-s``, leaves with its series)
``ei_router_inflight_requests``                     gauge      requests placed and not finished, as this router's load
                                                               view counts them: its own and, with several routers, the
                                                               others' it heard of (``route.sent``): the same on each
                                                               router, not a per-router share to sum
``ei_router_split_epoch``                           gauge      epoch of the split the router applies
``ei_router_split_nodes``                           gauge      nodes the split the router applies names (all phases,
                                                               dead ones included; 0 before its first split)
``ei_router_live_nodes{phase}``                     gauge      nodes routable now: prefill = prefill and collocated
                                                               nodes, decode = decode-only nodes
``ei_router_redispatches_total{lost}``              counter    requests placed again after a node they depended on was
                                                               fenced, by what was lost: ``prefill`` (before the first
                                                               token), ``decode`` (the decode or collocated node,
                                                               mid-stream: continued after the tokens sent),
                                                               ``handoff`` (the prefill node of a PD placement,
                                                               after the first token, before the hand-off)
``ei_router_node_fences_total{node}``               counter    times the router fenced the node out: no ``node.state``
                                                               within ``--fence-after-s``, or restarted (its state
                                                               sequence went back: a worker killed and restarted)
``ei_router_slow_client_aborts_total``              counter    requests aborted because their client did not take its
                                                               output: the most unread when the unread output of all
                                                               requests passed ``--max-buffered-output-tokens``
``ei_router_chunks_gap_total``                     counter    requests failed (502 'output lost') because output
                                                               tokens never reached the router: chunks after them
                                                               waited ``CHUNK_GAP_WAIT_S`` without them
``ei_router_chunks_bad_logprobs_total``            counter    requests failed (502) because a node's chunk carried more
                                                               log-probabilities than the request asked for (none, or
                                                               more than its top k a token): malformed output
``ei_router_buffered_output_tokens``                gauge      output tokens held for clients that have not taken them
``ei_router_branches_active``                       gauge      ``X-Branch-Id`` branches active (not ended, not expired)
``ei_router_branches_expired_total``                counter    branches expired silent past ``--branch-ttl-s`` (resumable)
``ei_router_branches_evicted_total``                counter    branches expired early by the ``--max-active-branches`` cap
``ei_router_branches_resumed_total``                counter    requests of an expired branch accepted as its resume
``ei_router_branch_parents_missing_total{reason}``  counter    new branches whose ``X-Parent-Branch-Id`` this router
                                                               does not know (``unknown``: maybe another router's)
                                                               or has ended (``ended``); served, warned (rate-limited);
                                                               the label the directory's family has (it also counts
                                                               ``expired``: a parent whose counts it released, which
                                                               this router still holds as resumable)
``ei_router_drain_refused_total``                   counter    generation requests refused (503, ``retry-after``) while
                                                               the router drained after a SIGTERM
``ei_router_gone_before_dispatch_total``            counter    requests whose client closed the connection before they
                                                               were sent to a node (499, nothing dispatched)
``ei_router_gate_disconnects_total``                counter    requests whose client closed the connection while their
                                                               big body waited for a parse slot (499)
``ei_router_http_responses_total{endpoint,code}``   counter    every HTTP response by endpoint (the router's paths, route
                                                               templates, ``other``) and status: 401s of any path too
``ei_router_api_key_reloads_total{result}``         counter    API key reloads (SIGHUP): ``ok``, or ``failed`` (the keys
                                                               in use stayed: no keys file, or it is unreadable / empty)
==================================================  =========  ==========================================================

``ei_router_requests_finished_total``: every request the router accepted (placed) counts once
when it ends, also when the router ends it itself: ``stop`` also for a stop string or stop
token id matched at the router; ``length`` also for a request whose last tokens arrived and
whose node died before its end; ``error`` for a node's error chunk and the router's 5xx
(continuation impossible, parked work expired, node fenced, request timeout, dispatch failed) and
for a node's abort chunk, which its client gets as a 503 (a prefill node that found no decode node
to bind: the failure parked work that expires is); ``abort`` for a client that went away or was too slow
(``--max-buffered-output-tokens``) and a
router shutting down. Requests
refused before placement (4xx, no route) are only in ``ei_router_requests_total{code}``, which
counts a stream's status when its headers go out (200 also for a stream that later fails).

``ei_router_kv_hit_ratio`` is the share of *all* prompt tokens whose KV was reused (the run
report's "KV hit"). It is not the directory's ``ei_kv_hit_ratio`` (h/h*: the share of the
*reusable* prefix tokens the cluster held, ``services/kvdirectory/prom.py``), which is higher
whenever prompts carry new tokens.

Not exported: ``drain_left_open`` (requests still open when a drain ended: grace over or a second
signal) and ``drain_left_busy_connections`` (on a held socket, connections with a request partly read
then), counted just before the process stops, so no scrape sees them: the ``router drained`` log line
carries them (``open_requests``, ``busy_connections``). The rest of the JSON counters (``/v1/stats``) are there only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import Metric

from shared.metrics import by_prefix, counter_family, gauge_family, histogram_family

if TYPE_CHECKING:
    from services.router.service import RouterService

REDISPATCH_KINDS = ("prefill", "decode", "handoff")
"""What a re-dispatched request lost with its fenced node (``RouterService._redispatch``'s ``redispatch.<kind>`` counters)."""

_MODEL_HELP = ("model = the served model name, every response's model (up and demo: their first --served-model-name, "
               "else the --model folder's name with --engine torch, evolving-infra-sim with sim; the router's own --model)")
"""The ``model`` label's meaning in the sequence-length histograms' help: ``up`` users set the served name with
``--served-model-name``; the router's ``--model`` is what ``up`` passes it (review 55 L6: the help said ``--model``)."""


def router_families(svc: "RouterService") -> Iterator[Metric]:
    """Every router family (table in the module docstring) from ``svc``'s core and counters."""
    mt = svc.core.metrics
    c = svc.counters
    yield histogram_family("ei_router_ttft_seconds", "Time to first token (s, router clock: simulated s under --speedup, wall s at speedup 1): HTTP arrival to the first output chunk", {(): mt.ttft})
    yield histogram_family("ei_router_tpot_seconds", "Time per output token after the first (s, router clock: simulated s under --speedup, wall s at speedup 1): (E2E - TTFT) / (output tokens - 1), one sample per served request", {(): mt.tpot})
    yield histogram_family("ei_router_e2e_seconds", "End-to-end latency (s, router clock: simulated s under --speedup, wall s at speedup 1): HTTP arrival to the last chunk, served requests", {(): mt.e2e})
    yield histogram_family(
        "ei_router_inter_token_latency_seconds",
        "Inter-token latency (s, router clock: simulated s under --speedup, wall s at speedup 1): per output token after the first, the gap since the previous output "
        "chunk over the tokens of the chunk that brought it",
        {(): mt.itl},
    )
    model = (svc.cfg.model,)  # Dynamo's label: one series, the served name (every response's model)
    yield histogram_family(
        "ei_router_input_sequence_tokens",
        "Input sequence length (tokens): each request's prompt tokens (usage.prompt_tokens) when its first output "
        f"token arrives; {_MODEL_HELP}; Dynamo's dynamo_frontend_input_sequence_tokens",
        {model: mt.isl}, ["model"],
    )
    yield histogram_family(
        "ei_router_output_sequence_tokens",
        "Output sequence length (tokens): each served request's output tokens (usage.completion_tokens) when it ends; "
        f"{_MODEL_HELP}; Dynamo's dynamo_frontend_output_sequence_tokens",
        {model: mt.osl}, ["model"],
    )
    yield histogram_family(
        "ei_router_queue_seconds",
        "Time a request queued on its prefill node before its first prefill chunk (s, cluster clock: simulated s under --speedup, wall s at speedup 1)",
        {(node,): h for node, h in sorted(mt.queue.items())},
        ["node"],
    )
    yield histogram_family(
        "ei_router_ttft_prediction_abs_error_seconds",
        "Absolute error of the routing policy's predicted TTFT (s, router clock: simulated s under --speedup, wall s at speedup 1; policies that predict)",
        {(): mt.ttft_abs_err},
    )
    yield counter_family(
        "ei_router_requests",
        "Generation requests (POST /v1/completions, /v1/chat/completions) by HTTP status code; another method on those "
        "paths (a GET's 405, a CORS preflight) is only in ei_router_http_responses_total",
        by_prefix(c, "requests."), ["code"],
    )
    finished = by_prefix(c, "finished.")  # served: stop / length
    finished.update(by_prefix(c, "finish."))  # failed: error / abort
    yield counter_family(
        "ei_router_requests_finished",
        "Requests that ended, each once, by the finish reason its client saw: stop / length (served), "
        "error / abort (failed at a node or ended by the router)",
        finished, ["reason"],
    )
    yield counter_family("ei_router_prompt_tokens", "Prompt tokens of requests that got a first token", {(): mt.prompt_tokens})
    yield counter_family(
        "ei_router_generation_tokens",
        "Output (generation) tokens sent to clients: usage.completion_tokens of finished requests, what was sent of "
        "streams that failed or whose client left",
        {(): mt.generation_tokens},
    )
    yield counter_family(
        "ei_router_cached_prompt_tokens", "Prompt tokens whose KV was reused (local or fetched) instead of computed", {(): mt.cached_tokens}
    )
    yield gauge_family(
        "ei_router_kv_hit_ratio",
        "Served KV hit rate: cached over all prompt tokens so far (ei_router_cached_prompt_tokens_total / "
        "ei_router_prompt_tokens_total); not the directory's ei_kv_hit_ratio (h/h*, reusable prefix tokens only)",
        {(): mt.kv_hit_rate or 0.0},
    )
    routed: dict[tuple[str, ...], float] = {("prefill", k[0]): v for k, v in by_prefix(c, "routed.prefill.").items()}
    routed.update({("decode", k[0]): v for k, v in by_prefix(c, "routed.decode.").items()})
    yield counter_family("ei_router_routed", "Placements per node and phase", routed, ["phase", "node"])
    view = svc.core.view
    now = svc.clock.now()
    yield gauge_family(
        "ei_router_inflight_requests",
        "Requests placed and not finished, as this router's load view counts them: its own and, with several routers "
        "on the partition, the other routers' it heard of (route.sent); about the same on every router, not its share",
        {(): float(view.inflight_total)},
    )
    yield gauge_family("ei_router_split_epoch", "Epoch of the PD split the router applies", {(): float(view.epoch)})
    yield gauge_family(
        "ei_router_split_nodes",
        "Nodes the PD split the router applies names, every phase, dead ones included (0 before its first split): "
        "less ei_router_live_nodes, the split's nodes it cannot place on",
        {(): float(view.split_nodes)},
    )
    yield gauge_family(
        "ei_router_live_nodes",
        "Nodes the router can place on now, by phase: prefill = prefill and collocated (both) nodes, decode = "
        "decode-only nodes (0 while every node is collocated)",
        {("prefill",): float(len(view.prefill_candidates(now))), ("decode",): float(len(view.decode_candidates(now)))},
        ["phase"],
    )
    redispatched: dict[tuple[str, ...], float] = {(k,): float(c.get(f"redispatch.{k}", 0)) for k in REDISPATCH_KINDS}
    yield counter_family(
        "ei_router_redispatches",
        "Requests placed again after a node they depended on was fenced (its client sees one response), by what was "
        "lost: prefill (before the first token), decode (the decode or collocated node mid-stream: continued after the "
        "tokens sent), handoff (the prefill node of a PD placement after the first token, before the hand-off); a stream "
        "that could not be continued exactly ends as error in ei_router_requests_finished_total",
        redispatched, ["lost"],
    )
    yield counter_family(
        "ei_router_node_fences",
        "Times the router fenced a node out (placed nothing on it until it reported again): no node.state within "
        "--fence-after-s, or restarted (its state sequence went back); every node the router knows, from 0",
        {(rec.node,): float(rec.fence_events) for rec in view.nodes.values()},
        ["node"],
    )
    yield counter_family(
        "ei_router_slow_client_aborts",
        "Requests aborted because their client did not take its output (a stream read slower than it came, or not "
        "at all): the one with the most unread tokens, each time the unread output of all requests passed "
        "--max-buffered-output-tokens; its stream ends with an error event 'client too slow'",
        {(): float(c.get("slow_client_aborts", 0))},
    )
    yield counter_family(
        "ei_router_chunks_gap",
        "Requests failed with a 502 'output lost: tokens a..b never arrived' because output tokens never reached the "
        "router: later chunks of the request waited CHUNK_GAP_WAIT_S (7 s: a NATS reconnect's resend; longer while the "
        "router's own NATS link settles) without the missing ones (a reliable message lost on the bus)",
        {(): float(c.get("chunks_gap", 0))},
    )
    yield counter_family(
        "ei_router_chunks_bad_logprobs",
        "Requests failed with a 502 because a node's token chunk carried more log-probabilities than the request asked "
        "for (some when it asked none, or more than its top k entries a token): malformed output from that node (a "
        "worker bug or a mismatched version), also aborts.bad_logprobs",
        {(): float(c.get("chunks_bad_logprobs", 0))},
    )
    yield gauge_family(
        "ei_router_buffered_output_tokens",
        "Output tokens the router holds for clients that have not taken them yet (at most --max-buffered-output-tokens)",
        {(): float(svc.buffered_output_tokens)},
    )
    branches = svc.branches
    yield gauge_family(
        "ei_router_branches_active", "X-Branch-Id branches active: started or resumed, not ended, not expired",
        {(): float(branches.active_count)},
    )
    yield counter_family(
        "ei_router_branches_expired",
        "X-Branch-Id branches expired silent past --branch-ttl-s (resumable while remembered); those the "
        "--max-active-branches cap expired are ei_router_branches_evicted_total",
        {(): float(branches.expired)},
    )
    yield counter_family(
        "ei_router_branches_evicted",
        "X-Branch-Id branches expired early (resumable) by the --max-active-branches cap: the least recent idle ones, "
        "each time a new or resumed branch passed it",
        {(): float(branches.evicted)},
    )
    yield counter_family(
        "ei_router_branches_resumed", "Requests of an expired X-Branch-Id branch accepted as its resume", {(): float(branches.resumed)}
    )
    yield counter_family(
        "ei_router_branch_parents_missing",
        "New X-Branch-Id branches (fork or sub-agent) whose X-Parent-Branch-Id this router does not know (reason "
        "unknown: never seen here or forgotten; it may be another router's) or has ended (reason ended); each served; "
        "the log warns of the first 5 of a reason per 10 s, then counts the rest",
        {(state,): float(n) for state, n in branches.parents_missing.items()}, ["reason"],
    )
    yield counter_family(
        "ei_router_drain_refused",
        "Generation requests refused with 503 (retry-after 1) while the router drained open requests after a SIGTERM "
        "(--shutdown-grace-s)",
        {(): float(c.get("drain_refused", 0))},
    )
    yield counter_family(
        "ei_router_gone_before_dispatch",
        "Generation requests whose client closed the connection before they were sent to a node (499, nothing dispatched)",
        {(): float(c.get("http.gone_before_dispatch", 0))},
    )
    yield counter_family(
        "ei_router_gate_disconnects",
        "Requests whose client closed the connection while their big body waited for a parse slot (499, never parsed)",
        {(): float(c.get("http.gate_disconnects", 0))},
    )
    yield counter_family(
        "ei_router_api_key_reloads",
        "API key reloads (SIGHUP; up: SIGUSR1) by result: ok (the file's keys replaced the old ones), failed (no "
        "--api-keys-file, an open router, or a file unreadable or without a key: the keys in use stayed)",
        {("ok",): float(c.get("api_keys.reloaded", 0)), ("failed",): float(c.get("api_keys.reload_failed", 0))},
        ["result"],
    )
    yield counter_family(
        "ei_router_http_responses",
        "HTTP responses of every path by endpoint and status code (ei_router_requests_total counts the generation "
        "paths only): a 401 of GET /v1/models or /version too; endpoint is one of the router's paths, a route template "
        "(/v1/models/{model}, /v1/branches/{branch_id}/end, /v1/branches/{branch_id}/tool-call), or other",
        {k: float(v) for k, v in sorted(svc.http_responses.items())}, ["endpoint", "code"],
    )
