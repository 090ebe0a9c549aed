"""The "earlier today" recap of a user's new conversation (SPEC section 8).

Which of the user's other conversations were active today (in the user's time zone), and what to
say of each.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from zoneinfo import ZoneInfo

from gateway.context import ConversationView, Message
from gateway.context.lifecycle import local_day, todays_lines, user_key
from gateway.context.recap_text import recap_conversations, recap_message
from gateway.exceptions import ConversationBusy, NotFound
from gateway.store import Store
from gateway.store.base import now
from gateway.types import Record, number

# The recap looks at most at this many of the user's most recently started conversations: its
# budget holds a few of them, and a user with thousands must not make every new one slower.
RECAP_SCAN = 50


async def build_recap(
    store: Store,
    load: Callable[[str], Awaitable[ConversationView]],
    user: str,
    tz: ZoneInfo,
    *,
    exclude: str,
    now: float,
    max_tokens: int,
    count: Callable[[Message], int],
) -> tuple[Message | None, list[str]]:
    """An "Earlier today" system message, and the conversations it drew on.

    It is made from the user's other conversations of the same local day, newest first, within
    `max_tokens`.
    """
    today = local_day(now, tz)
    ukey = user_key(user)
    digests = {r.get("conversation_id"): r for r in await store.read_side("digests", f"{ukey}.{today}")}
    seen: set[str] = set()
    candidates: list[tuple[float, str, list[str]]] = []
    for entry in reversed(await store.read_side("users", ukey)):
        cid = entry.get("conversation_id")
        if not isinstance(cid, str) or cid == exclude or cid in seen:
            continue
        if len(seen) >= RECAP_SCAN:
            break  # a long-lived user: only the newest conversations, not all they ever had
        seen.add(cid)
        view = await load(cid)
        if not view.turns or view.last_activity is None or local_day(view.last_activity, tz) != today:
            continue
        digest = digests.get(cid)
        # (a digest covers the activity its attempt began with: a turn landing meanwhile is newer)
        covered = number(digest.get("covers_activity")) or number(digest.get("at")) if digest else None
        if digest and (covered or 0.0) >= view.last_activity:
            # Line by line: its own lines at column 0 (a model's list) read as other blocks' heads.
            lines = [" ".join(line.split()) for line in str(digest.get("summary", "")).splitlines()]
            lines = [line for line in lines if line]
        else:
            lines = todays_lines(view, tz, today)
        if lines:
            candidates.append((view.last_activity, cid, lines))
    return recap_message(candidates, tz, max_tokens=max_tokens, count=count)


async def withdraw_recaps(
    store: Store, load: Callable[[str], Awaitable[ConversationView]], source: str, lock_timeout: float
) -> None:
    """Withdraw conversation `source` from later recaps that quote it, before its content is deleted.

    The recaps of the same user's later conversations stop quoting `source` (a `withdraw_recap`
    marker in each that does), so a deleted message never reaches the model again through a recap
    made before the deletion. `source`'s lock is not held: each other conversation's is taken on
    its own, never two at once. Recorded first: a crash between the two leaves a recap withdrawn
    for nothing, never a deleted message in one.
    """
    user = (await load(source)).user
    if not user:
        return
    entries = [e.get("conversation_id") for e in await store.read_side("users", user_key(user))]
    if source not in entries:
        return  # (a recap quotes only the conversations of this log)
    later = entries[entries.index(source) + 1 :]  # a recap quotes conversations started before its own
    for cid in dict.fromkeys(later):
        if not isinstance(cid, str) or cid == source:
            continue
        try:
            recap = (await load(cid)).recap
        except NotFound:
            continue
        if recap is None or source not in recap_conversations(recap):
            continue
        try:
            # (not held up by a long turn of that conversation: its next turn withdraws it
            # then, `stale_recap_sources`; a delete waited, and was a 409, behind such turns)
            async with store.lock(cid, min(lock_timeout, WITHDRAW_LOCK_SECONDS)):
                await store.append_marker(cid, withdrawal([source]))
        except ConversationBusy:
            continue


WITHDRAW_LOCK_SECONDS = 2.0


def withdrawal(conversations: list[str]) -> Record:
    """The index marker that takes `conversations` out of a conversation's recap."""
    return {"type": "withdraw_recap", "conversations": conversations, "withdrawn_at": now()}


async def stale_recap_sources(
    store: Store, load: Callable[[str], Awaitable[ConversationView]], view: ConversationView
) -> list[str]:
    """The conversations `view`'s recap quotes that are gone, or had an item or a response deleted since.

    Deleted after the recap was made: what a deletion could not withdraw itself (the recap's first
    turn was still running, or the conversation was busy). Read at each turn of a conversation
    with a recap, its lock held.
    """
    if view.recap is None:
        return []
    made = view.created_of.get(view.recap_owner or "", 0.0)
    stale = []
    for cid in recap_conversations(view.recap):
        try:
            if not await store.exists(cid) or ((await load(cid)).last_deletion or 0.0) > made:
                stale.append(cid)
        except NotFound:
            stale.append(cid)
    return stale
