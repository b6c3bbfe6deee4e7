"""OpenAI's routes: chat completions, legacy completions, models."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from loraplex.engine.api import AsyncEngine, InvalidRequestError
from loraplex.platform import openai_schema as oa
from loraplex.platform import registry
from loraplex.platform.calls import (
    Call,
    ClientDisconnected,
    authenticate,
    cancelled_on_disconnect,
)
from loraplex.platform.completions import (
    DONE,
    chat_logprobs,
    choice_index,
    collect,
    deltas,
    finish_reason,
    legacy_logprobs,
    sse,
    sse_error,
    start,
    usage,
)
from loraplex.platform.deps import CallerDep, PlatformDep
from loraplex.platform.errors import (
    APIError,
    invalid_request,
    model_not_found,
    unsupported_field,
    validation_error,
)
from loraplex.platform.sampling import TIER_NAMES, refuse_unsupported, sampling_params
from loraplex.platform.state import Platform
from loraplex.platform.structured import ToolPlan, constraint

router = APIRouter(tags=["openai"])
BODY_MODELS = (oa.ChatCompletionRequest, oa.CompletionRequest)  # described in the OpenAPI
EVENT_STREAM = "text/event-stream"
CLIENT_GONE = 499  # nginx's status for a client that closed the connection
# Chats this short are put through the template on the event loop (a fraction of a millisecond);
# longer ones on a worker thread.
INLINE_CHAT_CHARACTERS = 4096


@asynccontextmanager
async def ending_on_error(call: Call):
    """Whatever escapes ends the call with its status (and carries the rate-limit headers)."""
    try:
        yield
    except APIError as error:
        await call.finish(error.status)
        error.headers = {**call.headers, **error.headers}
        raise
    except (asyncio.CancelledError, ClientDisconnected):
        await call.finish(CLIENT_GONE)
        raise
    except Exception:
        await call.finish(500)
        raise


class DirectRoute(APIRoute):
    """A route whose endpoint takes the Request and returns a Response itself: described in the
    OpenAPI like any other, but called without FastAPI's dependency solving (the hot path)."""

    def get_route_handler(self):
        return self.endpoint


def hot_post(path: str, body: type[BaseModel], response: type[BaseModel]):
    """Register a hot POST route whose JSON `body` the endpoint parses itself."""
    schema = {"$ref": f"#/components/schemas/{body.__name__}"}  # see app._openapi
    extra = {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}

    def register(endpoint):
        router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            response_model=response,
            openapi_extra=extra,
            route_class_override=DirectRoute,
        )
        return endpoint

    return register


M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as error:
        raise validation_error(error.errors(include_url=False)) from None


def json_reply(reply, call: Call) -> Response:
    return Response(reply.model_dump_json(), media_type="application/json", headers=call.headers)


# -- chat ------------------------------------------------------------------------------------


@hot_post("/v1/chat/completions", oa.ChatCompletionRequest, oa.ChatCompletion)
async def chat_completions(request: Request):
    """Parsed by hand rather than through FastAPI's dependencies: the hot path, kept short."""
    platform: Platform = request.app.state.platform
    engine = platform.require_engine()
    caller = await authenticate(request, platform)
    body = await parse_body(request, oa.ChatCompletionRequest)
    call = Call(platform, caller, body.model, "chatcmpl", request)
    async with ending_on_error(call):
        refuse_unsupported(body)
        call.choose_tier(body)
        structured, plan = constraint(body)
        params = sampling_params(body, structured)
        target = await platform.directory.resolve(caller, body.model)
        call.adapter_id, call.resolved = target.adapter_id, True
        tools = body.tools if plan is not None else None
        prompt = await _encode_chat(engine, body.messages, tools)
        await call.admit(len(prompt) + (params.max_tokens or 0))
        if body.stream:
            async with cancelled_on_disconnect(request):
                primed = await start(engine, call, [prompt], params, target.lora)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _chat_stream(engine, call, primed, include_usage, platform.fingerprint, plan)
            return StreamingResponse(stream, media_type=EVENT_STREAM, headers=call.headers)
        async with cancelled_on_disconnect(request):
            reply = await _chat_reply(
                engine, call, prompt, params, target.lora, platform.fingerprint, plan
            )
        await call.finish(200)
        return json_reply(reply, call)


