"""The conversation inspector: a read-only web page served by the gateway itself (`/ui`).

Static HTML/CSS/JS shipped in the package (no build step, no CDN) and two JSON endpoints under
`/ui/api/` that the page reads with the same bearer key as the API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, Response

from gateway.api.http import JSONBody, store_for
from gateway.exceptions import NotFound
from gateway.ids import check_conversation_id
from gateway.lifecycle import derive_state
from gateway.store import Store

STATIC = Path(__file__).resolve().parent.parent / "ui" / "static"
_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}


def _enabled(request: Request) -> None:
    if not request.app.state.settings.ui.enabled:
        raise NotFound("The inspector is disabled ([ui] enabled = false)")


async def page(request: Request) -> Response:
    _enabled(request)
    return FileResponse(STATIC / "index.html", media_type="text/html")


async def static(request: Request) -> Response:
    _enabled(request)
    name = request.path_params["name"]
    if name not in _FILES:
        raise NotFound(f"No file {name!r}")
    return FileResponse(STATIC / name, media_type=_FILES[name], headers={"cache-control": "no-cache"})


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


async def conversations(request: Request) -> Response:
    _enabled(request)
    store = await store_for(request)
    query = request.query_params.get("q", "").strip().lower()
    out = []
    for summary in await store.list_conversations():
        view = await store.load(summary.conversation_id)
        if query:
            haystack = [summary.conversation_id.lower(), (view.user or "").lower()]
            haystack += [_text(m).lower() for m in view.transcript]
            if not any(query in h for h in haystack):
                continue
        state = derive_state(await store.read_side("lifecycle", summary.conversation_id), view.last_activity)
        out.append(
            {
                "id": summary.conversation_id,
                "turns": summary.turns,
                "messages": summary.messages,
                "tokens": summary.tokens,
                "last_activity": view.last_activity or summary.last_activity,
                "user": view.user,
                "state": state.state,
                "preview": next(
                    (_text(m)[:120] for m in reversed(view.history) if m.get("role") == "user"), ""
                ),
            }
        )
        if len(out) >= 200:
            break
    return JSONBody({"data": out})


async def _turn(store: Store, rid: str, index: int) -> dict[str, Any] | None:
    records = await store.read_response(rid)
    request = next((r for r in records if r.get("type") == "request"), None)
    if request is None:
        return None
    context = next((r for r in reversed(records) if r.get("type") == "context"), None) or {}
    response = next((r for r in records if r.get("type") == "response"), None) or {}
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
        "timings": response.get("timings"),
        "suspected_truncation": response.get("upstream_truncation_suspected"),
        "context": {k: v for k, v in context.items() if k not in ("type", "messages")},
        "sent": context.get("messages") or [],
        "outcome": records[-1].get("type") if records else None,
    }


async def conversation(request: Request) -> Response:
    _enabled(request)
    store = await store_for(request)
    cid = check_conversation_id(request.path_params["conversation_id"], param="conversation_id")
    since = int(request.query_params.get("since", "0") or 0)
    entries = await store.read_index(cid)
    view = await store.load(cid)
    turns = []
    index = 0
    for entry in entries:
        if isinstance(entry, dict):
            if entry.get("type") == "reset" and index >= since:
                turns.append({"index": index, "marker": "reset", "at": entry.get("at")})
            continue
        if index >= since:
            turn = await _turn(store, entry, index)
            if turn is not None:
                turns.append(turn)
        index += 1
    summaries = [r for r in await store.read_summaries(cid) if r.get("type") == "summary"]
    state = derive_state(await store.read_side("lifecycle", cid), view.last_activity)
    return JSONBody(
        {
            "id": cid,
            "state": state.state,
            "user": view.user,
            "metadata": view.metadata,
            "system": view.system,
            "summaries": [
                {k: s.get(k) for k in ("version", "covers_through", "covered_messages", "text", "created")}
                for s in summaries
            ],
            "count": index,
            "turns": turns,
        }
    )
