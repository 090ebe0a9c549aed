"""Every error the gateway raises on purpose, each knowing its HTTP status and OpenAI error shape.

GatewayError
├── ConfigError                    bad configuration (raised at start, never over HTTP)
├── InvalidRequest          400    malformed body, bad field, bad conversation id
│   ├── ContextLengthExceeded 400  the request alone does not fit the model's window
│   ├── ConversationTooLarge  400  the conversation is at storage.max_conversation_messages
│   └── UnsupportedEncoding   415  a request body sent compressed (Content-Encoding)
├── AuthenticationError     401    missing or unknown gateway key
├── CrossOriginRefused      403    another site's page, or a rebound name, on an open gateway
├── BodyTimeout             408    the request head or body arrived slower than server.body_timeout
├── ClientGone              499    the client left while sending its request
├── NotFound                404    unknown conversation, response or model
├── ConversationBusy        409    another request holds the conversation too long
├── BodyTooLarge            413    request body over server.max_body_bytes
├── TooManyBackground       429    a key already runs server.background_responses background turns
├── StorageError            503    the store cannot acknowledge a write
│   └── CorruptRecord              a stored line that cannot be decoded (keeps path and line)
└── UpstreamError           502    the provider failed
    ├── UpstreamUnreachable 502    connection refused / DNS / reset before an answer
    ├── UpstreamStatusError  *     the provider answered with an HTTP error (status kept)
    ├── UpstreamProtocolError 502  the provider answered something that is not valid
    └── UpstreamTimeout     504    the provider took longer than its timeout
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import ClassVar

from gateway.redact import redact
from gateway.types import JSONObject


@dataclass(frozen=True, slots=True)
class Refusal:
    """A provider refused a prompt as too long: what it said of the window and the prompt.

    Read from its answer by `gateway.upstream.refusal.parse_refusal`.
    """

    message: str
    window: int | None = None  # the provider's real window, when it said
    prompt_tokens: int | None = None  # what it counted for the refused prompt, when it said
    completion_tokens: int | None = None  # the room for the answer it counted with it, when it said


class GatewayError(Exception):
    """Base class: an error with an HTTP status and an OpenAI error type/code."""

    status_code = 500
    error_type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        message = redact(message)  # a provider's error may quote the key it was sent
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict[str, JSONObject]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {}


class ConfigError(GatewayError):
    """The configuration is invalid; the message names the key."""


class InvalidRequest(GatewayError):
    """The client sent something the gateway cannot accept."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Even the current request alone does not fit the model's context window."""

    code = "context_length_exceeded"

    def __init__(self, message: str, *, param: str | None = None, needs: int | None = None) -> None:
        super().__init__(message, param=param)
        self.needs = needs  # the tokens (the gateway's count) the request alone takes, when known


class ConversationTooLarge(InvalidRequest):
    """The turn would take the conversation past storage.max_conversation_messages."""

    code = "conversation_too_large"


class UnsupportedEncoding(InvalidRequest):
    """A request body with a Content-Encoding (gzip, br, ...): bodies are taken as sent, uncompressed."""

    status_code = 415
    code = "unsupported_content_encoding"

    def headers(self) -> dict[str, str]:
        return {"connection": "close"}  # its body is not read (see BodyTooLarge)


class AuthenticationError(GatewayError):
    """Missing or unknown gateway key."""

    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class CrossOriginRefused(GatewayError):
    """A web page of another origin, or a name that is not this machine's, on an open gateway."""

    status_code = 403
    error_type = "permission_error"
    code = "cross_origin"


class NotFound(GatewayError):
    """The named conversation, response or model does not exist (for this tenant)."""

    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class BodyTimeout(GatewayError):
    """The client did not send its request head or whole body within server.body_timeout."""

    status_code = 408
    error_type = "invalid_request_error"
    code = "request_timeout"

    def headers(self) -> dict[str, str]:
        # The rest of the body may still come: the connection ends with this answer, or those
        # bytes would be read as the client's next request.
        return {"connection": "close"}


