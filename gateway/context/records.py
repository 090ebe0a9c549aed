"""A committed response log, read as the turn it describes (pure)."""

from __future__ import annotations

from typing import Any

from gateway.context.history import Turn

Record = dict[str, Any]


def is_committed(records: list[Record]) -> bool:
    return bool(records) and records[-1].get("type") == "commit"


def turn_from_records(records: list[Record]) -> Turn | None:
    """The turn a response log describes, or None unless it is committed with a reply."""
    if not is_committed(records):
        return None
    request = next((r for r in records if r.get("type") == "request"), None)
    response = next((r for r in reversed(records) if r.get("type") == "response"), None)
    if request is None:
        return None
    if request.get("kind") == "items":
        response = {"message": None}  # items added through the Conversations API: no reply
    elif response is None or not isinstance(response.get("message"), dict):
        return None
    system = request.get("system")
    input_tokens = request.get("input_tokens")
    system_tokens = request.get("system_tokens")
    output_tokens = response.get("message_tokens")
    return Turn(
        response_id=str(request.get("response_id")),
        input=tuple(request.get("input") or ()),
        output=response["message"],
        system=tuple(system) if system is not None else None,
        encoding=request.get("encoding"),
        input_tokens=tuple(input_tokens) if isinstance(input_tokens, list) else None,
        output_tokens=output_tokens if isinstance(output_tokens, int) else None,
        system_tokens=tuple(system_tokens) if isinstance(system_tokens, list) else None,
        created=request.get("created") if isinstance(request.get("created"), int | float) else None,
        model=request.get("model") if isinstance(request.get("model"), str) else None,
        user=(request.get("params") or {}).get("user")
        if isinstance((request.get("params") or {}).get("user"), str)
        else None,
        recap=request.get("recap") if isinstance(request.get("recap"), dict) else None,
        timezone=request.get("user_timezone") if isinstance(request.get("user_timezone"), str) else None,
        branch_at=request.get("branch_at") if isinstance(request.get("branch_at"), int) else None,
    )
