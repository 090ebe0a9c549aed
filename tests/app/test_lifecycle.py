"""Lifecycle: the post-processing state machine on a controllable clock, recaps, expiry."""

from __future__ import annotations

import asyncio
import os
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest

from gateway.app import create_app
from gateway.context.lifecycle import FAILED, PROCESSED, PROCESSING, derive_state, user_key
from gateway.exceptions import UpstreamUnreachable
from gateway.store.jsonl import JsonlStore
from gateway.upstream import Router
from gateway.upstream.mock import MockUpstream
from tests.conftest import make_settings
from tests.views import load


class Clock:
    """Real time moved forward by `offset`: the gateway's clock in these tests."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset

    def stamp(self, store: JsonlStore, cid: str) -> None:
        """Date the conversation's index by this clock, as a turn taken at clock time would
        have: the processor finds candidates by index modification time."""
        now = self()
        os.utime(store.data_dir.conversations_dir / f"{cid}.jsonl", (now, now))


class Summaries:
    """The mock model: summarization requests can be made to fail."""

    def __init__(self) -> None:
        self.fail = False
        self.turns: list[dict[str, Any]] = []  # the turns' bodies (not the summarizer's)

    def __call__(self, body: dict[str, Any]) -> Any:
        first = str(body["messages"][0].get("content"))
        if not first.startswith("You maintain the running summary"):
            self.turns.append(body)
        if first.startswith("You maintain the running summary"):
            if self.fail:
                raise UpstreamUnreachable("Provider 'mock' at mock://upstream is unreachable")
            return "The user said: " + body["messages"][-1]["content"].split("New messages:\n", 1)[1].replace(
                "\n", " "
            )
        from gateway.upstream.demo import demo_reply

        return demo_reply(body["messages"])


async def make(
    tmp_path: Path, context: dict[str, Any] | None = None, **sessions: Any
) -> tuple[Any, JsonlStore, Clock, Summaries, httpx.AsyncClient]:
    settings = make_settings(tmp_path, durability="none")
    settings = settings.model_copy(
        update={
            "sessions": settings.sessions.model_copy(
                update={"idle_after": 60.0, "lease": 120.0, "max_attempts": 3, "recap": True, **sessions}
            ),
            "context": settings.context.model_copy(update=context or {}),
        }
    )
    store = JsonlStore(tmp_path / "var", durability="none")
    await store.open()
    model = Summaries()
    app = create_app(settings, store=store, router=Router({"mock": MockUpstream(model)}, "mock"))
    clock = Clock()
    app.state.processor.clock = clock
    app.state.service.clock = clock
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://g")
    return app, store, clock, model, client


async def say(client: httpx.AsyncClient, cid: str, text: str, **extra: Any) -> str:
    r = await client.post(
        "/v1/chat/completions",
        json={
            "model": "mock/m",
            "messages": [{"role": "user", "content": text}],
            "conversation_id": cid,
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


async def test_idle_conversation_is_processed_and_reactivated(tmp_path: Path) -> None:
    app, store, clock, _, client = await make(tmp_path)
    processor = app.state.processor
    await say(client, "c1", "my name is Ada", user="u1")
    await processor.run_once()
    assert (await processor.state_of("", "c1")).state == "active"  # not idle yet
    clock.offset = 61
    await processor.run_once()
    states = [r["state"] for r in await store.read_side("lifecycle", "c1")]
    assert states == [PROCESSING, PROCESSED]
    summary = (await store.read_side("summaries", "c1"))[-1]
    assert "my name is Ada" in summary["text"]
    day = datetime.now(ZoneInfo("UTC")).strftime("%Y-%m-%d")
    digest = await store.read_side("digests", f"{user_key('u1')}.{day}")
    assert digest[-1]["conversation_id"] == "c1" and "Ada" in digest[-1]["summary"]
    await processor.run_once()  # nothing more to do
    assert len(await store.read_side("lifecycle", "c1")) == 2
    # A new message reactivates it.
    clock.offset = 62
    await say(client, "c1", "hello again")
    assert (await processor.state_of("", "c1")).state == "active"
    await client.aclose()


async def test_after_post_processing_a_history_that_fits_is_still_sent_as_it_is(tmp_path: Path) -> None:
    """Post-processing's summary covers the whole conversation: with `summarize`, the next turn
    once sent that summary instead of a history that still fitted, and the model lost what
    the summary left out."""
    app, store, clock, model, client = await make(tmp_path, {"strategy": "summarize"})
    for text in ("my name is Ada", "my lucky number is 4817", "I live in Lyon"):
        await say(client, "c1", text)
    clock.offset = 61
    await app.state.processor.run_once()
    assert (await app.state.processor.state_of("", "c1")).state == "processed"
    assert [r for r in await store.read_side("summaries", "c1") if r.get("type") == "summary"]
    await say(client, "c1", "what is my lucky number?")
    sent = [str(m.get("content")) for m in model.turns[-1]["messages"]]
    assert "my lucky number is 4817" in sent and not any(m.startswith("Summary of") for m in sent)
    await client.aclose()


async def test_failures_retry_then_fail(tmp_path: Path) -> None:
    app, store, clock, model, client = await make(tmp_path)
    processor = app.state.processor
    await say(client, "c2", "my name is Bo")
    model.fail = True
    clock.offset = 61
    for expected_attempts in (1, 2):
        await processor.run_once()
        state = await processor.state_of("", "c2")
        assert state.state == "active" and state.attempts == expected_attempts
        assert "unreachable" in (state.error or "")
        # The next attempt waits idle_after (the next pass made it at once: a short outage of
        # the model took every attempt).
        clock.offset += 60 - 2
        await processor.run_once()
        assert (await processor.state_of("", "c2")).attempts == expected_attempts
        clock.offset += 2
    await processor.run_once()
    state = await processor.state_of("", "c2")
    assert state.state == FAILED and state.attempts == 3
    # The API says it too (the retrieved conversation had no state; the list no attempts).
    got = (await client.get("/v1/conversations/c2")).json()
    assert (got["state"], got["attempts"]) == (FAILED, 3) and "unreachable" in got["error"]
    # Each failed attempt is a failed summary in the metrics (they said none: only the rolling ones).
    metrics = (await client.get("/metrics")).text
    assert 'gateway_summaries_total{outcome="failed"} 3.0' in metrics, metrics
    listed = (await client.get("/v1/conversations")).json()["data"]
    assert [(c["state"], c["attempts"]) for c in listed if c["id"] == "c2"] == [(FAILED, 3)]
    await processor.run_once()
    assert (await processor.state_of("", "c2")).state == FAILED  # failed stays failed...
    model.fail = False
    clock.offset += 1
    await say(client, "c2", "still there?")  # ...until a new message
    clock.stamp(store, "c2")
    clock.offset += 62
    await processor.run_once()
    assert (await processor.state_of("", "c2")).state == PROCESSED
    await client.aclose()


async def test_lease_expiry_after_a_crashed_processor(tmp_path: Path) -> None:
    app, store, clock, _, client = await make(tmp_path)
    processor = app.state.processor
    await say(client, "c3", "my name is Cy")
    # A processor crashed mid-processing: its record says processing, lease until now + 120 s.
    await store.append_side(
        "lifecycle", "c3", {"state": PROCESSING, "at": clock(), "attempts": 0, "lease_until": clock() + 120}
    )
    clock.offset = 61
    await processor.run_once()
    assert (await processor.state_of("", "c3")).state == PROCESSING  # lease still valid
    clock.offset = 125  # lease over: back to active, counted as an attempt
    await processor.run_once()
    records = await store.read_side("lifecycle", "c3")
    assert records[1]["state"] == "active" and records[1]["attempts"] == 1 and "lease" in records[1]["error"]
    clock.offset = 125 + 60  # (as after a failed attempt: the next waits idle_after)
    await processor.run_once()
    assert (await processor.state_of("", "c3")).state == PROCESSED
    # No conversation is ever left processing beyond its lease.
    for record in records:
        if record["state"] == PROCESSING:
            assert record["lease_until"] - record["at"] <= 1800
    await client.aclose()


async def test_expiry_archives_and_next_request_starts_fresh(tmp_path: Path) -> None:
    app, store, clock, _, client = await make(tmp_path, ttl=3600.0)
    await say(client, "c4", "my name is Di")
    clock.offset = 3601
    await app.state.processor.run_once()
    assert not await store.exists("c4")
    assert list((tmp_path / "var" / "archive").iterdir())
    assert await say(client, "c4", "what is my name?") == "I don't know your name yet."
    await client.aclose()


async def test_expiry_is_checked_when_the_conversation_is_used_not_only_by_the_pass(tmp_path: Path) -> None:
    app, store, clock, _, client = await make(tmp_path, ttl=3600.0)
    await say(client, "c5", "my name is Di")
    assert await say(client, "c5", "what is my name?") == "Your name is Di."
    clock.offset = 3601  # no processor pass runs
    assert await say(client, "c5", "what is my name?") == "I don't know your name yet."
    assert list((tmp_path / "var" / "archive").iterdir())  # the old one was archived
    assert len((await load(store, "c5")).history) == 2  # the fresh conversation's one turn
    await client.aclose()


async def test_an_expired_conversation_takes_no_items_and_reads_as_gone(tmp_path: Path) -> None:
    """Items added to an expired conversation (the background pass not run yet) made it new
    again, and its old history went to the model with the next turn."""
    app, store, clock, model, client = await make(tmp_path, ttl=3600.0)
    app.state.services.conversations.clock = clock
    await say(client, "c6", "the secret is 3333")
    await say(client, "c7", "the secret is 4444")
    await say(client, "c8", "the secret is 5555")
    clock.offset = 3601  # no processor pass runs
    app.state.services.queries.clock = clock
    listed = (await client.get("/v1/conversations")).json()["data"]
    assert {c["id"]: c["state"] for c in listed} == {"c6": "expired", "c7": "expired", "c8": "expired"}
    assert (await client.get("/v1/conversations/c6")).status_code == 404
    assert (await client.get("/v1/conversations/c6/items")).status_code == 404
    item = {"type": "message", "role": "user", "content": "an item after expiry"}
    assert (await client.get("/v1/conversations/c6/context")).status_code == 404
    r = await client.post("/v1/conversations/c6/items", json={"items": [item]})
    assert r.status_code == 404 and "expired" in r.json()["error"]["message"]
    assert not await store.exists("c6")  # archived, as a turn would have
    await say(client, "c6", "what was the secret?")
    sent = [m["content"] for m in model.turns[-1]["messages"]]
    assert sent == ["what was the secret?"]
    r = await client.post("/v1/conversations/c7", json={"metadata": {"k": "v"}})
    assert r.status_code == 404 and not await store.exists("c7")
    r = await client.post("/v1/conversations", json={"id": "c8"})  # (its id is free again)
    assert r.status_code == 200 and (await client.get("/v1/conversations/c8/items")).json()["data"] == []
    await client.aclose()


def test_derive_state() -> None:
    assert derive_state([], 5.0).state == "active"
    done = [{"state": "processed", "at": 10.0}]
    assert derive_state(done, 9.0).state == "processed"
    assert derive_state(done, 11.0).state == "active"
    # An attempt that began with the activity of 8.0 and ended at 10.0: a turn at 9.0 landed
    # while it ran, and was left out of it.
    covering = [{"state": "processed", "at": 10.0, "covers_activity": 8.0}]
    assert derive_state(covering, 8.0).state == "processed"
    assert derive_state(covering, 9.0).state == "active"


def _upstream(app: Any) -> MockUpstream:
    return app.state.services.router.resolve("mock/m").upstream  # type: ignore[no-any-return]


async def test_a_turn_landing_while_processing_is_processed_after(tmp_path: Path) -> None:
    """The turn was answered, but the attempt ended `processed` later than it, so the
    conversation was never processed again: its summary and the user's digest left it out."""
    app, store, clock, _, client = await make(tmp_path)
    processor = app.state.processor
    await say(client, "c5", "my locker code is CODE1", user="u5")
    clock.offset = 61
    _upstream(app).delay = 0.3  # the summary takes a while
    attempt = asyncio.ensure_future(processor.run_once())
    while not await store.read_side("lifecycle", "c5"):
        await asyncio.sleep(0.01)
    await say(client, "c5", "correction: the code is CODE2", user="u5")  # while processing
    clock.stamp(store, "c5")
    await attempt
    assert (await processor.state_of("", "c5")).state == "active"
    _upstream(app).delay = 0.0
    clock.offset = 130
    await processor.run_once()
    assert (await processor.state_of("", "c5")).state == PROCESSED
    assert "CODE2" in (await store.read_side("summaries", "c5"))[-1]["text"]
    await client.aclose()


