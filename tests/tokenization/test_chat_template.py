"""Chat templates render as transformers' apply_chat_template does: real models' templates, the
expected prompts written out by hand."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from splitbus.tokenization import ChatTemplateError, ModelTokenizer
from splitbus.tokenization import chat_template as chat_template_module
from tests.tokenization.conftest import FolderMaker

# SmolLM2-135M-Instruct's template (its tokenizer_config.json and its GGUF carry it): ChatML with
# a default system prompt when the conversation has none.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Written as Qwen2.5's is: one statement a line, whitespace control, a default system prompt,
# loop controls, tools given with tojson (transformers passes tools=None when there are none).
QWEN2 = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- if tools is not none %}
    {{- raise_exception('no tools expected') }}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message.role == 'system' %}
        {%- continue %}
    {%- endif %}
    {%- if message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message | tojson + '\\n</tool_response><|im_end|>\\n' }}
        {%- break %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Llama 3.x style: bos_token, today's date from strftime_now, blocks on their own lines.
LLAMA3 = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% else %}
    {% set system = 'You are a helpful assistant.' %}
{% endif %}
<|start_header_id|>system<|end_header_id|>

Today Date: {{ strftime_now('%d %b %Y') }}

{{ system }}<|eot_id|>
{% for message in messages %}
    {% generation %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
    {% endgeneration %}
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

USER_HI = [{"role": "user", "content": "Hi"}]


def _tokenizer(model_folder: FolderMaker, template: object, **tok_config: object) -> ModelTokenizer:
    return ModelTokenizer.load(model_folder({"chat_template": template, "eos_token": "<|im_end|>", **tok_config}))


def test_smollm2_adds_its_default_system_prompt(model_folder: FolderMaker) -> None:
    tok = _tokenizer(model_folder, SMOLLM2)
    assert tok.has_own_chat_template
    assert tok.render_chat(USER_HI) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_keeps_a_given_system_prompt_and_can_leave_out_the_generation_prompt(
    model_folder: FolderMaker,
) -> None:
    tok = _tokenizer(model_folder, SMOLLM2)
    messages = [{"role": "system", "content": "Be brief."}, *USER_HI, {"role": "assistant", "content": "Hello!"}]
    assert tok.render_chat(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_qwen2_style_template_with_loop_controls_and_tojson(model_folder: FolderMaker) -> None:
    tok = _tokenizer(model_folder, QWEN2)
    messages = [
        *USER_HI,
        {"role": "tool", "content": "22 °C <sunny> & 'dry'"},
        {"role": "user", "content": "after the break: never rendered"},
    ]
    assert tok.render_chat(messages) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        # transformers' tojson: non-ASCII and HTML characters as they are (Jinja's own escapes both)
        '<|im_start|>user\n<tool_response>\n{"role": "tool", "content": "22 °C <sunny> & \'dry\'"}\n'
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "S"}, *USER_HI]
    assert tok.render_chat(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


class _FixedNow:
    @staticmethod
    def now() -> datetime:
        return datetime(2026, 7, 4, 12, 0)


def test_llama3_style_template_with_bos_date_and_generation_tags(
    model_folder: FolderMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat_template_module, "datetime", _FixedNow)
    tok = _tokenizer(model_folder, LLAMA3, bos_token={"content": "<|begin_of_text|>", "special": True})
    # Block lines vanish whole (trim_blocks, lstrip_blocks); a line ending in {{ }} keeps its newline.
    assert tok.render_chat([{"role": "user", "content": "  Hi  "}]) == (
        "<|begin_of_text|>\n"
        "<|start_header_id|>system<|end_header_id|>\n\n"
        "Today Date: 04 Jul 2026\n\nYou are a helpful assistant.<|eot_id|>\n"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\n"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_blocks_trim_their_newline_and_leading_whitespace(model_folder: FolderMaker) -> None:
    tok = _tokenizer(
        model_folder,
        "{% for m in messages %}\n  {{ m.content }}\n  {% if loop.last %}\nend\n  {% endif %}\n{% endfor %}\n",
    )
    assert tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "  a\n  b\nend\n"


def test_variables_are_the_ones_transformers_passes(model_folder: FolderMaker) -> None:
    template = (
        "{{ tools is none }} {{ documents is none }} {{ bos_token is defined }} {{ eos_token }} {{ pad_token }}"
        " {{ additional_special_tokens | join(',') }} {{ add_generation_prompt }}"
    )
    tok = _tokenizer(
        model_folder,
        template,
        bos_token=None,  # a null token is not passed: the template sees it undefined
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", {"content": "<|im_end|>"}],
    )
    assert tok.render_chat(USER_HI) == "True True False <|im_end|> <|endoftext|> <|im_start|>,<|im_end|> True"


def test_raise_exception_and_a_failing_template_are_chat_template_errors(model_folder: FolderMaker) -> None:
    strict = _tokenizer(
        model_folder, "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="system first"):
        strict.render_chat(USER_HI)
    with pytest.raises(ChatTemplateError, match="failed"):
        _tokenizer(model_folder, "{{ messages[0].content + 1 }}").render_chat(USER_HI)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _tokenizer(model_folder, "{% for m in messages %}").render_chat(USER_HI)


def test_the_sandbox_keeps_messages_unchanged(model_folder: FolderMaker) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    tok = _tokenizer(model_folder, "{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        tok.render_chat(messages)
    assert messages == [{"role": "user", "content": "Hi"}]


def test_chat_template_jinja_wins_and_a_named_list_gives_its_default(model_folder: FolderMaker) -> None:
    named = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default {{ messages | length }}"},
    ]
    assert _tokenizer(model_folder, named).render_chat(USER_HI) == "default 1"
    folder = model_folder({"chat_template": "from the config"}, files={"chat_template.jinja": "from the file\n"})
    assert ModelTokenizer.load(folder).render_chat(USER_HI) == "from the file"  # Jinja drops one trailing newline


def test_a_folder_without_a_template_gets_chatml(model_folder: FolderMaker) -> None:
    tok = ModelTokenizer.load(model_folder({"eos_token": "<|im_end|>"}))
    assert not tok.has_own_chat_template
    assert tok.render_chat(USER_HI) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


# Qwen2.5-Instruct's template as the model ships it (qwen25_tools.jinja): the tools printed with tojson
# in the system prompt, an assistant's calls as <tool_call> JSON with their arguments an object,
# tool results as <tool_response> in a user turn.
QWEN25_TOOLS = (Path(__file__).parent / "qwen25_tools.jinja").read_text()
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo d'une ville",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": "22 °C", "tool_call_id": "call_1"},
]
QWEN25_TOOLS_PROMPT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Météo d\'une ville", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    "<|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n22 °C\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_tools_and_tool_messages_render_as_qwen25_expects(model_folder: FolderMaker) -> None:
    tok = _tokenizer(model_folder, QWEN25_TOOLS)
    assert tok.render_chat(TOOL_CONVERSATION, tools=[WEATHER_TOOL]) == QWEN25_TOOLS_PROMPT
    without = tok.render_chat(USER_HI)  # tools None: the plain system prompt
    assert (
        without.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.") and "<tools>" not in without
    )
