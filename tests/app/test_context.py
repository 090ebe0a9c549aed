"""The context window through the whole turn: long conversations, summaries, the manifest."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import tiktoken

from gateway.config import ModelSettings
from gateway.store.jsonl import JsonlStore
from gateway.store.memory import MemoryStore
from gateway.tokens import bundled_tiktoken_dir
from gateway.upstream.demo import demo_reply
from gateway.upstream.mock import MockUpstream
from tests.conftest import REPO, app_of, build_client, make_settings
from tests.helpers import assert_openai_tool_order, say_each

os.environ.setdefault("TIKTOKEN_CACHE_DIR", bundled_tiktoken_dir() or "")
ENC = tiktoken.get_encoding("cl100k_base")
WINDOW = 4096
BUDGET = WINDOW - WINDOW // 4  # reserve_tokens (4500) is capped at a quarter of a small window


def independent_count(messages: list[dict[str, Any]]) -> int:
    """The mock upstream's own count (OpenAI's chat framing), not the gateway's code."""
    total = 3
    for m in messages:
        total += 3
        for value in m.values():
            if value is None:
                continue
            total += len(
                ENC.encode(value if isinstance(value, str) else json.dumps(value, separators=(",", ":")))
            )
    return total


_FACTS = re.compile(r"\bmy ([a-z]+) is ([A-Za-z]+)", re.IGNORECASE)


