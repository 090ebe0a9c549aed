"""Conversation lifecycle, the pure part (SPEC section 8): the states and how the current one is
derived from the lifecycle log, end users' file-safe keys and local days, and the text of the
"earlier today" recap.

    active ──idle_after──> processing ──ok──> processed
      ^                       │  └──error──> active (attempts + 1) ... failed (max_attempts)
      └── lease expired ──────┘   a new message makes processed/failed conversations active
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from gateway.context.history import ConversationView
from gateway.context.records import number, text
from gateway.exceptions import InvalidRequest
from gateway.types import Message, Record

ACTIVE, PROCESSING, PROCESSED, FAILED = "active", "processing", "processed", "failed"
RECAP_PREFIX = "Earlier today"


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
    """Both sides of what was said in a conversation on the user's local `today` (the user's
    lines and the assistant's answers, which hold what it promised), newest 20, each cut to
    300 characters; older turns of the same conversation are left out."""
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


def recap_message(
    candidates: list[tuple[float, str, list[str]]],
    tz: ZoneInfo,
    *,
    max_tokens: int,
    count: Callable[[Message], int],
) -> tuple[Message | None, list[str]]:
    """The "Earlier today" system message from (last activity, conversation, lines) candidates,
    newest first, within `max_tokens`; and the conversations it drew on."""
    header = f"{RECAP_PREFIX} ({tz.key}), this user talked with you in other conversations:"
    blocks = []
    for last, cid, lines in sorted(candidates, reverse=True):
        when = datetime.fromtimestamp(last, tz).strftime("%H:%M")
        blocks.append((f"- [{when}, {cid}]", cid, lines, False))
    return _pack(header, blocks, max_tokens, count)


_Block = tuple[str, str, list[str], bool]  # head line, conversation, lines, lines left out before


def _block(head: str, lines: list[str], cut: bool) -> str:
    """One conversation's block of a recap: its head, a `…` where older lines are left out,
    and its lines (`_parse` reads it back)."""
    return "\n".join([head, *(["  …"] if cut else []), *(f"  {line}" for line in lines)])


def _pack(
    header: str, blocks: list[_Block], max_tokens: int, count: Callable[[Message], int]
) -> tuple[Message | None, list[str]]:
    """The recap of `blocks` (newest conversation first) within `max_tokens`: whole blocks while
    they fit, then of a block its newest lines, after a `…` that says older ones are left out."""
    body: list[str] = []
    used: list[str] = []
    budget = max_tokens - count({"role": "system", "content": header})
    for head, cid, lines, cut in blocks:
        block = _block(head, lines, cut)
        cost = count({"role": "system", "content": block}) - 3
        if cost > budget:  # its newest lines that fit, after a mark that older ones are left out
            kept: list[str] = []
            for line in reversed(lines):
                if count({"role": "system", "content": _block(head, [line, *kept], True)}) - 3 > budget:
                    break
                kept.insert(0, line)
            if not kept:
                continue
            block = _block(head, kept, True)
            cost = count({"role": "system", "content": block}) - 3
        budget -= cost
        body.append(block)
        used.append(cid)
    if not body:
        return None, []
    return {"role": "system", "content": "\n".join([header, *body])}, used


def shrink_recap(
    recap: Message, max_tokens: int, count: Callable[[Message], int]
) -> tuple[Message | None, list[str]]:
    """A recap built for a larger budget, packed again within `max_tokens` the way it was built
    (not cut from its end, which kept the oldest line of the newest conversation, mid-sentence);
    and the conversations it still draws on."""
    parsed = _parse(recap)
    if parsed is None:
        return None, []
    header, blocks = parsed
    return _pack(header, blocks, max_tokens, count)


def _parse(recap: Message | None) -> tuple[str, list[_Block]] | None:
    """A recap's text read back as `recap_message` wrote it: its header and its blocks."""
    text = recap.get("content") if recap is not None else None
    if not isinstance(text, str):
        return None
    header, *rest = text.split("\n")
    blocks: list[_Block] = []
    for line in rest:
        if line.startswith("- [") and line.endswith("]"):
            cid = line[3:-1].partition(", ")[2]
            blocks.append((line, cid, [], False))
        elif blocks and line == "  …":
            head, cid, lines, _ = blocks[-1]
            blocks[-1] = (head, cid, lines, True)
        elif blocks:
            blocks[-1][2].append(line.removeprefix("  "))
    return header, blocks


def is_recap(message: Message) -> bool:
    content = message.get("content")
    return message.get("role") == "system" and isinstance(content, str) and content.startswith(RECAP_PREFIX)


def recap_without(recap: Message | None, conversations: Collection[str]) -> Message | None:
    """`recap` without the blocks of `conversations` (their content was deleted since), as it
    was written otherwise; None when nothing is left of it."""
    parsed = _parse(recap)
    if parsed is None:
        return recap
    header, blocks = parsed
    kept = [_block(head, lines, cut) for head, cid, lines, cut in blocks if cid not in conversations]
    return {"role": "system", "content": "\n".join([header, *kept])} if kept else None


def recap_conversations(recap: Message | None) -> list[str]:
    """The conversations a recap's text draws on (its blocks' heads)."""
    parsed = _parse(recap)
    return [cid for _, cid, _, _ in parsed[1]] if parsed is not None else []
