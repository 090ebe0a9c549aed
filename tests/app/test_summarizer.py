"""The rolling-summary job: retries with backoff, `summary_failed` records, giving up, and a
summarizer model that fails for real (through the service, on the store twin)."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.exceptions import UpstreamUnreachable
from gateway.jobs.summarizer import MAX_ATTEMPTS, Summarizer
from gateway.store.memory import MemoryStore
from gateway.upstream.demo import demo_reply
from gateway.upstream.mock import MockUpstream
from tests.conftest import app_of, build_client, make_settings
from tests.helpers import say_each


class FlakySummaries:
    """The service's side of a fold, failing its first `failures` attempts."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.folds: list[tuple[str, str, str, str]] = []
        self.recorded: list[tuple[str, int, str]] = []

    def model_for(self, model: str) -> str:
        return f"summarizer-for-{model}"

    async def fold(self, tenant: str, cid: str, target: str, model: str) -> None:
        self.folds.append((tenant, cid, target, model))
        if len(self.folds) <= self.failures:
            raise UpstreamUnreachable(f"attempt {len(self.folds)}: provider unreachable")

    async def record_failure(self, tenant: str, cid: str, attempt: int, message: str) -> None:
        self.recorded.append((cid, attempt, message))


def job(summaries: FlakySummaries) -> tuple[Summarizer, list[float], list[str]]:
    delays: list[float] = []
    outcomes: list[str] = []

    async def sleep(seconds: float) -> None:
        delays.append(seconds)

    summarizer = Summarizer(summaries, sleep=sleep)  # type: ignore[arg-type]
    summarizer.on_outcome = outcomes.append
    return summarizer, delays, outcomes


async def test_failures_are_recorded_and_retried_with_backoff_until_one_succeeds() -> None:
    summaries = FlakySummaries(failures=2)
    summarizer, delays, outcomes = job(summaries)
    summarizer.schedule("", "c", "resp-7", "m")
    await summarizer.wait_idle()
    assert summaries.folds == [("", "c", "resp-7", "summarizer-for-m")] * 3
    assert [(cid, attempt) for cid, attempt, _ in summaries.recorded] == [("c", 1), ("c", 2)]
    assert "attempt 2: provider unreachable" in summaries.recorded[1][2]
    assert delays == [1.0, 2.0]
    assert outcomes == ["failed", "failed"]  # (versions written are counted by Summaries.on_version)
    assert summarizer.failures == {}  # a success clears the count


async def test_after_max_attempts_it_gives_up_until_asked_again() -> None:
    summaries = FlakySummaries(failures=100)
    summarizer, delays, outcomes = job(summaries)
    summarizer.schedule("", "c", "resp-7", "m")
    await summarizer.wait_idle()
    assert len(summaries.folds) == MAX_ATTEMPTS
    assert [attempt for _, attempt, _ in summaries.recorded] == list(range(1, MAX_ATTEMPTS + 1))
    assert delays == [1.0, 2.0, 4.0, 8.0]  # none after the last attempt
    assert outcomes == ["failed"] * MAX_ATTEMPTS and summarizer.failures == {("", "c"): MAX_ATTEMPTS}
    summarizer.schedule("", "c", "resp-9", "m")  # the next truncation asks again
    await summarizer.wait_idle()
    assert len(summaries.folds) == 2 * MAX_ATTEMPTS and summaries.folds[-1][2] == "resp-9"


async def test_a_newer_target_arriving_during_a_fold_is_folded_next() -> None:
    summaries = FlakySummaries(failures=0)
    summarizer, _, _ = job(summaries)
    started = asyncio.Event()
    release = asyncio.Event()
    original = summaries.fold

    async def slow_fold(*args: Any) -> None:
        started.set()
        await release.wait()
        await original(*args)

    summaries.fold = slow_fold  # type: ignore[method-assign]
    summarizer.schedule("", "c", "resp-1", "m")
    await started.wait()
    summarizer.schedule("", "c", "resp-2", "m")  # same task, newer target
    release.set()
    await summarizer.wait_idle()
    assert [target for _, _, target, _ in summaries.folds] == ["resp-1", "resp-2"]


def summarizing() -> Any:
    """Settings of an app that summarizes once four history messages are exceeded."""
    settings = make_settings()
    context = settings.context.model_copy(
        update={"strategy": "summarize", "max_history_messages": 4, "keep_recent_messages": 2}
    )
    return settings.model_copy(update={"context": context})


