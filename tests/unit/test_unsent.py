"""`Unsent`: which stored messages the model no longer gets, and why (shown by `gateway show`
and the inspector alike)."""

from __future__ import annotations

from typing import Any

from gateway.context import ConversationView, Turn
from gateway.context.unsent import BRANCHED, CALL_GONE, DELETED, FEEDBACK, REPLACED, RESET, Unsent


def turn(rid: str, input: list[dict[str, Any]], output: dict[str, Any], **kw: Any) -> Turn:
    return Turn(response_id=rid, input=input, output=output, **kw)


def user(text: str, **kw: Any) -> dict[str, Any]:
    return {"role": "user", "content": text, **kw}


def test_every_reason_a_message_is_no_longer_given() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    view = ConversationView()
    view.extend(
        turn("r1", [{"role": "system", "content": "S1"}, user("a")], {"role": "assistant", "content": "A"})
    )
    view.extend(turn("r2", [user("b")], {"role": "assistant", "content": None, "tool_calls": [call]}))
    view.extend(
        turn(
            "r3",
            [{"role": "tool", "tool_call_id": "c1", "content": "42"}],
            {"role": "assistant", "content": "C"},
        )
    )
    view.extend(
        turn("r4", [user("this was rude", is_feedback=True)], {"role": "assistant", "content": "sorry"})
    )
    view.apply_marker({"type": "delete_item", "response_id": "r2", "position": 1})  # the call
    view.apply_marker({"type": "delete_item", "response_id": "r1", "position": 1})  # "A"
    view.extend(
        turn(
            "r5",
            [user("d")],
            {"role": "assistant", "content": "D"},
            system=[{"role": "system", "content": "S2"}],
        )
    )
    unsent = Unsent(view)
    answer = {"role": "assistant", "content": "A"}
    assert unsent.of_turn("r1", [user("a")], answer, [{"role": "system", "content": "S1"}]) == {
        1: DELETED,
        -1: REPLACED,
    }
    assert unsent.of_turn("r2", [user("b")], answer) == {1: DELETED}
    assert unsent.of_turn("r3", [{"role": "tool", "tool_call_id": "c1", "content": "42"}], answer) == {
        0: CALL_GONE
    }
    assert unsent.of_turn("r4", [user("rude", is_feedback=True)], answer) == {0: FEEDBACK, 1: FEEDBACK}
    assert unsent.why("r5", 0) is None and unsent.why("gone", 0) == BRANCHED


def test_what_a_reset_took_away_says_so() -> None:
    """Messages before a reset read "left behind by a branch", and their system prompt "replaced
    by a later system prompt": there had been neither."""
    system = [{"role": "system", "content": "S"}]
    view = ConversationView()
    view.extend(turn("r1", [user("a")], {"role": "assistant", "content": "A"}, system=system))
    view.apply_marker({"type": "reset", "keep_system_message": False})
    view.extend(turn("r2", [user("b")], {"role": "assistant", "content": "B"}))
    kept = ConversationView()
    kept.extend(turn("k1", [user("a")], {"role": "assistant", "content": "A"}, system=system))
    kept.apply_marker({"type": "reset", "keep_system_message": True})
    kept.extend(
        turn(
            "k2",
            [user("b")],
            {"role": "assistant", "content": "B"},
            system=[{"role": "system", "content": "S2"}],
        )
    )
    answer = {"role": "assistant", "content": "A"}
    assert Unsent(view).of_turn("r1", [user("a")], answer, system) == {0: RESET, 1: RESET, -1: RESET}
    assert Unsent(view).of_turn("r2", [user("b")], answer) == {}
    assert Unsent(kept).of_turn("k1", [user("a")], answer, system) == {0: RESET, 1: RESET, -1: REPLACED}
