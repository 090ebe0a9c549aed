"""History reconciliation for clients that resend history (SPEC 5.1): prefix, trimmed overlap,
and divergence (an edit, a regenerate) which branches the conversation. The property: over
random sequences of such requests, what reaches the provider is exactly the list a careful
stateless client would have sent itself."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.context import ConversationView, Turn, reconcile
from gateway.context.history import message_key
from gateway.store.memory import MemoryStore
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings


def u(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def view_of(*pairs: tuple[str, str]) -> ConversationView:
    view = ConversationView()
    for i, (q, r) in enumerate(pairs):
        view.extend(Turn(f"r{i}", (u(q),), a(r)))
    return view


def test_the_rules_with_examples() -> None:
    view = view_of(("q1", "a1"), ("q2", "a2"))
    # only the new message
    assert reconcile([u("q3")], view).new == [u("q3")]
    # the whole history, then the new message
    assert reconcile([u("q1"), a("a1"), u("q2"), a("a2"), u("q3")], view).new == [u("q3")]
    # a trimmed history: the stored tail, then the new message
    assert reconcile([u("q2"), a("a2"), u("q3")], view).new == [u("q3")]
    assert reconcile([a("a2"), u("q3")], view).new == [u("q3")]
    # an edit of the second question: a branch after the first answer
    edited = reconcile([u("q1"), a("a1"), u("q2, better")], view)
    assert edited.new == [u("q2, better")] and edited.branch_at == 2
    # a regenerate of the last answer: the question again, after the same branch point
    regenerated = reconcile([u("q1"), a("a1"), u("q2")], view)
    assert regenerated.new == [u("q2")] and regenerated.branch_at == 2
    # a trimmed history, edited or regenerated: a branch after the stored run it starts with
    trimmed_edit = reconcile([a("a1"), u("q2, better")], view)
    assert trimmed_edit.new == [u("q2, better")] and trimmed_edit.branch_at == 2
    trimmed_regenerate = reconcile([a("a1"), u("q2")], view)
    assert trimmed_regenerate.new == [u("q2")] and trimmed_regenerate.branch_at == 2
    # a regenerate resends the messages the branch leaves behind unchanged; an edit does not
    assert regenerated.regenerated and trimmed_regenerate.regenerated
    assert not edited.regenerated and not trimmed_edit.regenerated
    # the first stored message the branch leaves behind: q2, the input of r1
    assert regenerated.left_from == edited.left_from == ("r1", 0)
    # a regenerate of an older answer leaves more behind: still the same message asked again
    older = reconcile([u("q1")], view_of(("q1", "a1"), ("q2", "a2")))
    assert older.branch_at is None  # (one message: new, as ever)
    older = reconcile([u("q1"), a("a1"), u("q2")], view_of(("q1", "a1"), ("q2", "a2"), ("q3", "a3")))
    assert older.regenerated and older.branch_at == 2 and older.left_from == ("r1", 0)
    # an edited answer is an edit, though the question before it is resent unchanged
    answer_edited = reconcile([u("q1"), a("a1"), u("q2"), a("a2, better"), u("q3")], view)
    assert answer_edited.branch_at == 3 and not answer_edited.regenerated
    assert answer_edited.left_from == ("r1", 1)
    # the same text as an earlier question, no answer in the request: new, not a regenerate
    assert reconcile([u("q1")], view).new == [u("q1")] and reconcile([u("q1")], view).branch_at is None
    # two new messages, the first equal to the conversation's first: not an edit (no answer shared)
    assert reconcile([u("q1"), u("more")], view) == type(edited)([u("q1"), u("more")], None)
    # the first question edited, the rest resent as stored: the client's version from the start
    # (it was appended whole, every message then twice)
    resent = [u("q1, better"), a("a1"), u("q2"), a("a2"), u("q3")]
    first_edited = reconcile(resent, view)
    assert first_edited.new == resent and first_edited.branch_at == 0 and not first_edited.regenerated
    assert first_edited.left_from == ("r0", 0)
    # laid against the stored end: its first turn edited, a message put before it, or trimmed
    # with its new first message edited (each was appended whole: every message twice)
    turn_edited = [u("q1, better"), a("a1, better"), u("q2"), a("a2"), u("q3")]
    assert reconcile(turn_edited, view) == type(edited)(turn_edited, 0, False, ("r0", 0))
    put_before = [u("first of all"), u("q1"), a("a1"), u("q2"), a("a2"), u("q3")]
    assert reconcile(put_before, view).branch_at == 0 and reconcile(put_before, view).new == put_before
    longer = view_of(("q1", "a1"), ("q2", "a2"), ("q3", "a3"))
    trimmed_first_edited = [u("q2, better"), a("a2"), u("q3"), a("a3"), u("q4")]
    assert reconcile(trimmed_first_edited, longer) == type(edited)(trimmed_first_edited, 2, False, ("r1", 0))


def test_a_trimmed_copy_is_told_from_an_edit_when_messages_repeat() -> None:
    """A trimmed copy whose first message repeats the conversation's first ("continue") was
    taken for an edit there, three messages lost; an overlap of one repeated answer ("ok")
    with the stored end won over an edit of the copy (appended: every message twice), and over
    the whole copy's overlap with a history that holds a feedback turn."""
    stored = view_of(("continue", "a1"), ("what is 2+2?", "a2"), ("continue", "a3"), ("and 3+3?", "a4"))
    trimmed = [u("continue"), a("a3"), u("and 3+3?"), a("a4"), u("and 4+4?")]
    assert reconcile(trimmed, stored) == type(reconcile(trimmed, stored))([u("and 4+4?")])
    oks = view_of(("q1", "ok"), ("q2", "ok"), ("q3", "ok"))
    edited = reconcile([a("ok"), u("q2, better"), a("ok"), u("q3"), a("ok"), u("q4")], oks)
    assert edited.branch_at == 1 and edited.new[1] == u("q2, better")
    with_feedback = view_of(("q1", "ok"), ("q2", "ok"))
    with_feedback.extend(Turn("rf", ({**u("thumbs down"), "is_feedback": True},), a("ok")))
    with_feedback.extend(Turn("r3", (u("q3"),), a("ok")))
    resent = reconcile([a("ok"), u("q2"), a("ok"), u("q3"), a("ok"), u("q4")], with_feedback)
    assert resent.new == [u("q4")] and resent.branch_at is None
    # one answer alike at the end ("ok") is no copy of the stored end (it spliced the request
    # into the stored history, a question of it left unanswered)
    other = [u("x0"), u("x1"), a("ok"), u("q")]
    assert reconcile(other, oks).branch_at is None


