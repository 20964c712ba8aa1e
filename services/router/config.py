"""Router configuration: one frozen Struct; flags ``--field-name``, env ``EI_FIELD_NAME``, TOML ``[router]``."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from shared.config import CommonConfig


class RouterConfig(CommonConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of the router service (HTTP ingress + routing)."""

    host: Annotated[str, Meta(description="HTTP listen address")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535, description="HTTP listen port; 0 = a free port chosen by the kernel")] = 8000
    port_file: Annotated[
        str, Meta(description="if set, write the bound HTTP port (decimal, newline) to this file once listening")
    ] = ""
    routing: Annotated[str, Meta(description="prefill routing policy by name: cache-aware | round-robin")] = "cache-aware"
    tokenizer: Annotated[str, Meta(description="sim (built-in, deterministic) or hf:<local path to tokenizer.json or model folder>")] = "sim"
    model: Annotated[str, Meta(description="model name served (GET /v1/models; requests naming another model get 404)")] = "evolving-infra-sim"
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
    fence_after_s: Annotated[
        float, Meta(gt=0, description="wall seconds without a node.state after which a node is fenced out")
    ] = 3.0
    lookup_timeout_s: Annotated[
        float, Meta(gt=0, description="wall seconds to wait for the directory's kv.lookup reply before routing without cache info")
    ] = 0.5
    split_get_timeout_s: Annotated[
        float, Meta(ge=0, description="wall seconds to keep asking the planner (split.get) at start before using node-reported phases")
    ] = 30.0
    request_timeout_s: Annotated[
        float, Meta(gt=0, description="wall seconds a request may wait for its next output chunk before it fails with 504")
    ] = 600.0
    max_prompt_tokens: Annotated[int, Meta(ge=1, description="longest accepted prompt (tokens)")] = 1_048_576
    max_output_tokens: Annotated[int, Meta(ge=1, description="largest accepted max_tokens")] = 131_072
    chat_default_max_tokens: Annotated[
        int, Meta(ge=1, description="max_tokens of a chat request that sets neither max_tokens nor max_completion_tokens")
    ] = 256
    max_body_bytes: Annotated[int, Meta(ge=1024, description="largest accepted HTTP request body (bytes); larger gets 413")] = 64 * 1024 * 1024
    max_id_len: Annotated[int, Meta(ge=1, le=4096, description="longest accepted X-Branch-Id / X-Parent-Branch-Id / X-Agent-Id")] = 256
    max_ended_branches: Annotated[int, Meta(ge=0, description="ended branch ids remembered (duplicate end -> 409)")] = 100_000
