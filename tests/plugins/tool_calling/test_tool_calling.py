"""Tool calling in ``nxdplug serve``'s chat completions, through the ``openai`` client.

The oracles: transformers' own parser of Qwen2's tool calls (``tokenizer.parse_response`` with
the response template ``transformers serve`` uses) for the ``hermes`` parser and for a reply
that a scripted checkpoint writes (HF's greedy decoding checked first); HF's
``apply_chat_template`` for the prompt; and, for ``tool_choice`` ``required`` or a named
function, the same server's structured output of the schema that vLLM documents for them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS  # noqa: E402

from nxdplug.cli.main import main  # noqa: E402
from nxdplug.plugins.serve.protocol import ChatCompletionRequest, OpenAIError  # noqa: E402
from nxdplug.plugins.serve.replies import ReplyReader  # noqa: E402
from nxdplug.plugins.serve.tool_calls import CallArray, ToolUse  # noqa: E402
from nxdplug.plugins.tool_calling.hermes import HermesParser  # noqa: E402
from nxdplug.plugins.tool_calling.llama3_json import Llama3JsonParser  # noqa: E402
from nxdplug.plugins.tool_calling.mistral import MistralParser  # noqa: E402
from nxdplug.testing.tiny_models import make_tiny_checkpoint  # noqa: E402
from nxdplug.testing.tokenizer_builder import build_tokenizer  # noqa: E402
from tests.plugins.serve.test_serving import running_server, with_chat_template  # noqa: E402

MODEL = "tiny-llama"
# Long enough for the prompts that list the tools (~230 tokens of the tiny tokenizer).
SERVER_OPTIONS = ("--seq-len", "512", "--max-context-length", "384", "--batch-size", "2")
# transformers' response templates of Qwen2's and Qwen3's replies (one: <think>, then Hermes').
QWEN2_RESPONSES = next(t for types, t in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen2" in types)
QWEN3_RESPONSES = next(t for types, t in _RESPONSE_TEMPLATE_FALLBACKS.items() if "qwen3" in types)
# A Qwen-like template: tools listed first, calls written as Hermes' tags, tool results.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}"
    "{% if m.role == 'tool' %}<tool>{{ m.content }}\n"
    "{% else %}<{{ m.role }}>{{ m.content }}{% for call in m.tool_calls or [] %}"
    "<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# What the scripted checkpoint writes after any prompt: content, then one call.
SCRIPTED_CONTENT = "Let me check."
SCRIPTED_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
# The scripted checkpoint's greedy reply to any prompt: reasoning, content, then one call.
SCRIPTED_REPLY = (
    "<think>Paris</think>" + SCRIPTED_CONTENT + "<tool_call>" + SCRIPTED_CALL + "</tool_call>"
)


# --- the parsers, piece by piece ----------------------------------------------------------------


def parse(parser, text: str, size: int) -> tuple[str, list[tuple[str, object]]]:
    """The content and calls a parser finds in ``text`` fed ``size`` characters at a time."""
    parts = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
    parts.append(parser.finish())
    content = "".join(part.content for part in parts)
    calls = [(c.name, json.loads(c.arguments)) for part in parts for c in part.calls]
    return content, calls


def called(tool_calls: list[dict]) -> list[tuple[str, object]]:
    """transformers' parsed calls as (name, arguments)."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]


HERMES_REPLIES = [
    "Hello there",
    "Trailing space \n",
    "a < b, and <tool is not a tag",
    SCRIPTED_CONTENT + "<tool_call>" + SCRIPTED_CALL + "</tool_call>",
    'Sure.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "a", "arguments": {"s": "a \\" é"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and after',
]


@pytest.mark.parametrize("reply", HERMES_REPLIES)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_hermes_finds_what_transformers_finds(reply: str, size: int, tokenizer) -> None:
    expected = tokenizer.parse_response(reply, QWEN2_RESPONSES, prefix="")
    calls = called(expected.get("tool_calls", []))
    assert parse(HermesParser([]), reply, size) == (expected.get("content", ""), calls)