async def test_an_edited_first_message_reaches_the_model_once_with_the_rest() -> None:
    upstream = MockUpstream(lambda body: "ok")
    async with build_client(make_settings(), MemoryStore(), upstream) as client:

        async def say(messages: list[dict[str, Any]]) -> None:
            body = {"model": "mock/m", "messages": messages, "conversation_id": "first"}
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200

        await say([u("My name is Ann.")])
        await say([u("My name is Ann."), a("ok"), u("I like tea.")])
        edited = [u("My name is Bob."), a("ok"), u("I like tea."), a("ok"), u("What is my name?")]
        await say(edited)
        assert upstream.requests[-1]["messages"] == edited
        await say([u("And my drink?")])
        assert upstream.requests[-1]["messages"] == [*edited, a("ok"), u("And my drink?")]


def call(arguments: str) -> dict[str, Any]:
    """The model's tool call, its arguments written as given."""
    function = {"name": "get_weather", "arguments": arguments}
    calls = [{"id": "call_1", "type": "function", "function": function}]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def test_a_resent_tool_call_is_the_same_call_however_its_arguments_are_spaced() -> None:
    # LangChain and `llm` rebuild a call's arguments with json.dumps: other spacing, other order.
    view = view_of(("q1", "a1"))
    view.extend(Turn("r1", (u("weather?"),), call('{"city":"Paris","unit":"C"}')))
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    resent = call('{"unit": "C", "city": "Paris"}')
    whole = reconcile([u("q1"), a("a1"), u("weather?"), resent, result], view)
    assert whole.new == [result] and whole.branch_at is None
    trimmed = reconcile([u("weather?"), resent, result], view)
    assert trimmed.new == [result] and trimmed.branch_at is None
    # other arguments are another call (an edit); arguments that are not a JSON object are `{}`,
    # as the Messages API gives such a call to its client (`input: {}`), which resends it so
    other = reconcile([u("q1"), a("a1"), u("weather?"), call('{"city": "Oslo"}'), result], view)
    assert other.branch_at == 3  # after the shared question
    assert message_key(call("not json {")) == message_key(call("{}")) == message_key(call('"x"'))
    assert message_key(call("not json {")) != message_key(call('{"x": 1}'))