class Model:
    """Mock model + mock summarizer; checks every request it receives against the window."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.calls = 0

    def __call__(self, body: dict[str, Any]) -> Any:
        messages = body["messages"]
        first = str(messages[0].get("content") or "")
        if first.startswith("You maintain the running summary"):
            facts = dict((k.lower(), v) for k, v in _FACTS.findall(messages[-1]["content"]))
            return " ".join(f"The user said my {k} is {v}." for k, v in facts.items()) or "Nothing notable."
        self.sizes.append(independent_count(messages))
        assert messages[0] == {"role": "system", "content": "You are terse."}
        assert_openai_tool_order(messages)
        last = messages[-1]
        if last["role"] == "user" and "weather" in str(last["content"]):
            self.calls += 1
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"call_{self.calls}",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            }
        if last["role"] == "tool":
            return f"Weather report: {last['content']}"
        return demo_reply(messages)


FILLER = "this is an ordinary turn with some words to take up room in the context window " * 2


async def run_long_conversation(
    strategy: str, turns: int, tmp_path: Path
) -> tuple[Model, list[httpx.Response], Any]:
    settings = make_settings(tmp_path, durability="none")
    settings = settings.model_copy(
        update={
            "models": {"mock/m": ModelSettings(context_window=WINDOW)},
            "context": settings.context.model_copy(
                update={"strategy": strategy, "summary_model": "mock/summ"}
            ),
        }
    )
    store = JsonlStore(tmp_path / "var", durability="none")
    await store.open()
    model = Model()
    answers = []
    async with build_client(settings, store, MockUpstream(model)) as client:

        async def say(messages: list[dict[str, Any]]) -> httpx.Response:
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "mock/m", "messages": messages, "conversation_id": "long"},
            )
            assert r.status_code == 200, r.text
            await app_of(client).state.summarizer.wait_idle()
            return r

        await say(
            [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello " + FILLER}]
        )
        for i in range(1, turns - 1):
            if i == 3:
                text = "By the way, my name is Bob."
            elif i == turns - 5:
                text = "Also my colour is green."
            elif i % 10 == 0:
                text = "what is the weather?"
            else:
                text = f"turn {i}: {FILLER}"
            r = await say([{"role": "user", "content": text}])
            message = r.json()["choices"][0]["message"]
            if message.get("tool_calls"):
                await say(
                    [
                        {
                            "role": "tool",
                            "tool_call_id": message["tool_calls"][0]["id"],
                            "content": "sunny, 21C",
                        }
                    ]
                )
        answers.append(await say([{"role": "user", "content": "what is my colour?"}]))
        answers.append(await say([{"role": "user", "content": "what is my name?"}]))
    return model, answers, store


async def test_three_hundred_turns_in_a_4k_window_truncate(tmp_path: Path) -> None:
    """300 turns (about 11 times what the window holds) behave as 1,000 did: the window stays
    within its budget and what fell out of it is gone."""
    model, answers, store = await run_long_conversation("truncate", 300, tmp_path)
    assert len(model.sizes) > 300
    assert max(model.sizes) <= BUDGET <= WINDOW
    colour, name = (a.json()["choices"][0]["message"]["content"] for a in answers)
    assert colour == "Your colour is green."
    assert name == "I don't know your name yet."  # turn 3 fell out of the window, as it should
    rid = answers[-1].json()["id"]
    context = next(r for r in await store.read_response(rid) if r["type"] == "context")
    assert context["truncated"] > context["stored_messages"] * 3 // 4 and context["tokens"]["total"] <= BUDGET
    assert context["messages"][1]["content"] == f"[{context['truncated']} earlier messages omitted]"
    assert context["budget"] == BUDGET and context["context_window"] == WINDOW
    assert context["included_response_ids"][-1] == answers[0].json()["id"]


async def test_summary_recalls_turn_3_at_turn_300(tmp_path: Path) -> None:
    model, answers, store = await run_long_conversation("summarize", 300, tmp_path)
    assert max(model.sizes) <= BUDGET
    colour, name = (a.json()["choices"][0]["message"]["content"] for a in answers)
    assert colour == "Your colour is green."
    assert name == "Your name is Bob."
    summaries = await store.read_side("summaries", "long")
    versions = [s for s in summaries if s["type"] == "summary"]
    assert versions and [s["version"] for s in versions] == list(range(1, len(versions) + 1))
    # Coverage is contiguous: every turn is covered exactly once, oldest first, no gaps.
    covered = [rid for s in versions for rid in s["covered_response_ids"]]
    index = [e for e in await store.read_index("long") if isinstance(e, str)]
    assert covered == index[: len(covered)]
    rid = answers[-1].json()["id"]
    context = next(r for r in await store.read_response(rid) if r["type"] == "context")
    # The newest version at the time (the last turn may have asked for one more).
    used = next(s for s in versions if s["version"] == context["summary_version"])
    assert context["summary_version"] >= versions[-1]["version"] - 1
    assert context["summary_covers_through"] == used["covers_through"]
    assert context["messages"][1]["content"].startswith("Summary of the earlier conversation")
    assert all(s["tokens"] <= 500 for s in versions)


async def test_request_too_big_is_400_before_upstream(tmp_path: Path) -> None:
    upstream = MockUpstream()
    settings = make_settings()
    settings = settings.model_copy(
        update={"context": settings.context.model_copy(update={"max_context_tokens": 1000})}
    )
    async with build_client(settings, MemoryStore(), upstream) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": "mock/m",
                "messages": [{"role": "user", "content": "word " * 1200}],
                "conversation_id": "big",
            },
        )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert upstream.requests == []


async def test_a_request_that_fits_only_beside_half_the_answer_reserve_is_sent() -> None:
    """The reserve for the answer (a quarter of a 1000-token window here) is the gateway's own:
    a request of about 800 tokens was refused with a conversation, and sent without one. A
    client's own max_tokens is kept: then it is refused."""
    upstream = MockUpstream()
    settings = make_settings()
    settings = settings.model_copy(
        update={"context": settings.context.model_copy(update={"max_context_tokens": 1000})}
    )
    body = {
        "model": "mock/m",
        "messages": [{"role": "user", "content": "word " * 800}],
        "conversation_id": "big",
    }
    async with build_client(settings, MemoryStore(), upstream) as client:
        sent = await client.post("/v1/chat/completions", json=body)
        context = (await client.get("/v1/conversations/big/context")).json()
        asked = await client.post(
            "/v1/chat/completions", json={**body, "conversation_id": "b2", "max_tokens": 250}
        )
        again = await client.post(
            "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]}
        )
    assert sent.status_code == 200, sent.text
    assert context["reserve_tokens"] == 125 and context["tokens"]["total"] <= 875
    assert asked.status_code == 400 and asked.json()["error"]["code"] == "context_length_exceeded"
    assert again.status_code == 200  # the conversation goes on, with the usual reserve
    assert len(upstream.requests) == 2