async def _chat_reply(
    engine, call, prompt, params, lora, fingerprint, plan: ToolPlan | None
) -> oa.ChatCompletion:
    primed = await start(engine, call, [prompt], params, lora, stream=False)
    choices = await collect(call, primed, params.n)
    replies = []
    for i, state in choices.items():
        calls, reason = None, state.finish_reason
        if plan is not None:
            calls, reason = plan.outcome(state.text, reason)
        message = oa.AssistantMessage(content=None if calls else state.text, tool_calls=calls)
        logprobs = chat_logprobs(engine, state.logprobs) if params.logprobs is not None else None
        replies.append(
            oa.ChatChoice(index=i, message=message, logprobs=logprobs, finish_reason=reason)
        )
    return oa.ChatCompletion(
        id=call.id,
        created=call.created,
        model=call.model,
        system_fingerprint=fingerprint,
        service_tier=TIER_NAMES[call.tier],
        choices=replies,
        usage=usage(call),
    )


async def _encode_chat(
    engine: AsyncEngine, messages: list[oa.ChatMessage], tools: list[dict] | None = None
) -> list[int]:
    conversation = [_template_message(i, m) for i, m in enumerate(messages)]
    try:
        if sum(len(m["content"]) for m in conversation) <= INLINE_CHAT_CHARACTERS and not tools:
            return engine.encode_chat(conversation)
        return await asyncio.to_thread(engine.encode_chat, conversation, tools)
    except InvalidRequestError as error:
        raise invalid_request(str(error), param="messages") from None


def _template_message(index: int, message: oa.ChatMessage) -> dict:
    where = f"messages[{index}]"
    for field in ("function_call", "audio"):
        if getattr(message, field):
            reason = "legacy function calls and audio are not served"
            raise unsupported_field(f"{where}.{field}", reason)
    content = message.content
    if isinstance(content, list):
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise unsupported_field(f"{where}.content[{j}].type", "only text parts are served")
        content = "".join(part.text for part in content)
    # templates know system, user and assistant; OpenAI's developer role is the system's
    role = "system" if message.role == "developer" else message.role
    rendered: dict = {"role": role, "content": content or ""}
    if message.tool_calls:
        if role != "assistant":
            raise invalid_request("only assistant messages carry tool_calls", f"{where}.tool_calls")
        rendered["tool_calls"] = [
            _template_call(f"{where}.tool_calls[{j}]", call)
            for j, call in enumerate(message.tool_calls)
        ]
    if role == "tool":
        if not message.tool_call_id:
            raise invalid_request("a tool message needs tool_call_id", f"{where}.tool_call_id")
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _template_call(where: str, call: dict) -> dict:
    """A tool call as chat templates take it: the arguments an object, not JSON text."""
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise invalid_request("a tool call must be of type function", where)
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise invalid_request("a tool call needs the function's name", f"{where}.function.name")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        reason = "a tool call's arguments must be a JSON object in a string"
        raise invalid_request(reason, f"{where}.function.arguments")
    function = {"name": name, "arguments": parsed}
    return {"id": call.get("id"), "type": "function", "function": function}


