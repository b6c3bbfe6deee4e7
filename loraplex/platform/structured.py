"""From an OpenAI request to the engine's output constraint: `response_format`, vLLM's guided_*
fields and `structured_outputs`, and tools called with `tool_choice` "required" or a named
function (constrained to the functions' JSON schemas, so any model produces valid calls).

`tool_choice` "auto" needs a parser for the model's own tool-call format; loraplex has none yet,
so it is refused by name (400), as are tools with no tool_choice (OpenAI's default is "auto").
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from loraplex.engine.api import InvalidRequestError, StructuredOutput
from loraplex.platform import openai_schema as oa
from loraplex.platform.errors import invalid_request, unsupported_field

_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object"}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How the output of a tool-calling request becomes `tool_calls`."""

    named: str | None  # the function tool_choice names, or None for "required"

    def outcome(self, text: str, reason: str | None) -> tuple[list[oa.ToolCall] | None, str | None]:
        """(the tool calls a finished output holds, the choice's finish_reason). No calls for an
        output cut short (max_tokens, a stop string): its text is the reply, as it is."""
        if reason != "stop":
            return None, reason
        try:
            value = json.loads(text)
        except ValueError:  # a stop string ended it mid-way
            return None, reason
        if self.named is not None:
            # as OpenAI: a forced (named) call ends with "stop", a chosen one with "tool_calls"
            return [_call(self.named, value)], "stop"
        return [_call(item["name"], item["parameters"]) for item in value], "tool_calls"


def _call(name: str, arguments: Any) -> oa.ToolCall:
    return oa.ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}",
        function=oa.FunctionCall(name=name, arguments=json.dumps(arguments)),
    )


def constraint(
    request: oa.ChatCompletionRequest | oa.CompletionRequest,
) -> tuple[StructuredOutput | None, ToolPlan | None]:
    """The request's constraint, and for tool calls how to read the output. Raises APIError
    (400) naming the field."""
    found: list[tuple[str, StructuredOutput]] = []
    plan = None
    if isinstance(request, oa.ChatCompletionRequest):
        tools = _tools(request)
        if tools:
            plan, tool_constraint = tools
            found.append(("tool_choice", tool_constraint))
    fields = request.model_fields_set
    try:
        if "response_format" in fields and request.response_format is not None:
            made = _response_format(request.response_format)
            if made is not None:
                found.append(("response_format", made))
        if request.guided_json is not None:
            found.append(("guided_json", _schema(request.guided_json, "guided_json")))
        if request.guided_regex is not None:
            found.append(("guided_regex", StructuredOutput.regex(request.guided_regex)))
        if request.guided_choice is not None:
            found.append(("guided_choice", StructuredOutput.choice(request.guided_choice)))
        if request.guided_grammar is not None:
            found.append(("guided_grammar", StructuredOutput.grammar(request.guided_grammar)))
        if request.structured_outputs:
            found.append(("structured_outputs", _structured(request.structured_outputs)))
    except InvalidRequestError as error:
        raise invalid_request(str(error), param=error.param) from None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise invalid_request(
            f"at most one output constraint per request, got {names}", found[1][0]
        )
    return (found[0][1] if found else None), plan


def _response_format(response_format: dict) -> StructuredOutput | None:
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequestError(
                "response_format.json_schema must be an object with a 'schema' object",
                param="response_format",
            )
        return _schema(spec.get("schema", {}), "response_format")
    raise InvalidRequestError(
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format",
    )


def _schema(schema: Any, param: str) -> StructuredOutput:
    try:
        return StructuredOutput.json_schema(schema)
    except InvalidRequestError as error:
        raise InvalidRequestError(str(error), param=param) from None


def _structured(spec: dict) -> StructuredOutput:
    unknown = set(spec) - _STRUCTURED_KEYS
    given = {k: v for k, v in spec.items() if v not in (None, False)}
    if unknown or len(given) != 1:
        raise InvalidRequestError(
            f"structured_outputs takes exactly one of {sorted(_STRUCTURED_KEYS)}",
            param="structured_outputs",
        )
    ((key, value),) = given.items()
    if key == "json":
        return _schema(value, "structured_outputs")
    if key == "json_object":
        return StructuredOutput.json_object()
    return {"regex": StructuredOutput.regex, "choice": StructuredOutput.choice}.get(
        key, StructuredOutput.grammar
    )(value)


def _tools(request: oa.ChatCompletionRequest) -> tuple[ToolPlan, StructuredOutput] | None:
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise invalid_request("tool_choice needs tools", param="tool_choice")
        return None
    functions = [_function(i, tool) for i, tool in enumerate(request.tools)]
    if choice == "none":
        return None
    if choice in (None, "auto"):
        raise unsupported_field(
            "tool_choice",
            "'auto' needs a parser for this model's tool-call format, which loraplex does not "
            "have; send tool_choice 'required' or name a function",
        )
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, parameters in functions
        ]
        schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(None), _schema(schema, "tools")
    name = _named(choice)
    parameters = dict(functions).get(name)
    if parameters is None:
        raise invalid_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return ToolPlan(name), _schema(parameters, "tools")


def _function(index: int, tool: dict) -> tuple[str, dict]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type") != "function":
        raise invalid_request(
            "each tool must be {'type': 'function', 'function': {...}}", f"tools[{index}]"
        )
    name, parameters = function.get("name"), function.get("parameters", _EMPTY_PARAMETERS)
    if not isinstance(name, str) or not name:
        raise invalid_request("a function needs a name", f"tools[{index}].function.name")
    if not isinstance(parameters, dict):
        raise invalid_request(
            "parameters must be a JSON schema object", f"tools[{index}].function.parameters"
        )
    return name, parameters


def _named(choice: str | dict) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise invalid_request(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )
