"""What a list shows of a conversation, kept by the store beside its list of conversations.

The lists are `GET /v1/conversations`, the inspector and `gateway conversations`; kept so, a page
costs its rows, not the length of their conversations.

A turn (or a marker that names no stored message) brings its conversation's listing with it,
made from the view it was planned on without going over that view's messages
(`Listing.after`); the store keeps it with the version of the conversation it describes. A list
that finds none for a conversation as it is now (another change since, a catalog rebuilt from
the folder, a data dir older than listings) makes it from a view loaded from the newest turns
(`Listing.of`) and has the store keep it for the next list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.context import ConversationView
from gateway.context.history import NotLoaded
from gateway.tokens import count_message
from gateway.types import JSONObject

FORMAT = 1  # a listing kept in another format is not used (it is made again)


def stored_tokens(view: ConversationView) -> list[int]:
    """Each loaded message's tokens, system prompt first then history.

    As counted for its turn, or (a message added through the Conversations API, or counted for
    another encoding) by cl100k_base now.
    """
    system = view.system or []
    system_counts = view.system_tokens or [None] * len(system)
    pairs = [*zip(system, system_counts, strict=False), *zip(view.history, view.history_tokens, strict=True)]
    return [n if n is not None else count_message(m) for m, n in pairs]


@dataclass(frozen=True, slots=True)
class Listing:
    """One conversation as a list shows it."""

    turns: int
    messages: int  # in history: what the model sees
    tokens: int  # system prompt and history, each message as counted for its turn
    created_at: float | None
    last_activity: float | None
    user: str | None
    metadata: dict[str, str]
    preview: str  # the newest user message's text, cut to PREVIEW_CHARS

    @classmethod
    def of(cls, view: ConversationView) -> Listing | None:
        """The listing of the conversation `view` holds.

        None when a partly loaded view cannot tell (the checkpoint it starts from recorded no
        tokens or preview: older gateways).
        """
        preview = view.preview()
        if view.tokens_base is None or preview is None:
            return None
        return cls(
            turns=view.turns,
            messages=view.history_count,
            tokens=view.tokens_base + sum(stored_tokens(view)),
            created_at=view.created_at,
            last_activity=view.last_activity,
            user=view.user,
            metadata=dict(view.metadata),
            preview=preview,
        )

    @classmethod
    def after(cls, view: ConversationView, change: Callable[[ConversationView], None]) -> Listing | None:
        """The listing once `change` is applied to `view`, which is left as it is.

        `change` is a turn's `extend`, or a marker that names no stored message; making the listing
        costs the change, not the conversation. None when that cannot be told so (a branch cut into
        what is not loaded, a message not counted yet): the next list makes it.
        """
        stand_in = view.at_end()
        try:
            change(stand_in)
        except NotLoaded:
            return None
        return cls.of(stand_in)

    def record(self) -> JSONObject:
        return {
            "format": FORMAT,
            "turns": self.turns,
            "messages": self.messages,
            "tokens": self.tokens,
            "created_at": self.created_at,
            "last_activity": self.last_activity,
            "user": self.user,
            "metadata": self.metadata,
            "preview": self.preview,
        }

    @classmethod
    def from_record(cls, record: object) -> Listing | None:
        """The listing a store kept; None for anything else (another format, damage)."""
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            return None
        counts = [record.get(key) for key in ("turns", "messages", "tokens")]
        times = [record.get(key) for key in ("created_at", "last_activity")]
        user, metadata, preview = record.get("user"), record.get("metadata"), record.get("preview")
        if not all(type(n) is int and n >= 0 for n in counts) or not all(map(_is_time, times)):
            return None
        if not (user is None or isinstance(user, str)) or not isinstance(preview, str):
            return None
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            return None
        turns, messages, tokens = record["turns"], record["messages"], record["tokens"]
        created_at, last_activity = (float(t) if t is not None else None for t in times)
        return cls(turns, messages, tokens, created_at, last_activity, user, metadata, preview)


def _is_time(value: object) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))