async def test_a_failing_summarizer_model_leaves_summary_failed_records_and_truncation() -> None:
    """Through the app: the summarizer model is down; turns still succeed (truncated), and the
    conversation's summary log says why no summary exists."""
    down = True

    def model(body: dict[str, Any]) -> str:
        if str(body["messages"][0].get("content", "")).startswith("You maintain the running summary"):
            if down:
                raise UpstreamUnreachable("Provider 'mock' at mock://upstream is unreachable")
            return "They talked about numbers."
        return demo_reply(body["messages"])

    store = MemoryStore()
    settings = summarizing()
    delays: list[float] = []

    async def no_wait(seconds: float) -> None:
        delays.append(seconds)

    async with build_client(settings, store, MockUpstream(model)) as client:
        app = app_of(client)
        app.state.summarizer.sleep = no_wait
        for n in range(6):
            body = {
                "model": "mock/m",
                "conversation_id": "sum",
                "messages": [{"role": "user", "content": f"n{n}"}],
            }
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
        await app_of(client).state.summarizer.wait_idle()
        failed = [r for r in await store.read_side("summaries", "sum") if r["type"] == "summary_failed"]
        assert failed and failed[0]["attempt"] == 1 and "unreachable" in failed[0]["error"]
        assert not [r for r in await store.read_side("summaries", "sum") if r["type"] == "summary"]
        assert delays  # it retried
        down = False
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": "mock/m",
                "conversation_id": "sum",
                "messages": [{"role": "user", "content": "n6"}],
            },
        )
        assert r.status_code == 200
        await app_of(client).state.summarizer.wait_idle()
        summaries = [r for r in await store.read_side("summaries", "sum") if r["type"] == "summary"]
        assert summaries and summaries[-1]["text"] == "They talked about numbers."


async def test_the_metric_counts_summary_versions_written_rolling_and_post_processing() -> None:
    """`gateway_summaries_total{outcome="ok"}` counts versions written: rolling ones (a fold of a
    turn larger than one call writes one version), and post-processing's, which went uncounted."""
    store = MemoryStore()
    settings = summarizing()

    def versions() -> int:
        return len([r for r in store.summaries.get("sum", []) if r.get("type") == "summary"])

    def counted(text: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith('gateway_summaries_total{outcome="ok"}'))
        return float(line.split()[-1])

    async with build_client(settings, store, MockUpstream()) as client:
        await say_each(client, "sum", [f"n{n}" for n in range(6)])  # (each answered 200)
        await app_of(client).state.summarizer.wait_idle()
        rolling = versions()
        assert rolling >= 1 and counted((await client.get("/metrics")).text) == rolling
        summaries = app_of(client).state.processor.sessions.summaries
        await summaries.summarize_all("", "sum", "mock/m")  # post-processing folds the rest
        assert versions() > rolling and counted((await client.get("/metrics")).text) == versions()


async def test_a_conversation_back_after_post_processing_keeps_its_newest_turns_at_the_cut() -> None:
    """Post-processing's summary covers the whole conversation: at the first cut after it, the
    window began where it ended, and the model got the summary and the new message alone (not
    even the answer before it), where a cut keeps its low water of newest turns."""
    upstream = MockUpstream()
    settings = make_settings()
    context = {"strategy": "summarize", "max_context_tokens": 700, "reserve_tokens": 100, "cut_to": 0.6}
    settings = settings.model_copy(update={"context": settings.context.model_copy(update=context)})
    store = MemoryStore()
    facts = [f"fact {i}: box {i} is shade-{i * 7}, please remember it" for i in range(40)]
    async with build_client(settings, store, upstream) as client:
        summaries = app_of(client).state.processor.sessions.summaries
        said = 0
        while said < len(facts):  # until the window is nearly full, short of a cut
            await say_each(client, "back", [facts[said]])
            said += 1
            snapshot = (await client.get("/v1/conversations/back/context")).json()
            if snapshot["tokens"]["total"] > 0.85 * snapshot["budget"]:
                break
        await app_of(client).state.summarizer.wait_idle()
        await summaries.summarize_all("", "back", "mock/m")  # idle: post-processing folds it all
        for fact in facts[said : said + 6]:
            await say_each(client, "back", [fact])
            snapshot = (await client.get("/v1/conversations/back/context")).json()
            if snapshot["cut"]:
                break
        await say_each(client, "back", ["and one more"])  # the next turn holds that head
        after = (await client.get("/v1/conversations/back/context")).json()
    assert snapshot["cut"], snapshot
    sent = upstream.requests[-2]["messages"]
    assert after["cut"] is False and upstream.requests[-1]["messages"][: len(sent)] == sent
    assert sent[0]["content"].startswith("Summary of the earlier conversation")
    kept = [m for m in sent if m["role"] in ("user", "assistant")]
    assert len(kept) >= 5, [m["content"][:20] for m in sent]  # the newest turns, not the new message alone
    assert kept[-3]["role"] == "user" and kept[-2]["role"] == "assistant"  # the answer before it
    assert snapshot["truncated"] == 0  # what the window left out, the summary covers
    assert "omitted" not in str(sent)


