"""The router renders chat templates as transformers' ``apply_chat_template`` does (what vLLM calls): the same
Jinja environment (``shared.tokenizer.chat_template_env``, transformers' ``_compile_jinja_template``) and the same
variables. Found on a newcomer's walk: its own environment lacked ``strftime_now`` (a Llama-3.1 date block said
"Today Date: 26 Jul 2024" where transformers says today), ``{% break %}`` / ``{% continue %}`` (such a model's
template was refused at ``up``: "Encountered unknown tag 'continue'"), the ``{% generation %}`` tag,
transformers' ``documents`` variable and its restricted ``namespace``; and a chat's extra variables
(vLLM's ``chat_template_kwargs``, e.g. ``enable_thinking``) could not be passed at all.

Each template below is rendered here and by transformers (skipped without it) and must give the same text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shared.tokenizer import (
    HFTokenizer,
    SimTokenizer,
    TemplateKwargError,
    TokenizerError,
    check_template_kwargs,
    compile_chat_template,
)

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

HEAD = "{% for m in messages %}<|im_start|>{{ m.role }}\n"
TAIL = "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"

DATE_TEMPLATE = (  # Llama 3.1's date block
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now(\"%d %b %Y\") %}{%- else %}{%- set date_string = \"26 Jul 2024\" %}"
    "{%- endif %}{%- endif %}<|im_start|>system\nToday Date: {{ date_string }}<|im_end|>\n" + HEAD + "{{ m.content }}" + TAIL
)
CONTINUE_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GENERATION_TEMPLATE = (
    HEAD + "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}" + TAIL
)
VARIABLES_TEMPLATE = (  # transformers' variables: the special tokens (sep_token too), documents (None), tools
    "{{ bos_token }}{{ sep_token }}{% if documents is defined %}[documents defined]{% endif %}"
    "{% if documents %}{% for d in documents %}<doc>{{ d.title }}: {{ d.text }}</doc>{% endfor %}{% endif %}"
    "{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}" + HEAD + "{{ m.content }}" + TAIL
)
NAMESPACE_TEMPLATE = (
    "{% set ns = namespace(users=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.users = ns.users + 1 %}"
    "{% endif %}{% endfor %}{{ dict(users=ns.users, roles=dict.fromkeys(['a'], 1)) | tojson }}\n" + HEAD + "{{ m.content }}" + TAIL
)
THINKING_TEMPLATE = (  # Qwen3's switch, the way vLLM users turn thinking off (chat_template_kwargs)
    HEAD + "{{ m.content }}" + TAIL[: -len("{% endif %}")]
    + "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}, {"role": "user", "content": "more"},
     {"role": "assistant", "content": "sure"}, {"role": "user", "content": "last"}],
]
TOOLS = [{"type": "function", "function": {"name": "ls", "description": "list files", "parameters": {"type": "object"}}}]


def _folder(tmp_path: Path, template: Any) -> Path:
    from tests.unit.router.helpers import write_bpe_tokenizer

    folder = write_bpe_tokenizer(tmp_path / "bpe")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.update(chat_template=template, bos_token="<|endoftext|>", sep_token="<|im_end|>")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


def _pair(tmp_path: Path, template: Any) -> tuple[HFTokenizer, Any]:
    transformers = pytest.importorskip("transformers")
    folder = _folder(tmp_path, template)
    return HFTokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize(
    "template", [DATE_TEMPLATE, CONTINUE_TEMPLATE, GENERATION_TEMPLATE, VARIABLES_TEMPLATE, NAMESPACE_TEMPLATE, THINKING_TEMPLATE],
    ids=["strftime_now", "break-continue", "generation", "variables", "namespace-dict", "thinking"],
)
def test_a_models_template_renders_as_transformers_renders_it(tmp_path, template):
    tok, ref = _pair(tmp_path, template)
    for chat in CHATS:
        for tools in (None, TOOLS):
            for gen in (True, False):
                want = ref.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=gen)
                assert tok.render_chat(chat, tools, add_generation_prompt=gen) == want, (chat, tools, gen)
    if template is DATE_TEMPLATE:
        from datetime import datetime

        assert datetime.now().strftime("%d %b %Y") in tok.render_chat(CHATS[0])  # not the template's fallback date


@pytest.mark.parametrize(
    "kwargs",
    [{"enable_thinking": False}, {"enable_thinking": True}, {"date_string": "1 Jan 2025"}, {"bos_token": "<|im_start|>"},
     {"documents": [{"title": "a", "text": "first"}, {"title": "b", "text": "second"}]}, {"unread": 1}],
)
def test_template_kwargs_are_the_templates_variables_as_transformers_kwargs(tmp_path, kwargs):
    """vLLM passes ``chat_template_kwargs`` to ``apply_chat_template(**kwargs)``: extra template variables over the
    special tokens, ``documents`` as the template's documents; one the template does not read changes nothing."""
    template = THINKING_TEMPLATE.replace(HEAD, VARIABLES_TEMPLATE[: VARIABLES_TEMPLATE.index(HEAD)] + DATE_TEMPLATE[: DATE_TEMPLATE.index(HEAD)] + HEAD)
    tok, ref = _pair(tmp_path, template)
    for chat in CHATS:
        want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
        assert tok.render_chat(chat, template_kwargs=kwargs) == want, kwargs
        assert tok.apply_chat_template(chat, template_kwargs=kwargs) == tok.encode(want, add_special_tokens=False)
    if kwargs == {"enable_thinking": False}:
        assert tok.render_chat(CHATS[0], template_kwargs=kwargs).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert "<think>" not in tok.render_chat(CHATS[0])


