"""From an OpenAI request to the engine's SamplingParams, refusing by name every field the engine
cannot honour (yet) instead of ignoring it."""

from __future__ import annotations

from typing import Any

from loraplex.engine.api import InvalidRequestError, SamplingParams, StructuredOutput, Tier
from loraplex.platform.errors import invalid_request, unsupported_field
from loraplex.platform.openai_schema import ChatCompletionRequest, CompletionRequest

# field -> the values that mean "not used" (anything else is refused)
_UNSUPPORTED_UNLESS = {
    "min_p": (None, 0.0),
    "min_tokens": (None, 0),
    "repetition_penalty": (None, 1.0),
    "include_stop_str_in_output": (None, False),
    "priority": (None, 0),
    "suffix": (None, ""),
}
_CHAT_UNSUPPORTED_UNLESS = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "metadata": (None, {}),
    "store": (None, False),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "echo": (None, False),
    "continue_final_message": (None, False),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
}
_UNSUPPORTED = _UNSUPPORTED_UNLESS
_CHAT_UNSUPPORTED = _UNSUPPORTED_UNLESS | _CHAT_UNSUPPORTED_UNLESS
# service_tier -> the engine's tier: OpenAI's names ("flex": slower, when capacity allows) and
# loraplex's; None and "auto" take the key's default
_SERVICE_TIERS = {
    "default": Tier.INTERACTIVE,
    "interactive": Tier.INTERACTIVE,
    "flex": Tier.BATCH,
    "batch": Tier.BATCH,
}
_KEY_TIERS = {"interactive": Tier.INTERACTIVE, "batch": Tier.BATCH}
TIER_NAMES = {Tier.INTERACTIVE: "default", Tier.BATCH: "flex"}  # as replies name them


def refuse_unsupported(request: ChatCompletionRequest | CompletionRequest) -> None:
    fields = _CHAT_UNSUPPORTED if isinstance(request, ChatCompletionRequest) else _UNSUPPORTED
    for field in request.model_fields_set & fields.keys():  # only what the client sent
        if getattr(request, field) not in fields[field]:
            raise unsupported_field(field)
    if request.service_tier not in (None, "auto", *_SERVICE_TIERS):
        raise unsupported_field(
            "service_tier", f"the tiers served are auto, {', '.join(_SERVICE_TIERS)}"
        )
    if isinstance(request, ChatCompletionRequest):
        _refuse_chat_only(request)
    elif request.best_of not in (None, request.n or 1):
        raise unsupported_field("best_of", "best_of must equal n")


def service_tier(request: ChatCompletionRequest | CompletionRequest, key_tier: str) -> Tier:
    """The tier a request runs at: its own service_tier, else its key's default."""
    if request.service_tier in (None, "auto"):
        return _KEY_TIERS.get(key_tier, Tier.INTERACTIVE)
    return _SERVICE_TIERS[request.service_tier]


def _refuse_chat_only(request: ChatCompletionRequest) -> None:
    if request.modalities not in (None, ["text"]):
        raise unsupported_field("modalities", "only text is served")
    if request.top_logprobs is not None and not request.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")


def max_tokens(request: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        return request.max_completion_tokens or request.max_tokens
    return request.max_tokens


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    structured_outputs: StructuredOutput | None = None,
) -> SamplingParams:
    """Raises APIError (400) naming the field."""
    options: dict[str, Any] = {
        "n": request.n or 1,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_k": request.top_k if request.top_k not in (None, -1, 0) else None,
        "presence_penalty": request.presence_penalty or 0.0,
        "frequency_penalty": request.frequency_penalty or 0.0,
        "seed": request.seed,
        "max_tokens": max_tokens(request),
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "ignore_eos": bool(request.ignore_eos),
        "logprobs": _logprobs(request),
        "skip_special_tokens": True
        if request.skip_special_tokens is None
        else request.skip_special_tokens,
        "logit_bias": request.logit_bias,
        "structured_outputs": structured_outputs,
    }
    try:
        return SamplingParams(**options)
    except InvalidRequestError as error:
        raise invalid_request(str(error), param=error.param) from None


def _logprobs(request: ChatCompletionRequest | CompletionRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs
