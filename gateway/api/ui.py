"""The conversation inspector: a read-only web page served by the gateway itself (`/ui`).

Static HTML/CSS/JS shipped in the package (no build step, no CDN) and two JSON endpoints under
`/ui/api/` that the page reads with the same bearer key as the API.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from starlette.requests import Request
from starlette.responses import FileResponse, Response

from gateway.api.http import JSONBody, services_of, tenant_of
from gateway.api.pages import NEWEST_FIRST, list_params
from gateway.context.records import first, latest
from gateway.context.unsent import Unsent
from gateway.exceptions import InvalidRequest, NotFound
from gateway.ids import check_conversation_id
from gateway.types import JSONObject, Message, Record, ascii_int

STATIC = Path(__file__).resolve().parent.parent / "ui" / "static"
_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
# What the page shows of each compaction made of a conversation (where, what it covered, why).
_COMPACTION_FIELDS = ("id", "trigger", "covers_through", "covered_messages", "summary_version", "created")
SENT_FORMS = ("whole", "delta")  # how a conversation's turns say what was sent (`?sent=`)
PAGE = 200  # conversations listed at most by one request (the page asks for older ones after)


def _enabled(request: Request) -> None:
    if not request.app.state.settings.ui.enabled:
        raise NotFound("The inspector is disabled ([ui] enabled = false)")


NOSNIFF = {"x-content-type-options": "nosniff"}
# The page keeps the gateway key (localStorage) and shows what clients wrote: it runs its own
# script and nothing else, is never framed, and names nothing to other sites.
PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    **NOSNIFF,
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}


async def page(request: Request) -> Response:
    _enabled(request)
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)


async def static(request: Request) -> Response:
    _enabled(request)
    name = request.path_params["name"]
    if name not in _FILES:
        raise NotFound(f"No file {name!r}")
    headers = {**PAGE_HEADERS, "cache-control": "no-cache"}
    return FileResponse(STATIC / name, media_type=_FILES[name], headers=headers)


async def conversations(request: Request) -> Response:
    _enabled(request)
    params = list_params(request.query_params, orders=NEWEST_FIRST, default_limit=PAGE, max_limit=PAGE)
    if params.after is not None:
        check_conversation_id(params.after, param="after")
    rows, next_after = await services_of(request).queries.search(
        tenant_of(request), request.query_params.get("q", ""), limit=params.limit, after=params.after
    )
    out = [
        {
            "id": row.conversation_id,
            "turns": row.summary.turns,
            "messages": row.summary.messages,
            "tokens": row.summary.tokens,
            "last_activity": row.listing.last_activity or row.summary.last_activity,
            "user": row.listing.user,
            "state": row.state.state,
            "preview": row.listing.preview,
        }
        for row in rows
    ]
    # `next`: older conversations remain unread; ask again with `after` set to it.
    return JSONBody({"data": out, "next": next_after} if next_after else {"data": out}, headers=NOSNIFF)


def _turn(records: list[Record], rid: str, index: int) -> JSONObject | None:
    request = first(records, "request")
    if request is None:
        return None
    context = latest(records, "context") or {}
    response = first(records, "response") or {}
    return {
        "index": index,
        "response_id": rid,
        "kind": request.get("kind", "chat"),
        "created": request.get("created"),
        "model": request.get("model"),
        "system": request.get("system"),
        "input": request.get("input") or [],
        "recap": request.get("recap"),
        "output": response.get("message"),
        "finish_reason": response.get("finish_reason"),
        "usage": response.get("usage"),
        "cache": response.get("cache"),  # the prompt's size and what the provider's cache served
        "timings": response.get("timings"),
        "suspected_truncation": response.get("upstream_truncation_suspected"),
        "context": {k: v for k, v in context.items() if k not in ("type", "messages")},
        "sent": context.get("messages") or [],
        "outcome": records[-1].get("type") if records else None,
        # Where the client's version branched (history kept up to `branch_at`), whether it was
        # "edited" or "regenerated" (None: recorded before the two were told apart), and the
        # first stored message the branch left behind ({response_id, position}).
        "branch_at": request.get("branch_at"),
        "branch": request.get("branch"),
        "branch_left": request.get("branch_left"),
    }


def as_deltas(turns: list[JSONObject]) -> None:
    """Each turn's sent list said as what it shares with the turn's before it, and the rest.

    Between two cuts a turn sends the turn before's prompt and more (the window keeps the
    prompt's head for the provider's cache), so whole lists repeat each other: a conversation
    of a few hundred turns would say its window a few hundred times. `sent_shared` is how many
    leading messages are the previous turn's (in this answer) and `sent_tail` the messages after.
    """
    before: list[object] = []
    for turn in turns:
        sent = turn.pop("sent", None)
        if not isinstance(sent, list):
            continue  # (a marker)
        shared, most = 0, min(len(before), len(sent))
        while shared < most and sent[shared] == before[shared]:
            shared += 1
        turn["sent_shared"], turn["sent_tail"] = shared, sent[shared:]
        before = sent


async def conversation(request: Request) -> Response:
    _enabled(request)
    queries = services_of(request).queries
    tenant = tenant_of(request)
    cid = check_conversation_id(request.path_params["conversation_id"], param="conversation_id")
    raw_since = request.query_params.get("since", "0") or "0"
    since = ascii_int(raw_since)
    if since is None:
        raise InvalidRequest("'since' must be a non-negative integer (a turn index)", param="since")
    form = request.query_params.get("sent", "whole") or "whole"
    if form not in SENT_FORMS:
        raise InvalidRequest("'sent' must be 'whole' or 'delta'", param="sent")
    entries = await queries.index(tenant, cid)
    view = await queries.view(tenant, cid)
    unsent = Unsent(view)
    turns = []
    index = 0
    for entry in entries:
        if isinstance(entry, dict):
            kind = entry.get("type")
            if kind in ("reset", "delete_item", "delete_response") and index >= since:
                marker: JSONObject = {"index": index, "marker": kind, "at": entry.get("at")}
                for key in ("response_id", "position", "call", "text"):  # what a deletion names
                    if key in entry:
                        marker[key] = entry[key]
                turns.append(marker)
            continue
        if index >= since:
            # A response file that is missing or empty is left out, as in chat.
            records = await queries.logged_turn(tenant, cid, entry)
            turn = _turn(records, entry, index) if records is not None else None
            if turn is not None:
                # Positions (input, then the answer) of its messages the model no longer gets,
                # and its system prompt's (-1, -2, ...) once deleted or replaced by a later one,
                # with the reason (as `gateway show` says it).
                given, system = turn["input"], turn["system"]
                reasons = unsent.of_turn(
                    entry,
                    given if isinstance(given, list) else [],
                    cast(Message, turn["output"]) if isinstance(turn["output"], dict) else None,
                    system if isinstance(system, list) else None,
                )
                turn["not_sent"] = list(reasons)
                turn["not_sent_why"] = {str(p): why for p, why in reasons.items()}
                answer = len(given) if isinstance(given, list) else 0
                parts, _ = unsent.parts(entry, answer)  # (only an answer has parts deleted alone)
                turn["not_sent_parts"] = {str(answer): parts} if parts else {}
                turns.append(turn)
        index += 1
    if form == "delta":
        as_deltas(turns)
    summaries = await queries.summaries(tenant, cid, view)
    compactions = await queries.compactions(tenant, cid)
    state = await queries.state(tenant, cid, view)
    return JSONBody(
        {
            "id": cid,
            "state": state.state,
            "user": view.user,
            "metadata": view.metadata,
            "system": view.system,
            "summaries": [
                {
                    k: s.get(k)
                    for k in ("version", "covers_through", "covered_messages", "text", "created", "applies")
                }
                for s in summaries
            ],
            # Where compactions happened: what each covered (through a response) and why.
            "compactions": [{k: c.get(k) for k in _COMPACTION_FIELDS} for c in compactions],
            "count": index,
            # Every index line (turns and markers): when it changed with no new turn, or a new
            # entry is a marker or an edit, what was sent before may have changed too.
            "entries": len(entries),
            "turns": turns,
        },
        headers=NOSNIFF,
    )
