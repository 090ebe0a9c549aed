"""The OpenAPI 3.1 document served at `GET /openapi.json`.

Bodies generated from the models that check requests (`api/schemas.py`) and describe replies
(`api/replies.py`), operations from the table of `api/operations.py`.
tests/reliability/test_openapi.py fuzzes it against a real `gateway serve`.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, TypeAdapter

from gateway import __version__
from gateway.api import replies, schemas
from gateway.api.http import is_anthropic_path
from gateway.api.operations import (
    ANTHROPIC_VERSION,
    COMPLETION_FILTERS,
    ERRORS,
    OPERATIONS,
    PATH_PARAMETERS,
    STREAMS,
    Schema,
)
from gateway.api.pages import NEWEST_FIRST, ORDERS

JSON = "application/json"
REF = "#/components/schemas/{model}"

# Component name -> the model its schema is generated from (nested models get their own names).
MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m
    for m in (
        *(schemas.ChatCompletionRequest, schemas.ResponseCreate, schemas.ConversationCreate, schemas.Reset),
        *(schemas.ResponseCompact, replies.CompactedResponse),
        *(schemas.ConversationUpdate, schemas.ItemsCreate, replies.Error, replies.ChatCompletion),
        schemas.ChatCompletionUpdate,
        *(replies.Page, replies.ModelList, replies.Conversation, replies.Deleted),
        *(schemas.InputTokensCount, replies.InputTokens),
        *(schemas.MessageCreate, schemas.CountTokensRequest, replies.AnthropicError),
        *(replies.MessageObject, replies.MessageTokensCount),
    )
}
MODELS["Response"] = replies.ResponseObject  # and "Item", the union schemas.Item
REFS: dict[str, Schema] = {name: {"$ref": REF.format(model=name)} for name in [*MODELS, "Item"]}


def _page(orders: tuple[str, ...]) -> list[Schema]:
    """The query parameters of a list (`api/pages.py` checks them)."""
    return [
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
        {"name": "order", "in": "query", "schema": {"type": "string", "enum": list(orders)}},
        {"name": "after", "in": "query", "schema": {"type": "string"}},
    ]


def _json(schema: Schema, description: str) -> Schema:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _ok(method: str, path: str, answer: str) -> Schema:
    if path == "/metrics":
        return {"description": answer, "content": {"text/plain": {}}}
    if answer not in REFS:  # an object described in words
        return _json({"type": "object"}, answer)
    if method != "post" or path not in STREAMS:
        return _json(REFS[answer], answer)
    described = f"A {answer} (stream=true: an event stream of {STREAMS[path]})"
    return {"description": described, "content": {JSON: {"schema": REFS[answer]}, "text/event-stream": {}}}


def _operation(method: str, path: str, body: str | None, answer: str, errors: tuple[int, ...]) -> Schema:
    responses: Schema = {"200": _ok(method, path, answer)}
    shape = "A" if is_anthropic_path(path) else "E"
    responses.update({str(s): {"$ref": f"#/components/responses/{shape}{s}"} for s in errors})
    if path == "/readyz":
        responses["503"] = _json({"type": "object"}, "Not ready")
    parameters = [PATH_PARAMETERS[name] for name in re.findall(r"{(\w+)}", path)]
    if is_anthropic_path(path):
        parameters.append(ANTHROPIC_VERSION)
    if method == "get" and answer == "Page":
        parameters += _page(NEWEST_FIRST if path == "/v1/conversations" else ORDERS)
    if method == "get" and path == "/v1/chat/completions":
        parameters += COMPLETION_FILTERS
    operation: Schema = {"responses": responses, **({"parameters": parameters} if parameters else {})}
    if body is not None:
        schema = {"schema": REFS[body.rstrip("?")]}
        operation["requestBody"] = {"required": not body.endswith("?"), "content": {JSON: schema}}
    if method == "post" and path == "/v1/chat/completions":
        operation["operationId"] = "createChatCompletion"
    if is_anthropic_path(path):
        operation["security"] = [{}, {"gatewayKey": []}, {"anthropicKey": []}]
    return operation


def component_schemas() -> dict[str, Schema]:
    """Every component's schema, and those of the models nested in them."""
    named = {name: model.model_json_schema(ref_template=REF) for name, model in MODELS.items()}
    named["Item"] = TypeAdapter(schemas.Item).json_schema(ref_template=REF)
    out: dict[str, Schema] = {}
    for name, schema in named.items():
        out.update(schema.pop("$defs", {}))
        out[name] = schema
    return out


def build_schema() -> Schema:
    paths: dict[str, Schema] = {}
    for method, path, body, answer, errors, summary in OPERATIONS:
        operation = _operation(method, path, body, answer, errors)
        paths.setdefault(path, {})[method] = {"summary": summary, **operation}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Conversation-continuity gateway",
            "version": __version__,
            "description": "An OpenAI-compatible proxy that owns the conversation (see README.md).",
        },
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {
            "schemas": component_schemas(),
            "responses": {
                **{f"E{status}": _json(REFS["Error"], text) for status, text in ERRORS.items()},
                **{f"A{status}": _json(REFS["AnthropicError"], text) for status, text in ERRORS.items()},
            },
            "securitySchemes": {
                "gatewayKey": {"type": "http", "scheme": "bearer"},
                "anthropicKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{}, {"gatewayKey": []}],
    }
