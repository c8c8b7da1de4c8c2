"""What the OpenAPI document says about answers the routes do not declare by their return type.

Every error has one JSON shape (OpenAI's ``{"error": {...}}``) and request validation answers 400, not
FastAPI's 422; audio routes answer audio bytes in the requested container (or SSE); the voice upload
takes JSON or a multipart form. Declared here so the served document is complete: clients generated
from it, and the schema fuzzing in the tests, see what the server really sends.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from .protocol import MEDIA_TYPES, VoiceCreate


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """An error answer in the one shape every route documents (``ErrorBody``)."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


_WHY = {
    400: "Invalid request (a field, the text, an unknown model or voice)",
    401: "Missing or invalid API key",
    404: "No such voice",
    409: "A voice with this name exists",
    413: "Request body too large",
    415: "Unsupported content type",
    429: "Over capacity or the queue is full; retry after Retry-After",
    500: "The request failed on the server",
    503: "Not ready, the engine stopped, the voices database is busy, or no capacity in time",
    507: "No space left to store voices",
}
# Every route can answer these: bad input, the key check (when keys are set), the body-size limit,
# and the server's own failures.
COMMON = (400, 401, 413, 500, 503)


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for the given statuses (plus ``COMMON``), all in the error shape."""
    # Content given explicitly (not ``model=``): FastAPI would file it under the route's own media type,
    # and /metrics' is text/plain while its errors are JSON.
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    return {c: {"description": _WHY[c], "content": content} for c in sorted({*COMMON, *codes})}


_BINARY = {"schema": {"type": "string", "format": "binary"}}


def audio_responses(sse: bool) -> dict[int | str, dict[str, Any]]:
    """A 200 whose body is audio in one of the containers (or, with ``sse``, OpenAI's speech events)."""
    content: dict[str, Any] = {media: _BINARY for media in dict.fromkeys(MEDIA_TYPES.values())}
    if sse:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    empty = {
        "description": "1 when the request finished without any audio (the body is the format's shortest silence)",
        "schema": {"type": "string", "enum": ["1"]},
    }
    ok = {"description": "Audio in the requested format, streamed as it is made", "content": content}
    return {200: {**ok, "headers": {"X-Audio-Empty": empty}}}


VOICE_UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/VoiceCreate"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name", "file", "text"],
                    "properties": {
                        "name": VoiceCreate.model_json_schema()["properties"]["name"],
                        "file": {"type": "string", "format": "binary", "description": "a recording of the voice"},
                        "text": {"type": "string", "description": "what the recording says"},
                        "description": {"type": "string", "maxLength": 512},
                    },
                }
            },
        },
    }
}


def install(app: FastAPI) -> None:
    """Serve the document without FastAPI's 422 entries (validation errors answer 400 here, in the error
    shape), and with the schemas that ``errors`` and the voice upload body refer to."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for ops in doc.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for model in (VoiceCreate, ErrorBody):
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