def test_a_request_template_renders_as_transformers_chat_template_argument(tmp_path):
    """``chat_template`` (a request's own, vLLM's ``--trust-request-chat-template``) replaces the model's, with the
    model's special tokens; the sim tokenizer renders one too (no special tokens) instead of its ChatML."""
    tok, ref = _pair(tmp_path, CHATML_NOT_USED)
    for template in (CONTINUE_TEMPLATE, VARIABLES_TEMPLATE, THINKING_TEMPLATE):
        for chat in CHATS:
            want = ref.apply_chat_template(chat, chat_template=template, tokenize=False, add_generation_prompt=True, enable_thinking=False)
            got = tok.render_chat(chat, chat_template=template, template_kwargs={"enable_thinking": False})
            assert got == want
    assert tok.render_chat(CHATS[0]) == ref.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    sim = SimTokenizer()
    assert sim.render_chat(CHATS[0], chat_template=CONTINUE_TEMPLATE) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert sim.render_chat(CHATS[0], chat_template="{{ bos_token }}|{{ messages | length }}") == "|2"


CHATML_NOT_USED = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def test_the_sandbox_refuses_what_transformers_refuses(tmp_path):
    """The sandbox is kept: a namespace's ``_``-attributes (transformers' ``TemplateNamespace``; Jinja's own
    namespace takes them) and a method that changes the messages (immutable sandbox) are refused, as transformers
    refuses them; a template that does not compile is a TokenizerError naming Jinja's reason."""
    import jinja2

    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(_folder(tmp_path, CHATML_NOT_USED)))
    chat = CHATS[0]
    for template in ("{% set ns = namespace(_x=1) %}{{ ns._x }}", "{% set ns = namespace() %}{% set ns._y = 2 %}",
                     "{{ messages.append({'role': 'user'}) }}", "{{ ''.__class__.__mro__ }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            ref.apply_chat_template(chat, chat_template=template, tokenize=False)
        with pytest.raises(jinja2.exceptions.SecurityError):
            SimTokenizer().render_chat(chat, chat_template=template)
    with pytest.raises(TokenizerError, match="invalid chat template: .*unknown tag 'loop'"):
        compile_chat_template("{% loop %}")


def test_template_kwargs_may_not_set_what_the_renderer_sets():
    """``messages``, ``tools``, the flags, ``chat_template``, ``tokenize``: set by the renderer (transformers: a
    second value is a TypeError; vLLM refuses ``chat_template`` / ``tokenize`` by name); ``documents`` must be
    a list of objects (transformers' check)."""
    for key in ("messages", "conversation", "tools", "add_generation_prompt", "continue_final_message", "chat_template", "tokenize"):
        with pytest.raises(TemplateKwargError) as e:
            SimTokenizer().render_chat(CHATS[0], template_kwargs={key: 1})
        assert e.value.key == key and key in str(e.value)
    with pytest.raises(TemplateKwargError, match="documents must be a list of objects"):
        check_template_kwargs({"documents": ["text"]})
    assert check_template_kwargs(None) == {} and check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}


NAMED = [  # a tokenizer_config.json chat_template list (Hermes-2-Pro, Command-R: default and tool_use)
    {"name": "default", "template": HEAD + "{{ m.content }}" + TAIL},
    {"name": "tool_use", "template": "[tools: {{ tools | length if tools is not none else 'none' }}]" + HEAD + "{{ m.content }}" + TAIL},
    {"name": "rag", "template": "[rag]" + HEAD + "{{ m.content }}" + TAIL},
]


