"""What the command line prints of stored records."""

from __future__ import annotations


def test_the_manifest_line_adds_up_and_a_cancelled_attempt_says_only_that(capsys: object) -> None:
    """`gateway context` printed `cancelled: None`, and its token line left out the overhead,
    so the layers shown did not add up to the total."""
    from gateway.cli_render import render_log

    context = {"type": "context", "tokens": {"system": 5, "new": 7, "overhead": 3, "total": 15}}
    render_log([context, {"type": "incomplete", "reason": "cancelled", "error": None}], show_messages=False)
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "overhead 3 | total 15" in out and "server count" not in out
    render_log([{**context, "server_prompt_tokens": 21}], show_messages=False)
    assert "server count 21 tokens" in capsys.readouterr().out  # type: ignore[attr-defined]
    assert "incomplete   cancelled\n" in out and "cancelled: None" not in out


def test_an_attempt_without_an_ending_is_in_progress_or_interrupted(capsys: object) -> None:
    """`gateway context` of an attempt whose process was killed mid-turn ended after the
    window it sent, without saying the attempt never ended."""
    import socket

    from gateway.cli_render import render_log
    from gateway.writers import writer

    def attempt(name: str) -> str:
        request = {"type": "request", "response_id": "m-0123456789ab", "writer": name, "input": []}
        render_log([request, {"type": "context", "tokens": {"total": 3}}], show_messages=False)
        return capsys.readouterr().out  # type: ignore[attr-defined, no-any-return]

    assert "in progress  (no answer recorded yet)" in attempt(writer())
    gone = attempt(f"{socket.gethostname()}/999999999/1")
    assert "incomplete   interrupted: the gateway process handling it stopped before it ended" in gone


def test_a_message_no_longer_sent_is_faint_to_its_end() -> None:
    """Faintness put around the whole was ended by the role's own style: its text read as sent."""
    from gateway.cli_render import render_message

    shown = render_message({"role": "user", "content": "hello there"}, note="no longer sent", dim=True)
    assert "\x1b[2mhello there" in shown and "\x1b[1m" not in shown
    assert "\x1b[1m" in render_message({"role": "user", "content": "hello there"})  # (sent: bold role)
