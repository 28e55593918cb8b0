"""OpenAI's Responses API (``POST /v1/responses``) through the ``openai`` client.

On the scripted checkpoint of ``tests/plugins/tool_calling/test_tool_calling.py``, whose greedy
reply (checked with HF there) reasons, writes a sentence and calls a tool: the output items are
transformers' parse of that reply (a reasoning item, a message, a function call), whole or
streamed as OpenAI's events; the prompt (instructions, earlier calls and their outputs) is HF's
chat template of the same messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from transformers import AutoTokenizer  # noqa: E402

from tests.plugins.tool_calling.test_tool_calling import (  # noqa: E402
    MODEL,
    QUESTION,
    SCRIPTED_CALL,
    SCRIPTED_CONTENT,
    WEATHER,
    hf_prompt,
    scripted_checkpoint,
    scripted_client,
)

# The Responses API's function tool: flat, where chat nests it under "function".
FLAT_WEATHER = {"type": "function", **WEATHER["function"]}
ASKED = {"model": MODEL, "input": QUESTION[0]["content"], "tools": [FLAT_WEATHER]}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return scripted_checkpoint(tmp_path_factory.mktemp("scripted"))


@pytest.fixture(scope="module")
def client(scripted: Path) -> Iterator[openai.OpenAI]:
    with scripted_client(scripted) as scripted_server:
        yield scripted_server


def items(output: list) -> list[tuple]:
    """The output items' kinds and what they say (ids left out)."""
    said = []
    for item in output:
        if item.type == "reasoning":
            said.append(("reasoning", "".join(part.text for part in item.content)))
        elif item.type == "message":
            said.append(("message", "".join(part.text for part in item.content)))
        else:
            said.append(("function_call", item.name, json.loads(item.arguments)))
    return said


EXPECTED = [
    ("reasoning", "Paris"),
    ("message", SCRIPTED_CONTENT),
    ("function_call", "get_weather", json.loads(SCRIPTED_CALL)["arguments"]),
]


def test_a_response_is_the_replys_reasoning_message_and_call(client, scripted) -> None:
    response = client.responses.create(**ASKED, temperature=0)
    assert response.status == "completed" and response.object == "response"
    assert items(response.output) == EXPECTED and response.output_text == SCRIPTED_CONTENT
    call = response.output[2]
    assert call.call_id.startswith("call_") and call.status == "completed"
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    prompt = hf_prompt(tokenizer, QUESTION).shape[1]
    usage = response.usage
    assert usage.input_tokens == prompt and usage.total_tokens == prompt + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == len(tokenizer("Paris").input_ids)


def test_streamed_events_tell_the_same_items(client) -> None:
    events = list(client.responses.create(**ASKED, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert added == ["reasoning", "message", "function_call"] and items(done) == EXPECTED
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert (thought, text) == ("Paris", SCRIPTED_CONTENT)
    assert json.loads(arguments) == EXPECTED[2][2]
    assert items(events[-1].response.output) == EXPECTED


def test_instructions_and_earlier_calls_are_the_chat_templates_messages(client, scripted) -> None:
    earlier = [
        {"role": "user", "content": QUESTION[0]["content"]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "20 C"},
    ]  # fmt: skip
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", input=earlier, tools=[FLAT_WEATHER],
        tool_choice="none", max_output_tokens=4,
    )  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        *QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
    ]  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    assert response.usage.input_tokens == hf_prompt(tokenizer, messages).shape[1]
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"


def test_a_json_schema_text_format_holds_the_reply(client) -> None:
    schema = WEATHER["function"]["parameters"]
    text = {"format": {"type": "json_schema", "name": "weather", "schema": schema}}
    response = client.responses.create(model=MODEL, input="Which city?", text=text)
    assert json.loads(response.output_text)["city"] in ("Paris", "Oslo", "Lima")
    assert [item.type for item in response.output] == ["message"]  # no room to reason


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "image", "url": "x"}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0"),
        ({"input": []}, "input"),
    ],
)
def test_what_the_server_cannot_do_is_a_400(client, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**(ASKED | extra))
    assert refused.value.body["param"] == param
