"""Rolling summaries, the pure part: which summary version applies to a conversation, how a
summarizer prompt is rendered, and how big summaries and summarizer chunks may be for a window."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.context.history import ConversationView, NotLoaded
from gateway.context.records import number
from gateway.types import Message, Record

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
    """Tokens (ours) of new messages one summarizer call can take: its window less the answer
    (`cap`), the current summary (up to `cap`) and the instructions, in the provider's units."""
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

    def message(self) -> Message:
        return {"role": "system", "content": f"Summary of the earlier conversation:\n{self.text}"}


def current_summary(records: list[Record], view: ConversationView) -> Summary | None:
    """The newest summary that applies to this view (a reset makes older ones inapplicable)."""
    for record in reversed(records):
        if record.get("type") != "summary":
            continue
        rid = record.get("covers_through")
        if not isinstance(rid, str) or rid not in view.history_end:
            if rid in view.prefix_ids:
                raise NotLoaded(f"the summary covers through {rid}, which is not loaded")
            continue
        return Summary(
            version=int(number(record.get("version")) or 0),
            covers_through=rid,
            covered=view.history_end[rid],
            text=str(record.get("text", "")),
            model=str(record.get("model", "")),
        )
    return None


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
    """The first turn end at or after `position` that does not split a tool-call unit (the
    next message is not a tool result), or the end of history."""
    n = view.history_count
    for end in view.history_end.values():  # increasing
        if end >= position and (end == n or view.history[view.loaded_from(end)].get("role") != "tool"):
            return end
    return n