def test_a_resend_that_leaves_the_tool_results_out_is_no_edit() -> None:
    """A client resent its calls without their results: taken as an edit, the stored results
    were replaced by "no result" placeholders before the model's own answer that used them."""
    view = view_of(("q1", "a1"))
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    view.extend(Turn("r1", (u("weather?"),), call('{"city":"Paris"}')))
    view.extend(Turn("r2", (result,), a("It is sunny.")))
    history = [u("q1"), a("a1"), u("weather?"), call('{"city":"Paris"}')]
    without = reconcile([*history, a("It is sunny."), u("thanks")], view)
    assert without.new == [u("thanks")] and without.branch_at is None
    # an edit after the calls still branches, the stored results kept before it
    edited = reconcile([*history, a("It is raining."), u("thanks")], view)
    assert edited.branch_at == 5 and edited.new == [a("It is raining."), u("thanks")]
    # with the results, as before
    assert reconcile([*history, result, a("It is sunny."), u("thanks")], view).new == [u("thanks")]
    # Resent up to the result, to have another answer: a regenerate that keeps the result. It
    # was taken for calls without their results, and the result went after the stored one: a 400.
    again = reconcile([*history, result], view)
    assert (again.branch_at, again.new, again.regenerated) == (4, [result], True)
    # ... or with the result edited, to have the answer to another: an edit there (it was a 400).
    rainy = {**result, "content": "rainy"}
    edited = reconcile([*history, rainy], view)
    assert (edited.branch_at, edited.new, edited.regenerated) == (4, [rainy], False)
    assert reconcile([*history, rainy, a("It is rainy."), u("ok")], view).branch_at == 4


def test_a_branch_cuts_the_view_where_the_client_diverged() -> None:
    view = view_of(("q1", "a1"), ("q2", "a2"))
    view.extend(Turn("r2", (u("q2, better"),), a("a2'"), branch_at=2))
    assert view.history == [u("q1"), a("a1"), u("q2, better"), a("a2'")]
    assert view.history_end == {"r0": 2, "r2": 4} and view.turns == 3
    copy = view.branched(2)
    assert copy.history == [u("q1"), a("a1")] and len(view.history) == 4  # the original is untouched


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["full", "new", "trim", "edit", "regenerate", "trimmed edit", "trimmed regenerate"]),
        st.integers(0, 1000),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=ACTIONS)