def test_parallel_tool_calls_false_answers_the_first_call_only() -> None:
    two_calls = HERMES_REPLIES[4]
    for parallel, names in [(True, ["a", "b"]), (False, ["a"])]:
        reader = ReplyReader(ToolUse("auto", (WEATHER,), parallel=parallel), HermesParser)
        reader.read(two_calls)
        reader.finish()
        message = reader.message()
        assert [call.function.name for call in message.tool_calls] == names
        assert message.content == "Sure." and reader.finish_reason("stop") == "tool_calls"


def test_hermes_gives_a_call_that_is_not_json_back_as_content() -> None:
    for reply in ["<tool_call>{oops}</tool_call>", 'x<tool_call>{"name": "a", "argum']:
        assert parse(HermesParser([]), reply, 2) == (reply, [])


CUT_OFF = '{"name": "a", "parameters": {"x": '
LLAMA3_REPLIES = [
    ('{"name": "f", "parameters": {"city": "Paris"}}', "", [("f", {"city": "Paris"})]),
    ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "",
     [("a", {"x": 1}), ("b", {})]),
    ("The weather is nice.", "The weather is nice.", []),
    ('{"answer": 42} is JSON', '{"answer": 42} is JSON', []),
    (CUT_OFF, CUT_OFF, []),
]  # fmt: skip


@pytest.mark.parametrize(("reply", "content", "calls"), LLAMA3_REPLIES)
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_llama3_json_finds_calls_in_replies_that_are_calls(reply, content, calls, size) -> None:
    assert parse(Llama3JsonParser([]), reply, size) == (content, calls)


MISTRAL_REPLIES = [
    ('Sure.[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
     "Sure.", [("a", {"x": 1}), ("b", {})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"hour": 3}', "",
     [("get_weather", {"city": "Paris"}), ("get_time", {"hour": 3})]),
    ("No call [TOOLS here", "No call [TOOLS here", []),
    ('[TOOL_CALLS] [{"name": "a", "argu', '[TOOL_CALLS] [{"name": "a", "argu', []),
    ('[TOOL_CALLS] [{"answer": 4}]', '[TOOL_CALLS] [{"answer": 4}]', []),
]  # fmt: skip


@pytest.mark.parametrize(("reply", "content", "calls"), MISTRAL_REPLIES)
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_mistral_finds_both_formats_of_calls(reply, content, calls, size) -> None:
    assert parse(MistralParser([]), reply, size) == (content, calls)


def test_mistral_calls_get_the_9_character_ids_its_templates_take() -> None:
    for use in (ToolUse("auto", (WEATHER,)), ToolUse("required", (WEATHER,))):
        reader = ReplyReader(use, MistralParser)
        text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
        reader.read(text if use.choice == "required" else "[TOOL_CALLS]" + text.replace(
            "parameters", "arguments"))  # fmt: skip
        reader.finish()
        (call,) = reader.message().tool_calls
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id) and call.function.name == "get_weather"


def test_required_calls_are_told_as_each_object_closes() -> None:
    reply = '[{"name": "a", "parameters": {"s": "}]\\"{"}}, {"name": "b", "parameters": {}}]'
    parser = CallArray()
    cut = reply.index("}}, ") + 2
    first = parser.feed(reply[:cut])
    assert [c.name for c in first.calls] == ["a"]
    assert json.loads(first.calls[0].arguments) == {"s": '}]"{'}
    assert [c.name for c in parser.feed(reply[cut:]).calls] == ["b"]
    assert parse(CallArray(), '[{"name": "a", "parameters": {"s": "cut', 5) == ("", [])


# --- requests refused before they reach a model ------------------------------------------------


NAMED_X = {"type": "function", "function": {"name": "x"}}
JSON_OBJECT = {"type": "json_object"}
USER_CALLS = {"role": "user", "tool_calls": [{"id": "c", "function": {"name": "a"}}]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": NAMED_X}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": JSON_OBJECT},
         "tool_choice"),
        ({"messages": [{"role": "tool", "content": "20 C"}]}, "messages.0.tool_call_id"),
        ({"messages": [USER_CALLS]}, "messages.0.tool_calls"),
    ],
)  # fmt: skip
def test_a_tool_choice_its_tools_cannot_meet_is_a_400(body: dict, param: str) -> None:
    request = ChatCompletionRequest(**({"model": MODEL, "messages": QUESTION} | body))
    with pytest.raises(OpenAIError) as refused:
        request.refuse_unsupported()
        request.structured_output()
    assert refused.value.status == 400 and refused.value.param == param