async def test_max_tokens_in_request_enlarges_reserve(tmp_path: Path) -> None:
    upstream = MockUpstream()
    settings = make_settings()
    settings = settings.model_copy(
        update={
            "context": settings.context.model_copy(update={"max_context_tokens": 2000, "reserve_tokens": 100})
        }
    )
    store = MemoryStore()
    async with build_client(settings, store, upstream) as client:
        for _ in range(30):
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "mock/m",
                    "messages": [{"role": "user", "content": "word " * 60}],
                    "max_tokens": 1500,
                    "conversation_id": "mt",
                },
            )
    context = next(x for x in store.responses[r.json()["id"]] if x["type"] == "context")
    assert context["reserve_tokens"] == 1500 and context["budget"] == 500
    assert context["tokens"]["total"] <= 500 and context["truncated"] > 0


async def test_upstream_truncation_is_flagged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def lying(body: dict[str, Any]) -> Any:
        return {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101},
        }

    store = MemoryStore()
    async with build_client(make_settings(), store, MockUpstream(lying)) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": "mock/m",
                "messages": [{"role": "user", "content": "word " * 1000}],
                "conversation_id": "t",
            },
        )
    response = next(x for x in store.responses[r.json()["id"]] if x["type"] == "response")
    assert response["upstream_truncation_suspected"]["prompt_tokens"] == 100
    assert response["upstream_truncation_suspected"]["our_count"] > 1000
    assert "upstream_truncation_suspected" in caplog.text


@pytest.mark.parametrize("cache_dir", ["unset", "empty"])
def test_token_counting_works_offline(tmp_path: Path, cache_dir: str) -> None:
    """tiktoken must not download anything: the network is cut inside the child process. A
    TIKTOKEN_CACHE_DIR of the user's own (without these files) made every turn a 503 offline."""
    code = (
        "import socket\n"
        "def refuse(*a, **k): raise OSError('network is off')\n"
        "socket.socket.connect = refuse\nsocket.create_connection = refuse\nsocket.getaddrinfo = refuse\n"
        "from gateway.tokens import count_text, count_message\n"
        "print(count_text('hello world', 'gpt-4o'), count_text('hello world', 'ollama/llama3'), "
        "count_message({'role': 'user', 'content': 'hi'}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    if cache_dir == "empty":
        env["TIKTOKEN_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "2", "5"]


async def test_context_endpoint_returns_latest_snapshot(tmp_path: Path) -> None:
    store = MemoryStore()
    async with build_client(make_settings(), store, MockUpstream()) as client:
        assert (await client.get("/v1/conversations/none/context")).status_code == 404
        assert (await client.get("/v1/conversations/..%2fx/context")).status_code in (400, 404)
        ids = []
        for text in ["my name is Al", "what is my name?"]:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "mock/m",
                    "messages": [{"role": "user", "content": text}],
                    "conversation_id": "ctx",
                },
            )
            ids.append(r.json()["id"])
        r = await client.get("/v1/conversations/ctx/context")
    body = r.json()
    assert r.status_code == 200 and body["response_id"] == ids[-1]
    assert body["sent_messages"] == 3 and body["included_response_ids"] == [ids[0]]
    assert [m["content"] for m in body["messages"]][-1] == "what is my name?"
    assert body["tokens"]["total"] == sum(v for k, v in body["tokens"].items() if k != "total")