async def test_an_edit_after_the_head_has_the_next_cuts_summary_asked_again() -> None:
    """The summary asked for once per head covered a turn the edit then abandoned: it could not
    apply, nothing was asked again, and the next cut left 8 messages in neither the summary nor
    the window."""
    settings = make_settings()
    context = {"strategy": "summarize", "max_history_messages": 12, "keep_recent_messages": 2, "cut_to": 0.5}
    settings = settings.model_copy(update={"context": settings.context.model_copy(update=context)})
    async with build_client(settings, MemoryStore(), MockUpstream()) as client:
        transcript: list[dict[str, Any]] = []

        async def turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
            body = {"model": "mock/m", "conversation_id": "e", "messages": messages}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            transcript.append(r.json()["choices"][0]["message"])
            await app_of(client).state.summarizer.wait_idle()  # (the summary ready at each cut)
            return dict((await client.get("/v1/conversations/e/context")).json())

        cuts = 0
        for i in range(13):  # two cuts (turns 7 and 10: the head at turn 6), then turns 11 and 12
            transcript.append({"role": "user", "content": f"turn {i}"})
            cuts += (await turn(transcript))["cut"]
        assert cuts == 2
        # Turn 7 edited: after the head, inside what the summary for the next cut covers.
        del transcript[2 * 7 :]
        transcript.append({"role": "user", "content": "turn 7, edited"})
        snapshots = [await turn(transcript)]
        for i in range(13, 22):
            transcript.append({"role": "user", "content": f"turn {i}"})
            snapshots.append(await turn(transcript))
    assert any(s["cut"] for s in snapshots)
    assert [s["truncated"] for s in snapshots] == [0] * len(snapshots)


async def test_a_summary_ready_after_its_cut_enters_at_once_rather_than_at_the_next_cut() -> None:
    """A cut that came before its summary was ready (the summarizer slow, an edit, a request of
    many messages) left messages in neither the summary nor the window until the following
    cut, turns later; a cut now lets the summary in as soon as it is ready."""
    settings = make_settings()
    context = {"strategy": "summarize", "max_history_messages": 12, "keep_recent_messages": 2, "cut_to": 0.5}
    settings = settings.model_copy(update={"context": settings.context.model_copy(update=context)})
    ready = asyncio.Event()

    class SlowSummaries(MockUpstream):
        async def complete(self, body: dict[str, Any], *, waited: float = 0.0) -> Any:  # type: ignore[override]
            if str(body["messages"][0].get("content")).startswith("You maintain the running summary"):
                await ready.wait()
            return await super().complete(body, waited=waited)

    async with build_client(settings, MemoryStore(), SlowSummaries()) as client:
        snapshots = []
        for i in range(12):
            await say_each(client, "slow", [f"turn {i}"])
            snapshots.append((await client.get("/v1/conversations/slow/context")).json())
            if snapshots[-1]["cut"]:
                break
        assert snapshots[-1]["cut"] and snapshots[-1]["truncated"] > 0  # (no summary yet: a gap)
        ready.set()
        await app_of(client).state.summarizer.wait_idle()
        await say_each(client, "slow", ["and now?"])
        after = (await client.get("/v1/conversations/slow/context")).json()
    assert after["cut"] and after["summary_version"] is not None and after["truncated"] == 0


async def test_after_an_edit_at_the_head_a_summary_of_the_gap_is_asked_at_once() -> None:
    """An edit at the window's head makes a cut no summary was asked for: the messages it left
    in neither the summary nor the window waited for the next cut's summary, asked only once
    the window held what that cut drops (three turns here)."""
    settings = make_settings()
    context = {"strategy": "summarize", "max_history_messages": 8, "cut_to": 0.6}
    settings = settings.model_copy(update={"context": settings.context.model_copy(update=context)})
    async with build_client(settings, MemoryStore(), MockUpstream()) as client:
        transcript: list[dict[str, Any]] = []

        async def turn(messages: list[dict[str, Any]]) -> int:
            body = {"model": "mock/m", "conversation_id": "gap", "messages": messages}
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            transcript.append(r.json()["choices"][0]["message"])
            await app_of(client).state.summarizer.wait_idle()
            return int((await client.get("/v1/conversations/gap/context")).json()["truncated"])

        for i in range(15):
            transcript.append({"role": "user", "content": f"turn {i}"})
            await turn(transcript)
        k = [j for j, m in enumerate(transcript) if m["role"] == "user"][-4]
        transcript[k] = {"role": "user", "content": "edited"}  # (and the rest resent as it was)
        gaps = [await turn(transcript)]
        for i in range(15, 25):
            transcript.append({"role": "user", "content": f"turn {i}"})
            gaps.append(await turn(transcript))
    assert sum(1 for g in gaps if g) <= 1, gaps  # (the turn after the edit's cut, at most)