def test_a_template_that_leaves_tools_out_is_a_400(tokenizer) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    request = ChatCompletionRequest(model=MODEL, messages=QUESTION, tools=[WEATHER])
    with pytest.raises(OpenAIError, match="does not write tools into the prompt"):
        request.prompt_text(tokenizer)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--tool-call-parser", "hermes"], "go together"),
        (["--enable-auto-tool-choice", "--tool-call-parser", "hermez"], "Did you mean 'hermes'?"),
    ],
)
def test_serve_refuses_half_or_unknown_tool_options(options, message, checkpoint, capsys) -> None:
    code = main(["serve", "--model-path", str(checkpoint), "--port", "0", *options])
    error = capsys.readouterr().err
    assert code != 0 and message in error and "Traceback" not in error


# --- auto: a scripted checkpoint whose greedy reply reasons, then calls ----------------------


def scripted_checkpoint(folder: Path) -> Path:
    """A one-layer Llama whose layers add nothing (zero output projections), so each token's
    logits depend on that token alone: its lm_head makes the greedy reply to any prompt of
    ``TOOLS_TEMPLATE`` ``SCRIPTED_REPLY``, then end-of-sequence."""
    tokenizer = build_tokenizer(folder, vocab_size=400)
    tokenizer.add_tokens(["<think>", "</think>", SCRIPTED_CALL])
    # Special tokens, as Hermes 2 Pro's are: the server must keep them in the reply's text.
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(folder)
    prompt_end = hf_prompt(tokenizer, QUESTION)[0, -1].item()
    script = [prompt_end, *tokenizer(SCRIPTED_REPLY).input_ids, tokenizer.eos_token_id]
    assert len(set(script)) == len(script)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        embedding = model.model.embed_tokens.weight
        for token, following in itertools.pairwise(script):
            model.lm_head.weight[following] = 10 * embedding[token] / embedding[token].norm()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scripted_checkpoint(tmp_path_factory.mktemp("scripted"))


@contextlib.contextmanager
def scripted_client(folder: Path) -> Iterator[openai.OpenAI]:
    """The ``openai`` client of a server of the scripted checkpoint that reads Hermes' tool
    calls and Qwen3's reasoning."""
    parsers = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    parsers += ("--reasoning-parser", "qwen3")
    with running_server(folder, *SERVER_OPTIONS, *parsers) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def auto_client(scripted: Path) -> Iterator[openai.OpenAI]:
    with scripted_client(scripted) as client:
        yield client


def hf_prompt(tokenizer, messages: list[dict]) -> torch.Tensor:
    """HF's prompt ids, [1, n], of ``messages`` with the weather tool."""
    rendered = tokenizer.apply_chat_template(
        messages, tools=[WEATHER], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return rendered["input_ids"]


@pytest.fixture(scope="module")
def scripted_reply(scripted: Path) -> tuple[str, dict]:
    """HF's greedy reply of the scripted checkpoint, and transformers' parse of it (Qwen3's
    response template: reasoning, content, Hermes' calls)."""
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    prompt = hf_prompt(tokenizer, QUESTION)
    model = AutoModelForCausalLM.from_pretrained(scripted).eval()
    with torch.inference_mode():
        tokens = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.shape[1] :]
    assert tokens[-1] == tokenizer.eos_token_id  # the end, which is no text
    text = tokenizer.decode(tokens[:-1], skip_special_tokens=False)
    prefix = tokenizer.decode(prompt[0])
    return text, tokenizer.parse_response(text, QWEN3_RESPONSES, prefix=prefix)


def test_the_scripted_checkpoint_reasons_and_calls_a_tool_under_hf(scripted_reply) -> None:
    text, parsed = scripted_reply
    assert text == SCRIPTED_REPLY
    assert parsed["reasoning_content"] == "Paris" and parsed["content"] == SCRIPTED_CONTENT
    assert len(parsed["tool_calls"]) == 1