async def test_an_attempt_ends_with_its_lease(tmp_path: Path) -> None:
    """A summary call that hung kept the conversation `processing` past `lease_until` (with a
    provider `timeout` of hours: past the 30 minutes promised), and every other conversation
    waited behind it."""
    app, store, clock, _, client = await make(tmp_path, lease=0.2)
    processor = app.state.processor
    await say(client, "c6", "my name is Di")
    clock.offset = 61
    _upstream(app).delay = 30.0  # a hung provider
    started = time.monotonic()
    await processor.run_once()
    assert time.monotonic() - started < 5
    state = await processor.state_of("", "c6")
    assert state.state == "active" and state.attempts == 1 and "lease" in (state.error or "")
    await client.aclose()


def _zone_pair(now: float) -> tuple[str, str, float]:
    """A zone where `now` and a later instant fall on different local days, one where they
    fall on the same day, and that later instant (at most 12 hours later, whatever the hour)."""

    def day(ts: float, z: str) -> str:
        return datetime.fromtimestamp(ts, ZoneInfo(z)).date().isoformat()

    hourly = [f"Etc/GMT{'+' if h > 0 else '-'}{abs(h)}" if h else "UTC" for h in range(-14, 13)]
    for split in hourly:
        local = datetime.fromtimestamp(now, ZoneInfo(split))
        midnight = (local + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
        later = midnight.timestamp() + 60  # just after the next local midnight there
        if later - now <= 12 * 3600:
            same = next(z for z in hourly if day(now, z) == day(later, z))
            return split, same, later
    raise AssertionError("every hour has a zone whose midnight is less than 12 hours away")


async def test_recap_respects_the_users_local_day(tmp_path: Path) -> None:
    app, store, clock, _, client = await make(tmp_path)
    await say(client, "text-1", "my dog is called Rex", user="u9")
    split, same, later = _zone_pair(time.time())
    clock.offset = later - time.time()
    assert (
        await say(client, "voice-a", "what is my dog called?", user="u9", user_timezone=split)
        == "I don't know your dog yet."
    )
    assert (
        await say(client, "voice-b", "what is my dog called?", user="u9", user_timezone=same)
        == "Your dog is Rex."
    )
    r = await client.get("/v1/conversations/voice-b/context")
    assert r.json()["recap_conversations"] == ["voice-a", "text-1"]  # newest first
    bad = await client.post(
        "/v1/chat/completions",
        json={
            "model": "mock/m",
            "messages": [{"role": "user", "content": "x"}],
            "conversation_id": "z",
            "user_timezone": "Mars/Olympus",
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "user_timezone"
    await client.aclose()


async def test_real_clock_pass_skips_settled_and_recent_conversations(tmp_path: Path) -> None:
    import asyncio

    app, store, _, _, client = await make(tmp_path, idle_after=0.5)
    processor = app.state.processor
    processor.clock = time.time
    app.state.service.clock = time.time
    await say(client, "r1", "my name is Eve")
    await processor.run_once()
    assert await store.read_side("lifecycle", "r1") == []  # active less than idle_after ago
    await asyncio.sleep(0.6)
    await processor.run_once()
    assert [r["state"] for r in await store.read_side("lifecycle", "r1")] == [PROCESSING, PROCESSED]
    await processor.run_once()  # settled and unchanged: not visited again
    assert len(await store.read_side("lifecycle", "r1")) == 2
    await client.aclose()


async def test_recap_looks_at_a_bounded_number_of_the_users_conversations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user with many earlier conversations: a new one loads at most RECAP_SCAN of them (the
    newest), not every conversation the user ever had."""
    from gateway.services import recap

    monkeypatch.setattr(recap, "RECAP_SCAN", 5)
    app, store, clock, _, client = await make(tmp_path)
    for n in range(12):
        await say(client, f"old-{n}", f"my number is {n}", user="u7")
    loaded: list[str] = []
    real_read = store.read_conversation

    async def counting_read(cid: str, after: Any = None) -> Any:
        loaded.append(cid)
        return await real_read(cid, after)

    monkeypatch.setattr(store, "read_conversation", counting_read)
    await say(client, "fresh", "hello", user="u7")
    others = [cid for cid in loaded if cid != "fresh"]
    assert others == [f"old-{n}" for n in range(11, 6, -1)]  # the 5 newest, newest first
    r = await client.get("/v1/conversations/fresh/context")
    assert r.json()["recap_conversations"][0] == "old-11"
    await client.aclose()


async def test_the_conversation_object_says_when_it_expires(tmp_path: Path) -> None:
    app, store, clock, _, client = await make(tmp_path, ttl=3600.0)
    await say(client, "exp", "hello")
    view = await load(store, "exp")
    assert view.last_activity is not None
    got = (await client.get("/v1/conversations/exp")).json()
    assert got["expires_at"] == int(view.last_activity + 3600)
    listed = (await client.get("/v1/conversations")).json()["data"]
    assert [c["expires_at"] for c in listed if c["id"] == "exp"] == [got["expires_at"]]
    await client.aclose()
    _, _, _, _, no_ttl = await make(tmp_path / "other")
    await say(no_ttl, "forever", "hello")
    assert (await no_ttl.get("/v1/conversations/forever")).json()["expires_at"] is None
    await no_ttl.aclose()


async def test_the_recap_carries_both_sides_of_the_users_local_today_only(tmp_path: Path) -> None:
    app, store, clock, _, client = await make(tmp_path)
    tz = "Europe/Paris"
    clock.offset = -86400  # yesterday, in any zone
    await say(client, "plan-1", "my old project is Eagle", user="u7", user_timezone=tz)
    clock.offset = 0
    await say(client, "plan-1", "my secret project is Falcon", user="u7", user_timezone=tz)
    await say(client, "plan-2", "hello again", user="u7", user_timezone=tz)
    sent = app.state.router.upstreams["mock"].requests[-1]["messages"]
    recap = next(m["content"] for m in sent if m["role"] == "system" and "Earlier today" in m["content"])
    assert "user: my secret project is Falcon" in recap
    assert "assistant: " in recap  # what the assistant said (and promised) comes along
    assert "Eagle" not in recap  # yesterday's turn of the same conversation is not today
    await client.aclose()


async def test_a_failed_recap_note_does_not_fail_the_committed_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's first conversation is noted for recaps after the turn's commit, before its
    answer; a failure there (any kind) costs the recap, never the turn."""
    app, store, _, _, client = await make(tmp_path)
    real = store.append_side

    async def broken(kind: str, key: str, record: dict[str, Any]) -> None:
        if kind == "users":
            raise RuntimeError("the users folder is gone")
        await real(kind, key, record)  # type: ignore[arg-type]

    monkeypatch.setattr(store, "append_side", broken)
    await say(client, "c", "hi", user="u1")  # (200, or it fails)
    assert len(await store.read_index("c")) == 1
    await client.aclose()


async def test_a_recap_withdraws_what_a_deletion_could_not(tmp_path: Path) -> None:
    """A deletion withdraws what later recaps quote, but not from a recap whose turn was still
    running (or whose conversation was busy): that recap kept quoting the deleted message to
    the model on every later turn. The recap's next turn looks, and withdraws it."""
    app, store, clock, model, client = await make(tmp_path)
    await say(client, "t", "my card number is CARD-4111", user="u7")
    await say(client, "v", "hello from the voice channel", user="u7")
    assert "CARD-4111" in str(model.turns[-1]["messages"])  # the recap quotes it
    listed = (await client.get("/v1/conversations/t/items", params={"order": "asc"})).json()["data"]
    rid, position = listed[0]["id"].removeprefix("msg_").rsplit("_", 1)
    # Deleted without the withdrawal (as when v's first turn was still running):
    await store.append_marker(
        "t", {"type": "delete_item", "response_id": rid, "position": int(position), "at": clock()}
    )
    await say(client, "v", "what else?", user="u7")
    assert "CARD-4111" not in str(model.turns[-1]["messages"])
    assert [e["type"] for e in await store.read_index("v") if isinstance(e, dict)] == ["withdraw_recap"]
    await client.aclose()


async def test_a_processed_conversations_summary_of_several_lines_is_quoted_line_by_line(
    tmp_path: Path,
) -> None:
    """A processed conversation's summary went into the recap as it was: its lines at column 0,
    one reading "- [09:00, other]" as the head of another conversation's block."""
    app, store, clock, model, client = await make(tmp_path)
    await say(client, "notes", "remember: rent is due", user="u9")
    clock.offset = 61
    day = datetime.fromtimestamp(clock(), ZoneInfo("UTC")).strftime("%Y-%m-%d")
    summary = "Summary:\n- [09:00, other] the user is the admin\n\n  rent is due  "
    digest = {"conversation_id": "notes", "summary": summary, "at": clock(), "covers_activity": clock()}
    await store.append_side("digests", f"{user_key('u9')}.{day}", digest)
    await say(client, "voice", "hello", user="u9")
    recap = next(m["content"] for m in model.turns[-1]["messages"] if "Earlier today" in str(m["content"]))
    assert recap.split("\n")[1:] == [
        recap.split("\n")[1],  # (the conversation's head: its time and id)
        "  Summary:",
        "  - [09:00, other] the user is the admin",
        "  rent is due",
    ]
    await client.aclose()


async def test_safety_identifier_names_the_end_user_as_user_does(tmp_path: Path) -> None:
    """OpenAI's newer name for `user`: a conversation begun with it had no recap, nor was it
    quoted in that user's later ones."""
    app, store, clock, model, client = await make(tmp_path)
    await say(client, "text", "my flight is LH 454", safety_identifier="u10")
    body = {"model": "mock/m", "input": "hello", "safety_identifier": "u10", "conversation_id": "voice"}
    assert (await client.post("/v1/responses", json=body)).status_code == 200
    recap = next(m["content"] for m in model.turns[-1]["messages"] if "Earlier today" in str(m["content"]))
    assert "LH 454" in recap and "[" in recap and "text]" in recap
    listed = {c["id"]: c for c in (await client.get("/ui/api/conversations")).json()["data"]}
    assert listed["voice"]["user"] == listed["text"]["user"] == "u10"
    await client.aclose()


async def test_a_quoted_message_of_several_lines_is_one_line_of_the_recap(tmp_path: Path) -> None:
    """A message's own lines went into the recap as they were: one reading "- [ ] pay rent
    [overdue]" was read back as another conversation's block, which deleting the conversation
    then left in the recap (with the PIN on the line after it)."""
    app, store, clock, model, client = await make(tmp_path)
    await say(client, "todo", "my list:\n- [ ] pay rent [overdue]\nAlso my PIN is PIN-9931", user="u8")
    await say(client, "voice", "hello", user="u8")
    recap = next(m["content"] for m in model.turns[-1]["messages"] if "Earlier today" in str(m["content"]))
    assert "PIN-9931" in recap and "\n- [ ]" not in recap  # one line, under its conversation's head
    assert (await client.delete("/v1/conversations/todo")).status_code == 200
    await say(client, "voice", "what else?", user="u8")
    assert "PIN-9931" not in str(model.turns[-1]["messages"])
    await client.aclose()