async def test_truncation_warning_once_per_conversation_and_cache_hits_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    usage: dict[str, Any] = {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101}

    def reply(body: dict[str, Any]) -> Any:
        return {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "m",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
            ],
            "usage": dict(usage),
        }

    store = MemoryStore()
    ids = []
    async with build_client(make_settings(), store, MockUpstream(reply)) as client:

        async def say(cid: str) -> None:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "mock/m",
                    "messages": [{"role": "user", "content": "word " * 400}],
                    "conversation_id": cid,
                },
            )
            ids.append(r.json()["id"])

        for _ in range(3):
            await say("w")
        # prompt_tokens already includes cached tokens (OpenAI, llama.cpp): 100 is still a cut prompt.
        usage["prompt_tokens_details"] = {"cached_tokens": 90}
        await say("w")
        # Before any calibration the threshold is half our count (408 here): 210 is not a cut,
        # 190 is (a provider may just count fewer tokens than we do).
        usage["prompt_tokens"] = 210
        await say("a")
        usage["prompt_tokens"] = 190
        await say("b")
    flagged = [
        any(x.get("upstream_truncation_suspected") for x in store.responses[i] if x["type"] == "response")
        for i in ids
    ]
    ours = [next(x for x in store.responses[i] if x["type"] == "context")["tokens"]["total"] for i in ids[4:]]
    assert ours == [408, 408]
    assert flagged == [True, True, True, True, False, True]
    assert caplog.text.count("upstream_truncation_suspected") == 2  # once per conversation


@pytest.mark.parametrize("stored", [0, 2])
async def test_a_long_history_sent_at_once_is_cut_like_a_stored_one(stored: int) -> None:
    """A client moving a long chat onto the gateway sends it whole in one request (or edits an
    early message, which makes everything after it new): what it sent before its newest user
    message is cut oldest first with the marker, as stored history is, instead of a 400. The
    newest user message alone too big is still a 400 (`test_request_too_big_is_400_before_upstream`)."""
    upstream = MockUpstream()
    settings = make_settings()
    settings = settings.model_copy(
        update={"context": settings.context.model_copy(update={"max_context_tokens": 1000})}
    )
    pairs = [
        [
            {"role": "user", "content": f"question {i}: " + "word " * 40},
            {"role": "assistant", "content": f"answer {i}"},
        ]
        for i in range(60)
    ]
    history = [m for pair in pairs for m in pair]
    async with build_client(settings, MemoryStore(), upstream) as client:
        for k in range(stored):  # a stored beginning, resent and then edited after it
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "mock/m", "messages": history[: 2 * k + 1], "conversation_id": "moved"},
            )
            assert r.status_code == 200, r.text
        sent = [*history, {"role": "user", "content": "and the newest question?"}]
        if stored:
            sent[2 * stored + 1] = {"role": "assistant", "content": "an edited answer"}
        r = await client.post(
            "/v1/chat/completions", json={"model": "mock/m", "messages": sent, "conversation_id": "moved"}
        )
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        body = upstream.requests[-1]["messages"]
        assert body[-1] == {"role": "user", "content": "and the newest question?"}
        assert body[-2] == {"role": "assistant", "content": "answer 59"}  # the answer before it
        assert re.fullmatch(r"\[\d+ earlier messages omitted\]", str(body[0]["content"]))
        assert len(body) < len(sent)
        context = (await client.get("/v1/conversations/moved/context")).json()
        assert context["truncated"] > 0
        # All of it is stored: the next turn sees the same conversation, cut the same way.
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": "mock/m",
                "messages": [{"role": "user", "content": "next"}],
                "conversation_id": "moved",
            },
        )
        assert r.status_code == 200, r.text
        assert upstream.requests[-1]["messages"][-3:] == [
            body[-1],
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "next"},
        ]


