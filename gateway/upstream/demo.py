"""The built-in `demo` model: deterministic, offline, and it answers from the history it is sent.

It remembers facts of the form "my X is Y" and answers "what is my X?", so continuity is
visible without any provider: if the gateway forgot a turn, the demo model forgets it too.
Asked to summarize (the gateway's rolling summaries and compaction), it answers with the facts
it was given, in those words, so that a summary carries them.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Mapping, Sequence

from gateway.types import as_list, as_object
from gateway.upstream.base import (
    Body,
    Chunk,
    Upstream,
    approx_tokens,
    chunks_from_completion,
    completion_from_text,
)

_FACT = re.compile(r"\bmy ([a-z][a-z ]{0,30}?) is ((?:(?! and | but )[^.,!?\n])+)", re.IGNORECASE)
_QUESTION = re.compile(
    r"\bwhat(?:'s| is| was) my ([a-z][a-z ]{0,30}?)(?: called| named)?\s*\?", re.IGNORECASE
)
_NAMING = re.compile(r"^(?:called|named)\s+", re.IGNORECASE)
_FIRST = re.compile(r"\bwhat did i (?:first )?(?:say|ask)\b", re.IGNORECASE)
_SUMMARIZER = "You maintain the running summary"  # (the gateway's summarizer instructions)


def _text(message: Mapping[str, object]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _summary_reply(prompt: str) -> str:
    """A summary of what the summarizer's `prompt` holds (the current summary, new messages).

    Each fact stated in it, as "The user said my X is Y."; without any, the current summary and
    what the user said, quoted.
    """
    facts: dict[str, str] = {}
    for key, value in _FACT.findall(prompt):
        facts[key.strip().lower()] = _NAMING.sub("", value.strip())
    if facts:
        return " ".join(f"The user said my {key} is {value}." for key, value in facts.items())
    current, _, new = prompt.partition("\n\nNew messages:\n")
    earlier = current.removeprefix("Current summary:\n")
    said = [f'The user said "{line[6:]}".' for line in new.splitlines() if line.startswith("user: ")]
    return " ".join([*([] if earlier == "(none yet)" else [earlier]), *said]) or "Nothing to remember yet."


def demo_reply(messages: Sequence[Mapping[str, object]]) -> str:
    """The demo model's answer to a message list (pure, deterministic)."""
    if messages and messages[0].get("role") == "system" and _text(messages[0]).startswith(_SUMMARIZER):
        return _summary_reply(_text(messages[-1]))
    users = [_text(m) for m in messages if m.get("role") == "user"]
    if not users:
        return "Hello! Tell me something about yourself."
    last = users[-1]
    facts: dict[str, str] = {}
    # What the user said earlier, and what a summary or recap (system messages) says they said.
    earlier = [_text(m) for m in messages[:-1] if m.get("role") in ("user", "system")]
    for text in earlier:
        for key, value in _FACT.findall(text):
            facts[key.strip().lower()] = _NAMING.sub("", value.strip())
    question = _QUESTION.search(last)
    if question:
        key = question.group(1).strip().lower()
        if key in facts:
            return f"Your {key} is {facts[key]}."
        return f"I don't know your {key} yet."
    if _FIRST.search(last) and len(users) > 1:
        return f'You first said: "{users[0]}"'
    stated = _FACT.findall(last)
    turn = len(users)
    if stated:
        found = {k.strip().lower(): v.strip() for k, v in stated}
        if "name" in found:
            return f"Nice to meet you, {found['name']}! (turn {turn})"
        key, value = next(iter(found.items()))
        return f"Got it: your {key} is {value}. (turn {turn})"
    return f"You said: {last} (turn {turn}, {len(messages)} messages in my context)"


class DemoUpstream(Upstream):
    def __init__(self, name: str = "demo") -> None:
        self.name = name
        self.url = "builtin:demo"
        self.reports_real_usage = False

    async def complete(self, body: Body, *, waited: float = 0.0) -> Body:
        messages = [as_object(m) for m in as_list(body.get("messages"))]
        return completion_from_text(
            str(body.get("model", "demo")), demo_reply(messages), prompt_tokens=approx_tokens(messages)
        )

    async def stream(self, body: Body, *, waited: float = 0.0) -> AsyncIterator[Chunk]:
        completion = await self.complete(body)
        include_usage = bool(as_object(body.get("stream_options")).get("include_usage"))
        for chunk in chunks_from_completion(completion, include_usage=include_usage):
            yield chunk