async def _chat_stream(
    engine: AsyncEngine,
    call: Call,
    primed,
    include_usage: bool,
    fingerprint: str,
    plan: ToolPlan | None = None,
) -> AsyncIterator[str]:
    def chunk(choices, usage_=None) -> str:
        return sse(
            oa.ChatCompletionChunk(
                id=call.id,
                created=call.created,
                model=call.model,
                system_fingerprint=fingerprint,
                service_tier=TIER_NAMES[call.tier],
                choices=choices,
                usage=usage_,
            )
        )

    status, started = 200, set()
    held: dict[int, str] = {}  # tool-call output, sent whole once complete
    try:
        async for _, delta in deltas(call, primed):
            for out in delta.outputs:
                if out.index not in started:
                    started.add(out.index)
                    role = oa.ChatDelta(role="assistant", content="")
                    yield chunk([oa.ChunkChoice(index=out.index, delta=role)])
                reason = finish_reason(out.finish_reason)
                if plan is not None:
                    held[out.index] = held.get(out.index, "") + out.text
                    if reason:  # the whole output at once
                        calls, reason = plan.outcome(held[out.index], reason)
                        yield chunk(
                            [
                                oa.ChunkChoice(
                                    index=out.index, delta=_tool_delta(held[out.index], calls)
                                )
                            ]
                        )
                elif out.text or out.logprobs:
                    logprobs = chat_logprobs(engine, out.logprobs) if out.logprobs else None
                    content = oa.ChatDelta(content=out.text)
                    yield chunk([oa.ChunkChoice(index=out.index, delta=content, logprobs=logprobs)])
                if reason:
                    end = oa.ChunkChoice(
                        index=out.index, delta=oa.ChatDelta(), finish_reason=reason
                    )
                    yield chunk([end])
        if include_usage:
            yield chunk([], usage(call))
        yield DONE
    except APIError as error:
        status = error.status
        yield sse_error(error)
        yield DONE
    except asyncio.CancelledError:
        status = CLIENT_GONE
        raise
    finally:
        await call.finish(status)


def _tool_delta(text: str, calls: list[oa.ToolCall] | None) -> oa.ChatDelta:
    if calls is None:
        return oa.ChatDelta(content=text)
    return oa.ChatDelta(
        tool_calls=[oa.ChunkToolCall(index=k, **c.model_dump()) for k, c in enumerate(calls)]
    )


# -- legacy completions ----------------------------------------------------------------------


@hot_post("/v1/completions", oa.CompletionRequest, oa.Completion)
async def completions(request: Request):
    platform: Platform = request.app.state.platform
    engine = platform.require_engine()
    caller = await authenticate(request, platform)
    body = await parse_body(request, oa.CompletionRequest)
    call = Call(platform, caller, body.model, "cmpl", request)
    async with ending_on_error(call):
        refuse_unsupported(body)
        call.choose_tier(body)
        params = sampling_params(body, constraint(body)[0])
        if body.echo and params.logprobs is not None:
            raise unsupported_field("echo", "echo with logprobs (prompt logprobs) is not served")
        target = await platform.directory.resolve(caller, body.model)
        call.adapter_id, call.resolved = target.adapter_id, True
        try:
            texts, prompts = await asyncio.to_thread(_prompts, engine, body.prompt)
        except InvalidRequestError as error:
            raise invalid_request(str(error), param="prompt") from None
        estimate = sum(len(p) for p in prompts) + (params.max_tokens or 0) * len(prompts)
        await call.admit(estimate)
        echoes = texts if body.echo else [""] * len(prompts)
        if body.stream:
            async with cancelled_on_disconnect(request):
                primed = await start(engine, call, prompts, params, target.lora)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = _completion_stream(
                engine, call, primed, params.n, echoes, include_usage, platform.fingerprint
            )
            return StreamingResponse(stream, media_type=EVENT_STREAM, headers=call.headers)
        async with cancelled_on_disconnect(request):
            reply = await _completion_reply(
                engine, call, prompts, params, target.lora, echoes, platform
            )
        await call.finish(200)
        return json_reply(reply, call)


