"""The OpenAPI 3.1 description of the gateway's HTTP API, served at `GET /openapi.json`.

Written by hand (the routes are plain Starlette functions) and kept honest by a test that
fuzzes every operation from this document against a real `gateway serve` (tests/test_openapi.py):
every documented status is one the gateway really returns, and no generated input gets a 5xx.
Request bodies accept additional properties, as OpenAI's do: unknown fields are passed upstream.
"""

from __future__ import annotations

from typing import Any

from gateway import __version__
from gateway.ids import CONVERSATION_ID_RE

CONVERSATION_ID_PATTERN = f"^{CONVERSATION_ID_RE.pattern}$"

JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


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
ERROR_RESPONSES: dict[str, Any] = {
    f"E{status}": _json(_ref("Error"), text) for status, text in ERRORS.items()
}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"$ref": f"#/components/responses/E{s}"} for s in statuses}


# Statuses common to every operation that reads a body / touches the store.
_BODY = (400, 401, 408, 413)
_TURN = (*_BODY, 404, 409, 429, 502, 503, 504)

_path_conversation = {
    "name": "conversation_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string"},
    "description": f"Matches {CONVERSATION_ID_PATTERN}; anything else is a 400",
}
_path_response = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
_path_item = {"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}
_page = [
    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
    {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
    {"name": "after", "in": "query", "schema": {"type": "string"}},
]

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"]},
                },
            }
        },
    },
    "ContentPart": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    },
    "Content": {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"$ref": "#/components/schemas/ContentPart"}},
        ]
    },
    "ToolCall": {
        "type": "object",
        "required": ["id", "type", "function"],
        "properties": {
            "id": {"type": "string"},
            "type": {"const": "function"},
            "function": {
                "type": "object",
                "required": ["name", "arguments"],
                "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
            },
        },
    },
    "Message": {
        "oneOf": [
            {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"enum": ["system", "developer", "user"]},
                    "content": _ref("Content"),
                    "name": {"type": "string"},
                    "is_feedback": {
                        "type": "boolean",
                        "description": "Gateway extension: left out of history",
                    },
                },
            },
            {
                "type": "object",
                "required": ["role"],
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"anyOf": [_ref("Content"), {"type": "null"}]},
                    "tool_calls": {"type": "array", "items": _ref("ToolCall")},
                },
            },
            {
                "type": "object",
                "required": ["role", "content", "tool_call_id"],
                "properties": {
                    "role": {"const": "tool"},
                    "content": _ref("Content"),
                    "tool_call_id": {"type": "string"},
                },
            },
        ]
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["model", "messages"],
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": _ref("Message")},
            "conversation_id": {
                "type": "string",
                "pattern": CONVERSATION_ID_PATTERN,
                "description": "Gateway extension: the conversation this turn continues (or starts)",
            },
            "stream": {"type": "boolean"},
            "user": {"type": "string"},
            "user_timezone": {"type": "string", "description": "IANA zone for the recap's 'today'"},
            "temperature": {"type": "number"},
            "max_tokens": {"type": "integer"},
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": {"type": ["string", "object"]},
        },
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "choices"],
        "properties": {
            "id": {"type": "string", "description": "The minted response id, {model-slug}-{12 hex}"},
            "object": {"type": "string"},
            "model": {"type": "string"},
            "conversation_id": {"type": ["string", "null"]},
            "choices": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": ["object", "null"]},
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}}},
    },
    "Item": {
        "oneOf": [
            {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "type": {"const": "message"},
                    "role": {"enum": ["user", "assistant", "system", "developer"]},
                    "content": {
                        "anyOf": [
                            {"type": "string"},
                            {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["type", "text"],
                                    "properties": {
                                        "type": {"enum": ["input_text", "output_text"]},
                                        "text": {"type": "string"},
                                    },
                                },
                            },
                        ]
                    },
                },
            },
            {
                "type": "object",
                "required": ["type", "call_id", "name", "arguments"],
                "properties": {
                    "type": {"const": "function_call"},
                    "call_id": {"type": "string", "minLength": 1},
                    "name": {"type": "string", "minLength": 1},
                    "arguments": {"type": "string"},
                },
            },
            {
                "type": "object",
                "required": ["type", "call_id", "output"],
                "properties": {
                    "type": {"const": "function_call_output"},
                    "call_id": {"type": "string", "minLength": 1},
                    "output": {"type": "string"},
                },
            },
        ]
    },
    "ConversationCreate": {
        "type": "object",
        "properties": {
            "metadata": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
            "items": {"type": ["array", "null"], "items": _ref("Item")},
        },
    },
    "ConversationUpdate": {
        "type": "object",
        "required": ["metadata"],
        "properties": {"metadata": {"type": "object", "additionalProperties": {"type": "string"}}},
    },
    "ItemsCreate": {
        "type": "object",
        "required": ["items"],
        "properties": {"items": {"type": "array", "items": _ref("Item")}},
    },
    "Reset": {"type": "object", "properties": {"keep_system_message": {"type": "boolean"}}},
    "Conversation": {
        "type": "object",
        "required": ["id", "object"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "conversation"},
            "created_at": {"type": "integer"},
            "metadata": {"type": "object"},
        },
    },
    "Deleted": {
        "type": "object",
        "required": ["id", "object", "deleted"],
        "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "deleted": {"const": True}},
    },
    "Page": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": {"type": "object"}},
            "has_more": {"type": "boolean"},
            "first_id": {"type": ["string", "null"]},
            "last_id": {"type": ["string", "null"]},
        },
    },
    "ResponseCreate": {
        "type": "object",
        "required": ["model", "input"],
        "not": {"required": ["conversation", "previous_response_id"]},
        "properties": {
            "model": {"type": "string", "minLength": 1},
            "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _ref("Item")}]},
            "instructions": {"type": ["string", "null"]},
            "previous_response_id": {
                "type": "string",
                "description": "404 unless it names a stored response",
            },
            "conversation": {
                "anyOf": [
                    {"type": "string", "pattern": CONVERSATION_ID_PATTERN},
                    {
                        "type": "object",
                        "required": ["id"],
                        "properties": {"id": {"type": "string", "pattern": CONVERSATION_ID_PATTERN}},
                    },
                ]
            },
            "stream": {"type": "boolean"},
            "store": {"type": "boolean"},
            "tools": {"type": "array", "items": {"type": "object"}},
            "max_output_tokens": {"type": "integer"},
            "metadata": {"type": "object"},
        },
    },
    "Response": {
        "type": "object",
        "required": ["id", "object"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "status": {"type": "string"},
            "output": {"type": "array"},
        },
    },
}


