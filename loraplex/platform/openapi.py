"""The OpenAPI description as clients see the API: FastAPI's schema, plus the bodies the hot
routes parse themselves, the error replies in OpenAI's shape (400 where FastAPI would document
its own 422, which this server never sends), and the two bearer credentials (a tenant's API key
for the OpenAI routes, the admin token for the admin ones)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from loraplex.platform.routes import openai

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
OPERATIONS = ("/health", "/ready", "/metrics")  # open to anyone (an orchestrator, a scraper)
ADMIN_PATHS = ("/admin/", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
ERRORS = {
    "400": "Invalid request: a malformed body, a value out of range, a field not served.",
    "401": "Missing or unknown credentials.",
    "404": "No such model (or one this key may not use), or no such object.",
    "503": "Starting, shutting down or overloaded: retry later.",
}
API_ERRORS = {
    "403": "The key's tenant is disabled.",
    "429": "A rate limit of the key was reached (see the x-ratelimit-* headers).",
}
ADMIN_ERRORS = {"409": "A name already taken in its scope."}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def build(app: FastAPI) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    _, definitions = models_json_schema(
        [(model, "validation") for model in (*openai.BODY_MODELS, ErrorResponse)],
        ref_template="#/components/schemas/{model}",
    )
    schemas.update(definitions["$defs"])
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schema["components"]["securitySchemes"] = {
        "apiKey": {"type": "http", "scheme": "bearer", "description": "A tenant's API key."},
        "adminToken": {"type": "http", "scheme": "bearer", "description": "The admin token."},
    }
    for path, operations in schema["paths"].items():
        if path in OPERATIONS:
            continue
        admin = path.startswith(ADMIN_PATHS)
        errors = ERRORS | (ADMIN_ERRORS if admin else API_ERRORS)
        for operation in operations.values():
            operation["security"] = [{"adminToken": []}] if admin else [{"apiKey": []}]
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            for status, description in errors.items():
                responses[status] = {
                    "description": description,
                    "content": {"application/json": {"schema": ERROR_REF}},
                }
    return schema
