"""The OpenAPI 3.1 document served at `GET /openapi.json`: bodies generated from the models that
check requests (`api/schemas.py`) and describe replies (`api/replies.py`), operations from the
table below. tests/reliability/test_openapi.py fuzzes it against a real `gateway serve`."""

from __future__ import annotations

import re

from pydantic import BaseModel, TypeAdapter

from gateway import __version__
from gateway.api import replies, schemas
from gateway.api.http import is_anthropic_path
from gateway.api.pages import NEWEST_FIRST, ORDERS
from gateway.ids import CONVERSATION_ID_RE

Schema = dict[str, object]
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

ERRORS = {
    400: "Invalid request (also: context_length_exceeded, conversation_too_large)",
    401: "Missing or unknown gateway key",
    404: "Unknown conversation, response or item (also: another tenant's)",
    408: "The request body did not arrive within body_timeout",
    409: "The conversation is busy past lock_timeout, or changed under the request",
    413: "Request body larger than max_body_bytes",
    429: "The provider's rate limit, passed through with Retry-After",
    502: "The provider is unreachable or answered with an error",
    503: "The store cannot accept writes; nothing was acknowledged",
    504: "The provider timed out",
}
BODY, READ, DELETE = (400, 401, 408, 413), (400, 401, 404), (400, 401, 404, 409, 503)
TURN, CREATE, WRITE = (*BODY, 404, 409, 429, 502, 503, 504), (*BODY, 409, 503), (*BODY, 404, 409, 503)
COUNT = (*BODY, 404, 503)  # (a read: no lock, no provider call but the server's own count)
CONVERSATION = "/v1/conversations/{conversation_id}"
RESPONSES = "/v1/responses"
RESPONSE = f"{RESPONSES}/{{response_id}}"
COMPLETION = "/v1/chat/completions/{completion_id}"

# (method, path, request body: a component, "?" when optional; 200: a component or words;
# error statuses, summary). A GET answered with a Page takes limit/order/after.
Operation = tuple[str, str, str | None, str, tuple[int, ...], str]
OPERATIONS: list[Operation] = [
    ("post", "/v1/chat/completions", "ChatCompletionRequest", "ChatCompletion", TURN, "Chat completion"),
    ("get", "/v1/chat/completions", None, "Page", READ, "List stored chat completions"),
    ("get", COMPLETION, None, "ChatCompletion", READ, "Retrieve a stored chat completion"),
    ("post", COMPLETION, "ChatCompletionUpdate", "ChatCompletion", WRITE, "Set its metadata"),
    ("delete", COMPLETION, None, "Deleted", DELETE, "Delete a stored chat completion"),
    ("get", f"{COMPLETION}/messages", None, "Page", READ, "A stored chat completion's messages"),
    ("get", "/v1/models", None, "ModelList", (401,), "Configured models"),
    ("get", "/v1/models/{model}", None, "The model, as listed", (401, 404), "Retrieve a model"),
    ("post", "/v1/conversations", "ConversationCreate?", "Conversation", CREATE, "Create a conversation"),
    ("get", "/v1/conversations", None, "Page", READ, "List conversations (extension)"),
    ("get", CONVERSATION, None, "Conversation", READ, "Retrieve a conversation"),
    ("post", CONVERSATION, "ConversationUpdate", "Conversation", WRITE, "Update a conversation's metadata"),
    ("delete", CONVERSATION, None, "Deleted", DELETE, "Delete a conversation"),
    ("post", f"{CONVERSATION}/reset", "Reset?", "Conversation", WRITE, "Reset a conversation (extension)"),
    ("get", f"{CONVERSATION}/context", None, "What the model was last given", READ, "Context (extension)"),
    ("get", f"{CONVERSATION}/items", None, "Page", READ, "List a conversation's items"),
    ("post", f"{CONVERSATION}/items", "ItemsCreate", "Page", WRITE, "Add items to a conversation"),
    ("get", f"{CONVERSATION}/items/{{item_id}}", None, "Item", READ, "Retrieve an item"),
    ("delete", f"{CONVERSATION}/items/{{item_id}}", None, "Conversation", DELETE, "Delete an item"),
    ("post", "/v1/responses", "ResponseCreate", "Response", TURN, "Responses API bridge"),
    ("post", f"{RESPONSES}/input_tokens", "InputTokensCount", "InputTokens", COUNT, "Count a turn's input"),
    ("post", "/v1/responses/compact", "ResponseCompact", "CompactedResponse", TURN, "Compact a conversation"),
    ("get", RESPONSE, None, "Response", READ, "Retrieve a response (and its log)"),
    ("delete", RESPONSE, None, "Deleted", DELETE, "Delete a response"),
    ("post", f"{RESPONSE}/cancel", None, "Response", (*READ, 409), "Cancel a background response"),
    ("get", f"{RESPONSE}/input_items", None, "Page", READ, "A response's input items"),
    ("post", "/v1/messages", "MessageCreate", "MessageObject", TURN, "Anthropic's Messages API"),
    (
        "post",
        "/v1/messages/count_tokens",
        "CountTokensRequest",
        "MessageTokensCount",
        COUNT,
        "Count input tokens",
    ),
    ("get", "/healthz", None, "Alive", (), "Liveness"),
    ("get", "/readyz", None, "Ready", (), "Readiness: 503 while starting, stopping or unable to write"),
    ("get", "/metrics", None, "Text exposition", (), "Prometheus metrics"),
]
# The operations whose 200 is an event stream with `"stream": true`, and what the events are.
STREAMS = {
    "/v1/chat/completions": "chat.completion.chunk",
    "/v1/responses": "response events",
    "/v1/messages": "Anthropic's message events (message_start ... message_stop)",
}
# Anthropic's API: its errors in its own shape, its version header required, its key header too.
ANTHROPIC_VERSION: Schema = {
    "name": "anthropic-version",
    "in": "header",
    "required": True,
    "schema": {"type": "string", "minLength": 1, "pattern": "\\S"},
    "description": "Required, as by Anthropic (any version is accepted); without it a 400",
}
PATH_PARAMETERS: dict[str, Schema] = {
    name: {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
    for name in ("conversation_id", "response_id", "item_id", "model", "completion_id")
}
PATH_PARAMETERS["conversation_id"]["description"] = f"Matches ^{CONVERSATION_ID_RE.pattern}$, else a 400"


def _page(orders: tuple[str, ...]) -> list[Schema]:
    """The query parameters of a list (`api/pages.py` checks them)."""
    return [
        {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
        {"name": "order", "in": "query", "schema": {"type": "string", "enum": list(orders)}},
        {"name": "after", "in": "query", "schema": {"type": "string"}},
    ]


# The filters of the list of stored chat completions (`api/completions.py`).
COMPLETION_FILTERS: list[Schema] = [
    {"name": "model", "in": "query", "schema": {"type": "string"}},
    {
        "name": "metadata",
        "in": "query",
        "style": "deepObject",
        "explode": True,
        "description": "metadata[key]=value: only those holding every pair given",
        "schema": {"type": "object", "additionalProperties": {"type": "string"}, "maxProperties": 16},
    },
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
