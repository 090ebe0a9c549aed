"""Rolling summaries, the pure part.

Which summary version applies to a conversation, how a summarizer prompt is rendered, and how
big summaries and summarizer chunks may be for a window.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from gateway.context.history import ConversationView, NotLoaded
from gateway.types import Message, Record, number

SUMMARY_INSTRUCTIONS = (
    "You maintain the running summary of a conversation between a user and an assistant. "
    "Fold the new messages into the current summary. Keep every fact the user stated (names, "
    "preferences, numbers, decisions), what the assistant promised or did, and open questions. "
    "Write plain prose in at most {max_tokens} tokens. Reply with the summary only."
)
CHUNK_TOKENS = 3000
# A summary takes at most this share of the window of the model it is sent to.
SUMMARY_WINDOW_SHARE = 5
_INSTRUCTION_TOKENS = 96  # the instructions and the framing of the summarizer's prompt


def summary_cap(configured: int, window: int) -> int:
    """Tokens a summary may have: `summary_max_tokens`, at most a fifth of the window."""
    return max(16, min(configured, window // SUMMARY_WINDOW_SHARE))


def chunk_budget(window: int, cap: int, ratio: float, overhead: float, margin: int) -> int:
    """Tokens (ours) of new messages one summarizer call can take.

    Its window less the answer (`cap`), the current summary (up to `cap`) and the instructions,
    in the provider's units.
    """
    room = window - cap - margin - overhead
    ours = int(room / ratio) - cap - _INSTRUCTION_TOKENS
    return max(32, min(CHUNK_TOKENS, ours))


@dataclass(frozen=True, slots=True)
class Summary:
    version: int
    covers_through: str  # the last response id whose messages it covers
    covered: int  # history messages covered, as of the view it applies to
    text: str
    model: str
    compaction: bool = False  # made by a compaction the client asked for (`context_management`)

    def message(self) -> Message:
        return {"role": "system", "content": f"{SUMMARY_HEAD}{self.text}"}


SUMMARY_HEAD = "Summary of the earlier conversation:\n"


def is_summary_message(message: object) -> bool:
    """Is `message` (as a window sent it) a rolling summary?"""
    content = message.get("content") if isinstance(message, dict) else None
    return (
        isinstance(message, dict)
        and message.get("role") == "system"
        and str(content).startswith(SUMMARY_HEAD)
    )


def current_summary(records: list[Record], view: ConversationView) -> Summary | None:
    """The newest summary that applies to this view.

    One applies when the last response it covers is in the view's history (a reset or a branch
    makes the others inapplicable), and no withdrawal recorded after it (a deletion of a message
    it covers, `withdrawal`) rules it out.
    """
    return next(_applicable(records, view), None)


def summary_version(records: list[Record], view: ConversationView, version: int) -> Summary | None:
    """Summary `version` when it still applies to this view (see `current_summary`)."""
    return next((s for s in _applicable(records, view) if s.version == version), None)


def applicable_versions(records: list[Record], view: ConversationView) -> set[int]:
    """The versions that still apply to this view (see `current_summary`), for the inspector."""
    return {summary.version for summary in _applicable(records, view)}


def _applicable(records: list[Record], view: ConversationView) -> Iterator[Summary]:
    """The summaries that apply to this view, newest first."""
    bound: int | None = None  # history messages a summary older than the withdrawals may cover
    compacted = {r.get("summary_version") for r in records if r.get("type") == "compaction"}
    for record in reversed(records):
        kind = record.get("type")
        if kind == "withdrawn":
            end = _end_of(record.get("keep_through"), view)
            bound = end if bound is None else min(bound, end)
            continue
        if kind != "summary":
            continue
        rid = record.get("covers_through")
        if not isinstance(rid, str) or rid not in view.history_end:
            if rid in view.prefix_ids:
                raise NotLoaded(f"the summary covers through {rid}, which is not loaded")
            continue
        covered = view.history_end[rid]
        if bound is not None and covered > bound:
            continue  # it folded in a message deleted since
        version = int(number(record.get("version")) or 0)
        yield Summary(
            version=version,
            covers_through=rid,
            covered=covered,
            text=str(record.get("text", "")),
            model=str(record.get("model", "")),
            compaction=version in compacted,
        )


def _end_of(response_id: object, view: ConversationView) -> int:
    """Where `response_id`'s messages end in history; 0 when it is not in it (deleted or reset)."""
    if not isinstance(response_id, str):
        return 0
    if response_id in view.history_end:
        return view.history_end[response_id]
    if response_id in view.prefix_ids:
        raise NotLoaded(f"a summary withdrawal keeps through {response_id}, which is not loaded")
    return 0


def withdrawal(view: ConversationView, response_id: str, at: float) -> Record | None:
    """The summaries log's record for a deletion of `response_id`'s messages (all of them, or one).

    Every summary version that covers one of them, or was folded from one that did, is withdrawn;
    those covering only the turns before it still apply. None when none of its messages is in
    history (a summary never sees the system prompt or feedback).
    """
    first = next((i for i, owner in enumerate(view.history_owner) if owner == response_id), None)
    if first is None:
        if response_id in view.prefix_ids:
            raise NotLoaded(f"{response_id} is not loaded")
        return None
    if first == 0 and view.history_base:
        raise NotLoaded(f"the turn before {response_id} is not loaded")
    keep = view.history_owner[first - 1] if first else None
    return {"type": "withdrawn", "keep_through": keep, "response_id": response_id, "created": at}


def last_version(records: list[Record]) -> int:
    """The highest summary version recorded (withdrawn ones included: numbers never repeat)."""
    versions = [int(number(r.get("version")) or 0) for r in records if r.get("type") == "summary"]
    return max(versions, default=0)


def render_for_summary(messages: list[Message]) -> str:
    lines = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        text = content if isinstance(content, str) else ""
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            text += f" [called {fn.get('name')}({fn.get('arguments')})]"
        lines.append(f"{m.get('role')}: {text}")
    return "\n".join(lines)


def snap_to_turn_end(view: ConversationView, position: int) -> int:
    """The first turn end at or after `position` that does not split a tool-call unit.

    A turn end splits none when the next message is not a tool result. The end of history when
    there is no such turn end.
    """
    n = view.history_count
    for end in view.history_end.values():  # increasing
        if end >= position and (end == n or view.history[view.loaded_from(end)].get("role") != "tool"):
            return end
    return n