async def _completion_reply(engine, call, prompts, params, lora, echoes, platform):
    primed = await start(engine, call, prompts, params, lora, stream=False)
    choices = await collect(call, primed, params.n)
    return oa.Completion(
        id=call.id,
        created=call.created,
        model=call.model,
        system_fingerprint=platform.fingerprint,
        choices=[
            oa.CompletionChoice(
                index=i,
                text=echoes[i // params.n] + state.text,
                logprobs=legacy_logprobs(engine, state.logprobs, 0)
                if params.logprobs is not None
                else None,
                finish_reason=state.finish_reason,
            )
            for i, state in choices.items()
        ],
        usage=usage(call),
    )


def _prompts(engine: AsyncEngine, prompt: oa.Prompt) -> tuple[list[str], list[list[int]]]:
    """-> (each prompt's text, its token ids); raises APIError 400 for an invalid one."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise invalid_request("prompt must not be empty", param="prompt")
    try:
        ids = [engine.prompt_ids(one) for one in prompt]
    except InvalidRequestError as error:
        raise invalid_request(str(error), param="prompt") from None
    texts = [one if isinstance(one, str) else _decode(engine, one) for one in prompt]
    return texts, ids


def _decode(engine: AsyncEngine, token_ids: list[int]) -> str:
    return b"".join(engine.token_bytes(t) for t in token_ids).decode(errors="replace")


async def _completion_stream(
    engine: AsyncEngine,
    call: Call,
    primed,
    n: int,
    echoes: list[str],
    include_usage: bool,
    fingerprint: str,
) -> AsyncIterator[str]:
    def chunk(choices, usage_=None) -> str:
        return sse(
            oa.Completion(
                id=call.id,
                created=call.created,
                model=call.model,
                system_fingerprint=fingerprint,
                service_tier=TIER_NAMES[call.tier],
                choices=choices,
                usage=usage_,
            )
        )

    status, started, offsets = 200, set(), {}
    try:
        async for prompt_index, delta in deltas(call, primed):
            for out in delta.outputs:
                index = choice_index(prompt_index, out.index, n)
                text = out.text
                if index not in started:
                    started.add(index)
                    text = echoes[prompt_index] + text
                logprobs = None
                if out.logprobs:
                    logprobs = legacy_logprobs(engine, out.logprobs, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + sum(map(len, logprobs.tokens))
                reason = finish_reason(out.finish_reason)
                if text or logprobs or reason:
                    choice = oa.CompletionChoice(
                        index=index, text=text, logprobs=logprobs, finish_reason=reason
                    )
                    yield chunk([choice])
        if include_usage:
            yield chunk([], usage(call))
        yield DONE
    except APIError as error:
        status = error.status
        yield sse_error(error)
        yield DONE
    except asyncio.CancelledError:
        status = CLIENT_GONE
        raise
    finally:
        await call.finish(status)


# -- models ----------------------------------------------------------------------------------


@router.get("/v1/models", response_model=oa.ModelList)
async def list_models(caller: CallerDep, platform: PlatformDep) -> oa.ModelList:
    adapters = await platform.db.run(lambda s: registry.visible_adapters(s, caller.tenant_id))
    return oa.ModelList(
        data=[_base_card(platform)] + [_adapter_card(platform, caller, a) for a in adapters]
    )


@router.get("/v1/models/{model:path}", response_model=oa.ModelCard)
async def get_model(model: str, caller: CallerDep, platform: PlatformDep) -> oa.ModelCard:
    if model == platform.base_model:
        return _base_card(platform)
    adapter = await platform.db.run(lambda s: registry.visible_adapter(s, caller.tenant_id, model))
    if adapter is None:
        raise model_not_found(model)
    return _adapter_card(platform, caller, adapter)


def _base_card(platform: Platform) -> oa.ModelCard:
    return oa.ModelCard(
        id=platform.base_model,
        created=int(platform.started_at),
        owned_by="loraplex",
        root=platform.base_model,
        max_model_len=platform.engine.model_info().max_model_len,
    )


def _adapter_card(platform: Platform, caller, adapter) -> oa.ModelCard:
    return oa.ModelCard(
        id=adapter.name,
        created=int(adapter.created_at),
        owned_by="shared" if adapter.shared else caller.tenant_name,
        parent=platform.base_model,
        root=platform.base_model,
        max_model_len=platform.engine.model_info().max_model_len,
    )