async def test_keep_first_holds_on_the_turn_that_moves_a_chat_in() -> None:
    """With `keep_first`, the conversation's first message is kept ahead of the cut on the turn
    that brings a long chat in one request, as on every later turn."""
    upstream = MockUpstream()
    settings = make_settings()
    settings = settings.model_copy(
        update={
            "context": settings.context.model_copy(update={"max_context_tokens": 1000, "keep_first": True})
        }
    )
    first = {"role": "user", "content": "INSTRUCTIONS: answer in French."}
    rest = []
    for i in range(40):
        rest += [
            {"role": "user", "content": f"question {i}: " + "word " * 40},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    sent = [first, {"role": "assistant", "content": "d'accord"}, *rest, {"role": "user", "content": "last?"}]
    async with build_client(settings, MemoryStore(), upstream) as client:
        for messages in (sent, [{"role": "user", "content": "next"}]):
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "mock/m", "messages": messages, "conversation_id": "kf"},
            )
            assert r.status_code == 200, r.text
            body = upstream.requests[-1]["messages"]
            assert body[0] == first, body[:2]
            assert re.fullmatch(r"\[\d+ earlier messages omitted\]", str(body[1]["content"]))
        # Turn by turn, the window moves past the turns after the first: the response that
        # stored the first message is still among those whose messages were sent.
        ids = [(await client.get("/v1/conversations/kf/context")).json()["included_response_ids"][0]]
        for i in range(12):
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "mock/m", "messages": [{"role": "user", "content": f"q{i} " + "word " * 60}],
                      "conversation_id": "kf"},
            )  # fmt: skip
            ids.append(r.json()["id"])
        context = (await client.get("/v1/conversations/kf/context")).json()
        assert upstream.requests[-1]["messages"][0] == first
        assert context["included_response_ids"][0] == ids[0], context["included_response_ids"]
        assert ids[1] not in context["included_response_ids"]  # (cut past it)


async def test_a_summary_left_out_for_lack_of_room_is_not_claimed() -> None:
    """A summary too big for the room a long request left was dropped, yet the manifest named
    its version and the marker counted only what the summary did not cover."""
    settings = make_settings()
    context = {"strategy": "summarize", "max_history_messages": 4, "max_context_tokens": 1000}
    settings = settings.model_copy(update={"context": settings.context.model_copy(update=context)})
    store = MemoryStore()
    async with build_client(settings, store, MockUpstream()) as client:
        await say_each(client, "s", [f"my fact number {n} is {n * 7}" for n in range(6)])
        for n in range(6):  # a summary enters at a cut: the turn with one sent
            await app_of(client).state.summarizer.wait_idle()
            (summarized,) = await say_each(client, "s", [f"and one more, {n}"])
            sent = next(r for r in store.responses[summarized] if r["type"] == "context")
            if sent["summary_version"]:
                break
        (crowded,) = await say_each(client, "s", ["word " * 700])  # leaves under 72 tokens free
    assert sent["summary_version"] and sent["tokens"]["summary"] > 0  # (a summary to leave out)
    left_out = next(r for r in store.responses[crowded] if r["type"] == "context")
    assert left_out["tokens"]["summary"] == 0
    assert left_out["summary_version"] is None and left_out["summary_covers_messages"] == 0
    kept = sum(1 for m in left_out["messages"] if m["role"] in ("user", "assistant")) - 1  # less the new one
    assert left_out["truncated"] == left_out["stored_messages"] - kept
    assert f"[{left_out['truncated']} earlier messages omitted]" in str(left_out["messages"])


async def test_the_context_endpoint_says_what_the_providers_cache_served() -> None:
    """The CLI said it (`show`, `context`), GET /v1/conversations/{id}/context did not."""
    from gateway.upstream.base import completion_from_text

    def cached(body: dict[str, Any]) -> Any:
        completion = completion_from_text("m", "ok", prompt_tokens=1100)
        completion["usage"]["prompt_tokens_details"] = {"cached_tokens": 1024}
        return completion

    async with build_client(make_settings(), MemoryStore(), MockUpstream(cached)) as client:
        body = {"model": "mock/m", "conversation_id": "k", "messages": [{"role": "user", "content": "hi"}]}
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        context = (await client.get("/v1/conversations/k/context")).json()
    assert context["cache"] == {"prompt_tokens": 1100, "cached_tokens": 1024, "source": "usage"}
