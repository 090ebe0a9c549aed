"""The command table of docs/cli.md is the `gateway` command: every command, and every option of
each, in both directions (the table may not name what does not exist, nor leave anything out)."""

from __future__ import annotations

import re

import click

from gateway.cli import main
from tests.conftest import REPO

COMMON = {"--config", "--data-dir", "--help"}  # on every command; said once above the table
PAGE = REPO / "docs" / "cli.md"


def documented_commands() -> dict[str, str]:
    """{command name: its usage cell} from the table under "## Commands" in docs/cli.md."""
    text = PAGE.read_text(encoding="utf-8")
    assert "\n## Commands\n" in text, "docs/cli.md: no '## Commands' section"
    section = text.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"^\| `gateway ([a-z-]+)([^`]*)` \|", line)
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} twice in the table of docs/cli.md"
            rows[match.group(1)] = match.group(2)
    assert rows, "docs/cli.md: no command table under '## Commands'"
    return rows


def cli_options(command: click.Command) -> set[str]:
    names = set()
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(n for n in param.opts if n.startswith("--"))
    return names - COMMON


def cli_arguments(command: click.Command) -> int:
    return sum(isinstance(param, click.Argument) for param in command.params)


def test_the_table_names_every_command_and_only_those() -> None:
    assert set(documented_commands()) == set(main.commands)


def test_each_row_names_every_option_of_its_command_and_only_those() -> None:
    for name, usage in documented_commands().items():
        command = main.commands[name]
        assert set(re.findall(r"--[a-z][a-z-]*", usage)) == cli_options(command), name
        # Positional arguments are the bare capitals outside [...] not after an option.
        bare = re.sub(r"\[[^]]*\]", "", usage)
        bare = re.sub(r"--[a-z-]+ [A-Z_]+", "", bare)
        assert len(re.findall(r"\b[A-Z][A-Z_]*\b", bare)) == cli_arguments(command), name


def test_every_command_takes_config_and_data_dir() -> None:
    """The sentence above the table: every command accepts --config and --data-dir."""
    for name, command in main.commands.items():
        opts = {n for p in command.params if isinstance(p, click.Option) for n in p.opts}
        assert {"--config", "--data-dir"} <= opts, name
