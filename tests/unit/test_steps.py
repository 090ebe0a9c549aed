"""Cuts in steps (gateway.context.steps through fit_window): the prompt of the next turn starts
with the prompt of this one, except at a cut, and a cut goes down to the low-water mark."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.context.steps import Head
from gateway.context.window import fit_window
from tests.unit.test_window import a, count, marker_tokens, u

Message = dict[str, Any]
SYSTEM = [{"role": "system", "content": "be brief"}]


def turn_sizes() -> st.SearchStrategy[list[tuple[int, int, bool]]]:
    """Per turn: words in the question, words in the answer, whether the answer calls a tool."""
    return st.lists(st.tuples(st.integers(1, 60), st.integers(1, 40), st.booleans()), min_size=2, max_size=40)


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def converse(
    sizes: list[tuple[int, int, bool]], budget: int, cut_share: float, max_msgs: int = 1000
) -> list[tuple[list[Message], bool, int]]:
    """Each turn's prompt, whether it held the previous head, and its token total: the planner's
    loop in miniature (the window's start carried from turn to turn)."""
    history: list[Message] = []
    start: int | None = 0
    prompts = []
    for n, (asked, answered, calls) in enumerate(sizes):
        new = [u(words(asked, f"q{n}-"))]
        conversation = [*history, *new]
        tokens = [count(m) for m in conversation]
        window = fit_window(
            system=SYSTEM,
            system_tokens=[count(m) for m in SYSTEM],
            conversation=conversation,
            conversation_tokens=tokens,
            first_new=len(history),
            budget=budget,
            max_history_messages=max_msgs,
            marker_tokens=marker_tokens,
            hold=start,
            cut_share=cut_share,
        )
        prompts.append((window.messages, window.held, window.total_tokens))
        start = window.history_start
        history.extend(new)
        if calls:
            call = {"id": f"c{n}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            history.append({"role": "assistant", "content": None, "tool_calls": [call]})
            history.append({"role": "tool", "tool_call_id": f"c{n}", "content": words(answered, "r")})
        history.append(a(words(answered, f"a{n}-")))
    return prompts


def begins_with_answer(messages: list[Message]) -> bool:
    """Does the prompt's history begin with an assistant message, its question left out?"""
    first = next(i for i, m in enumerate(messages) if m["role"] != "system")
    return first > len(SYSTEM) and messages[first]["role"] == "assistant"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turn_sizes(), st.integers(160, 600), st.sampled_from([0.5, 0.6, 0.75]))
def test_no_prompt_begins_with_an_answer_but_the_one_before_its_request(
    sizes: list[tuple[int, int, bool]], budget: int, cut_share: float
) -> None:
    """A held head kept beginning with the answer a cut had kept without its question (allowed
    only as the answer before the request) on the turns after it."""
    for messages, _, _ in converse(sizes, budget, cut_share):
        if begins_with_answer(messages):
            first = next(i for i, m in enumerate(messages) if m["role"] != "system")
            assert first == len(messages) - 2, [m["role"] for m in messages]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turn_sizes(), st.integers(160, 600), st.sampled_from([0.5, 0.6, 0.75]))
def test_the_next_prompt_starts_with_this_one_except_at_a_cut(
    sizes: list[tuple[int, int, bool]], budget: int, cut_share: float
) -> None:
    prompts = converse(sizes, budget, cut_share)
    for (before, _, _), (after, held, total) in zip(prompts, prompts[1:], strict=False):
        assert total <= budget
        if held:
            assert after[: len(before)] == before  # the provider's cached prefix is still valid
        else:
            # A cut only when holding did not fit, and then down to the low-water mark (the
            # newest unit and the request may need more: they are never dropped for it).
            newest = count(after[-2]) + count(after[-1]) if len(after) > 2 else total
            assert total <= cut_share * budget + newest + 20 or total <= budget


@settings(max_examples=100, deadline=None)
@given(turn_sizes(), st.integers(200, 600))
def test_cuts_are_rare_steps_not_one_per_turn(sizes: list[tuple[int, int, bool]], budget: int) -> None:
    """After a cut to the low-water mark, the turns that follow append to it until the window is
    full again: the next turn cuts again only when it added the room a cut frees."""
    prompts = converse(sizes, budget, 0.6)
    for i in range(1, len(prompts) - 1):
        messages, held, total = prompts[i]
        # (A cut that kept the answer before the request without its question, a turn too large
        # for the low water: the next turn's head may not begin with it, and is cut again.)
        if not held and not prompts[i + 1][1] and total <= 0.6 * budget and not begins_with_answer(messages):
            asked, answered, calls = sizes[i]
            added = 4 + answered + (5 + 4 + answered if calls else 0) + 4 + sizes[i + 1][0]
            assert total + added > budget - 10  # (10: the marker may appear)


def test_a_long_conversation_holds_its_head_between_cuts() -> None:
    """30 short turns in a small window: a few cuts, every other turn an unchanged head."""
    prompts = converse([(20, 10, False)] * 30, 400, 0.6)
    cuts = [i for i, (_, held, _) in enumerate(prompts) if not held]
    assert 2 <= len(cuts) <= 8
    assert all(total <= 400 for _, _, total in prompts)
    assert all(total >= 0.45 * 400 for _, _, total in prompts[cuts[0] :])


def test_the_count_limit_is_cut_in_steps_too() -> None:
    """max_history_messages: past it, the history is cut to cut_to of it, not by one turn."""
    prompts = converse([(3, 3, False)] * 40, 10_000, 0.5, max_msgs=20)
    held = [h for _, h, _ in prompts]
    assert held.count(False) <= 5 and held[-5:].count(True) >= 3


def test_head_from_a_context_snapshot() -> None:
    assert Head.of({"window_from": "r1#0", "summary_version": 3}) == Head("r1#0", 3)
    assert Head.of({"window_from": None, "summary_version": None}) == Head(None, None)
    assert Head.of({"truncated": 2}) is None  # recorded before heads: unknown
    assert Head.of({"window_from": 5, "summary_version": True}) == Head(None, None)


def test_a_cut_keeps_the_question_of_a_tool_exchange_it_keeps_when_the_window_holds_it() -> None:
    """Cut to the low water (4 of 8 messages), a tool turn (question, calls, two results,
    answer: 5 messages) lost its question: the prompt began with the assistant's calls, which
    chat templates requiring user/assistant alternation refuse, though 8 messages held it."""
    calls = [
        {"id": f"c{k}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for k in (1, 2)
    ]
    turn = [
        u("look it up"),
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        a("found it"),
    ]
    conversation = [*turn, *turn, u("and now?")]
    window = fit_window(
        system=SYSTEM,
        system_tokens=[count(m) for m in SYSTEM],
        conversation=conversation,
        conversation_tokens=[count(m) for m in conversation],
        first_new=len(conversation) - 1,
        budget=100_000,
        max_history_messages=8,
        marker_tokens=marker_tokens,
        cut_share=0.6,
    )
    assert [m["role"] for m in window.messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
    ]
