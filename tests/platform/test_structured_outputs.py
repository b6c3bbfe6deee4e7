"""Structured outputs through the official OpenAI SDK on SmolLM2 and the demo adapters: JSON
schemas, regexes, choices and tool calls, each inside one continuous batch with unconstrained
requests and other adapters."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.platform.servers import start_server

DEMO_ADAPTERS = Path(__file__).resolve().parents[2] / "demo" / "adapters"
BASE = "smol"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["items", "express"],
    "additionalProperties": False,
}
SENTIMENT = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["label", "score"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["title", "day", "attendees", "priority"],
    "additionalProperties": False,
}
SCHEMAS = {"person": PERSON, "order": ORDER, "sentiment": SENTIMENT, "event": EVENT}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
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
            "properties": {"timezone": {"type": "string", "maxLength": 20}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def smol_server(tmp_path_factory, smollm2_dir):
    server = start_server(
        smollm2_dir,
        tmp_path_factory.mktemp("structured"),
        adapter_roots=DEMO_ADAPTERS,
        served_model_name=BASE,
        engine__memory_budget="512MiB",
    )
    tenant = server.tenant("structured")
    for name in ("ahoy", "uppercase"):
        server.register(name, DEMO_ADAPTERS / name, tenant)
    server.api_key = server.key(tenant)
    yield server
    server.stop()


@pytest.fixture
def client(smol_server):
    return openai.OpenAI(base_url=smol_server.api, api_key=smol_server.api_key, max_retries=0)


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}


@pytest.mark.smollm2
def test_schemas_hold_in_a_batch_mixed_with_free_requests_and_adapters(smol_server, report):
    models = [BASE, "ahoy", "uppercase"]
    constrained = [
        (name, models[i % 3], f"Request {i}: give me a {name} as JSON.")
        for i, name in enumerate(list(SCHEMAS) * 5)
    ]  # 20 requests, 4 schemas
    free = [(models[i % 3], f"Tell me one fact about the number {i}.") for i in range(8)]
    aio = openai.AsyncOpenAI(base_url=smol_server.api, api_key=smol_server.api_key, max_retries=0)

    async def ask(model, content, max_tokens=96, **extra):
        reply = await aio.chat.completions.create(
            model=model, messages=chat(content), temperature=0, max_tokens=max_tokens, **extra
        )
        return reply.choices[0]

    async def both():
        asks = [ask(m, c, response_format=schema_format(n)) for n, m, c in constrained]
        asks += [ask(m, c, max_tokens=24) for m, c in free]
        mixed = await asyncio.gather(*asks)  # one continuous batch
        alone = await asyncio.gather(*(ask(m, c, max_tokens=24) for m, c in free))
        await aio.close()
        return mixed, alone

    mixed, alone = asyncio.run(both())
    for (name, model, _), choice in zip(constrained, mixed[: len(constrained)], strict=True):
        assert choice.finish_reason == "stop", (name, model, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    for (model, _), with_neighbours, without in zip(
        free, mixed[len(constrained) :], alone, strict=True
    ):
        assert with_neighbours.message.content == without.message.content, model
    report(
        f"structured outputs: {len(constrained)} requests on {len(SCHEMAS)} schemas and "
        f"{len(free)} free ones over {len(models)} models in one batch: every constrained output "
        "valid, every free output unchanged by its neighbours"
    )


@pytest.mark.smollm2
def test_a_named_tool_choice_gives_valid_arguments(client):
    reply = client.chat.completions.create(
        model="ahoy",
        messages=chat("What is the weather in Lisbon?"),
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0,
    )
    message = reply.choices[0].message
    assert message.content is None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.smollm2
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_calls_one_of_the_tools_with_valid_arguments(client, stream):
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    request = dict(
        model=BASE,
        messages=chat("What time is it in Tokyo, and the weather in Oslo?"),
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=96,
        temperature=0,
    )
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(**request, stream=True):
            for delta in chunk.choices:
                for tc in delta.delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    entry["name"] += tc.function.name or ""
                    entry["arguments"] += tc.function.arguments or ""
                finish = delta.finish_reason or finish
        listed = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    else:
        choice = client.chat.completions.create(**request).choices[0]
        finish = choice.finish_reason
        listed = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls" and listed
    for name, arguments in listed:
        jsonschema.validate(json.loads(arguments), tools[name])


@pytest.mark.smollm2
def test_a_tool_result_goes_back_into_the_conversation(client):
    question = chat("What is the weather in Lisbon?")
    first = client.chat.completions.create(
        model="ahoy",
        messages=question,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0,
    )
    call = first.choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "deg": 21}'}
    turn = first.choices[0].message.model_dump(exclude_none=True)
    answer = client.chat.completions.create(
        model="ahoy", messages=[*question, turn, result], max_tokens=24, temperature=0
    )
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in (
        "stop",
        "length",
    )

    # the call itself is part of the prompt the model reads (SmolLM2's template does not show
    # tool calls: they are written out as the JSON a constrained call produces)
    silent = {"role": "assistant", "content": ""}
    without_call = client.chat.completions.create(
        model="ahoy", messages=[*question, silent, result], max_tokens=1, temperature=0
    )
    extra = answer.usage.prompt_tokens - without_call.usage.prompt_tokens
    assert extra >= len(call.function.arguments) // 8

    broken = {
        **turn,
        "tool_calls": [
            {**turn["tool_calls"][0], "function": {"name": "get_weather", "arguments": "{not json"}}
        ],
    }
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="ahoy", messages=[*question, broken, result])
    assert caught.value.body["param"] == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="ahoy", messages=[*question, turn, {"role": "tool", "content": "21"}]
        )
    assert caught.value.body["param"] == "messages[2].tool_call_id"


@pytest.mark.smollm2
def test_regex_and_choice_constraints_hold(client):
    pattern = r"[A-Z]{3}-[0-9]{4}"
    regex = client.chat.completions.create(
        model="uppercase",
        messages=chat("Invent a ticket code."),
        max_tokens=20,
        temperature=0.9,
        seed=3,
        extra_body={"guided_regex": pattern},
    )
    assert re.fullmatch(pattern, regex.choices[0].message.content)
    choices = ["red", "green", "blue"]
    picked = client.chat.completions.create(
        model=BASE,
        messages=chat("Pick a colour."),
        max_tokens=8,
        n=3,
        temperature=1.0,
        seed=5,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.message.content in choices for c in picked.choices)
    legacy = client.completions.create(
        model="ahoy",
        prompt="The answer is",
        max_tokens=8,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert legacy.choices[0].text in ("yes", "no")
    cut = client.chat.completions.create(
        model=BASE,
        messages=chat("Give me a person."),
        max_tokens=3,
        response_format=schema_format("person"),
    )
    assert cut.choices[0].finish_reason == "length"  # incomplete, as OpenAI's API allows


@pytest.mark.smollm2
@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "structured_outputs",
            'Unsupported type "nonsense"',
        ),
        ({"extra_body": {"guided_regex": "([a-z"}}, "structured_outputs", "Unclosed"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format type"),
        ({"tools": [WEATHER]}, "tool_choice", "'auto'"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "'auto'"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not in tools",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
            "guided_regex",
            "at most one output constraint",
        ),
    ],
    ids=[
        "bad schema",
        "bad regex",
        "unknown format",
        "tools default auto",
        "auto",
        "unknown tool",
        "two",
    ],
)
def test_an_unservable_constraint_is_a_400_and_the_server_goes_on(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=BASE, messages=chat("Hi"), max_tokens=8, **extra)
    error = caught.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]
    after = client.chat.completions.create(model=BASE, messages=chat("Hi"), max_tokens=4)
    assert after.choices[0].message.content