async def test_what_reaches_the_provider_is_what_a_careful_client_would_send(
    actions: list[tuple[str, int]],
) -> None:
    counter = iter(range(10_000))

    def reply(body: dict[str, Any]) -> str:
        return f"answer {next(counter)}"

    upstream = MockUpstream(reply)
    store = MemoryStore()
    history: list[dict[str, Any]] = []  # the careful client's own copy of the conversation
    async with build_client(make_settings(), store, upstream) as client:
        for step, (action, pick) in enumerate(actions):
            question = u(f"question {step}")
            users = [i for i, m in enumerate(history) if m["role"] == "user" and i >= 2]
            branch = None  # what the request record must say of the branch
            if action in ("edit", "trimmed edit") and users:
                branch = "edited"
            elif action in ("regenerate", "trimmed regenerate") and len(history) >= 4:
                branch = "regenerated"
            if action == "new" or not history:
                sent, history = [question], [*history, question]
            elif action == "full":
                history = [*history, question]
                sent = history
            elif action == "trim":
                k = 1 + pick % len(history)
                history = [*history, question]
                sent = history[-(k + 1) :]
            elif action == "edit" and users:
                j = users[pick % len(users)]
                history = [*history[:j], u(f"edited {step}")]
                sent = history
            elif action == "regenerate" and len(history) >= 4:
                history = history[:-1]
                sent = history
            elif action == "trimmed edit" and users:
                # resends its newest messages only, from an answer on, with a question edited
                j = users[pick % len(users)]
                history = [*history[:j], u(f"edited {step}")]
                first = max(i for i in range(j) if history[i]["role"] == "assistant")
                sent = history[first - 2 * (pick % (first // 2 + 1)) :] if first >= 2 else history[first:]
            elif action == "trimmed regenerate" and len(history) >= 4:
                history = history[:-1]
                sent = history[-2 - 2 * (pick % (len(history) // 2)) :]
            else:
                history = [*history, question]
                sent = history
            r = await client.post(
                "/v1/chat/completions", json={"model": "mock/m", "messages": sent, "conversation_id": "c"}
            )
            assert r.status_code == 200, r.text
            assert upstream.requests[-1]["messages"] == history, (action, sent)
            record = (await client.get(f"/v1/responses/{r.json()['id']}")).json()["gateway"]["request"]
            assert record.get("branch") == branch, (action, sent)
            history = [*history, r.json()["choices"][0]["message"]]


async def test_an_edited_branch_stays_readable_but_never_reaches_the_model_again() -> None:
    upstream = MockUpstream(lambda body: f"answer to {body['messages'][-1]['content']}")
    store = MemoryStore()
    async with build_client(make_settings(), store, upstream) as client:

        async def say(messages: list[dict[str, Any]]) -> dict[str, Any]:
            r = await client.post(
                "/v1/chat/completions", json={"model": "mock/m", "messages": messages, "conversation_id": "c"}
            )
            assert r.status_code == 200, r.text
            return dict(r.json()["choices"][0]["message"])

        a1 = await say([u("my secret is Falcon")])
        a2 = await say([u("my secret is Falcon"), a1, u("what is my secret?")])
        assert a2["content"] == "answer to what is my secret?"
        await say([u("never mind"), u("let us talk about tea")])  # not a branch: only new messages
        edited = [u("my secret is Falcon"), a1, u("tell me a joke")]
        await say(edited)
        await say([*edited, a("ok"), u("and another")])
        sent = upstream.requests[-1]["messages"]
        assert u("what is my secret?") not in sent and u("tell me a joke") in sent
        items = (await client.get("/v1/conversations/c/items?order=asc")).json()["data"]
        ui = (await client.get("/ui/api/conversations/c")).json()
    texts = [c["text"] for item in items for c in item["content"]]
    assert "what is my secret?" not in texts  # the conversation is the client's version now
    logged = [m["content"] for t in ui["turns"] for m in t["input"]]
    assert "what is my secret?" in logged  # the abandoned branch is still in the logs


def test_gateway_show_marks_the_abandoned_branch(tmp_path: Any) -> None:
    import asyncio

    from click.testing import CliRunner

    from gateway.cli import main
    from gateway.store.jsonl import JsonlStore

    async def converse() -> None:
        store = JsonlStore(tmp_path / "var")
        await store.open()
        upstream = MockUpstream(lambda body: f"answer to {body['messages'][-1]['content']}")
        async with build_client(make_settings(tmp_path), store, upstream) as client:
            history: list[dict[str, Any]] = []
            for text in ("first question", "second question"):
                history.append(u(text))
                r = await client.post(
                    "/v1/chat/completions",
                    json={"model": "mock/m", "messages": history, "conversation_id": "c"},
                )
                history.append(r.json()["choices"][0]["message"])
            edited = [*history[:2], u("second, edited")]
            r = await client.post(
                "/v1/chat/completions", json={"model": "mock/m", "messages": edited, "conversation_id": "c"}
            )
            assert r.status_code == 200

    asyncio.run(converse())
    result = CliRunner().invoke(main, ["show", "c", "--data-dir", str(tmp_path / "var")])
    out = result.output
    assert result.exit_code == 0, out
    _, _, rest = out.partition("no longer sent to the model")
    assert "second question" in rest.split("the client's edit")[0]  # shown under the abandoned turn
    assert "continues after message 2" in out and "second, edited" in out
    assert "3 turns, 4 messages" in out


def test_an_edit_after_a_deletion_branches_where_the_client_edited() -> None:
    """The client still has the messages deleted since (or feedback it sent): its copy matches
    the transcript, not the history, up to its edit. The branch is made there, and what it
    resends before the edit is not stored again (a deleted message would come back)."""
    view = view_of(("q1", "a1"), ("q2", "a2"), ("q3", "a3"), ("q4", "a4"))
    view.apply_marker({"type": "delete_response", "response_id": "r1"})  # q2 and a2
    # the plain resend is an echo, as before
    assert reconcile(
        [u("q1"), a("a1"), u("q2"), a("a2"), u("q3"), a("a3"), u("q4"), a("a4"), u("q5")], view
    ).new == [u("q5")]
    edited = reconcile([u("q1"), a("a1"), u("q2"), a("a2"), u("q3"), a("a3"), u("q4, better")], view)
    assert edited.new == [u("q4, better")]
    assert edited.branch_at == 4  # history q1 a1 q3 a3: the deleted pair is not counted
    cut = view.branched(edited.branch_at)
    assert [m["content"] for m in cut.history] == ["q1", "a1", "q3", "a3"]


def test_a_trimmed_resend_that_still_holds_a_deleted_message_is_an_overlap() -> None:
    """A client that resends only its newest messages may still hold one deleted since (or its
    feedback): the overlap with the stored transcript is dropped, nothing comes back, nothing
    is stored twice; an edit in such a copy branches after the run it starts with."""
    view = view_of(("q1", "a1"), ("q2", "a2"), ("q3", "a3"), ("q4", "a4"))
    view.apply_marker({"type": "delete_item", "response_id": "r2", "position": 1})  # a3
    assert reconcile([u("q3"), a("a3"), u("q4"), a("a4"), u("q5")], view).new == [u("q5")]
    assert reconcile([a("a3"), u("q4"), a("a4"), u("q5")], view).new == [u("q5")]
    # the client drops the deleted answer itself: still an overlap
    assert reconcile([u("q3"), u("q4"), a("a4"), u("q5")], view).new == [u("q5")]
    edited = reconcile([u("q3"), a("a3"), u("q4, better")], view)
    assert edited.new == [u("q4, better")] and edited.branch_at == 5  # q1 a1 q2 a2 q3


def test_the_linear_matching_finds_what_the_quadratic_one_did() -> None:
    """The overlap with the stored tail and the longest stored run are found in linear time (a
    resent history of 50,000 messages against as many stored held the event loop for minutes):
    the same answers as comparing every candidate, on random histories of few distinct keys."""
    import random

    from gateway.context.reconcile import _failure_table, _matched_at_end, _matches

    rng = random.Random(11)
    for _ in range(400):
        keys = [bytes([rng.randrange(3)]) for _ in range(rng.randrange(1, 9))]
        stored = [bytes([rng.randrange(3)]) for _ in range(rng.randrange(0, 12))]
        table = _failure_table(keys)
        overlap = next((k for k in range(min(len(keys), len(stored)), 0, -1) if keys[:k] == stored[-k:]), 0)
        assert _matched_at_end(keys, table, stored) == overlap
        runs = _matches(keys, table, stored)
        for end in range(1, len(stored) + 1):
            longest = max(
                (k for k in range(1, min(end, len(keys)) + 1) if stored[end - k : end] == keys[:k]), default=0
            )
            assert runs[end - 1] == longest


def test_a_regenerated_answer_is_labelled_so_and_an_edit_as_an_edit(tmp_path: Any) -> None:
    """A regenerated answer (the history resent up to before it) was labelled "the client's edit"
    in `gateway show` and `gateway tail`, and the inspector did not say where a branch started."""
    import asyncio

    from click.testing import CliRunner

    from gateway.cli import main
    from gateway.store.jsonl import JsonlStore

    async def converse() -> dict[str, Any]:
        store = JsonlStore(tmp_path / "var")
        await store.open()
        upstream = MockUpstream(lambda body: f"answer {len(upstream.requests)}")
        async with build_client(make_settings(tmp_path), store, upstream) as client:

            async def say(messages: list[dict[str, Any]]) -> dict[str, Any]:
                body = {"model": "mock/m", "messages": messages, "conversation_id": "c"}
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return dict(r.json()["choices"][0]["message"])

            history = [u("first question")]
            history.append(await say(history))
            await say([*history, u("second question")])
            history.append(u("second, edited"))  # the client edits its second question
            history.append(await say(history))
            history.append(u("third question"))
            await say(history)
            await say(history)  # and has the answer to its third question regenerated
            return dict((await client.get("/ui/api/conversations/c")).json())

    ui = asyncio.run(converse())
    result = CliRunner().invoke(main, ["show", "c", "--data-dir", str(tmp_path / "var")])
    assert result.exit_code == 0, result.output
    [edit] = [line for line in result.output.splitlines() if "continues after message 2" in line]
    [regenerated] = [line for line in result.output.splitlines() if "continues after message 4" in line]
    assert "the client's edit" in edit and "regenerated" not in edit
    assert "regenerated" in regenerated and "the client's edit" not in regenerated
    # The inspector: which kind each branch was, and the message each one left behind.
    turns = ui["turns"]
    assert [t["branch"] for t in turns] == [None, None, "edited", None, "regenerated"]
    assert [t["branch_at"] for t in turns] == [None, None, 2, None, 4]
    assert turns[2]["branch_left"] == {"response_id": turns[1]["response_id"], "position": 0}
    assert turns[4]["branch_left"] == {"response_id": turns[3]["response_id"], "position": 0}
    assert [t["not_sent"] for t in turns] == [[], [0, 1], [], [0, 1], []]
    branched = {"0": "left behind by a branch", "1": "left behind by a branch"}
    assert [t["not_sent_why"] for t in turns] == [{}, branched, {}, branched, {}]
    # `gateway show` says the same of the same messages.
    assert sum("left behind by a branch" in line for line in result.output.splitlines()) == 2


def test_a_turn_heading_names_the_kind_of_branch() -> None:
    from gateway.cli_render import turn_heading

    def heading(**branch: Any) -> str:
        return turn_heading(Turn("r9", (u("q"),), a("x"), **branch))

    assert heading() == "── r9"
    assert "(regenerated: the client asked again for an answer: continues after message 2;" in heading(
        branch_at=2, branch="regenerated"
    )
    assert "(the client's edit: continues after message 2;" in heading(branch_at=2, branch="edited")
    # recorded before the two were told apart: neither
    older = heading(branch_at=2)
    assert "continues after message 2" in older and "edit" not in older and "regenerated" not in older


def test_feedback_kept_in_a_resent_copy_is_not_sent_or_stored_again() -> None:
    """A copy that keeps the feedback its client sent, edited before it: the feedback went to
    the model again, and its reply was stored as history for good (two answers in a row)."""
    fb = {**u("thumbs down"), "is_feedback": True}
    view = view_of(("u1", "a1"), ("u2", "a2"))
    view.extend(Turn("rf", (fb,), a("sorry")))
    view.extend(Turn("r3", (u("u3"),), a("a3")))
    edited = reconcile(
        [u("u1"), a("a1"), u("u2, better"), a("a2"), fb, a("sorry"), u("u3"), a("a3"), u("u4")], view
    )
    assert edited.branch_at == 2
    assert edited.new == [u("u2, better"), a("a2"), u("u3"), a("a3"), u("u4")]
    # Beside another message, the feedback goes alone; the request's own feedback stays.
    beside = reconcile([u("u1"), a("a1"), u("u2, better"), fb, a("a2"), fb], view)
    assert beside.new == [u("u2, better"), a("a2"), fb]
