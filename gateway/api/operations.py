"""The operations the gateway serves, as its OpenAPI document lists them (`api/openapi.py`).

Method, path, request and answer bodies, error statuses, summary; the parameters they share.
"""

from __future__ import annotations

from gateway.ids import CONVERSATION_ID_RE

Schema = dict[str, object]

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
