"""The recap message: a conversation whose lines do not all fit keeps its newest ones."""

from __future__ import annotations

from zoneinfo import ZoneInfo

from gateway.context.lifecycle import recap_message
from gateway.tokens import count_message


def count(message: dict[str, object]) -> int:
    return count_message(message, "gpt-4o")


def test_a_conversation_too_long_for_the_recap_keeps_its_newest_lines() -> None:
    lines = [f"user: turn {i} " + "words " * 20 for i in range(12)]
    message, used = recap_message(
        [(1_700_000_000.0, "long", lines)], ZoneInfo("UTC"), max_tokens=150, count=count
    )
    assert message is not None and used == ["long"]  # it was left out whole
    text = str(message["content"])
    assert "turn 11" in text and "turn 0 " not in text  # the newest, not the oldest
    assert count(message) <= 150
    kept = [line for line in lines if line.split(" words")[0] + " " in text]
    assert kept == lines[-len(kept) :]  # a run of the newest lines, in order


def test_the_newest_conversation_first_and_each_within_what_is_left() -> None:
    a = [f"user: a{i} " + "words " * 20 for i in range(3)]
    b = [f"user: b{i} " + "words " * 20 for i in range(3)]
    message, used = recap_message(
        [(1_700_000_100.0, "b", b), (1_700_000_000.0, "a", a)], ZoneInfo("UTC"), max_tokens=120, count=count
    )
    assert message is not None and used[0] == "b"
    assert count(message) <= 120
