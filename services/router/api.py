"""OpenAI-compatible request bodies, header validation and response shapes.

No I/O here: bodies are decoded from bytes into msgspec Structs (fast even
for a prompt of ~300K token ids), semantic checks raise :class:`ApiError`
with the HTTP status and the reason, and the response builders return plain
dicts that the shell encodes with ``msgspec.json``.

Sampling fields (:func:`sampling`). Sent to the nodes in
:class:`~shared.messages.Sampling` and applied by the ``torch`` engine:
``temperature`` [0, :data:`~shared.validate.MAX_TEMPERATURE`] (0 = greedy, the default; vLLM and SGLang take
any temperature ≥ 0, OpenAI [0, 2]; 100 is the nodes' bound, which the API may not pass), ``top_p`` (0, 1], ``top_k``
(-1 or 0 = off, else ≥ 1, as vLLM), ``min_p`` [0, 1], ``seed`` (int64),
``stop_token_ids``; ``ignore_eos``; ``logit_bias`` (keys integer token ids in the vocabulary,
values in [-100, 100], as OpenAI: :func:`check_logit_bias`; added to the logits before the
penalties, so -100 effectively bans a token); ``presence_penalty`` / ``frequency_penalty``
[-2, 2], ``repetition_penalty`` [0.01, 100] (1 = off) and ``min_tokens`` (≥ 0, at most an
explicit ``max_tokens`` here, at most the defaulted one in ``RouterService._prepare_body``; vLLM's extras). ``stop`` (a string or a list of at most
:data:`MAX_STOP` non-empty strings of at most :data:`MAX_STOP_LEN` characters)
is applied by the router where it detokenizes (``services.router.stops``), for
every engine, and so is ``include_stop_str_in_output`` (vLLM's extra: keep the matched stop
string, or the stop token id's text, in the output). The ``sim`` engine has no real tokens: it accepts the sampling
parameters and ignores them (always ``max_tokens`` tokens, unless the router ends
the text at a stop string or stop token id); ``logit_bias`` is refused there, as ``logprobs`` (below).
*Accepted, validated and ignored*: ``user``, ``parallel_tool_calls``, ``skip_special_tokens``, ``response_format``
``{"type": "text"}``. ``tool_choice`` (:func:`tool_choice`, vLLM's rules): ``none`` (or ``null``, or absent
without ``tools``) is served as text; ``auto`` (or absent with ``tools``) needs the router's
``--enable-auto-tool-choice --tool-call-parser hermes`` and then answers the calls in the output as
``tool_calls`` (``services.router.toolcalls``; only with a non-empty ``tools``, as vLLM), else a 400 (:data:`AUTO_TOOL_CHOICE_OFF`, vLLM's); a
``tool_choice`` without ``tools`` is a 400 (vLLM's). Rejected with 400 because no engine here
constrains the output (vLLM does, by guided decoding; :func:`_check_no_output_constraint`): any other
``response_format`` type (``json_object``, ``json_schema``), a ``tool_choice`` that forces a tool call
(``required``, a named function) and vLLM's guided-decoding extras ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``, ``structured_outputs``; vLLM's ``prompt_logprobs`` too (no engine here
computes the prompt's logprobs; :func:`_check_no_vllm_extras`). ``tools`` are rendered into
the chat prompt. Rejected with 400 because they would change the response
shape: ``n`` > 1, ``best_of`` > 1, ``suffix``, batched prompts, completions ``echo`` with
``logprobs`` (vLLM adds the prompt's logprobs, which no engine here computes); ``echo`` alone
puts the prompt's text (a token-id prompt detokenized, special tokens shown, as vLLM) before the choice's text;
chat ``echo`` (vLLM's extra) puts the last message's content before the reply when that message is the
assistant's (:func:`chat_echo`). ``logprobs`` (:func:`logprobs_asked`): chat ``logprobs: true`` with
``top_logprobs`` 0..20, completions ``logprobs`` 0..:data:`MAX_LOGPROBS` (``true`` / ``false`` read as 1 / 0, as vLLM's pydantic ``int`` does; vLLM's default
``max_logprobs``; OpenAI's legacy API allows 5) are sent to the nodes in
``Sampling.logprobs`` and answered in OpenAI's / vLLM's shapes (:func:`chat_logprobs`,
:func:`completion_logprobs`); only the ``torch`` engine computes them (and applies ``logit_bias``): the
router refuses either with a 400 while a node it may place the request on runs the ``sim`` engine. Unknown fields are ignored (clients send
vendor extensions); a known field with a wrong type or value is a 400 naming
the field (in the message and in the error's ``param``, as OpenAI's API does). vLLM's chat-template
extras are applied (:func:`render_chat`): chat ``add_generation_prompt`` / ``continue_final_message`` /
``add_special_tokens`` / ``chat_template_kwargs`` (:func:`template_kwargs`) and completions ``add_special_tokens``;
a request's ``chat_template`` only with the router's ``--trust-request-chat-template``, else vLLM's 400
(:func:`request_chat_template`); token ids of any size are decoded and the
router names the first outside the vocabulary (:func:`check_token_ids`).
An explicit ``null`` is the default for every field OpenAI's spec marks nullable
(``stream``, ``n``, ``logprobs``, ``echo``, ``stream_options.*``, ...), as vLLM's
``Optional[...]`` fields take it; ``ignore_eos`` / ``skip_special_tokens`` stay
strict booleans (vLLM's are too).
"""

from __future__ import annotations

import json
import math
import re
import functools
import hashlib
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar, cast

import msgspec
from msgspec import Meta, Struct

from shared.messages import BranchKind, Sampling
from services.router.template_pool import MAX_TEMPLATE_CHARS
from shared.tokenizer import TemplateKwargError, check_template_kwargs
from shared.validate import (  # the nodes' bounds of a work's Sampling: the API takes no more than they do
    MAX_ABS_LOGIT_BIAS,
    MAX_LOGIT_BIAS,
    MAX_MIN_TOKENS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
)
from shared.validate import MAX_TOP_LOGPROBS as MAX_LOGPROBS

TokenId = Annotated[int, Meta(ge=0, le=0xFFFFFFFF)]
PosInt = Annotated[int, Meta(ge=1)]
Temperature = Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Prob = Annotated[float, Meta(ge=0.0, le=1.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
MAX_STOP = 16
"""Most stop strings of one request (OpenAI allows 4; vLLM has no limit)."""
MAX_STOP_LEN = 1024
"""Longest stop string, characters (the router holds back that much streamed text)."""
LOGPROB_FLOOR = -9999.0
"""A log-probability of -inf (a token the model rules out) is sent as this, as vLLM does (JSON has no -inf);
NaN (a chunk of a node that sent none) is sent as ``null``."""


_T = TypeVar("_T")


class ApiError(Exception):
    """A request the router refuses; ``status`` is the HTTP status, ``reason`` the message."""

    def __init__(self, status: int, reason: str, *, param: str | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.param = param


_OPENAI_CODES: dict[int, tuple[str, str]] = {
    401: ("invalid_request_error", "invalid_api_key"),
    429: ("requests", "rate_limit_exceeded"),
}
"""The statuses whose ``type`` and ``code`` are OpenAI's own strings (:func:`error_body`)."""


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The one error body of the router's HTTP API, every status and every path alike (the API's refusals,
    the API-key guard's 401 / 400 / 429, an unknown path's 404 or 405, a 503, a refused CORS preflight's 400, an
    unexpected exception's 500, a stream's ``data: {"error": ...}`` event; not uvicorn's own 400 for malformed
    HTTP): OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

    * ``type``: OpenAI's: ``invalid_request_error`` for a 4xx (OpenAI's 400, its 404 for an unknown model
      or URL, its 401 for a bad key), ``requests`` for the 429 (OpenAI's requests-per-minute limit),
      ``server_error`` for a 5xx (OpenAI's 500 and its 503 "overloaded"). vLLM's types differ among its own
      paths (``BadRequestError``, ``NotFoundError``, the status phrase ``Service Unavailable`` / ``Not Found``
      of an HTTP exception: ``vllm/entrypoints/serve/exception_handling``), so no client can rely on them.
    * ``code``: the HTTP status as an int (vLLM's ``ErrorInfo.code``: clients of vLLM read it, e.g. a
      stream's error event, which has no status line), except where vLLM sends no such body and OpenAI's
      string code is the only one a client knows: 401 ``invalid_api_key`` (vLLM's 401 is
      ``{"error": "Unauthorized"}``) and 429 ``rate_limit_exceeded`` (vLLM has no per-key limit).
    * ``param``: the field at fault (a request field, a header such as ``Authorization``,
      ``model`` for an unknown model, as both OpenAI and vLLM), else null.

    Raises:
        ValueError: ``status`` is not an error status (below 400 or above 599).
    """
    if not 400 <= status <= 599:
        raise ValueError(f"an error body needs a 4xx or 5xx status, got {status}")
    kind, code = _OPENAI_CODES.get(status, ("server_error" if status >= 500 else "invalid_request_error", status))
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --------------------------------------------------------------------------- #
# request bodies
# --------------------------------------------------------------------------- #


class StreamOptions(Struct, kw_only=True):
    """``stream_options``; ``null`` members are ``false`` (OpenAI: a usage chunk only when asked)."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(Struct, kw_only=True):
    """Fields shared by both endpoints (see the module docstring for what is ignored)."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Prob | None = None
    n: PosInt | None = 1
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_MIN_TOKENS)] | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    prompt_logprobs: Any = None
    """vLLM's extras none of the engines here can honour (:func:`_check_no_vllm_extras`): any value but null is a 400."""


_GUIDED_EXTRAS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
"""vLLM's guided-decoding extras (both endpoints): they constrain the output, which no engine here does."""


class CompletionRequest(_Sampling, kw_only=True):
    """``POST /v1/completions``; ``prompt`` is text or token ids."""

    prompt: str | list[int]
    """Text or token ids; ids are checked against the vocabulary by the router (``check_token_ids``), so an id
    of any size gets the same 400."""
    max_tokens: PosInt | None = None
    add_special_tokens: bool = True
    """vLLM's extra: False encodes a text prompt without the model's special tokens (BOS)."""
    echo: bool | None = False
    logprobs: int | bool | None = None
    """Top log-probabilities per token, 0..:data:`MAX_LOGPROBS`; ``true`` / ``false`` are 1 / 0, as vLLM's pydantic
    ``int`` field reads them (lax mode: ``{"logprobs": true}`` is 1, ``false`` 0, which asks for the chosen token's
    logprob with no alternatives); :func:`parse_completion` leaves an int here."""
    best_of: PosInt | None = None
    suffix: str | None = None


class _AnyPrompt(Struct, kw_only=True):
    """Second-chance decode of ``prompt`` to explain batched/ nested forms."""

    prompt: Any = None


class _CompletionAnyPrompt(CompletionRequest, kw_only=True):
    """The other fields of a completions body whose prompt is decoded apart (``[text]`` / ``[[ids]]``), checked
    with their types (an untyped decode of the whole body refused an integer msgspec cannot hold anywhere in it
    with an uncaught error naming ``$[...]``)."""

    prompt: Any = None


class ContentPart(Struct, kw_only=True):
    """One part of a list ``content``: ``text`` (any role) or ``refusal`` (assistant; OpenAI's
    ``ChatCompletionContentPartRefusalParam``), both rendered as their text."""

    type: str
    text: str | None = None
    refusal: str | None = None

    def as_text(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None | msgspec.UnsetType = msgspec.UNSET
    """``UNSET`` when the message has no ``content`` key (an empty turn, as vLLM's ``total=False`` message
    type reads it); an explicit ``null`` only in an assistant or function message (:func:`_check_content_parts`)."""
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""vLLM's ``reasoning_effort`` values (OpenAI's, and DeepSeek's ``max``); another is a 400 naming the field."""


class ChatRequest(_Sampling, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_tokens: PosInt | None = None
    max_completion_tokens: PosInt | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = msgspec.UNSET
    """``UNSET`` when the body has none (:func:`tool_choice`: vLLM then makes it ``auto`` if ``tools`` are sent);
    an explicit ``null`` is ``none``, as vLLM's."""
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    echo: bool = False
    """vLLM's chat extra (:func:`chat_echo`); not OpenAI's, so null is a 400, as in vLLM."""
    add_generation_prompt: bool = True
    """vLLM's chat extra: False renders no generation prompt (the reply's role is then the last message's, :func:`reply_role`)."""
    continue_final_message: bool = False
    """vLLM's chat extra: the last message is left open (no end of turn) and the reply continues it;
    needs ``add_generation_prompt`` false (a 400 otherwise, as vLLM's ``check_generation_prompt``)."""
    add_special_tokens: bool = False
    """vLLM's chat extra: True adds the model's special tokens (BOS) on top of the chat template's."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's chat extra: more variables for the chat template (``{"enable_thinking": false}``), :func:`template_kwargs`."""
    chat_template: str | None = None
    """vLLM's chat extra: a Jinja chat template for this request (or the name of one of the model's named
    templates); refused unless the router trusts request templates (:func:`request_chat_template`)."""
    documents: list[dict[str, str]] | None = None
    """vLLM's chat extra: the template's ``documents`` (RAG), over ``chat_template_kwargs.documents`` unless null
    (:func:`template_kwargs`)."""
    reasoning_effort: ReasoningEffort | None = None
    """OpenAI's (vLLM's values): the template's ``reasoning_effort`` and, unless ``chat_template_kwargs`` sets
    ``enable_thinking``, ``enable_thinking`` = effort != "none" (vLLM's ``build_chat_params``; :func:`template_kwargs`)."""


_COMPLETION_DEC = msgspec.json.Decoder(CompletionRequest)
_ANY_PROMPT_DEC = msgspec.json.Decoder(_AnyPrompt)
_COMPLETION_ANY_PROMPT_DEC = msgspec.json.Decoder(_CompletionAnyPrompt)
_CHAT_DEC = msgspec.json.Decoder(ChatRequest)
_TOKENS_DEC = msgspec.json.Decoder(list[int])


_AT_PATH = re.compile(r" - at `\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def _param_of(message: str) -> str | None:
    """The field a msgspec validation message names, as OpenAI's ``param``: ``... - at `$.messages[0].content```
    → ``messages[0].content``; ``Object missing required field `role` - at `$.messages[0]``` → ``messages[0].role``;
    None for the whole body (``Expected `object`, got `array```)."""
    at = _AT_PATH.search(message)
    path = at.group(1) if at else ""
    missing = _MISSING.search(message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def _decode_error(e: Exception, body: bytes | None = None) -> ApiError:
    """The 400 for a body the decoder refused; ``body`` given: an empty one, or one that is not JSON at
    all, is named as such (msgspec says only "Input data was truncated" for both an empty body and cut JSON).
    A field that fails validation is the error's ``param`` (:func:`_param_of`)."""
    if body is not None and not isinstance(e, msgspec.ValidationError):
        if not body.strip():
            return ApiError(400, "request body is empty: expected a JSON object")
        return ApiError(400, f"invalid request body: not valid JSON ({e})")
    return ApiError(400, f"invalid request body: {e}", param=_param_of(str(e)))


def _check_no_vllm_extras(req: _Sampling) -> None:
    """Refuse vLLM's extras that no engine here honours, as ``response_format`` ``json_object`` and ``suffix`` are:
    the guided-decoding ones (:data:`_GUIDED_EXTRAS`: the output would not follow the schema, regex, choices or
    grammar, and a client would take free text for it) and ``prompt_logprobs`` (no engine computes the prompt's
    logprobs). Before, they were unknown fields, ignored: a 200 without what was asked. ``null`` is their default.

    Raises:
        ApiError: 400 naming the field (``param``).
    """
    for name in _GUIDED_EXTRAS:
        if getattr(req, name) is not None:
            raise ApiError(
                400, f"{name} is not supported: this server does not constrain the output (no guided decoding); omit {name}",
                param=name,
            )
    if req.prompt_logprobs is not None:
        raise ApiError(
            400, "prompt_logprobs is not supported: no engine here computes the prompt's logprobs; omit prompt_logprobs",
            param="prompt_logprobs",
        )


def _check_common(req: _Sampling) -> None:
    _check_no_vllm_extras(req)
    if req.n not in (None, 1):
        raise ApiError(400, "n > 1 is not supported; send one request per sample", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"stop has {len(stops)} strings; at most {MAX_STOP} are supported", param="stop")
    if any(len(x) > MAX_STOP_LEN for x in stops):
        raise ApiError(400, f"a stop string is longer than {MAX_STOP_LEN} characters", param="stop")
    if any(not x for x in stops):  # it would end every output at once; vLLM's SamplingParams refuses it too
        raise ApiError(400, "stop cannot contain an empty string", param="stop")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
    max_tokens = getattr(req, "max_completion_tokens", None) or getattr(req, "max_tokens", None)
    if req.min_tokens and max_tokens is not None and req.min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_tokens})", param="min_tokens")
    _check_logit_bias_form(req.logit_bias)


_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,20}\Z")  # \Z: "$" would let a trailing newline through


def _check_logit_bias_form(bias: dict[str, float] | None) -> None:
    """At most :data:`~shared.validate.MAX_LOGIT_BIAS` entries, every ``logit_bias`` key an integer
    (decimal digits, as vLLM's ``int(key)`` takes them, without its spaces, ``+`` or ``_``; not
    ``"abc"`` or ``"1e3"``), every value finite in [-100, 100] (OpenAI's range; vLLM clamps instead).
    The vocabulary bound needs the tokenizer: :func:`check_logit_bias`.

    Raises:
        ApiError: 400, ``param`` ``logit_bias``, naming the key or value.
    """
    if not bias:
        return
    if len(bias) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias")
    for key, value in bias.items():
        if not _TOKEN_ID_KEY.match(key):
            raise ApiError(400, f"logit_bias key {key[:40]!r} is not a token id (an integer)", param="logit_bias")
        if not (math.isfinite(value) and -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS):
            raise ApiError(
                400, f"logit_bias value {value!r} for token {key} is outside [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]",
                param="logit_bias",
            )


def check_logit_bias(req: _Sampling, vocab_size: int, what: str = "the vocabulary") -> None:
    """Every ``logit_bias`` key (well formed: checked when the body is parsed) is a token id in
    ``[0, vocab_size)`` (vLLM refuses out-of-vocabulary ids with a 400 too).

    Raises:
        ApiError: 400, ``param`` ``logit_bias``, naming the first such id in the body's order.
    """
    for key in req.logit_bias or ():
        if not 0 <= int(key) < vocab_size:
            raise ApiError(400, f"logit_bias token id {key} is outside {what} [0, {vocab_size})", param="logit_bias")


def stop_strings(req: _Sampling) -> list[str]:
    """The request's stop strings (``stop``: a string or a list), duplicates once. None is empty: a parsed
    request (:func:`parse_completion`, :func:`parse_chat`) holds no empty one (a 400, as vLLM's
    ``SamplingParams``: it would end every output at once); one in an unchecked request is left out."""
    stop = req.stop
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    return list(dict.fromkeys(x for x in items if x))  # "" kept out all the same: StopMatcher takes non-empty ones


def sampling(req: _Sampling) -> Sampling | None:
    """The :class:`~shared.messages.Sampling` the nodes get for ``req`` (None: greedy with no
    stop token ids, penalties, ``min_tokens``, ``logprobs`` or ``logit_bias``, the default, sent as nothing; ``top_*`` / ``seed`` do not change greedy). Unset fields take vLLM's defaults except
    ``temperature``: unset = 0 (greedy; vLLM's OpenAI server takes the model's
    ``generation_config`` default, 1.0 without one) so a request that says nothing gets today's
    deterministic output. ``top_k`` -1 and 0 are both off (0 on the wire), and so is one above
    :data:`MAX_TOP_K` (more than any vocabulary: the engine keeps every token anyway), which the
    nodes' message check (``shared.validate``) would drop (the request then waited for nothing)."""
    top_k = req.top_k or 0
    sp = Sampling(
        temperature=req.temperature or 0.0,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k if 0 < top_k <= MAX_TOP_K else 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        stop_token_ids=list(dict.fromkeys(req.stop_token_ids or ())),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_tokens=req.min_tokens or 0,
        logprobs=logprobs_asked(req),
        # keys checked (_check_logit_bias_form); "7" and "07" are one id, the later value wins (as vLLM's dict)
        logit_bias={int(k): float(v) for k, v in (req.logit_bias or {}).items()},
    )
    if sp.greedy and not sp.stop_token_ids and not sp.penalized and not sp.min_tokens and sp.logprobs is None and not sp.logit_bias:
        return None
    return sp


def chat_echo(req: ChatRequest) -> str:
    """The text vLLM's chat ``echo`` puts before the reply: the last message's content when that
    message has the reply's role (:func:`reply_role`: ``assistant`` with the generation prompt, else
    the last message's own), its text parts joined by newlines as vLLM's conversation parsing joins
    them; "" when ``echo`` is off or the last message is another role's or has no content (vLLM's ``serving_chat``)."""
    last = req.messages[-1]
    if not req.echo or last.role != reply_role(req):
        return ""
    return _content_text(last.content)


def logprobs_asked(req: _Sampling) -> int | None:
    """How many top log-probabilities per output token ``req`` asks for (``Sampling.logprobs``):
    None = no logprobs; chat ``logprobs: true`` → ``top_logprobs`` (0 if unset); completions → ``logprobs``."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    if isinstance(req, CompletionRequest):
        return req.logprobs
    return None


LogprobEntry = tuple[int, float, list[int], list[float]]
"""One output token's ``(token id, logprob, top ids most likely first, their logprobs)`` (``TokenChunk``)."""


def _lp(x: float) -> float | None:
    if x != x:  # NaN: not computed
        return None
    return x if x >= LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(entries: list[LogprobEntry], top: int, decode: Callable[[int], str]) -> dict[str, Any]:
    """OpenAI's / vLLM's chat ``logprobs`` (``ChatCompletionLogProbs``):
    ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}``,
    one item per token of ``entries``; ``top_logprobs`` the ``top`` most likely tokens, most likely
    first. ``token`` is ``decode(id)`` (the token's own text), ``bytes`` its UTF-8 bytes."""
    def item(t: int, lp: float) -> dict[str, Any]:
        text = decode(t)
        return {"token": text, "logprob": _lp(lp), "bytes": list(text.encode("utf-8"))}

    content = []
    for t, lp, ids, lps in entries:
        d = item(t, lp)
        d["top_logprobs"] = [item(i, v) for i, v in zip(ids[:top], lps[:top])]
        content.append(d)
    return {"content": content}


def completion_logprobs(entries: list[LogprobEntry], top: int, decode: Callable[[int], str], offset: int = 0) -> dict[str, Any]:
    """vLLM's / OpenAI's legacy completions ``logprobs`` (``CompletionLogProbs``): ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (per token a dict token text → logprob of the ``top`` most
    likely and the chosen token, as vLLM's; ids whose texts are equal, e.g. byte pieces of one
    character that each decode alone to U+FFFD, share one key, holding the likeliest one's logprob,
    so a greedy token's entry is its own), ``text_offset`` (characters: the token's start in
    the output text made of the tokens' texts, counting from ``offset``, for a stream's later chunks)."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float | None]] = []
    offsets: list[int] = []
    for t, lp, ids, lps in entries:
        text = decode(t)
        tokens.append(text)
        token_lps.append(_lp(lp))
        d: dict[str, float | None] = {}
        for i, v in zip(ids[:top], lps[:top]):  # most likely first: of ids whose texts collide, the likeliest is kept
            d.setdefault(decode(i), _lp(v))
        d.setdefault(text, _lp(lp))
        tops.append(d)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _bounded_nesting(fn: Callable[..., _T]) -> Callable[..., _T]:
    """JSON nested deeper than the decoder's recursion limit is a 400, never a 500 (issue 18)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        try:
            return fn(*args, **kwargs)
        except RecursionError:
            raise ApiError(400, "invalid request body: JSON nested too deeply") from None

    return wrapper


@_bounded_nesting
def parse_completion(body: bytes) -> tuple[CompletionRequest, str | list[int]]:
    """Decode and check a completions body.

    Returns:
        ``(request, prompt)`` where ``prompt`` is the text or the token ids
        (a one-element list ``[text]`` or ``[[ids]]`` is unwrapped).

    Raises:
        ApiError: 400 with the reason (invalid JSON, wrong type, value out of
            range, unsupported option, batched or empty prompt).
    """
    try:
        req = _COMPLETION_DEC.decode(body)
    except msgspec.ValidationError as e:
        if "$.prompt" not in str(e):
            raise _decode_error(e) from e
        req, prompt = _reparse_prompt(body, e)
    except msgspec.DecodeError as e:
        raise _decode_error(e, body) from e
    else:
        prompt = req.prompt
    if isinstance(req.logprobs, bool):  # vLLM's pydantic int: true is 1, false 0
        req.logprobs = int(req.logprobs)
    _check_common(req)
    if req.echo and req.logprobs is not None:
        raise ApiError(
            400, "echo with logprobs is not supported: it would need the prompt's logprobs, which no engine here computes; "
            "send echo or logprobs, not both", param="echo",
        )
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", param="logprobs")
    if req.best_of not in (None, 1):
        raise ApiError(400, "best_of > 1 is not supported", param="best_of")
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    if isinstance(prompt, str) and not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt is an empty token list", param="prompt")
    return req, prompt


def _reparse_prompt(body: bytes, err: msgspec.ValidationError) -> tuple[CompletionRequest, str | list[int]]:
    """Accept ``[text]`` and ``[[ids]]``; explain batches; else re-raise ``err`` as a 400. An id msgspec cannot
    decode at all (an integer of over 4300 digits: ``Integer value out of range``) is a 400 naming it too."""
    try:
        raw = _ANY_PROMPT_DEC.decode(body).prompt
    except msgspec.ValidationError as e:
        raise _decode_error(e) from e
    if isinstance(raw, list) and raw and all(isinstance(x, (str, list)) for x in raw):
        if len(raw) > 1:
            raise ApiError(400, f"batched prompts ({len(raw)} prompts in one request) are not supported; send one request per prompt", param="prompt")
        inner = raw[0]
        if isinstance(inner, list):
            try:
                prompt: str | list[int] = _TOKENS_DEC.decode(msgspec.json.encode(inner))
            except msgspec.ValidationError as e:  # "... - at `$[1]`": the id's place in the inner list
                at = _AT_PATH.search(str(e))
                where = "prompt[0]" + (at.group(1) if at else "")
                raise ApiError(400, f"invalid request body: {_AT_PATH.sub('', str(e))} - at `$.{where}`", param=where) from e
        else:
            prompt = inner
        # validate the other fields (typed: the prompt apart)
        try:
            req = _COMPLETION_ANY_PROMPT_DEC.decode(body)
        except msgspec.ValidationError as e:
            raise _decode_error(e) from e
        req.prompt = ""
        return req, prompt
    raise _decode_error(err) from err


@_bounded_nesting
def parse_chat(body: bytes) -> ChatRequest:
    """Decode and check a chat-completions body.

    Raises:
        ApiError: 400 with the reason (invalid JSON, wrong type or value,
            no messages, non-text content part, a malformed tool or tool call, unsupported option).
    """
    try:
        req = _CHAT_DEC.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise _decode_error(e, body) from e
    _check_common(req)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", param="top_logprobs")
    if req.top_logprobs and not req.logprobs:  # top_logprobs 0 (vLLM's default) asks for nothing
        raise ApiError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    _check_chat(req)
    _check_no_output_constraint(req)
    return req


def _check_no_output_constraint(req: ChatRequest) -> None:
    """Refuse what would constrain the output, which no engine here enforces (vLLM does, by guided
    decoding): ``response_format`` of any ``type`` but ``text`` (``json_object``, ``json_schema``, ...)
    and a ``tool_choice`` that demands a tool call (``required``, or a named function). A JSON-mode
    client silently given free text is worse off than one told so. ``tool_choice`` ``none`` / ``auto``
    and ``response_format`` ``{"type": "text"}`` (what the output is anyway) are accepted; a ``tool_choice``
    other than ``none`` / ``null`` without ``tools`` is refused, as vLLM's ``check_tool_usage`` does (whether
    ``auto`` is served is the router's flags': :data:`AUTO_TOOL_CHOICE_OFF`).

    Raises:
        ApiError: 400 naming the field (``param``) and saying it is not supported.
    """
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise ApiError(
            400, f"response_format type {fmt.get('type')!r} is not supported: this server does not constrain the output "
            "(no guided decoding); omit response_format or send {\"type\": \"text\"}", param="response_format",
        )
    choice = req.tool_choice
    if choice is msgspec.UNSET or choice is None or choice == "none":
        return
    if req.tools is None:  # vLLM's check_tool_usage
        raise ApiError(400, "When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        return
    if choice == "required" or isinstance(choice, dict):
        what = "'required'" if choice == "required" else "a named function"
        raise ApiError(
            400, f"tool_choice {what} is not supported: this server cannot force a tool call (no guided decoding); "
            "send 'auto' (the model may call a tool) or 'none'", param="tool_choice",
        )
    raise ApiError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}", param="tool_choice")


def tool_choice(req: ChatRequest) -> Any:
    """The request's ``tool_choice`` as vLLM serves it (``check_tool_usage``): none in the body and ``tools``
    sent (a non-empty list) → ``"auto"``; none and no tools, or an explicit ``null`` → ``"none"``; else as sent
    (``parse_chat`` has refused all but ``"none"`` / ``"auto"``)."""
    choice = req.tool_choice
    if choice is msgspec.UNSET:
        return "auto" if req.tools else "none"
    return "none" if choice is None else choice


AUTO_TOOL_CHOICE_OFF = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
"""vLLM's 400 for a ``tool_choice`` ``auto`` (:func:`tool_choice`) that a server without its tool-call flags refuses."""


def _check_chat(req: ChatRequest | TokenizeChatRequest) -> None:
    """The checks a chat request and a chat ``/tokenize`` share (in this order): its content parts, its messages'
    tool calls, its tools, its generation prompt, its ``chat_template_kwargs`` (:func:`template_kwargs`). Raises
    :class:`ApiError` (400) naming the field."""
    _check_content_parts(req.messages)
    _check_tool_calls(req.messages)
    _check_tools(req.tools)
    _check_generation_prompt(req)
    template_kwargs(req)


def _check_generation_prompt(req: ChatRequest | TokenizeChatRequest) -> None:
    """vLLM's ``check_generation_prompt``: ``continue_final_message`` needs ``add_generation_prompt`` false
    (its default is true, so a body must say so; vLLM's chat template call refuses the pair too).

    Raises:
        ApiError: 400 naming ``continue_final_message``.
    """
    if req.continue_final_message and req.add_generation_prompt:
        raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", param="continue_final_message")


TEMPLATE_FLAG_KWARGS = ("add_generation_prompt", "continue_final_message")
"""``chat_template_kwargs`` keys that are request fields too: the request's field is what the template gets (vLLM's
``build_chat_params`` merges ``chat_template_kwargs`` with these fields over it)."""


def template_kwargs(req: ChatRequest | TokenizeChatRequest) -> dict[str, Any]:
    """The extra variables a chat request gives its chat template: its ``chat_template_kwargs`` (vLLM's extra, as
    vLLM passes them to ``apply_chat_template``: ``{"enable_thinking": false}`` turns Qwen3's thinking off; a
    variable the template does not read changes nothing, as vLLM drops it), less :data:`TEMPLATE_FLAG_KWARGS`
    (the request's own fields win, as vLLM's merge) and less ``chat_template`` (a request template:
    :func:`request_chat_template`); the request's ``documents`` over theirs unless null, and its
    ``reasoning_effort`` as ``reasoning_effort`` plus ``enable_thinking`` = effort != "none" unless they set
    ``enable_thinking`` (vLLM's ``build_chat_params``).

    Raises:
        ApiError: 400 naming ``chat_template_kwargs.<key>`` for a key the renderer sets itself (``messages``,
            ``tools``, ``tokenize``...: ``shared.tokenizer.RESERVED_TEMPLATE_KWARGS``; vLLM refuses ``tokenize``
            by name and fails on the others) or a ``documents`` that is not a list of objects.
    """
    given = req.chat_template_kwargs or {}
    kwargs = {k: v for k, v in given.items() if k not in TEMPLATE_FLAG_KWARGS and k != "chat_template"}
    # vLLM's build_chat_params: the request's fields merged over chat_template_kwargs (merge_kwargs: None is unset)
    if req.documents is not None:
        kwargs["documents"] = req.documents
    effort = req.reasoning_effort
    if effort is not None:
        kwargs["reasoning_effort"] = effort
        if "enable_thinking" not in given:  # templates that opt in (Gemma 4) or out (Qwen3) of thinking
            kwargs["enable_thinking"] = effort != "none"
    try:
        return check_template_kwargs(kwargs)
    except TemplateKwargError as e:
        raise ApiError(400, f"chat_template_kwargs: {e}", param=f"chat_template_kwargs.{e.key}") from e


UNTRUSTED_CHAT_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)
"""vLLM's 400 for a request's ``chat_template`` (or ``chat_template_kwargs.chat_template``) that a server without
``--trust-request-chat-template`` refuses (``_validate_chat_template``)."""


def request_chat_template(req: ChatRequest | TokenizeChatRequest, trusted: bool) -> str | None:
    """The request's own chat template (``chat_template``, else ``chat_template_kwargs.chat_template``, as vLLM
    takes either), or None to render with the tokenizer's. ``trusted``: the router's
    ``--trust-request-chat-template``.

    Raises:
        ApiError: 400 naming the field when a template is sent and ``trusted`` is false (vLLM's
            :data:`UNTRUSTED_CHAT_TEMPLATE`: a template is code the router runs), or when
            ``chat_template_kwargs.chat_template`` is not a string.
    """
    in_kwargs = (req.chat_template_kwargs or {}).get("chat_template")
    if not req.chat_template and in_kwargs in (None, ""):  # "" is no template (vLLM's falls back to the model's too)
        return None
    param = "chat_template" if req.chat_template else "chat_template_kwargs.chat_template"
    if not trusted:
        raise ApiError(400, UNTRUSTED_CHAT_TEMPLATE, param=param)
    if req.chat_template:
        return req.chat_template
    if not isinstance(in_kwargs, str):
        raise ApiError(400, f"chat_template_kwargs.chat_template must be a string, got {type(in_kwargs).__name__}", param=param)
    return in_kwargs


class RenderRequestTemplate(Exception):
    """Raised by :func:`render_chat` for a request that carries its own chat template (and a trusting router):
    the caller renders ``template`` in its child processes (``services.router.template_pool``, never in the
    router's process: a template may loop or allocate without end) and calls :func:`render_chat` again with the
    text as ``rendered``. ``param``: the field the template came in (errors name it)."""

    def __init__(self, req: ChatRequest | TokenizeChatRequest, template: str, param: str) -> None:
        super().__init__(param)
        self.req = req
        self.template = template
        self.param = param


def render_chat(
    tokenizer: Any, req: ChatRequest | TokenizeChatRequest, check: Callable[[str], None] | None = None, *,
    trust_request_chat_template: bool = False, rendered: str | None = None,
) -> list[int]:
    """The prompt ids of a chat request: its messages and tools through ``tokenizer``'s chat template (or the
    request's own, :func:`request_chat_template`) with the request's ``add_generation_prompt`` /
    ``continue_final_message`` and its ``chat_template_kwargs`` (:func:`template_kwargs`) (``Tokenizer.render_chat``),
    the text encoded with ``add_special_tokens`` (what ``Tokenizer.apply_chat_template`` gives); what
    ``/v1/chat/completions`` serves and ``/tokenize`` counts. ``check``: called with the rendered text before it is
    encoded (a template may drop text, so a bound on the tokens of a prompt holds for this string, not for the
    messages). ``trust_request_chat_template``: the router's flag of that name. ``rendered``: the request
    template's text, rendered by the caller (:class:`RenderRequestTemplate`).

    Raises:
        ApiError: a request template not trusted or longer than ``template_pool.MAX_TEMPLATE_CHARS`` characters
            (400 naming its field); refused ``chat_template_kwargs``; what ``check`` raises.
        RenderRequestTemplate: a trusted request template, ``rendered`` not given.
        ValueError (or the template's own error): a conversation the model's template refuses.
    """
    template = request_chat_template(req, trust_request_chat_template)
    named = template if template is not None and template in getattr(tokenizer, "chat_template_names", ()) else None
    if named is not None:  # the model's own template of that name (transformers' get_chat_template): rendered here
        template = None
    if template is not None and rendered is None:
        param = "chat_template" if req.chat_template else "chat_template_kwargs.chat_template"
        if len(template) > MAX_TEMPLATE_CHARS:
            raise ApiError(400, f"{param} is {len(template)} characters long; at most {MAX_TEMPLATE_CHARS} are accepted", param=param)
        template_kwargs(req)  # refused before the template is rendered
        raise RenderRequestTemplate(req, template, param)
    if rendered is not None:
        text = rendered
    else:
        text = tokenizer.render_chat(
            chat_messages(req), req.tools, add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message,
            template_kwargs=template_kwargs(req), chat_template=named,
        )
    if check is not None:
        check(text)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    return ids


def reply_role(req: ChatRequest) -> str:
    """The role of a chat reply, as vLLM's ``get_chat_request_role``: ``assistant`` when the chat ends with the
    generation prompt (the default), else the last message's role (the reply continues that turn)."""
    return "assistant" if req.add_generation_prompt else req.messages[-1].role


_CONTENT_OPTIONAL = frozenset({"assistant", "function"})
"""Roles whose ``content`` may be ``null`` (OpenAI's ``ChatCompletionAssistantMessageParam``: with
``tool_calls``; ``function``'s is ``Optional[str]``); a system, developer, user or tool message's may not."""


def _check_content_parts(messages: list[ChatMessage]) -> None:
    """No message but an assistant's (or a legacy ``function`` one's) has ``content: null``, as vLLM: none of the
    message types it validates against takes a null there (a 400; it was rendered as an empty turn); a message
    with no ``content`` key at all is an empty turn, as vLLM serves it (its ``CustomChatCompletionMessageParam``
    is ``total=False``). Only text parts (and refusal parts in assistant messages) can be rendered.

    Raises:
        ApiError: 400 naming the content (``messages[i].content``) or the part (``messages[i].content[j]``).
    """
    for i, msg in enumerate(messages):
        if msg.content is None and msg.role not in _CONTENT_OPTIONAL:
            raise ApiError(
                400, f"messages[{i}]: a {msg.role!r} message's content may not be null (a string or a list of content "
                "parts; null is allowed only in an assistant message)", param=f"messages[{i}].content",
            )
        if isinstance(msg.content, list):
            for j, part in enumerate(msg.content):
                where = f"messages[{i}].content[{j}]"
                if part.type == "refusal" and msg.role != "assistant":
                    raise ApiError(400, f"a refusal content part is only allowed in an assistant message, not a {msg.role!r} one", param=where)
                if part.type in ("text", "refusal"):
                    if getattr(part, part.type) is None:  # the type is known, its field is missing (or null)
                        raise ApiError(400, f"a content part of type {part.type!r} needs a {part.type!r} string", param=f"{where}.{part.type}")
                    continue
                raise ApiError(
                    400, f"content part type {part.type!r} is not supported (text only; refusal in assistant messages)", param=where,
                )


def _check_tools(tools: list[dict[str, Any]] | None) -> None:
    """Each of ``tools`` is OpenAI's (and vLLM's ``ChatCompletionToolsParam``): ``{"type": "function"`` (the
    default when absent)``, "function": {"name": str, "description": str | null, "parameters": object | null}}``.
    vLLM refuses another shape with a 400; here the tools were rendered into the prompt as sent, so a malformed
    list (``[{}]``, a name that is a number) was served as if the model had been told of tools.

    Raises:
        ApiError: 400 naming the field (``tools[i].function.name``).
    """
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        kind = tool.get("type", "function")
        if kind != "function":
            raise ApiError(400, f"{where}.type must be 'function', got {str(kind)[:64]!r}", param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(400, f"{where}.function must be an object with a name", param=f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
        if not isinstance(fn.get("description", ""), (str, type(None))):
            raise ApiError(400, f"{where}.function.description must be a string", param=f"{where}.function.description")
        if not isinstance(fn.get("parameters", {}), (dict, type(None))):
            raise ApiError(400, f"{where}.function.parameters must be an object (a JSON Schema)", param=f"{where}.function.parameters")


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for a 400's message (``null`` for a missing key too)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    names: dict[type[Any], str] = {str: "string", list: "array", dict: "object"}
    return names.get(type(value), type(value).__name__)


def _check_tool_calls(messages: list[ChatMessage]) -> None:
    """Each of a message's ``tool_calls`` is OpenAI's ``ChatCompletionMessageToolCallParam`` (vLLM's requests take
    the same TypedDict, all keys required): ``{"id": str, "type": "function", "function": {"name": str,
    "arguments": str}}``; ``arguments`` is the call's JSON text, not parsed here (OpenAI: the model does not
    always generate valid JSON), or the arguments as a JSON object (vLLM's ``_postprocess_messages`` hands an object
    to the template as it is; before, that was a 400 here). Other keys are ignored, as vLLM's.

    Any other ``arguments`` (``null``, ``[]``, ``42``, ``true``) is a 400, as vLLM's server answers it: its
    ``ChatCompletionRequest.messages`` items are OpenAI's TypedDicts (``vllm/entrypoints/chat_utils`` types:
    ``ChatCompletionMessageParam``, ``arguments: Required[str]``); pydantic validates an assistant message's
    ``tool_calls`` (an ``Iterable``) lazily, when ``_parse_chat_message_content`` lists them, and that raises a
    ``ValidationError`` (a ``ValueError``: vLLM's 400) for a non-string. Its ``_postprocess_messages`` coerces
    to ``{}`` only what passes that: the text ``""``, invalid JSON or JSON of a non-object (``"[]"``, ``"42"``,
    ``"null"``), as :func:`_template_arguments` does, and what ``LLM.chat`` hands it unvalidated. (Checked
    session 52 with vLLM's message types, openai 3.63 and pydantic 2.14: a string is served, every non-string,
    an object too, raises on that listing; this router serves an object all the same.)

    The name must be non-empty, as a tool's (:func:`_check_tools`): a call to no function. Unchecked, any shape (``[{}]``, arguments as a number) was served, rendered into the prompt as sent (or a
    template's error, a 400 naming only ``messages``).

    Raises:
        ApiError: 400 naming the message and the field (``messages[i].tool_calls[j].function.arguments``).
    """
    for i, msg in enumerate(messages):
        for j, call in enumerate(msg.tool_calls or ()):
            where = f"messages[{i}].tool_calls[{j}]"
            if not isinstance(call.get("id"), str):
                raise ApiError(400, f"{where}.id must be a string (the call's id, which the tool message's tool_call_id names)", param=f"{where}.id")
            kind = call.get("type")
            if kind != "function":
                raise ApiError(400, f"{where}.type must be 'function', got {str(kind)[:64]!r}", param=f"{where}.type")
            fn = call.get("function")
            if not isinstance(fn, dict):
                raise ApiError(400, f"{where}.function must be an object with a name and arguments", param=f"{where}.function")
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                raise ApiError(400, f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
            args = fn.get("arguments")
            if not isinstance(args, (str, dict)):
                raise ApiError(
                    400, f"{where}.function.arguments must be a string (the arguments' JSON text) or an object, got {_json_type(args)}",
                    param=f"{where}.function.arguments",
                )


def _content_text(content: str | list[ContentPart] | None | msgspec.UnsetType) -> str:
    """A message's text: a content list's text parts joined by newlines, as vLLM's conversation parsing
    joins them; None or ``UNSET`` (no ``content`` key) is "" (:func:`chat_messages`, :func:`chat_echo`)."""
    if isinstance(content, list):
        return "\n".join(p.as_text() for p in content)
    return content if isinstance(content, str) else ""


def _template_arguments(text: str) -> Any:
    """A call's ``arguments`` (JSON text) as a chat template gets it, vLLM's ``_postprocess_messages``: the decoded
    JSON object; ``{}`` when empty, not valid JSON (nested past the decoder's limit too) or not an object (vLLM
    coerces it, so that a conversation with a bad call in its history can go on). Never raises."""
    if not text:
        return {}
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _template_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (checked by :func:`_check_tool_calls`) as a chat template gets them:
    copies whose ``function.arguments`` is :func:`_template_arguments` of the text (transformers' and vLLM's: a
    template such as Qwen2.5's writes ``arguments | tojson``, which double-encoded the text), or the object the
    client sent, as it is (vLLM's)."""
    def args(a: str | dict[str, Any]) -> dict[str, Any] | Any:
        return a if isinstance(a, dict) else _template_arguments(a)

    return [{**c, "function": {**c["function"], "arguments": args(c["function"]["arguments"])}} for c in calls]


def chat_messages(req: ChatRequest | TokenizeChatRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for a chat template (``None`` fields dropped; content None or absent is ""); a content
    list's text parts joined by newlines, as vLLM's conversation parsing gives a template that reads a string; an
    assistant message's tool calls with their ``arguments`` decoded to an object (:func:`_template_calls`), an empty
    ``tool_calls`` list dropped (vLLM's ``_postprocess_messages``); the request's messages are not changed."""
    out: list[dict[str, Any]] = []
    for msg in req.messages:
        d: dict[str, Any] = {"role": msg.role}
        d["content"] = _content_text(msg.content)
        if msg.name is not None:
            d["name"] = msg.name
        if msg.tool_calls is not None and msg.role == "assistant":
            if msg.tool_calls:
                d["tool_calls"] = _template_calls(msg.tool_calls)
        elif msg.tool_calls is not None:
            d["tool_calls"] = msg.tool_calls
        if msg.tool_call_id is not None:
            d["tool_call_id"] = msg.tool_call_id
        out.append(d)
    return out


# --------------------------------------------------------------------------- #
# agent headers
# --------------------------------------------------------------------------- #

BRANCH_KINDS = ("main", "fork", "subagent")


def check_header_value(name: str, value: str, max_len: int) -> str:
    """A header value used as an id: non-empty, at most ``max_len`` characters, no control characters.

    Raises:
        ApiError: 400 naming the header.
    """
    if not value:
        raise ApiError(400, f"{name} is empty", param=name)
    if len(value) > max_len:
        raise ApiError(400, f"{name} is {len(value)} characters long; at most {max_len} allowed", param=name)
    for ch in value:
        o = ord(ch)
        if o < 0x20 or o == 0x7F or 0x80 <= o < 0xA0:
            raise ApiError(400, f"{name} contains a control character (U+{o:04X})", param=name)
    return value


def path_branch_id(branch_id: str, raw_path: bytes | None, max_len: int) -> str:
    """The branch id of ``/v1/branches/{id}/end`` or ``/tool-call``: ``branch_id`` as the server percent-decoded it
    (as UTF-8: the id an ``X-Branch-Id`` header of the same UTF-8 bytes names, :func:`header_text`), checked as a
    header's id (:func:`check_header_value`, ``param`` ``branch_id``). ``raw_path``: the ASGI scope's
    ``raw_path`` (None if the server gives none); percent-escapes that are not UTF-8 (which the server turned
    into U+FFFD, another branch's id) are refused.

    Raises:
        ApiError: 400 for an id whose escapes are not UTF-8, or that is empty, too long or holds a control character.
    """
    if raw_path is not None and "\ufffd" in branch_id:
        try:
            urllib.parse.unquote_to_bytes(raw_path).decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "the branch id in the path is not valid UTF-8 once percent-decoded", param="branch_id") from None
    return check_header_value("branch_id", branch_id, max_len)


def header_text(value: str) -> str:
    """A header value as text: the header's bytes decoded as UTF-8, or as latin-1 when they are not UTF-8.

    ``value`` is the value as an ASGI server and Starlette hand it on, one latin-1 character per byte
    (``Headers.get``), so ``X-Branch-Id: zweig-ä`` sent as UTF-8 (curl, aiohttp, Go's net/http) arrives as
    ``'zweig-Ã¤'``; this gives ``'zweig-ä'``, the same string as the id in a path
    (``/v1/branches/zweig-%C3%A4/end``: the server percent-decodes a path as UTF-8). Python's ``requests`` and
    ``http.client`` and Node's ``fetch`` send a str's U+0080-U+00FF as single latin-1 bytes (``zweig-\xe4``):
    those bytes are not UTF-8 and are read as latin-1, so they name ``'zweig-ä'`` too (the id those clients put
    in the path). Bytes that are valid UTF-8 are read as UTF-8 (latin-1 text such as ``Ã¤`` that happens to be
    UTF-8 is the rare case read the other way). An ASCII value is returned as is; no value is refused here.

    Raises:
        UnicodeEncodeError: ``value`` holds a character above U+00FF (never one made of a header's bytes).
    """
    if value.isascii():
        return value
    raw = value.encode("latin-1")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return value  # the latin-1 reading: what requests / http.client / Node fetch sent for U+0080-U+00FF


REQUEST_ID_MAX_LEN = 256
"""Longest accepted ``X-Request-ID`` (characters)."""
RID_MAX_LEN = 128
"""Longest rid (:func:`request_rid`): a client id of up to this many characters of ``[A-Za-z0-9_-]`` is its own rid."""
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")
_RID_SAFE = re.compile(r"[A-Za-z0-9_-]+")
_RID_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_RID_HASH_HEX = 20
_RID_MAPPED = re.compile(r"--[0-9a-f]{%d}\Z" % _RID_HASH_HEX)


@_bounded_nesting
def parse_tool_call(body: bytes) -> tuple[bool, float]:
    """Body of ``POST /v1/branches/{id}/tool-call``: ``{"outstanding": bool, "expected_s": seconds}``,
    both optional (defaults ``true`` and 0 = unknown, held up to the router's ``--max-tool-hold-s``);
    an empty body is the defaults.

    Returns:
        ``(outstanding, expected_s)``.

    Raises:
        ApiError: 400 for a body that is not a JSON object, an unknown key, or a bad value.
    """
    if not body.strip():
        return True, 0.0
    try:
        obj = json.loads(body)
    except ValueError as e:
        raise ApiError(400, f"tool-call body is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "tool-call body must be a JSON object")
    extra = set(obj) - {"outstanding", "expected_s"}
    if extra:
        raise ApiError(400, f"unknown tool-call field(s) {sorted(extra)}; known: outstanding, expected_s", param=sorted(extra)[0])
    outstanding = obj.get("outstanding", True)
    if not isinstance(outstanding, bool):
        raise ApiError(400, "outstanding must be true or false", param="outstanding")
    expected = obj.get("expected_s", 0.0)
    if isinstance(expected, bool) or not isinstance(expected, (int, float)) or not math.isfinite(expected) or expected < 0:
        raise ApiError(400, "expected_s must be a finite number of seconds >= 0", param="expected_s")
    return outstanding, float(expected)


def parse_request_id(value: str | None) -> str | None:
    """The client's ``X-Request-ID`` as sent: echoed in the ``x-request-id`` response header, the body's
    ``id`` (:func:`response_id` of it, as vLLM's), the 409 of a duplicate and the ``--log-requests`` lines;
    the request's id on the bus, the nodes and in logs (``rid``) is :func:`request_rid` of it.

    Any valid HTTP header value of 1 to :data:`REQUEST_ID_MAX_LEN` visible ASCII characters (0x21-0x7E)
    is taken: vLLM takes any value, and gateways' and tracers' ids hold ``.``, ``:``, ``/``
    (``abc/def:ghi.jkl``, Envoy's, AWS's). ``None`` (no header) means the router makes one.

    Raises:
        ApiError: 400 naming the header for an empty or too long id or one with a space, control or
            non-ASCII character (not replaced by one of ours: the client's records could not be joined with ours);
            the message names the first such byte of the header (``byte 0xC3`` for a UTF-8 ``é``).
    """
    if value is None:
        return None
    if not value:
        raise ApiError(400, "X-Request-ID is empty", param="X-Request-ID")
    if len(value) > REQUEST_ID_MAX_LEN:
        raise ApiError(400, f"X-Request-ID is {len(value)} characters long; at most {REQUEST_ID_MAX_LEN} allowed", param="X-Request-ID")
    if not _REQUEST_ID.fullmatch(value):
        bad = ord(next(ch for ch in value if not "\x21" <= ch <= "\x7e"))
        # a header's value comes one latin-1 character per byte: name the byte (a UTF-8 'é' is 0xC3 0xA9, not U+00C3)
        what = f"byte 0x{bad:02X}" + (" (non-ASCII: a UTF-8 or latin-1 character)" if bad > 0x7F else "") if bad <= 0xFF else f"U+{bad:04X}"
        raise ApiError(400, f"X-Request-ID may hold only visible ASCII characters (0x21-0x7E), not {what}", param="X-Request-ID")
    return value


def request_rid(client_id: str) -> str:
    """The request's id (``rid``) for the client's ``X-Request-ID`` ``client_id`` (:func:`parse_request_id`):
    one NATS subject token (``req.<rid>.out.<node>``; ``shared.subjects.check_token``: ``[A-Za-z0-9_-]``) of at most
    :data:`RID_MAX_LEN` characters, the same for the same id on every call and router.

    An id of 1 to :data:`RID_MAX_LEN` characters of ``[A-Za-z0-9_-]`` is its own rid (a UUID; the rid,
    logs and spans are the id as sent), unless it ends like a mapped one (``--`` + 20 lowercase hex digits).
    Any other id is mapped: each character but ``[A-Za-z0-9_-]`` becomes ``_``, the first
    ``RID_MAX_LEN - 22`` characters are kept, then ``--`` and the first 20 hex digits (80 bits) of the
    SHA-256 of the whole id (``abc/def:ghi.jkl`` → ``abc_def_ghi_jkl--<hash>``). So two different ids
    never have the same rid: an id kept as is never ends like a mapped one, and mapped ones differ in
    their hash (two ids of the same hash prefix: chance 2**-80 a pair). A duplicate in flight (409) and a
    client's retry are told by the rid, which is thus told by the client's id as sent.

    Raises:
        ValueError: ``client_id`` is empty (``parse_request_id`` refuses it first).
    """
    if not client_id:
        raise ValueError("an X-Request-ID is never empty")
    if len(client_id) <= RID_MAX_LEN and _RID_SAFE.fullmatch(client_id) and not _RID_MAPPED.search(client_id):
        return client_id
    digest = hashlib.sha256(client_id.encode("utf-8", "surrogatepass")).hexdigest()[:_RID_HASH_HEX]
    return _RID_UNSAFE.sub("_", client_id)[: RID_MAX_LEN - 2 - _RID_HASH_HEX] + "--" + digest


def response_id(request_id: str, *, chat: bool) -> str:
    """The OpenAI ``id`` of a response (every chunk of a stream has the same): ``chatcmpl-<request_id>``
    for ``/v1/chat/completions``, ``cmpl-<request_id>`` for ``/v1/completions``, as vLLM's OpenAI server
    (``chat_completion/serving.py`` / ``completion/serving.py``: the prefix before
    ``_base_request_id``, the ``X-Request-Id`` value or a random hex). ``request_id``: the client's
    ``X-Request-ID`` as sent (also the ``x-request-id`` response header, bare), or the rid the router made.
    """
    return ("chatcmpl-" if chat else "cmpl-") + request_id


class BranchHeaders(Struct, frozen=True, kw_only=True):
    """Validated agent headers of one request."""

    branch_id: str | None = None
    parent_branch_id: str | None = None
    kind: Literal["main", "fork", "subagent"] = "main"
    agent_id: str | None = None


def parse_branch_headers(headers: Any, max_len: int) -> BranchHeaders:
    """Read ``X-Branch-Id``, ``X-Parent-Branch-Id``, ``X-Branch-Kind`` (fork | subagent | main) and ``X-Agent-Id``.

    Ids may hold any character but control characters (C0, DEL, C1): the header's bytes are read as UTF-8, or
    as latin-1 when they are not UTF-8 (:func:`header_text`: what Python's ``requests`` and Node's ``fetch``
    send for U+0080-U+00FF), so an id in a header is the same string as that id percent-encoded as UTF-8 in
    ``/v1/branches/{id}/end`` and ``/tool-call``; the length and control-character rules
    (:func:`check_header_value`) apply to that text.

    Args:
        headers: a case-insensitive mapping of header values, each byte one latin-1 character, as ASGI
            servers give them (Starlette ``Headers``; with its ``getlist``, a header repeated with different
            values is refused: which branch the request is of would be a guess).
        max_len: longest accepted id, in characters.

    Raises:
        ApiError: 400 for an empty, too long or control-character value, one of
            the four headers sent again with another value, an unknown kind, kind/parent without a branch id,
            or a branch that is its own parent.
    """
    getlist = getattr(headers, "getlist", None)  # Starlette's Headers: every value of a repeated header
    if getlist is not None:
        for name, shown in (("x-branch-id", "X-Branch-Id"), ("x-parent-branch-id", "X-Parent-Branch-Id"),
                            ("x-branch-kind", "X-Branch-Kind"), ("x-agent-id", "X-Agent-Id")):
            values = getlist(name)
            if len(set(values)) > 1:  # the same value twice (a proxy's copy) is one value
                raise ApiError(400, f"{shown} is sent {len(values)} times with different values; send it once", param=shown)
    texts: list[str | None] = []
    for name in ("x-branch-id", "x-parent-branch-id", "x-branch-kind", "x-agent-id"):
        value = headers.get(name)
        texts.append(None if value is None else header_text(value))
    bid, parent, kind, agent = texts
    if bid is not None:
        check_header_value("X-Branch-Id", bid, max_len)
    if parent is not None:
        check_header_value("X-Parent-Branch-Id", parent, max_len)
    if agent is not None:
        check_header_value("X-Agent-Id", agent, max_len)
    if kind is not None and kind not in BRANCH_KINDS:
        raise ApiError(400, f"X-Branch-Kind must be one of fork, subagent, main; got {kind[:64]!r}", param="X-Branch-Kind")
    if bid is None and (parent is not None or kind is not None):
        raise ApiError(400, "X-Parent-Branch-Id and X-Branch-Kind need an X-Branch-Id", param="X-Branch-Id")
    if bid is not None and parent == bid:
        raise ApiError(400, "a branch cannot be its own parent", param="X-Parent-Branch-Id")
    return BranchHeaders(branch_id=bid, parent_branch_id=parent, kind=cast(BranchKind, kind or "main"), agent_id=agent)


# --------------------------------------------------------------------------- #
# responses
# --------------------------------------------------------------------------- #


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI ``usage`` with ``prompt_tokens_details.cached_tokens``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _choice(choice: dict[str, Any], stop_reason: str | int | None) -> dict[str, Any]:
    """``choice`` with vLLM's ``stop_reason``: the stop string or stop token id that ended the
    output, ``null`` when none did (EOS, ``max_tokens``, or not ended yet in a stream's chunk)."""
    choice["stop_reason"] = stop_reason
    return choice


def completion_response(
    oid: str, created: int, model: str, text: str, finish_reason: str | None, use: dict[str, Any], *, stop_reason: str | int | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A non-streaming ``/v1/completions`` body; ``oid``: its :func:`response_id`; ``logprobs``: :func:`completion_logprobs`."""
    return {
        "id": oid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}, stop_reason)],
        "usage": use,
    }


def chat_response(
    oid: str, created: int, model: str, text: str | None, finish_reason: str | None, use: dict[str, Any], *, stop_reason: str | int | None = None,
    logprobs: dict[str, Any] | None = None, role: str = "assistant", tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A non-streaming ``/v1/chat/completions`` body; ``oid``: its :func:`response_id`; ``logprobs``: :func:`chat_logprobs`;
    ``role``: the message's, :func:`reply_role`; ``text``: its ``content`` (None: a reply of tool calls only);
    ``tool_calls``: the message's (``services.router.toolcalls.ToolCall.message`` each), left out when None."""
    message: dict[str, Any] = {"role": role, "content": text}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {
        "id": oid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            _choice(
                {
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                },
                stop_reason,
            )
        ],
        "usage": use,
    }


def completion_chunk(
    oid: str, created: int, model: str, text: str, finish_reason: str | None, include_usage: bool, *, stop_reason: str | int | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``/v1/completions`` stream chunk; its choice always has ``stop_reason`` (``null``
    until the last chunk), as vLLM's."""
    out: dict[str, Any] = {
        "id": oid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}, stop_reason)],
    }
    if include_usage:
        out["usage"] = None
    return out


def chat_chunk(
    oid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None, include_usage: bool,
    *, stop_reason: str | int | None = None, logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``/v1/chat/completions`` stream chunk; its choice has ``stop_reason`` only with a
    ``finish_reason`` (the last chunk), as vLLM's (set there only; ``exclude_unset``)."""
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    out: dict[str, Any] = {
        "id": oid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice if finish_reason is None else _choice(choice, stop_reason)],
    }
    if include_usage:
        out["usage"] = None
    return out


def usage_chunk(oid: str, created: int, model: str, obj: str, use: dict[str, Any]) -> dict[str, Any]:
    """The final chunk of a stream with ``stream_options.include_usage``: no choices, usage set."""
    return {"id": oid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def models_response(models: Sequence[str], created: int, max_model_len: int | None = None) -> dict[str, Any]:
    """``GET /v1/models``: one entry per name of ``models``, in order (vLLM's ``show_available_models``, one
    ``ModelCard`` per served name); ``max_model_len`` (vLLM's ``ModelCard`` field, tokens) is left out when None.

    Raises:
        TypeError: ``models`` is a str (a sequence of names is meant)."""
    if isinstance(models, str):
        raise TypeError(f"models_response takes a sequence of names, not the str {models!r}")
    extra = {} if max_model_len is None else {"max_model_len": max_model_len}
    data = [{"id": m, "object": "model", "created": created, "owned_by": "evolving-infra", **extra} for m in models]
    return {"object": "list", "data": data}


# --------------------------------------------------------------------------- #
# vLLM's utility endpoints: /version, /tokenize, /detokenize
# --------------------------------------------------------------------------- #

@functools.cache
def version_response() -> dict[str, str]:
    """``GET /version``: ``{"version": ...}`` as vLLM's, the installed package's version
    (:func:`shared.package_version`; ``"unknown"`` when the package is not installed, a bare source tree)."""
    from shared import package_version

    return {"version": package_version()}


class TokenizeCompletionRequest(Struct, kw_only=True):
    """``POST /tokenize`` with a ``prompt`` (vLLM's ``TokenizeCompletionRequest``)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(Struct, kw_only=True):
    """``POST /tokenize`` with ``messages`` (vLLM's ``TokenizeChatRequest``); ``chat_template`` /
    ``chat_template_kwargs`` are applied (and refused) as ``/v1/chat/completions`` applies them, so the count is
    that request's ``usage.prompt_tokens``."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None
    """As :attr:`ChatRequest.documents`."""
    reasoning_effort: ReasoningEffort | None = None
    """As :attr:`ChatRequest.reasoning_effort`, so that the count is the chat's ``usage.prompt_tokens``."""


class DetokenizeRequest(Struct, kw_only=True):
    """``POST /detokenize`` (vLLM's ``DetokenizeRequest``)."""

    model: str | None = None
    tokens: list[int]
    """Any integers here: :func:`check_token_ids` names the first outside the vocabulary (a bound in the
    decoder answered msgspec's bare ``Expected `int` <= 4294967295``)."""


@_bounded_nesting
def parse_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """Decode a ``/tokenize`` body: a chat request when it has ``messages`` (as vLLM's union picks), else a prompt.

    The options are the ones ``/v1/completions`` / ``/v1/chat/completions`` take (``add_special_tokens``,
    ``add_generation_prompt``, ``continue_final_message``), so the count is the ``usage.prompt_tokens``
    of the same request.

    Raises:
        ApiError: 400 naming the field (invalid JSON or value, a non-text content part,
            ``continue_final_message`` with ``add_generation_prompt``).
    """
    try:
        head = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise _decode_error(e, body) from e
    if not isinstance(head, dict):
        raise ApiError(400, f"invalid request body: Expected `object`, got `{type(head).__name__}`")
    if "messages" in head:
        chat = _convert(head, TokenizeChatRequest)
        _check_chat(chat)
        return chat
    return _convert(head, TokenizeCompletionRequest)


def _convert(obj: Any, cls: type[_T]) -> _T:
    try:
        return msgspec.convert(obj, cls)
    except msgspec.ValidationError as e:
        raise _decode_error(e) from e


_DETOKENIZE_DEC = msgspec.json.Decoder(DetokenizeRequest)


@_bounded_nesting
def parse_detokenize(body: bytes) -> DetokenizeRequest:
    """Decode a ``/detokenize`` body; the ids are checked against the vocabulary by the caller (:func:`check_token_ids`).

    Raises:
        ApiError: 400 naming the field.
    """
    try:
        return _DETOKENIZE_DEC.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise _decode_error(e, body) from e


def check_token_ids(ids: list[int], vocab_size: int, param: str = "tokens", what: str = "the vocabulary") -> None:
    """Every id in ``[0, vocab_size)`` (ids of any size: the decoders take plain ``int``).

    Args:
        what: the vocabulary the message names (``the model's vocabulary`` when the model's size is the limit).

    Raises:
        ApiError: 400 naming the first id outside (``param``: ``tokens[i]``).
    """
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ApiError(400, f"token id {t} is outside {what} [0, {vocab_size})", param=f"{param}[{i}]")


_JSON_PIECE = 262_144
"""Items of a list :func:`tokenize_response_json` encodes per ``msgspec`` call (~10 ms each)."""
_LIST_ENCODER = msgspec.json.Encoder()


def _json_list(items: list[Any]) -> bytes:
    """``items`` as a JSON array, encoded :data:`_JSON_PIECE` items per call: one call holds the GIL for the
    whole list, and so stops every other thread (the event loop) for it."""
    if len(items) <= _JSON_PIECE:
        return _LIST_ENCODER.encode(items)
    parts: list[bytes] = []
    for i in range(0, len(items), _JSON_PIECE):
        if parts:
            parts.append(b",")
        parts.append(_LIST_ENCODER.encode(items[i : i + _JSON_PIECE])[1:-1])
    return b"".join([b"[", *parts, b"]"])


def tokenize_response_json(ids: list[int], max_model_len: int, token_strs: list[str] | None = None) -> bytes:
    """vLLM's ``TokenizeResponse`` as JSON: ``count``, ``max_model_len`` (tokens), ``tokens``, ``token_strs`` (null
    unless asked), the same bytes as ``msgspec.json.encode`` of that dict, its lists encoded a piece at a time
    (:func:`_json_list`), so that it may run in a worker thread without stopping the event loop: ``/tokenize`` of
    a 60 MB prompt (31M ids, a 189 MB answer) was encoded on the loop in one call, which stopped every other
    request for 1.0 s (2.5 s on a loaded box)."""
    head = _LIST_ENCODER.encode({"count": len(ids), "max_model_len": max_model_len})[:-1]
    strs = b"null" if token_strs is None else _json_list(token_strs)
    return b"".join([head, b',"tokens":', _json_list(ids), b',"token_strs":', strs, b"}"])
