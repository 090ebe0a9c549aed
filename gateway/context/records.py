"""A response log read back (pure): as the turn it describes, or as a typed view of its records.

The typed view is for the Responses API and the CLI. Records come from disk and are not trusted:
every field is narrowed here, once, so readers get typed values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

from gateway.context.history import Turn
from gateway.context.steps import Head
from gateway.types import (
    JSONObject,
    Message,
    Record,
    Usage,
    ints,
    message,
    messages,
    number,
    obj,
    request_api,
    text,
)


def is_committed(records: list[Record]) -> bool:
    return bool(records) and records[-1].get("type") == "commit"


def first(records: list[Record], kind: str) -> Record | None:
    return next((r for r in records if r.get("type") == kind), None)


def latest(records: list[Record], kind: str) -> Record | None:
    """The last record of a kind (a refitted turn has two `context` records: the last was sent)."""
    return next((r for r in reversed(records) if r.get("type") == kind), None)


def turn_from_records(records: list[Record]) -> Turn | None:
    """The turn a response log describes, or None unless it is committed with a reply."""
    if not is_committed(records):
        return None
    request = first(records, "request")
    response = latest(records, "response")
    if request is None:
        return None
    output: Message | None = None
    output_tokens: object = None
    if request.get("kind") != "items":  # items added through the Conversations API: no reply
        output = message(response.get("message")) if response is not None else None
        if output is None or response is None:
            return None
        output_tokens = response.get("message_tokens")
    system = request.get("system")
    created, branch_at, branch = request.get("created"), request.get("branch_at"), request.get("branch")
    head = obj(response.get("head")) if response is not None else None
    return Turn(
        response_id=str(request.get("response_id")),
        input=tuple(messages(request.get("input"))),
        output=output,
        system=tuple(messages(system)) if system is not None else None,
        encoding=text(request.get("encoding")),
        input_tokens=ints(request.get("input_tokens")),
        output_tokens=output_tokens if isinstance(output_tokens, int) else None,
        system_tokens=ints(request.get("system_tokens")),
        created=created if isinstance(created, int | float) else None,
        model=text(request.get("model")),
        user=end_user(obj(request.get("params")) or {}),
        recap=message(request.get("recap")),
        timezone=text(request.get("user_timezone")),
        branch_at=branch_at if isinstance(branch_at, int) else None,
        branch=branch if isinstance(branch_at, int) and branch in ("edited", "regenerated") else None,
        head=Head.of(head) if head is not None else None,
    )


# How an attempt that ended without an error of its own is said to have ended, by its reason.
INCOMPLETE_REASONS = {
    "cancelled": "The attempt was cancelled before its answer was complete (its client left, or a cancel)",
}
Status = Literal["completed", "failed", "in_progress"]


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response log read back: the request, the context last sent, the reply, the outcome."""

    response_id: str
    records: list[Record]
    request: Record
    context: Record | None
    response: Record | None
    outcome: Record

    @classmethod
    def of(cls, response_id: str, records: list[Record]) -> StoredResponse:
        return cls(
            response_id=response_id,
            records=records,
            request=first(records, "request") or {},
            context=latest(records, "context"),
            response=first(records, "response"),
            outcome=records[-1] if records else {},
        )

    @property
    def status(self) -> Status:
        kind = self.outcome.get("type")
        return "completed" if kind == "commit" else "failed" if kind == "incomplete" else "in_progress"

    @property
    def conversation_id(self) -> str | None:
        return text(self.request.get("conversation_id"))

    @property
    def created(self) -> float:
        return number(self.request.get("created")) or 0.0

    @property
    def model(self) -> str:
        return text(self.request.get("model")) or ""

    @property
    def params(self) -> JSONObject:
        return obj(self.request.get("params")) or {}

    @property
    def input(self) -> list[Message]:
        return messages(self.request.get("input"))

    @property
    def system(self) -> list[Message]:
        return messages(self.request.get("system"))

    @property
    def message(self) -> Message | None:
        return message(self.response.get("message")) if self.response else None

    @property
    def answered(self) -> Message | None:
        """The reply as the client got it.

        The provider's own message where the one kept for history differs from it (fields the
        gateway does not replay), else that one.
        """
        raw = message(self.response.get("upstream_message")) if self.response else None
        return raw if raw is not None else self.message

    @property
    def text_after_calls(self) -> int:
        """How many of the answer's calls a stream gave before its text (0: the text came first)."""
        after = self.response.get("text_after_calls") if self.response else None
        return after if isinstance(after, int) and not isinstance(after, bool) and after > 0 else 0

    @property
    def finish_reason(self) -> str | None:
        return text(self.response.get("finish_reason")) if self.response else None

    @property
    def served(self) -> JSONObject:
        """How the provider served it (`system_fingerprint`, `service_tier`), as it said."""
        return (obj(self.response.get("served")) if self.response else None) or {}

    @property
    def usage(self) -> Usage | None:
        usage = obj(self.response.get("usage")) if self.response else None
        return cast(Usage, usage) if usage is not None else None

    @property
    def error(self) -> JSONObject | None:
        """Why a failed attempt failed, in OpenAI's error shape (None unless it failed).

        One that ended without an error of its own (its client left: `cancelled`) says how it ended.
        """
        if self.status != "failed":
            return None
        error = obj(self.outcome.get("error"))
        if error is not None:
            return error
        reason = text(self.outcome.get("reason")) or "incomplete"
        said = INCOMPLETE_REASONS.get(reason, f"The attempt ended before it was complete ({reason})")
        return {"message": f"{said}; nothing was added to the conversation", "type": "server_error",
                "param": None, "code": reason}  # fmt: skip


def string_pairs(value: object) -> dict[str, str] | None:
    """A stored metadata object (its string values), or None when it is not an object."""
    if not isinstance(value, dict):
        return None
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


@dataclass(frozen=True, slots=True)
class StoredCompletion:
    """A chat-completion turn as OpenAI's stored chat completions show it.

    Its response log (context snapshots left out) and its metadata now.
    """

    stored: StoredResponse
    metadata: dict[str, str]

    @classmethod
    def of(cls, response_id: str, records: list[Record], updates: list[Record]) -> StoredCompletion | None:
        """The stored chat completion a response log holds, with the metadata set on it since.

        Of `updates`, the last one holds. None unless the log is a committed chat-completion turn
        with a reply (not a failed or deleted one, a Responses API turn, items added to a
        conversation).
        """
        stored = StoredResponse.of(response_id, records)
        if stored.status != "completed" or not stored.request or request_api(stored.request) != "chat":
            return None
        if stored.message is None:
            return None
        metadata = string_pairs(stored.params.get("metadata")) or {}
        for update in updates:  # (the last one holds; {} clears)
            pairs = string_pairs(update.get("metadata"))
            metadata = pairs if pairs is not None else metadata
        return cls(stored, metadata)

    @property
    def messages(self) -> list[Message]:
        """What the request carried, as the gateway stored it.

        Its system message when it set the system prompt, then its new messages (a history the
        client resent is not repeated).
        """
        return [*self.stored.system, *self.stored.input]


def end_user(params: Record) -> str | None:
    """A request's end user: `user`, else `safety_identifier` (OpenAI's newer name for it)."""
    return text(params.get("user")) or text(params.get("safety_identifier"))
