"""A tool call's non-object ``arguments``, as vLLM's server answers them (session 52 check of the brief's "vLLM
coerces ``null``, ``[]``, ``42`` to ``{}``"): vLLM's request model types ``arguments`` as OpenAI's ``str``, and
pydantic refuses a non-string when ``_parse_chat_message_content`` lists the calls (a 400), while its
``_postprocess_messages`` turns JSON *text* of a non-object (``"null"``, ``"[]"``, ``"42"``) into ``{}`` for the
chat template. So the same values are a 400 as JSON values and ``{}`` as JSON text, here as there."""

from __future__ import annotations

import msgspec
import pytest

from services.router import api


def _chat(args: object) -> dict[str, object]:
    return {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": args}}]},
        {"role": "tool", "content": "out", "tool_call_id": "c1"},
    ]}  # fmt: skip


@pytest.mark.parametrize(("value", "kind"), [(None, "null"), ([], "array"), (42, "number"), (False, "boolean")])
def test_a_non_string_non_object_arguments_value_is_a_400_naming_the_field_as_vllms_server(value: object, kind: str) -> None:
    with pytest.raises(api.ApiError, match=f"arguments must be a string .* or an object, got {kind}") as ei:
        api.parse_chat(msgspec.json.encode(_chat(value)))
    assert (ei.value.status, ei.value.param) == (400, "messages[1].tool_calls[0].function.arguments")


@pytest.mark.parametrize("text", ["null", "[]", "42", "true", '"{}"', "", "{not json"])
def test_arguments_text_of_a_non_object_reaches_the_template_as_an_empty_object_as_vllms_postprocess(text: str) -> None:
    req = api.parse_chat(msgspec.json.encode(_chat(text)))
    assert api.chat_messages(req)[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert req.messages[1].tool_calls is not None
    assert req.messages[1].tool_calls[0]["function"]["arguments"] == text  # the request itself is not changed
