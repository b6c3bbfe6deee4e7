"""The engine's exceptions. Each carries a machine-readable `code`, so that a server maps it to a
status without reading message text, and, for bad input, the `param` it concerns.

    EngineError
    ├── InvalidRequestError (also a ValueError)  the caller's input is wrong: fix it and retry
    │   └── AdapterError                          the adapter cannot be served as it is
    ├── OverloadedError                           too many requests wait: retry later
    ├── RequestFailedError                        this request failed while running, alone
    ├── EngineShutdownError                       the engine is stopping or stopped
    └── EngineDeadError (also a RuntimeError)     the engine thread failed
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    INVALID_REQUEST = "invalid_request"  # a malformed prompt or sampling value
    PROMPT_TOO_LONG = "prompt_too_long"  # prompt + max_tokens past the model's context
    EXCEEDS_POOL = "exceeds_pool"  # the request's pages can never fit the page pool
    ADAPTER_NOT_FOUND = "adapter_not_found"
    ADAPTER_OUTSIDE_ROOTS = "adapter_outside_roots"
    ADAPTER_CORRUPT = "adapter_corrupt"  # unreadable files, invalid config or values
    ADAPTER_INCOMPATIBLE = "adapter_incompatible"  # made for another base model
    ADAPTER_UNSUPPORTED = "adapter_unsupported"  # a PEFT feature loraplex does not serve
    ADAPTER_RANK_TOO_HIGH = "adapter_rank_too_high"
    ADAPTER_TOO_LARGE = "adapter_too_large"  # more pages than the pool can spare
    OVERLOADED = "overloaded"
    NON_FINITE = "non_finite_output"  # the model's output for this request turned NaN/inf
    STEP_FAILED = "engine_error"  # a step failed; its requests failed, the engine goes on
    SHUTDOWN = "engine_shutdown"
    ENGINE_DEAD = "engine_dead"


class EngineError(Exception):
    code: ErrorCode = ErrorCode.INVALID_REQUEST

    def __init__(self, message: str, code: ErrorCode | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param


class InvalidRequestError(EngineError, ValueError):
    """Bad input: the message names the field and what is allowed."""


class AdapterError(InvalidRequestError):
    """The adapter cannot be served; the message says what is wrong and where."""

    code = ErrorCode.ADAPTER_CORRUPT


class OverloadedError(EngineError):
    code = ErrorCode.OVERLOADED


class RequestFailedError(EngineError):
    """The request failed while running (its output turned non-finite); nothing else did."""

    code = ErrorCode.NON_FINITE


class EngineShutdownError(EngineError):
    code = ErrorCode.SHUTDOWN


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop failed; in-flight requests were dropped."""

    code = ErrorCode.ENGINE_DEAD


def fresh(error: EngineError) -> EngineError:
    """A new instance of the same error: one instance raised in many places would collect every
    traceback (and keep their frames alive)."""
    return type(error)(error.message, error.code, error.param)


def shown(value: object, limit: int = 80) -> str:
    """A value for an error message: short, and safe for any input (Python refuses to print
    integers of more than 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        return "a huge integer"
    try:
        text = repr(value)
    except ValueError:
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
