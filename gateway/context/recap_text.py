"""The text of the "earlier today" recap (pure).

It is written from the lines of a user's other conversations, packed within a budget, read back,
and withdrawn a conversation at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime
from zoneinfo import ZoneInfo

from gateway.types import Message

RECAP_PREFIX = "Earlier today"


def recap_message(
    candidates: list[tuple[float, str, list[str]]],
    tz: ZoneInfo,
    *,
    max_tokens: int,
    count: Callable[[Message], int],
) -> tuple[Message | None, list[str]]:
    """The "Earlier today" system message, and the conversations it drew on.

    It is written from (last activity, conversation, lines) candidates, newest first, within
    `max_tokens`.
    """
    header = f"{RECAP_PREFIX} ({tz.key}), this user talked with you in other conversations:"
    blocks = []
    for last, cid, lines in sorted(candidates, reverse=True):
        when = datetime.fromtimestamp(last, tz).strftime("%H:%M")
        blocks.append((f"- [{when}, {cid}]", cid, lines, False))
    return _pack(header, blocks, max_tokens, count)


_Block = tuple[str, str, list[str], bool]  # head line, conversation, lines, lines left out before


def _block(head: str, lines: list[str], cut: bool) -> str:
    """One conversation's block of a recap (`_parse` reads it back).

    Its head, a `…` where older lines are left out, and its lines.
    """
    return "\n".join([head, *(["  …"] if cut else []), *(f"  {line}" for line in lines)])


def _pack(
    header: str, blocks: list[_Block], max_tokens: int, count: Callable[[Message], int]
) -> tuple[Message | None, list[str]]:
    """The recap of `blocks` (newest conversation first) within `max_tokens`.

    Whole blocks while they fit, then of a block its newest lines, after a `…` that says older
    ones are left out.
    """
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
    """A recap built for a larger budget, packed again within `max_tokens`; and what it draws on.

    It is packed the way it was built (not cut from its end, which kept the oldest line of the
    newest conversation, mid-sentence). With it come the conversations it still draws on.
    """
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
    """`recap` without the blocks of `conversations`, or None when nothing is left of it.

    Their content was deleted since; the rest is as it was written.
    """
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
