"""Cuts in steps through the whole app: what the provider receives keeps its head from turn to
turn, also after a restart (the head is read back from the response logs), and is cut again
after a deletion of the message the head began with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings
from tests.helpers import say_each

CID = "steps"


def settings(tmp_path: Path) -> Any:
    base = make_settings(tmp_path)
    context = {"max_context_tokens": 1000, "reserve_tokens": 40, "cut_to": 0.6}
    return base.model_copy(update={"context": base.context.model_copy(update=context)})


def texts(start: int, n: int) -> list[str]:
    return [f"message {i}: " + " ".join(f"w{i}x{j}" for j in range(12)) for i in range(start, start + n)]


def heads(requests: list[dict[str, Any]]) -> list[bool]:
    """Per request after the first: did it begin with the whole previous prompt?"""
    prompts = [r["messages"] for r in requests]
    return [after[: len(before)] == before for before, after in zip(prompts, prompts[1:], strict=False)]


async def test_the_prompt_keeps_its_head_between_cuts_and_across_a_restart(tmp_path: Path) -> None:
    upstream = MockUpstream()
    async with build_client(settings(tmp_path), None, upstream) as client:
        await say_each(client, CID, texts(0, 24))
    held = heads(upstream.requests)
    cuts = held.count(False)
    assert 2 <= cuts <= 6, held  # a cut every few turns, not one per turn
    assert held[-3:].count(True) >= 1
    # A new process (a new cache): the head is read back from the logs and held.
    again = MockUpstream()
    async with build_client(settings(tmp_path), None, again) as client:
        await say_each(client, CID, texts(24, 1))
    # The last turn before the restart was a cut (low water): the next one holds its head.
    assert held[-1] is False, held
    last = upstream.requests[-1]["messages"]
    assert again.requests[0]["messages"][: len(last)] == last


async def test_deleting_the_message_the_head_begins_with_makes_the_next_turn_a_cut(tmp_path: Path) -> None:
    upstream = MockUpstream()
    async with build_client(settings(tmp_path), None, upstream) as client:
        ids = await say_each(client, CID, texts(0, 16))
        context = (await client.get(f"/v1/conversations/{CID}/context")).json()
        first = context["window_from"]
        assert first is not None  # the window was cut: its head begins with a stored message
        rid, _, position = first.rpartition("#")
        assert rid in ids
        r = await client.delete(f"/v1/conversations/{CID}/items/{rid}:{position}")
        if r.status_code == 404:  # (item ids may be spelled otherwise: find it in the list)
            items = (await client.get(f"/v1/conversations/{CID}/items?limit=100&order=asc")).json()["data"]
            item = next(i for i in items if rid in i["id"])
            r = await client.delete(f"/v1/conversations/{CID}/items/{item['id']}")
        assert r.status_code == 200, r.text
        await say_each(client, CID, texts(16, 1))
        after = (await client.get(f"/v1/conversations/{CID}/context")).json()
    assert after["cut"] is True and after["window_from"] != first


async def test_a_long_chat_moved_in_one_first_request_keeps_its_cut_head_next_turn(tmp_path: Path) -> None:
    """A new conversation's first request carrying a long chat was cut inside its own messages,
    but the head was not recorded (`window_from` null, "from the conversation's first message"):
    the next turn, which fitted, was cut again and missed the provider's cache."""
    upstream = MockUpstream()
    history: list[dict[str, Any]] = []
    for i, text in enumerate(texts(0, 40)):
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": f"noted {i}"}]
    body = {
        "model": "mock/m",
        "conversation_id": "moved",
        "messages": [*history, {"role": "user", "content": "go"}],
    }
    async with build_client(settings(tmp_path), None, upstream) as client:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        first = (await client.get("/v1/conversations/moved/context")).json()
        await say_each(client, "moved", texts(40, 2))
        after = (await client.get("/v1/conversations/moved/context")).json()
    assert first["cut"] is True and first["window_from"] is not None
    assert heads(upstream.requests) == [True, True]  # each later prompt begins with the one before
    assert after["window_from"] == first["window_from"]


async def test_the_manifests_cut_says_whether_the_head_moved_after_a_reset_and_with_keep_first(
    tmp_path: Path,
) -> None:
    """After a reset the head of the prompt changed, yet `cut` said false; with `keep_first` the
    second turn's prompt began with the whole first one, yet `cut` said true."""
    base = settings(tmp_path)
    kept = base.model_copy(update={"context": base.context.model_copy(update={"keep_first": True})})
    upstream = MockUpstream()
    async with build_client(kept, None, upstream) as client:
        cuts = []
        for text in texts(0, 3):
            await say_each(client, "kf", [text])
            cuts.append((await client.get("/v1/conversations/kf/context")).json()["cut"])
        assert heads(upstream.requests) == [True, True] and cuts == [False, False, False]
        await say_each(client, CID, texts(0, 16))
        assert (await client.post(f"/v1/conversations/{CID}/reset", json={})).status_code == 200
        after = []
        for text in texts(16, 2):
            await say_each(client, CID, [text])
            after.append((await client.get(f"/v1/conversations/{CID}/context")).json()["cut"])
    assert after == [True, False]  # the reset's next turn began afresh; the one after it held


async def test_a_new_system_prompt_is_said_to_move_the_head(tmp_path: Path) -> None:
    """The prompt's first message changed and the manifest said `cut: false` (the head held): the
    provider's cache served none of it."""
    upstream = MockUpstream()
    async with build_client(settings(tmp_path), None, upstream) as client:
        cuts = []
        for system in ("be brief", "be brief", "be very brief", "be very brief"):
            body = {
                "model": "mock/m",
                "conversation_id": CID,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hello"}],
            }
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            cuts.append((await client.get(f"/v1/conversations/{CID}/context")).json()["cut"])
    assert cuts == [False, False, True, False]
