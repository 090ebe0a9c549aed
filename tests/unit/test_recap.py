"""The recap message: a conversation whose lines do not all fit keeps its newest ones."""

from __future__ import annotations

from zoneinfo import ZoneInfo

from gateway.context.recap_text import recap_message
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


def test_a_recap_too_large_for_a_small_window_is_packed_again_not_cut_from_its_end() -> None:
    """Built at recap_max_tokens, a recap sized to a 512-token window was cut from its end: the
    newest conversation kept its oldest line, cut mid-sentence, and the manifest still named a
    conversation no longer in the text."""
    from gateway.context.recap_text import recap_conversations, shrink_recap

    newest = [f"user: detail number {i} of the trip, with a few more words to it" for i in range(6)]
    newest.append("user: aisle seat, row 12")
    older = [f"user: an older topic, line {i}" for i in range(4)]
    candidates = [(2000.0, "trip", newest), (1000.0, "other", older)]
    full, used = recap_message(candidates, ZoneInfo("UTC"), max_tokens=300, count=count)
    assert full is not None and used == ["trip", "other"] == recap_conversations(full)
    small, kept = shrink_recap(full, 70, count)
    assert small is not None and count(small) <= 70
    text = str(small["content"])
    assert text.startswith("Earlier today (UTC)") and "aisle seat, row 12" in text
    assert "  …" in text and "detail number 0" not in text  # its newest lines, after the mark
    assert kept == ["trip"] == recap_conversations(small)
    assert all(line in str(full["content"]) for line in text.split("\n") if line != "  …")  # whole lines
    assert shrink_recap(full, 400, count)[0] == full
