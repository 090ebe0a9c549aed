"""Pure history rules (gateway.context): system prompt, what is new, feedback, tool-call repair."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.context import (
    ConversationView,
    Message,
    Turn,
    new_messages,
    rebuild_view,
    repair_tool_calls,
    split_system,
)
from gateway.context.history import UNANSWERED_TOOL_RESULT
from tests.helpers import assert_openai_tool_order


def user(text: str, **extra: Any) -> Message:
    return {"role": "user", "content": text, **extra}


def assistant(text: str | None, **extra: Any) -> Message:
    return {"role": "assistant", "content": text, **extra}


def system(text: str) -> Message:
    return {"role": "system", "content": text}


def call(call_id: str, name: str = "lookup", arguments: str = "{}") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def calls(*ids: str) -> Message:
    return {"role": "assistant", "content": None, "tool_calls": [call(i) for i in ids]}


def result(call_id: str, text: str = "ok") -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def synthetic(call_id: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": UNANSWERED_TOOL_RESULT}


def turn(rid: str, *inputs: Message, output: Message, system_prompt: list[Message] | None = None) -> Turn:
    return Turn(
        response_id=rid,
        input=tuple(inputs),
        output=output,
        system=tuple(system_prompt) if system_prompt is not None else None,
    )


def two_turn_view() -> ConversationView:
    return rebuild_view(
        [
            turn("m-000000000001", user("hi"), output=assistant("Hello!")),
            turn("m-000000000002", user("my name is Ada"), output=assistant("Nice to meet you, Ada.")),
        ]
    )


# -- split_system ---------------------------------------------------------------------------


def test_split_system_takes_leading_system_and_developer_messages() -> None:
    dev = {"role": "developer", "content": "be terse"}
    messages = [system("you are helpful"), dev, user("hi"), system("late system")]
    head, rest = split_system(messages)
    assert head == [system("you are helpful"), dev]
    # A system message after the first ordinary one is not part of the prompt.
    assert rest == [user("hi"), system("late system")]


def test_split_system_without_system_prompt() -> None:
    assert split_system([user("hi")]) == ([], [user("hi")])
    assert split_system([]) == ([], [])


def test_split_system_only_system() -> None:
    assert split_system([system("s")]) == ([system("s")], [])


# -- new_messages -----------------------------------------------------------------------------


def test_only_new_message_client() -> None:
    view = two_turn_view()
    assert new_messages([user("what is my name?")], view) == [user("what is my name?")]


def test_anything_is_new_for_an_empty_conversation() -> None:
    incoming = [user("hi"), assistant("Hello!"), user("again")]
    assert new_messages(incoming, ConversationView()) == incoming


def test_full_history_client_exact_echo() -> None:
    view = two_turn_view()
    incoming = [*view.transcript, user("what is my name?")]
    assert new_messages(incoming, view) == [user("what is my name?")]


def test_full_history_client_sending_several_new_messages() -> None:
    view = two_turn_view()
    new = [user("first"), user("second")]
    assert new_messages([*view.transcript, *new], view) == new


def test_full_history_echo_with_content_as_text_parts_and_null_fields() -> None:
    view = two_turn_view()
    incoming: list[Message] = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "!"}],
            "refusal": None,
            "tool_calls": None,
            "function_call": None,
            "audio": None,
        },
        user("my name is Ada"),
        {"role": "assistant", "content": "Nice to meet you, Ada.", "refusal": None, "annotations": []},
        user("what is my name?"),
    ]
    assert new_messages(incoming, view) == [user("what is my name?")]


def test_echo_that_differs_is_not_dropped() -> None:
    view = two_turn_view()
    # The client rewrote the first assistant answer: from there on everything is new.
    incoming = [user("hi"), assistant("Howdy"), user("my name is Ada"), user("next")]
    assert new_messages(incoming, view) == incoming[1:]


def test_one_message_equal_to_first_message_is_not_dropped() -> None:
    view = two_turn_view()
    assert new_messages([user("hi")], view) == [user("hi")]


def test_echo_of_whole_transcript_keeps_last_message() -> None:
    # A retry that resends exactly what is stored still carries one new message: the last.
    view = rebuild_view([turn("m-000000000001", user("hi"), output=assistant("Hello!"))])
    incoming = [user("hi"), assistant("Hello!"), user("hi")]
    assert new_messages(incoming, view) == [user("hi")]
    assert new_messages([user("hi"), assistant("Hello!")], view) == [assistant("Hello!")]


def test_full_history_client_with_tool_calls_echo() -> None:
    view = rebuild_view(
        [
            turn("m-000000000001", user("weather?"), output=calls("call_1")),
            turn("m-000000000002", result("call_1", "sunny"), output=assistant("It is sunny.")),
        ]
    )
    echoed_call = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "tool_calls": [call("call_1")],
    }
    incoming = [
        user("weather?"),
        echoed_call,
        result("call_1", "sunny"),
        assistant("It is sunny."),
        user("thanks"),
    ]
    assert new_messages(incoming, view) == [user("thanks")]


def test_feedback_turns_are_in_the_transcript_so_full_history_echo_matches() -> None:
    view = rebuild_view(
        [
            turn("m-000000000001", user("hi"), output=assistant("Hello!")),
            turn("m-000000000002", user("great answer", is_feedback=True), output=assistant("Thanks!")),
        ]
    )
    # The transcript keeps the feedback exchange (without the gateway-only flag) ...
    assert view.transcript == [user("hi"), assistant("Hello!"), user("great answer"), assistant("Thanks!")]
    # ... so a client echoing everything it said and heard is recognised, flagged or not.
    for feedback in (user("great answer"), user("great answer", is_feedback=True)):
        incoming = [user("hi"), assistant("Hello!"), feedback, assistant("Thanks!"), user("next")]
        assert new_messages(incoming, view) == [user("next")]


def test_full_history_client_that_omits_feedback_turn_matches_history() -> None:
    view = rebuild_view(
        [
            turn("m-000000000001", user("hi"), output=assistant("Hello!")),
            turn("m-000000000002", user("nice", is_feedback=True), output=assistant("Thanks!")),
            turn("m-000000000003", user("q2"), output=assistant("a2")),
        ]
    )
    incoming = [user("hi"), assistant("Hello!"), user("q2"), assistant("a2"), user("q3")]
    assert new_messages(incoming, view) == [user("q3")]


# -- ConversationView.extend ----------------------------------------------------------------------


def test_extend_records_history_transcript_and_ids() -> None:
    view = two_turn_view()
    expected = [user("hi"), assistant("Hello!"), user("my name is Ada"), assistant("Nice to meet you, Ada.")]
    assert view.history == expected
    assert view.transcript == expected
    assert view.response_ids == ["m-000000000001", "m-000000000002"]
    assert view.turns == 2
    assert view.system is None


def test_feedback_only_turn_is_left_out_whole() -> None:
    view = rebuild_view(
        [
            turn("m-000000000001", user("hi"), output=assistant("Hello!")),
            turn(
                "m-000000000002",
                user("too long", is_feedback=True),
                user("be shorter", is_feedback=True),
                output=assistant("Sorry, will do."),
            ),
            turn("m-000000000003", user("q2"), output=assistant("a2")),
        ]
    )
    assert view.history == [user("hi"), assistant("Hello!"), user("q2"), assistant("a2")]
    assert all(m.get("content") != "Sorry, will do." for m in view.history)
    assert view.turns == 3
    assert view.response_ids == ["m-000000000001", "m-000000000002", "m-000000000003"]


def test_feedback_beside_ordinary_messages_is_left_out_alone() -> None:
    view = rebuild_view(
        [
            turn(
                "m-000000000001",
                user("that was wrong", is_feedback=True),
                user("what is 2+2?"),
                output=assistant("4"),
            ),
        ]
    )
    assert view.history == [user("what is 2+2?"), assistant("4")]
    assert view.transcript == [user("that was wrong"), user("what is 2+2?"), assistant("4")]
    assert not any("is_feedback" in m for m in view.transcript)


def test_is_feedback_false_is_an_ordinary_message() -> None:
    view = rebuild_view([turn("m-000000000001", user("hi", is_feedback=False), output=assistant("Hello!"))])
    assert [m["content"] for m in view.history] == ["hi", "Hello!"]
    assert "is_feedback" not in view.history[0]


def test_system_prompt_replaced_and_carried_forward() -> None:
    view = rebuild_view(
        [
            turn("m-000000000001", user("hi"), output=assistant("Hello!"), system_prompt=[system("A")]),
            turn("m-000000000002", user("q"), output=assistant("a")),
        ]
    )
    assert view.system == [system("A")]  # carried forward by a turn without one
    view.extend(turn("m-000000000003", user("q2"), output=assistant("a2"), system_prompt=[system("B")]))
    assert view.system == [system("B")]
    view.extend(turn("m-000000000004", user("q3"), output=assistant("a3")))
    assert view.system == [system("B")]
    # The system prompt lives beside the history, never inside it.
    assert all(m["role"] != "system" for m in view.history)


def test_reset_keeps_system_message_when_asked() -> None:
    view = rebuild_view(
        [turn("m-000000000001", user("hi"), output=assistant("Hello!"), system_prompt=[system("A")])]
    )
    view.reset(keep_system_message=True)
    assert view.system == [system("A")]
    assert (view.history, view.transcript, view.response_ids, view.turns) == ([], [], [], 0)
    view.extend(turn("m-000000000002", user("again"), output=assistant("fresh")))
    assert view.history == [user("again"), assistant("fresh")]
    assert view.system == [system("A")]


def test_reset_drops_system_message_by_default_choice() -> None:
    view = rebuild_view(
        [turn("m-000000000001", user("hi"), output=assistant("Hello!"), system_prompt=[system("A")])]
    )
    view.reset(keep_system_message=False)
    assert view.system is None
    assert (view.history, view.transcript, view.response_ids, view.turns) == ([], [], [], 0)


def test_reset_invalidates_cached_keys() -> None:
    view = two_turn_view()
    assert len(view.keys("transcript")) == 4
    view.reset(keep_system_message=False)
    view.extend(turn("m-000000000003", user("new start"), output=assistant("ok")))
    # After a reset the old conversation is not an echo any more.
    incoming = [user("hi"), assistant("Hello!"), user("q")]
    assert new_messages(incoming, view) == incoming
    assert new_messages([user("new start"), assistant("ok"), user("q")], view) == [user("q")]


# -- repair_tool_calls ------------------------------------------------------------------------------


def test_unanswered_tool_calls_followed_by_user_get_synthetic_results() -> None:
    messages = [user("weather in Paris and Rome?"), calls("c1", "c2"), user("no, stop")]
    assert repair_tool_calls(messages) == [
        user("weather in Paris and Rome?"),
        calls("c1", "c2"),
        synthetic("c1"),
        synthetic("c2"),
        user("no, stop"),
    ]


def test_partially_answered_calls_get_results_after_existing_ones() -> None:
    messages = [user("q"), calls("c1", "c2", "c3"), result("c2", "two"), user("never mind")]
    assert repair_tool_calls(messages) == [
        user("q"),
        calls("c1", "c2", "c3"),
        result("c2", "two"),
        synthetic("c1"),
        synthetic("c3"),
        user("never mind"),
    ]


def test_calls_answered_in_part_at_the_end_get_results_for_the_others() -> None:
    """A client that answered one of two calls: the history went upstream with the other call
    unanswered, which OpenAI refuses (a 400); with no result at all the call is left as it is."""
    messages = [user("q"), calls("c1", "c2"), result("c1", "one")]
    assert repair_tool_calls(messages) == [*messages, synthetic("c2")]
    asking = [user("q"), calls("c1", "c2")]
    assert repair_tool_calls(asking) == asking


def test_unanswered_calls_followed_by_assistant_message() -> None:
    messages = [calls("c1"), assistant("I will not call the tool after all")]
    assert repair_tool_calls(messages) == [calls("c1"), synthetic("c1"), messages[1]]


def test_orphan_tool_messages_are_dropped() -> None:
    messages = [
        result("stray", "before anything"),
        user("q"),
        result("c9", "answers nothing"),
        calls("c1"),
        result("c1", "one"),
        result("c1", "duplicate answer"),
        result("zz", "unknown id"),
        assistant("done"),
        result("c1", "late"),
    ]
    assert repair_tool_calls(messages) == [user("q"), calls("c1"), result("c1", "one"), assistant("done")]


def test_complete_chains_are_replayed_exactly() -> None:
    messages = [
        system("s"),
        user("weather?"),
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                call("c1", "weather", '{"city":"Paris"}'),
                call("c2", "weather", '{"city":"Rome"}'),
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "rain", "name": "weather"},
        {"role": "tool", "tool_call_id": "c1", "content": "sun", "name": "weather"},
        assistant("Paris is sunny, Rome rainy."),
        user("thanks"),
    ]
    repaired = repair_tool_calls(messages)
    assert repaired == messages
    # Untouched means the very same dicts, in the same order.
    assert all(a is b for a, b in zip(repaired, messages, strict=True))


def test_trailing_unanswered_tool_calls_left_as_is() -> None:
    messages = [user("weather?"), calls("c1", "c2")]
    assert repair_tool_calls(messages) == messages


def test_repair_does_not_mutate_its_input() -> None:
    messages = [user("q"), calls("c1"), user("stop")]
    snapshot = [dict(m) for m in messages]
    repair_tool_calls(messages)
    assert messages == snapshot


# -- property: repaired output always satisfies OpenAI's ordering rules ------------------------------

_texts = st.sampled_from(["a", "b", "hello", ""])


@st.composite
def conversations(draw: st.DrawFn) -> list[Message]:
    """Random message lists mixing users, assistants, tool calls, answers, partial and stray results."""
    out: list[Message] = []
    next_id = 0
    issued: list[str] = []
    for _ in range(draw(st.integers(0, 14))):
        kind = draw(st.sampled_from(["user", "assistant", "calls", "tool", "system"]))
        if kind == "user":
            out.append(user(draw(_texts)))
        elif kind == "system":
            out.append(system(draw(_texts)))
        elif kind == "assistant":
            out.append(assistant(draw(_texts)))
        elif kind == "calls":
            n = draw(st.integers(1, 3))
            ids = [f"call_{next_id + i}" for i in range(n)]
            next_id += n
            issued.extend(ids)
            out.append(calls(*ids))
            # Answer some of them, in any order, maybe twice.
            answered = draw(st.lists(st.sampled_from(ids), max_size=4))
            out.extend(result(i) for i in answered)
        else:
            # A tool message that may answer an old call, the latest one, or nothing at all.
            pool = [*issued, "ghost"] if issued else ["ghost"]
            out.append(result(draw(st.sampled_from(pool))))
    return out


@settings(max_examples=200, deadline=None)
@given(conversations())
def test_repaired_history_satisfies_openai_ordering(messages: list[Message]) -> None:
    repaired = repair_tool_calls(messages)
    assert_openai_tool_order(repaired)
    # Every original non-tool message survives, in order, as the same object.
    originals = [m for m in messages if m["role"] != "tool"]
    kept = [m for m in repaired if m["role"] != "tool"]
    assert len(kept) == len(originals)
    assert all(a is b for a, b in zip(kept, originals, strict=True))
    # Real tool results are never rewritten: every non-synthetic tool message is an original one.
    original_ids = {id(m) for m in messages}
    for m in repaired:
        if m["role"] == "tool" and m["content"] != UNANSWERED_TOOL_RESULT:
            assert id(m) in original_ids
    # Repair is idempotent: a repaired history needs no further repair.
    assert repair_tool_calls(repaired) == repaired


@pytest.mark.parametrize(
    "messages",
    [
        [calls("c1"), user("x")],
        [calls("c1", "c2"), result("c2"), assistant("y")],
        [calls("c1"), result("c1"), calls("c2"), user("z")],
    ],
)
def test_ordering_checker_rejects_unrepaired_histories(messages: list[Message]) -> None:
    # The property above is only as good as its checker: it must catch the raw problems.
    with pytest.raises(AssertionError):
        assert_openai_tool_order(messages)


def test_a_call_without_arguments_is_the_same_call_however_it_comes_back() -> None:
    """The gateway stores a call without arguments with "{}"; the client got null (a whole
    answer) or "" (a stream) and sends that back: the same call, not an edit that branches."""
    from gateway.context.history import message_key

    def called(arguments: object) -> Message:
        function: dict[str, Any] = {"name": "now"}
        if arguments is not ...:
            function["arguments"] = arguments
        return {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": function}],
        }

    stored = message_key(called("{}"))
    assert all(message_key(called(a)) == stored for a in (None, "", ...))
    assert message_key(called('{"tz": "UTC"}')) != stored


def test_a_message_whose_calls_come_back_in_another_order_is_the_same_message() -> None:
    """LangChain resends a message's calls in another order when one's arguments are not
    JSON: the conversation branched on the model's own answer."""
    from gateway.context.history import message_key

    def calls_in(order: list[str]) -> Message:
        calls = [
            {"id": c, "type": "function", "function": {"name": "f", "arguments": f"not json {c}"}}
            for c in order
        ]
        return {"role": "assistant", "content": None, "tool_calls": calls}

    assert message_key(calls_in(["c1", "c2"])) == message_key(calls_in(["c2", "c1"]))
    assert message_key(calls_in(["c1", "c2"])) != message_key(calls_in(["c1", "c3"]))
