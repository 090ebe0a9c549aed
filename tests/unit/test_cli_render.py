"""What the command line prints of stored records."""

from __future__ import annotations


def test_the_manifest_line_adds_up_and_a_cancelled_attempt_says_only_that(capsys: object) -> None:
    """`gateway context` printed `cancelled: None`, and its token line left out the overhead,
    so the layers shown did not add up to the total."""
    from gateway.cli_render import render_log

    context = {"type": "context", "tokens": {"system": 5, "new": 7, "overhead": 3, "total": 15}}
    render_log([context, {"type": "incomplete", "reason": "cancelled", "error": None}], show_messages=False)
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "overhead 3 | total 15" in out
    assert "incomplete   cancelled\n" in out and "cancelled: None" not in out
