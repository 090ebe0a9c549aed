"""A conversation's newest part only (pure).

What a turn records about everything before it, and the view rebuilt from that record on, so
that a turn on a long conversation reads the responses its window needs instead of all of them.
"""

from __future__ import annotations

from gateway.context.history import ConversationView, Turn
from gateway.types import JSONObject, Record, number, obj, text

_COUNTS = ("entries", "history", "transcript", "turns")


def checkpoint(view: ConversationView) -> JSONObject:
    """What a view resumed at the next index entry needs of every entry before it.

    A turn keeps it in its request record as `before`: counts, who set the system prompt and the
    recap, and the conversation's latest facts.
    """
    return {
        "entries": view.entries,
        "history": view.history_count,
        "transcript": view.transcript_count,
        "turns": view.turns,
        "system_from": view.system_owner if view.system is not None else None,
        "recap_from": view.recap_owner if view.recap is not None else None,
        "encoding": view.encoding,
        "created_at": view.created_at,
        "last_activity": view.last_activity,
        "model": view.last_model,
        "user": view.user,
        "timezone": view.timezone,
        # What a list shows of the history so far (None: not known, e.g. not counted yet).
        "tokens": view.history_tokens_total(),
        "preview": view.preview(),
    }


def checkpoint_of(records: list[Record]) -> JSONObject | None:
    """The `before` a response log's request record carries, if it is whole.

    Older gateways wrote none: such a turn cannot start a partial view.
    """
    request = next((r for r in records if r.get("type") == "request"), None)
    point = obj(request.get("before")) if request is not None else None
    if point is None:
        return None
    for key in _COUNTS:
        value = point.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            return None
    return point


def resume(
    point: JSONObject, prefix_ids: frozenset[str], system: Turn | None, recap: Turn | None
) -> ConversationView:
    """An empty view standing where `point` was taken.

    The entries after it are then applied as usual (the first of them without its `branch_at`:
    the point was taken after that cut). `system` and `recap` are the turns `point` names as
    their source.
    """
    counts = {key: int(number(point.get(key)) or 0) for key in _COUNTS}
    view = ConversationView(
        entries=counts["entries"],
        history_base=counts["history"],
        transcript_base=counts["transcript"],
        turns=counts["turns"],
        encoding=text(point.get("encoding")),
        created_at=number(point.get("created_at")),
        last_activity=number(point.get("last_activity")),
        last_model=text(point.get("model")),
        user=text(point.get("user")),
        timezone=text(point.get("timezone")),
        prefix_ids=prefix_ids,
    )
    if counts["history"]:
        counted, preview = point.get("tokens"), point.get("preview")
        view.tokens_base = counted if type(counted) is int and counted >= 0 else None
        view.preview_base = preview if isinstance(preview, str) else None
    if system is not None and system.system is not None:
        view.system, view.system_owner = list(system.system), system.response_id
        tokens = (
            system.system_tokens if system.encoding is not None and system.encoding == view.encoding else None
        )
        view.system_tokens = list(tokens) if tokens is not None else [None] * len(system.system)
        view.needs_count = tokens is None
    if recap is not None and recap.recap is not None:
        view.recap, view.recap_owner = recap.recap, recap.response_id
    return view
