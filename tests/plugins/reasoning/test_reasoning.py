"""Reasoning in chat replies (the ``reasoning`` plugin's parsers) and the chat template's
variables (``chat_template_kwargs``).

The oracle for Qwen3's ``<think>`` tags is transformers' own parser of Qwen3 replies
(``tokenizer.parse_response`` with the response template ``transformers serve`` uses), given the
same prompt; the whole reply path (reasoning, content and tool calls) is checked through a
server in ``tests/plugins/tool_calling/test_tool_calling.py``.
"""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast
from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS

from nxdplug.plugins.reasoning.think_tags import ThinksFirst, ThinkTags
from nxdplug.plugins.serve.protocol import ChatCompletionRequest, OpenAIError
from nxdplug.plugins.serve.replies import ReplyReader
from nxdplug.plugins.serve.tool_calls import ToolUse
from nxdplug.plugins.tool_calling.hermes import HermesParser
from nxdplug.testing.tokenizer_builder import END_OF_TEXT, train_tokenizer

QWEN3_RESPONSES = next(t for types, t in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen3" in types)
ASKED = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [ASKED, ASKED + "<think>\n", ASKED + "<think>\n\n</think>\n\n"]
REPLIES = [
    "<think>\nhmm, let me see\n</think>\n\nThe answer is 4",
    "The answer is 4",
    "  hmm</think>\n\nThe answer",
    "<think>\nstill thinking \n",
    "<think></think>4",
    "<thi is not a tag",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(300), eos_token=END_OF_TEXT)


def split(splitter, text: str, size: int) -> tuple[str, str]:
    """The reasoning and answer a splitter tells of ``text`` fed ``size`` characters at a time."""
    parts = [splitter.feed(text[i : i + size]) for i in range(0, len(text), size)]
    parts.append(splitter.finish())
    return "".join(p.reasoning for p in parts), "".join(p.answer for p in parts)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("reply", REPLIES)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_qwen3_tells_reasoning_as_transformers_does(tokenizer, prompt, reply, size) -> None:
    expected = tokenizer.parse_response(reply, QWEN3_RESPONSES, prefix=prompt)
    reasoning, answer = split(ThinkTags(prompt), reply, size)
    assert reasoning == expected.get("reasoning_content", "")
    assert answer.rstrip() == expected.get("content", "")


@pytest.mark.parametrize(
    ("reply", "reasoning", "answer"),
    [
        ("hmm</think>\n\nThe answer", "hmm", "The answer"),
        ("<think>\nx\n</think>y", "x", "y"),
        ("thinking, cut off", "thinking, cut off", ""),
    ],
)
def test_deepseek_r1_reasons_until_the_closing_tag(reply, reasoning, answer) -> None:
    for size in (1, 1000):
        assert split(ThinksFirst(ASKED), reply, size) == (reasoning, answer)


def test_a_reply_reads_as_reasoning_content_and_calls(tokenizer) -> None:
    reply = (
        "<think>\nthe weather tool\n</think>\n\nSure.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    expected = tokenizer.parse_response(reply, QWEN3_RESPONSES, prefix=ASKED)
    tools = ({"type": "function", "function": {"name": "get_weather"}},)
    for size in (1, 5, 1000):
        reader = ReplyReader(ToolUse("auto", tools), HermesParser, ThinkTags(ASKED))
        told = [reader.read(reply[i : i + size]) for i in range(0, len(reply), size)]
        told.append(reader.finish())
        message = reader.message()
        assert message.reasoning_content == expected["reasoning_content"]
        assert message.content == expected["content"]
        (call,) = message.tool_calls
        assert call.function.name == "get_weather"
        assert call.function.arguments == '{"city": "Oslo"}'
        assert "".join(t.reasoning for t in told) == expected["reasoning_content"]
        assert [c.function.name for t in told for c in t.calls] == ["get_weather"]


THINKING_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


def test_chat_template_kwargs_are_the_templates_variables(tokenizer) -> None:
    tokenizer.chat_template = THINKING_TEMPLATE
    messages = [{"role": "user", "content": "2+2?"}]
    for variables in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        request = ChatCompletionRequest(
            model="m", messages=messages, chat_template_kwargs=variables or None
        )
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **variables
        )
        assert request.prompt_text(tokenizer) == expected
    assert request.prompt_text(tokenizer) != ChatCompletionRequest(
        model="m", messages=messages, chat_template_kwargs={"enable_thinking": False}
    ).prompt_text(tokenizer)
    refused = ChatCompletionRequest(
        model="m", messages=messages, chat_template_kwargs={"add_generation_prompt": False}
    )
    with pytest.raises(OpenAIError, match="add_generation_prompt") as error:
        refused.prompt_text(tokenizer)
    assert error.value.param == "chat_template_kwargs"
