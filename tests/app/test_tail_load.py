"""A turn on a long stored conversation reads the index and only the response logs its window
needs (`services/tail.py`), and sends upstream exactly what a load of the whole conversation
would have sent: every shape below is grown through the API, copied, and its next turn is
taken twice from a cold gateway, once as shipped and once made to load everything."""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.config import Settings
from gateway.services.cache import ConversationCache
from gateway.store.jsonl import JsonlStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings

CID = "long"


def model(body: dict[str, Any]) -> Any:
    """Answers that depend on everything sent (so a difference in history shows), and tool
    calls when asked about the weather."""
    messages = body["messages"]
    last = messages[-1]
    if last["role"] == "user" and "weather" in str(last.get("content")):
        n = len(messages)
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": f"call_{n}_{k}",
                    "type": "function",
                    "function": {"name": "weather", "arguments": "{}"},
                }
                for k in range(2)
            ],
        }
    return f"answer {len(messages)} to {str(last.get('content'))[:30]}"


class Driver:
    """Talks to one gateway like a client does, keeping the transcript it was shown."""

    def __init__(self, client: Any, cid: str = CID) -> None:
        self.client = client
        self.cid = cid
        self.transcript: list[dict[str, Any]] = []
        self.ids: list[str] = []

    async def say(
        self, *messages: dict[str, Any], resend: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        sent = [*(resend if resend is not None else []), *messages]
        r = await self.client.post(
            "/v1/chat/completions", json={"model": "mock/m", "messages": sent, "conversation_id": self.cid}
        )
        assert r.status_code == 200, r.text
        answer: dict[str, Any] = r.json()["choices"][0]["message"]
        if resend is not None:
            self.transcript = list(resend)
        self.transcript += [*messages, answer]
        self.ids.append(r.json()["id"])
        if answer.get("tool_calls"):
            results = [
                {"role": "tool", "tool_call_id": c["id"], "content": f"sunny {c['id']}"}
                for c in answer["tool_calls"]
            ]
            await self.say(*results)
        return answer

    async def turns(self, n: int, start: int = 0) -> None:
        for i in range(start, start + n):
            await self.say({"role": "user", "content": f"turn {i} of {self.cid}"})

    async def items(self) -> list[dict[str, Any]]:
        r = await self.client.get(f"/v1/conversations/{self.cid}/items?limit=100&order=asc")
        assert r.status_code == 200, r.text
        return list(r.json()["data"])


async def plain(d: Driver) -> None:
    await d.turns(30)


async def system_prompts(d: Driver) -> None:
    await d.say({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"})
    await d.turns(12)
    await d.say({"role": "system", "content": "Be very brief."}, {"role": "user", "content": "again"})
    await d.turns(14, 12)


async def tools(d: Driver) -> None:
    for i in range(24):
        text = "what is the weather?" if i % 5 == 2 else f"turn {i}"
        await d.say({"role": "user", "content": text})


async def resets(d: Driver) -> None:
    await d.say({"role": "system", "content": "Keep me."}, {"role": "user", "content": "hi"})
    await d.turns(12)
    r = await d.client.post(f"/v1/conversations/{d.cid}/reset", json={"keep_system_message": True})
    assert r.status_code == 200, r.text
    await d.turns(14, 12)
    r = await d.client.post(f"/v1/conversations/{d.cid}/reset", json={})
    assert r.status_code == 200, r.text
    await d.turns(3, 40)


async def deletions(d: Driver) -> None:
    await d.turns(24)
    items = await d.items()
    for item in (items[3], items[-5]):  # one long out of the window, one in it
        r = await d.client.delete(f"/v1/conversations/{d.cid}/items/{item['id']}")
        assert r.status_code == 200, r.text
    await d.turns(2, 24)
    r = await d.client.delete(f"/v1/responses/{d.ids[-2]}")
    assert r.status_code == 200, r.text


async def edits(d: Driver) -> None:
    await d.turns(14)
    # An edit well back (a full-history client branching), then more turns, then a regenerate.
    await d.say({"role": "user", "content": "edited question"}, resend=d.transcript[:10])
    await d.turns(14, 14)
    await d.say(d.transcript[-2], resend=d.transcript[:-2])
    await d.turns(2, 30)


async def feedback_and_items(d: Driver) -> None:
    await d.turns(10)
    await d.say({"role": "user", "content": "thumbs up", "is_feedback": True})
    r = await d.client.post(
        f"/v1/conversations/{d.cid}/items",
        json={"items": [{"type": "message", "role": "user", "content": "added by the API"}]},
    )
    assert r.status_code == 200, r.text
    await d.turns(16, 10)
    await d.say({"role": "user", "content": "more feedback", "is_feedback": True})


async def forks(d: Driver) -> None:
    await d.turns(20)
    r = await d.client.post(
        "/v1/responses", json={"model": "mock/m", "input": "a fork", "previous_response_id": d.ids[12]}
    )
    assert r.status_code == 200, r.text
    d.cid = r.headers["x-conversation-id"]
    assert d.cid != CID
    await d.turns(20, 100)


SHAPES: dict[str, Callable[[Driver], Awaitable[None]]] = {
    "plain": plain,
    "system_prompts": system_prompts,
    "tools": tools,
    "resets": resets,
    "deletions": deletions,
    "edits": edits,
    "feedback_and_items": feedback_and_items,
    "forks": forks,
}


def settings_for(tmp: Path, **context: Any) -> Settings:
    settings = make_settings(tmp, durability="none")
    update = {"max_history_messages": 8, "keep_recent_messages": 2, **context}
    return settings.model_copy(update={"context": settings.context.model_copy(update=update)})


async def grow(tmp: Path, shape: str, settings: Settings) -> str:
    store = JsonlStore(tmp / "var", durability="none")
    await store.open()
    async with build_client(settings, store, MockUpstream(model)) as client:
        app_of(client).state.service.schedule_summary = lambda *args: None
        d = Driver(client)
        await SHAPES[shape](d)
    return d.cid


class Turn:
    """The next turn, taken by a cold gateway on a copy of the data."""

    def __init__(
        self, body: dict[str, Any], context: dict[str, Any], files: int, reply: dict[str, Any]
    ) -> None:
        self.body, self.context, self.files, self.reply = body, context, files, reply


async def cold_turn(
    data: Path, copy: Path, cid: str, settings: Settings, message: list[dict[str, Any]], *, whole: bool
) -> Turn:
    shutil.copytree(data / "var", copy / "var")
    store = JsonlStore(copy / "var", durability="none")
    await store.open()
    files: list[str] = []
    real = store._read_records

    def counting(path: Path, *, skip_context: bool = False) -> list[Any]:
        if path.parent == store.data_dir.responses_dir:
            files.append(path.name)
        return real(path, skip_context=skip_context)

    store._read_records = counting  # type: ignore[method-assign]
    upstream = MockUpstream(model)
    async with build_client(
        settings.model_copy(
            update={"storage": settings.storage.model_copy(update={"data_dir": str(copy / "var")})}
        ),
        store,
        upstream,
    ) as client:
        service = app_of(client).state.service
        service.schedule_summary = lambda *args: None
        if whole:

            async def everything(store: Any, cid: str) -> dict[str, Any]:
                return {}

            service.planner.window_needs = everything
        r = await client.post(
            "/v1/chat/completions", json={"model": "mock/m", "messages": message, "conversation_id": cid}
        )
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
    records = [
        orjson.loads(line)
        for line in (store.data_dir.responses_dir / f"{rid}.jsonl").read_bytes().splitlines()
    ]
    context = next(r for r in records if r["type"] == "context")
    request = next(r for r in records if r["type"] == "request")
    kept = {k: v for k, v in context.items() if k not in ("calibration",)}
    kept["before"] = request.get("before")
    return Turn(upstream.requests[-1], kept, len(files), r.json()["choices"][0]["message"])


async def both(
    tmp: Path, shape: str, settings: Settings, message: list[dict[str, Any]] | None = None
) -> tuple[Turn, Turn]:
    cid = await grow(tmp / "grown", shape, settings)
    message = message or [{"role": "user", "content": "and now?"}]
    partial = await cold_turn(tmp / "grown", tmp / "a", cid, settings, message, whole=False)
    whole = await cold_turn(tmp / "grown", tmp / "b", cid, settings, message, whole=True)
    return partial, whole


def index_entries(tmp: Path, cid: str) -> int:
    return len((tmp / "grown" / "var" / "logs" / "conversations" / f"{cid}.jsonl").read_bytes().splitlines())


@pytest.mark.parametrize("shape", sorted(SHAPES))
async def test_a_cold_turn_sends_what_a_whole_load_sends(shape: str, tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    partial, whole = await both(tmp_path, shape, settings)
    assert partial.body == whole.body
    assert partial.context == whole.context
    assert partial.reply == whole.reply


async def test_a_new_conversation_reads_its_missing_index_once(tmp_path: Path) -> None:
    store = JsonlStore(tmp_path / "var")
    await store.open()
    real = store._read_raw
    reads: list[str] = []

    def counting(cid: str, after: Any, repair: bool) -> Any:
        reads.append(cid)
        return real(cid, after, repair)

    store._read_raw = counting  # type: ignore[method-assign]
    view = await ConversationCache().load(store, "brand-new", tail=10)
    assert view.turns == 0 and view.history == [] and not view.partial
    assert reads == ["brand-new"]
    await store.close()


@pytest.mark.parametrize("shape", ["plain", "tools", "system_prompts", "forks"])
async def test_a_cold_turn_reads_only_the_responses_its_window_needs(shape: str, tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    partial, whole = await both(tmp_path, shape, settings)
    assert partial.body == whole.body
    # 8 messages sent at most, + 16 for tool units: about 12 turns of 2, and the system prompt's.
    assert partial.files <= 16 < whole.files


async def test_the_window_bound_by_tokens_and_keep_first_match_a_whole_load(tmp_path: Path) -> None:
    for n, context in enumerate(
        ({"max_context_tokens": 300}, {"keep_first": True}, {"max_history_messages": 0})
    ):
        settings = settings_for(tmp_path / str(n), **context)
        partial, whole = await both(tmp_path / str(n), "tools", settings)
        assert partial.body == whole.body and partial.context == whole.context, context


async def test_a_resent_history_loads_all_of_it_and_matches(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    cid = await grow(tmp_path / "grown", "plain", settings)
    store = JsonlStore(tmp_path / "grown" / "var", durability="none")
    await store.open()
    # The client's own copy of the conversation, resent whole, plus the new question.
    view_items = []
    for entry in await store.read_index(cid):
        records = await store.read_response(str(entry))
        request = next(r for r in records if r["type"] == "request")
        response = next(r for r in records if r["type"] == "response")
        view_items += [*request["input"], response["message"]]
    message = [*view_items, {"role": "user", "content": "and now?"}]
    partial = await cold_turn(tmp_path / "grown", tmp_path / "a", cid, settings, message, whole=False)
    whole = await cold_turn(tmp_path / "grown", tmp_path / "b", cid, settings, message, whole=True)
    assert partial.body == whole.body and partial.context == whole.context
    assert partial.context["new_messages"] == 1


@pytest.mark.parametrize("covers", [-3, 4])
async def test_a_summary_is_loaded_with_what_follows_it(covers: int, tmp_path: Path) -> None:
    """The newest summary covers through a recent turn (in the tail) or an old one (read back
    to it): the window is the summary and what follows, as with a whole load."""
    # (cut_to = 1: every turn past max_history_messages is a cut, where a summary enters)
    settings = settings_for(tmp_path, strategy="summarize", summary_model="mock/m", cut_to=1.0)
    cid = await grow(tmp_path / "grown", "plain", settings)
    store = JsonlStore(tmp_path / "grown" / "var", durability="none")
    await store.open()
    ids = [str(e) for e in await store.read_index(cid)]
    await store.append_side(
        "summaries",
        cid,
        {"type": "summary", "version": 1, "covers_through": ids[covers], "text": "S", "model": "m"},
    )
    message = [{"role": "user", "content": "and now?"}]
    partial = await cold_turn(tmp_path / "grown", tmp_path / "a", cid, settings, message, whole=False)
    whole = await cold_turn(tmp_path / "grown", tmp_path / "b", cid, settings, message, whole=True)
    assert partial.body == whole.body and partial.context == whole.context
    assert partial.context["summary_version"] == 1
    assert partial.files <= 16 - covers if covers < 0 else partial.files <= 30 - covers + 4
    assert partial.files < whole.files


async def test_turns_written_before_checkpoints_are_read_whole_then_new_turns_start_partial_loads(
    tmp_path: Path,
) -> None:
    settings = settings_for(tmp_path)
    cid = await grow(tmp_path / "grown", "plain", settings)
    responses = tmp_path / "grown" / "var" / "logs" / "responses"
    for path in responses.iterdir():  # as an older gateway wrote them: no `before`
        records = [orjson.loads(line) for line in path.read_bytes().splitlines()]
        for record in records:
            record.pop("before", None)
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    partial, whole = await both_on(tmp_path, cid, settings)
    assert partial.body == whole.body and partial.context == whole.context
    assert partial.files == whole.files  # nothing to start from but the beginning
    assert partial.context["before"] is not None  # the new turn has its checkpoint


async def both_on(tmp: Path, cid: str, settings: Settings) -> tuple[Turn, Turn]:
    message = [{"role": "user", "content": "and now?"}]
    partial = await cold_turn(tmp / "grown", tmp / "a", cid, settings, message, whole=False)
    whole = await cold_turn(tmp / "grown", tmp / "b", cid, settings, message, whole=True)
    return partial, whole


async def test_a_deleted_system_prompt_owner_is_not_trusted(tmp_path: Path) -> None:
    """A checkpoint naming the turn that set the system prompt, deleted since: read back."""
    settings = settings_for(tmp_path)
    cid = await grow(tmp_path / "grown", "system_prompts", settings)
    store = JsonlStore(tmp_path / "grown" / "var", durability="none")
    await store.open()
    owners = []
    for entry in await store.read_index(cid):
        records = await store.read_response(str(entry))
        if next(r for r in records if r["type"] == "request")["system"]:
            owners.append(str(entry))
    owner = owners[-1]
    await store.tombstone(owner)  # as a deletion from a fork sharing it would leave it here
    partial, whole = await both_on(tmp_path, cid, settings)
    assert partial.body == whole.body and partial.context == whole.context
