"""Every error the platform returns, in OpenAI's shape:

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

with the statuses the OpenAI SDK maps to its exception classes: 400 BadRequestError, 401
AuthenticationError, 403 PermissionDeniedError, 404 NotFoundError, 409 ConflictError, 429
RateLimitError, 500 InternalServerError, 503 (an APIStatusError the SDK retries).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.engine.api import EngineError, ErrorCode

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class ClientDisconnected(Exception):
    """The client went away before its reply was ready; its work was cancelled."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.code, self.param, self.headers = code, param, headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported_field(field: str, detail: str = "") -> APIError:
    return invalid_request(
        f"`{field}` is not supported by this server{f': {detail}' if detail else ''}",
        param=field,
        code="unsupported_parameter",
    )


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        code="model_not_found",
        param="model",
    )


def invalid_api_key() -> APIError:
    return APIError(401, "Incorrect API key provided.", code="invalid_api_key")


def not_found(message: str) -> APIError:
    return APIError(404, message, code="not_found")


# Engine error codes -> (status, OpenAI type, OpenAI code)
_ENGINE_STATUS = {
    ErrorCode.INVALID_REQUEST: (400, INVALID_REQUEST, None),
    ErrorCode.PROMPT_TOO_LONG: (400, INVALID_REQUEST, "context_length_exceeded"),
    ErrorCode.EXCEEDS_POOL: (400, INVALID_REQUEST, "context_length_exceeded"),
    ErrorCode.OVERLOADED: (503, SERVER_ERROR, "overloaded"),
    ErrorCode.NON_FINITE: (500, SERVER_ERROR, "non_finite_output"),
    ErrorCode.SHUTDOWN: (503, SERVER_ERROR, "shutting_down"),
    ErrorCode.ENGINE_DEAD: (503, SERVER_ERROR, "engine_unavailable"),
}


def from_engine(error: EngineError, serving: bool = True) -> APIError:
    """The API error for an engine error. An adapter error while serving a registered adapter
    is the server's fault (500); while registering one, the caller's (400)."""
    if error.code.value.startswith("adapter_"):
        if serving:
            logger.error("a registered adapter could not be served: %s", error)
            return APIError(500, f"the adapter could not be loaded: {error}", SERVER_ERROR)
        return invalid_request(str(error), param="path", code=error.code.value)
    status, type_, code = _ENGINE_STATUS.get(error.code, (500, SERVER_ERROR, None))
    return APIError(status, str(error), type_, code or error.code.value, error.param)


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(ClientDisconnected, _client_gone)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _api_error(_request: Request, error: APIError) -> JSONResponse:
    return error.response()


async def _client_gone(_request: Request, _error: ClientDisconnected) -> Response:
    return Response(status_code=499)  # nobody reads it: the connection is gone


async def _validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
    return validation_error(error.errors()).response()


def validation_error(problems: list[dict]) -> APIError:
    """FastAPI's 422 list of problems as one OpenAI-shaped 400 naming the first."""
    problem = problems[0] if problems else {"loc": (), "msg": "invalid request", "type": ""}
    path = [str(part) for part in problem.get("loc", ()) if part not in ("body", "query")]
    param = ".".join(path) or None
    if problem.get("type") == "extra_forbidden":
        return invalid_request(f"Unrecognized request argument supplied: {param}", param=param)
    if problem.get("type") == "json_invalid":
        return invalid_request(
            "We could not parse the JSON body of your request: it must be valid JSON."
        )
    if problem.get("type") == "missing":
        return invalid_request(f"Missing required parameter: '{param}'.", param=param)
    message = problem.get("msg", "invalid value")
    return invalid_request(f"Invalid value for '{param}': {message}." if param else message, param)


async def _http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
    type_ = INVALID_REQUEST if error.status_code < 500 else SERVER_ERROR
    return APIError(error.status_code, str(error.detail), type_).response()


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return APIError(
        500, "The server had an error while processing your request.", SERVER_ERROR
    ).response()