class ClientGone(GatewayError):
    """The client closed the connection while sending its request (nobody reads the answer)."""

    status_code = 499
    error_type = "invalid_request_error"
    code = "client_closed_request"


class ConversationBusy(GatewayError):
    """Another request on the same conversation held it longer than the lock wait."""

    status_code = 409
    error_type = "conflict_error"
    code = "conversation_busy"


class BodyTooLarge(GatewayError):
    """The request body is larger than server.max_body_bytes."""

    status_code = 413
    error_type = "invalid_request_error"
    code = "request_too_large"

    def headers(self) -> dict[str, str]:
        return {"connection": "close"}  # the rest of the body is not read (see BodyTimeout)


class TooManyBackground(GatewayError):
    """A key already has as many background responses running as `server.background_responses`."""

    status_code = 429
    error_type = "rate_limit_error"
    code = "too_many_background_responses"


class ShuttingDown(GatewayError):
    """The server stopped before this request was done (it outlived `server.shutdown_timeout`)."""

    status_code = 503
    error_type = "server_error"
    code = "shutting_down"


class StorageError(GatewayError):
    """The store could not durably record a turn; nothing is acknowledged."""

    status_code = 503
    error_type = "server_error"
    code = "storage_unavailable"


class NoGatewayData(GatewayError):
    """The configured database holds none of the gateway's tables (a command leaves it so)."""


class CorruptRecord(StorageError):
    """A stored line could not be decoded; keeps where it was found."""

    def __init__(self, message: str, *, path: str = "", lineno: int = 0) -> None:
        super().__init__(f"{message} ({path}:{lineno})")
        self.path = path
        self.lineno = lineno


class UpstreamError(GatewayError):
    """The provider failed to produce an answer."""

    status_code = 502
    error_type = "upstream_error"
    code = "upstream_error"


class UpstreamUnreachable(UpstreamError):
    """The provider could not be reached (refused, DNS, reset before an answer)."""

    code = "upstream_unreachable"


class UpstreamProtocolError(UpstreamError):
    """The provider answered with something that is not a valid chat completion."""

    code = "upstream_bad_response"


class UpstreamTimeout(UpstreamError):
    """The provider did not answer within its configured timeout."""

    status_code = 504
    code = "upstream_timeout"


class UpstreamStatusError(UpstreamError):
    """The provider answered with an HTTP error; 4xx are passed through, 5xx become 502."""

    # An error the provider reported inside a 200 answer (its `upstream_status` is the gateway's
    # 502, not a status the provider sent).
    in_band: ClassVar[bool] = False

    def __init__(
        self,
        message: str,
        *,
        upstream_status: int,
        error_type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after: str | None = None,
        refusal: Refusal | None = None,
    ) -> None:
        passed = 400 <= upstream_status < 500  # (a 502 is the gateway's: its own type and code)
        super().__init__(message, param=param, code=code if passed else None)
        self.upstream_status = upstream_status
        self.refusal = refusal  # set when the provider refused the prompt as too long
        self.status_code = upstream_status if passed else 502
        if error_type and passed:
            self.error_type = error_type
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": self.retry_after} if self.retry_after else {}


# uvicorn's message when it cancels the requests that outlived the graceful shutdown
_SHUTDOWN_CANCEL = "graceful shutdown"


class ClientDisconnected(Exception):
    """The client went away before the answer was ready (its turn is closed as cancelled)."""


def shutting_down(exc: BaseException) -> ShuttingDown | None:
    """A cancellation by the server's shutdown, as the error the client is told (503), or None.

    None for any other exception. The running task is un-cancelled: it still answers and records.
    """
    if not isinstance(exc, asyncio.CancelledError) or not any(_SHUTDOWN_CANCEL in str(a) for a in exc.args):
        return None
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    return ShuttingDown("The gateway is shutting down: this request was not completed; retry it")
