"""Conversation lifecycle, the pure part (SPEC section 8).

The states and how the current one is derived from the lifecycle log, end users' file-safe keys
and local days, and the lines of a conversation an "earlier today" recap quotes (its text is
`gateway.context.recap_text`).

    active ──idle_after──> processing ──ok──> processed
      ^                       │  └──error──> active (attempts + 1) ... failed (max_attempts)
      └── lease expired ──────┘   a new message makes processed/failed conversations active
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gateway.context.history import ConversationView
from gateway.exceptions import InvalidRequest
from gateway.types import Message, Record, number, text

ACTIVE, PROCESSING, PROCESSED, FAILED = "active", "processing", "processed", "failed"
EXPIRED = "expired"  # (a list's word for one idle past `ttl`, not yet archived: never logged)


def user_key(user: str) -> str:
    """A file-safe name for an end user (the raw `user` value is never a file name)."""
    return "u" + hashlib.sha256(user.encode()).hexdigest()[:24]


def zone(name: str | None, default: str) -> ZoneInfo:
    try:
        return ZoneInfo(name or default)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidRequest(
            f"Unknown time zone {name!r}: use an IANA name such as 'Europe/Berlin'", param="user_timezone"
        ) from None


def local_day(ts: float, tz: ZoneInfo) -> str:
    return datetime.fromtimestamp(ts, tz).strftime("%Y-%m-%d")


@dataclass(frozen=True, slots=True)
class State:
    state: str
    attempts: int
    since: float
    lease_until: float | None = None
    error: str | None = None


def derive_state(records: list[Record], last_activity: float | None) -> State:
    """The current state from the lifecycle log and the conversation's last activity."""
    if not records:
        return State(ACTIVE, 0, 0.0)
    last = records[-1]
    state = str(last.get("state", ACTIVE))
    at = number(last.get("at")) or 0.0
    attempts = int(number(last.get("attempts")) or 0)
    # What the attempt looked at: the conversation's activity when it began (a turn landing
    # while it ran is newer than that, not than its end: it was left out of the summary).
    covered = number(last.get("covers_activity"))
    if state in (PROCESSED, FAILED) and last_activity is not None and last_activity > (covered or at):
        return State(ACTIVE, 0, last_activity)  # a new message reactivates it
    return State(state, attempts, at, number(last.get("lease_until")), text(last.get("error")))


def _text(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def todays_lines(view: ConversationView, tz: ZoneInfo, today: str) -> list[str]:
    """Both sides of what was said in a conversation on the user's local `today`, newest 20.

    The user's lines and the assistant's answers (which hold what it promised), each cut to 300
    characters; older turns of the same conversation are left out.
    """
    lines = []
    for message, owner in zip(view.history, view.history_owner, strict=True):
        role = message.get("role")
        created = view.created_of.get(owner)
        if role not in ("user", "assistant") or created is None or local_day(created, tz) != today:
            continue
        # One line each: a message's own lines (a "- [ ] pay rent [overdue]" among them) read
        # back as the head of another conversation's block, which a withdrawal then left in.
        text = " ".join(_text(message).split())
        if text:
            lines.append(f"{role}: {text[:300]}")
    return lines[-20:]
