"""`gateway tail` as someone who knows `tail -f` types it."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from gateway.cli import main


@pytest.mark.parametrize("args", [["-f", "c1"], ["c1", "-f"], ["--follow", "c1"], ["c1"]])
def test_tail_takes_f_and_follow(args: list[str]) -> None:
    """Was: "No such option: -f". Following is the default: the flag is taken and changes nothing."""
    context = main.commands["tail"].make_context("tail", list(args))
    assert context.params["conversation_id"] == "c1"


def test_tail_help_says_following_is_the_default() -> None:
    result = CliRunner().invoke(main, ["tail", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "-f, --follow" in result.output and "the default" in result.output