def test_named_templates_are_picked_as_transformers_get_chat_template(tmp_path):
    """A model's named templates: ``tool_use`` when tools are given, ``default`` otherwise, and a ``chat_template``
    that is a name selects that template (transformers' ``get_chat_template``, which vLLM's ``apply_chat_template``
    goes through). Before, ``default`` was always taken and a name was rendered as a template: the literal word."""
    tok, ref = _pair(tmp_path, NAMED)
    assert tok.chat_template_names == ("default", "tool_use", "rag")
    for chat in CHATS:
        for tools in (None, TOOLS, []):
            want = ref.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
            assert tok.render_chat(chat, tools) == want, tools
        for name in ("rag", "tool_use", "default"):
            want = ref.apply_chat_template(chat, chat_template=name, tokenize=False, add_generation_prompt=True)
            assert tok.render_chat(chat, chat_template=name) == want, name
    assert tok.render_chat(CHATS[0], TOOLS).startswith("[tools: 1]")
    assert tok.render_chat(CHATS[0], chat_template="rag").startswith("[rag]<|im_start|>")
    assert tok.render_chat(CHATS[0], chat_template="no such name") == "no such name"  # no name: a template, as transformers


def test_named_templates_without_default_are_refused_as_transformers(tmp_path):
    tok, ref = _pair(tmp_path, NAMED[1:])
    with pytest.raises(ValueError, match="multiple chat templates with no default") as want:
        ref.apply_chat_template(CHATS[0], tokenize=False)
    with pytest.raises(ValueError) as got:
        tok.render_chat(CHATS[0])
    assert str(got.value) == str(want.value)
    assert tok.render_chat(CHATS[0], TOOLS) == ref.apply_chat_template(CHATS[0], tools=TOOLS, tokenize=False, add_generation_prompt=True)


def test_a_variable_named_self_is_a_variable(tmp_path):
    """``chat_template_kwargs: {"self": 1}``: Jinja's ``render(self, *args, **kwargs)`` took it as its own argument
    (TypeError: multiple values for 'self', the request a 400 "cannot tokenize"); rendered from one dict, it is a
    variable the template cannot see (Jinja's ``self`` is the template's own reference) and changes nothing."""
    tok = HFTokenizer(_folder(tmp_path, HEAD + "{{ m.content }}" + TAIL))
    assert tok.render_chat(CHATS[0], template_kwargs={"self": 1}) == tok.render_chat(CHATS[0])
    assert SimTokenizer().render_chat(CHATS[0], chat_template="{{ other }}", template_kwargs={"self": "me", "other": 2}) == "2"


def test_dict_is_transformers_restricted_dict_and_old_jinja2_is_refused(monkeypatch):
    """The template's ``dict`` is a callable with ``fromkeys`` only (``{{ dict.mro() }}`` / ``dict.__subclasses__``
    would reach every class of the process through the builtin type); jinja2 older than 3.1.6 is refused (its
    sandbox has known escapes), as transformers refuses it."""
    import jinja2

    from shared import tokenizer as T

    with pytest.raises(jinja2.exceptions.UndefinedError):
        SimTokenizer().render_chat(CHATS[0], chat_template="{{ dict.mro() }}")
    assert SimTokenizer().render_chat(CHATS[0], chat_template="{{ dict(a=1) | tojson }}{{ dict.fromkeys('ab', 0) | tojson }}") == '{"a": 1}{"a": 0, "b": 0}'
    T.chat_template_env.cache_clear()
    T.compile_chat_template.cache_clear()
    monkeypatch.setattr(jinja2, "__version__", "3.1.5")
    try:
        with pytest.raises(TokenizerError, match=r"jinja2>=3.1.6 .*found 3.1.5"):
            compile_chat_template("{{ 1 }}")
    finally:
        monkeypatch.undo()
        T.chat_template_env.cache_clear()
        T.compile_chat_template.cache_clear()
    assert compile_chat_template("{{ 1 }}").render() == "1"


def test_a_template_nested_past_the_recursion_limit_is_a_tokenizer_error(tmp_path):
    """5,000 nested ``{% if %}`` blocks: Jinja's parser recursed past Python's limit and the RecursionError went
    through (a model's template: the router died at start with a traceback, not "invalid chat template")."""
    deep = "{% if 1 %}" * 5000 + "x" + "{% endif %}" * 5000
    with pytest.raises(TokenizerError, match="nests too deeply"):
        compile_chat_template(deep)
    with pytest.raises(TokenizerError, match="nests too deeply"):
        HFTokenizer(_folder(tmp_path, deep))