def test_auto_answers_transformers_parse_of_the_reply(auto_client, scripted_reply) -> None:
    """Reasoning (``--reasoning-parser qwen3``), content and calls (``hermes``)."""
    _, parsed = scripted_reply
    expected = called(parsed["tool_calls"])
    answer = auto_client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], temperature=0
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == parsed["content"]
    assert choice.message.reasoning_content == parsed["reasoning_content"]
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    assert calls[0].id.startswith("call_") and calls[0].type == "function"

    chunks = list(
        auto_client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[WEATHER], temperature=0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    streamed: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.id is not None:
                streamed[call.index] = [call.function.name, ""]
            streamed[call.index][1] += call.function.arguments
    assert content == parsed["content"] and reasoning == parsed["reasoning_content"]
    assert [(name, json.loads(args)) for name, args in streamed.values()] == expected
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    none = auto_client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="none", temperature=0
    )
    message = none.choices[0].message  # the tags are special tokens, left out of plain text
    assert message.content == SCRIPTED_CONTENT + SCRIPTED_CALL
    assert message.reasoning_content == "Paris" and not message.tool_calls
    assert none.choices[0].finish_reason == "stop"


# --- required, a named function, none: a random model held to the schemas ---------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_checkpoint(
        "llama", tmp_path_factory.mktemp("tools") / "ckpt", seed=3,
        overrides={"initializer_range": 0.15},
    )  # fmt: skip
    return with_chat_template(path, TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path):
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def client(checkpoint: Path) -> Iterator[openai.OpenAI]:
    with running_server(checkpoint, *SERVER_OPTIONS) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)


def test_a_named_function_is_its_parameters_schema(client) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    asked = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 30}
    answer = client.chat.completions.create(**asked, tools=[WEATHER, TIME], tool_choice=named)
    held = client.chat.completions.create(
        **asked, tools=[WEATHER, TIME], tool_choice="none",
        extra_body={"structured_outputs": {"json": TIME["function"]["parameters"]}},
    )  # fmt: skip
    choice = answer.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert call.function.arguments == held.choices[0].message.content
    assert 0 <= json.loads(call.function.arguments)["hour"] <= 23
    assert choice.message.content is None and choice.finish_reason == "stop"

    stream = client.chat.completions.create(
        **asked, tools=[WEATHER, TIME], tool_choice=named, stream=True
    )
    pieces = [c.choices[0].delta.tool_calls for c in stream if c.choices]
    pieces = [call for piece in pieces if piece for call in piece]
    assert pieces[0].function.name == "get_time" and pieces[0].id
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments


def test_required_is_vllms_array_of_calls(client) -> None:
    def call_of(tool: dict) -> dict:
        return {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "parameters": tool["function"]["parameters"],
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }

    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [call_of(WEATHER), call_of(TIME)]}}
    asked = {"model": MODEL, "messages": QUESTION, "max_tokens": 60, "tools": [WEATHER, TIME]}
    for seed in range(3):  # sampled, so that more than one path through the schema is taken
        answer = client.chat.completions.create(**asked, tool_choice="required", seed=seed)
        held = client.chat.completions.create(
            **asked, tool_choice="none", seed=seed,
            extra_body={"structured_outputs": {"json": schema}},
        )  # fmt: skip
        choice = answer.choices[0]
        array = json.loads(held.choices[0].message.content)
        calls = [
            (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls
        ]
        assert calls == [(c["name"], c["parameters"]) for c in array]
        assert choice.finish_reason == "tool_calls"


def test_auto_without_a_parser_is_a_400_that_names_the_flags(client) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER])
    assert "--enable-auto-tool-choice --tool-call-parser" in str(refused.value)
    assert refused.value.body["param"] == "tool_choice"


def test_tools_and_earlier_calls_are_in_the_prompt_as_hf_writes_them(client, checkpoint) -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        *QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "function": call}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C, sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0,
        max_tokens=8, extra_body={"ignore_eos": True},
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    prompt = hf_prompt(tokenizer, hf_messages)
    assert '"city": "Paris"' in tokenizer.decode(prompt[0])
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    with torch.inference_mode():
        greedy = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert answer.usage.prompt_tokens == prompt.shape[1]
    assert answer.choices[0].message.content == tokenizer.decode(greedy[0, prompt.shape[1] :])