def _op(summary: str, ok: dict[str, Any], errors: tuple[int, ...], **extra: Any) -> dict[str, Any]:
    return {"summary": summary, "responses": {"200": ok, **_errors(*errors)}, **extra}


def _body(name: str, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {JSON: {"schema": _ref(name)}}}


def build_schema() -> dict[str, Any]:
    chat = _op(
        "Chat completion that continues a stored conversation",
        {
            "description": "A chat.completion (stream=true: an event stream of chat.completion.chunk)",
            "content": {JSON: {"schema": _ref("ChatCompletion")}, "text/event-stream": {"schema": {}}},
        },
        _TURN,
        requestBody=_body("ChatCompletionRequest"),
    )
    conversation = _json(_ref("Conversation"), "The conversation")
    page = _json(_ref("Page"), "A page of results")
    deleted = _json(_ref("Deleted"), "Deleted")
    item_page = _op(
        "List a conversation's items", page, (400, 401, 404), parameters=[_path_conversation, *_page]
    )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Conversation-continuity gateway",
            "version": __version__,
            "description": "An OpenAI-compatible proxy that owns the conversation (see README.md).",
        },
        "servers": [{"url": "/"}],
        "paths": {
            "/v1/chat/completions": {"post": {**chat, "operationId": "createChatCompletion"}},
            "/v1/models": {"get": _op("Configured models", _json(_ref("ModelList"), "Models"), (401,))},
            "/v1/conversations": {
                "post": _op(
                    "Create a conversation",
                    conversation,
                    (*_BODY, 409, 503),
                    requestBody=_body("ConversationCreate", False),
                ),
                "get": _op("List conversations (gateway extension)", page, (400, 401, 404), parameters=_page),
            },
            "/v1/conversations/{conversation_id}": {
                "parameters": [_path_conversation],
                "get": _op("Retrieve a conversation", conversation, (400, 401, 404)),
                "post": _op(
                    "Update a conversation's metadata",
                    conversation,
                    (*_BODY, 404, 409, 503),
                    requestBody=_body("ConversationUpdate"),
                ),
                "delete": _op("Delete a conversation", deleted, (400, 401, 404, 409, 503)),
            },
            "/v1/conversations/{conversation_id}/reset": {
                "parameters": [_path_conversation],
                "post": _op(
                    "Reset a conversation's history (gateway extension)",
                    conversation,
                    (*_BODY, 404, 409, 503),
                    requestBody=_body("Reset", False),
                ),
            },
            "/v1/conversations/{conversation_id}/context": {
                "parameters": [_path_conversation],
                "get": _op(
                    "The last context snapshot (gateway extension)",
                    _json({"type": "object"}, "What the model was given on the last turn"),
                    (400, 401, 404),
                ),
            },
            "/v1/conversations/{conversation_id}/items": {
                "get": item_page,
                "post": _op(
                    "Add items to a conversation",
                    page,
                    (*_BODY, 404, 409, 503),
                    parameters=[_path_conversation],
                    requestBody=_body("ItemsCreate"),
                ),
            },
            "/v1/conversations/{conversation_id}/items/{item_id}": {
                "parameters": [_path_conversation, _path_item],
                "get": _op("Retrieve an item", _json(_ref("Item"), "The item"), (400, 401, 404)),
                "delete": _op("Delete an item", conversation, (400, 401, 404, 409, 503)),
            },
            "/v1/responses": {
                "post": _op(
                    "Responses API bridge",
                    {
                        "description": "A response (stream=true: an event stream of response events)",
                        "content": {JSON: {"schema": _ref("Response")}, "text/event-stream": {"schema": {}}},
                    },
                    _TURN,
                    requestBody=_body("ResponseCreate"),
                ),
            },
            "/v1/responses/{response_id}": {
                "parameters": [_path_response],
                "get": _op(
                    "Retrieve a response (and its log)",
                    _json(_ref("Response"), "The response"),
                    (400, 401, 404),
                ),
                "delete": _op("Delete a response", deleted, (400, 401, 404, 409, 503)),
            },
            "/v1/responses/{response_id}/input_items": {
                "get": _op(
                    "A response's input items", page, (400, 401, 404), parameters=[_path_response, *_page]
                ),
            },
            "/healthz": {"get": _op("Liveness", _json({"type": "object"}, "Alive"), ())},
            "/readyz": {
                "get": {
                    "summary": "Readiness: 503 while starting, stopping, or while the store refuses writes",
                    "responses": {
                        "200": _json({"type": "object"}, "Ready"),
                        "503": _json({"type": "object"}, "Not ready"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {"200": {"description": "Text exposition", "content": {"text/plain": {}}}},
                }
            },
        },
        "components": {
            "schemas": SCHEMAS,
            "responses": ERROR_RESPONSES,
            "securitySchemes": {"gatewayKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"gatewayKey": []}],
    }
