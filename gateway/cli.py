"""The `gateway` command: serve, demo, and read-only views of the data dir (no server needed)."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from collections.abc import Awaitable, Callable
from datetime import datetime
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click
import orjson

from gateway.config import Settings, load_settings
from gateway.context import Message, Turn
from gateway.exceptions import GatewayError, NotFound
from gateway.services import Services

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def _common(func: F) -> F:
    """--config and --data-dir on every command; errors become one line and exit 1."""

    @click.option(
        "--config",
        "config_path",
        type=click.Path(),
        default=None,
        help="Config file (default config/gateway.toml).",
    )
    @click.option(
        "--data-dir",
        "data_dir",
        type=click.Path(),
        default=None,
        help="Data directory (overrides storage.data_dir).",
    )
    @wraps(func)
    def wrapper(*args: Any, config_path: str | None, data_dir: str | None, **kwargs: Any) -> Any:
        try:
            overrides: dict[str, Any] = {}
            if data_dir is not None:
                overrides["storage"] = {"data_dir": data_dir}
            settings = load_settings(config_path, overrides=overrides)
            return func(settings, *args, config_path=config_path, **kwargs)
        except GatewayError as exc:
            click.echo(f"gateway: {exc.message}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def _no_conversation(settings: Settings, conversation_id: str) -> GatewayError:
    return GatewayError(f"no conversation {conversation_id!r} in {settings.storage.data_dir}")


def _run(settings: Settings, work: Callable[[Services], Awaitable[T]], *, writes: bool = False) -> T:
    """Run `work` with the services of the configured store (jsonl or postgres), then close it."""

    async def main() -> T:
        async with Services.for_command(settings, writes=writes) as services:
            return await work(services)

    return asyncio.run(main())


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def _text(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(str(p.get("text", f"[{p.get('type')}]")) for p in content if isinstance(p, dict))
    text = content if isinstance(content, str) else ""
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        text += f"\n→ call {fn.get('name')}({fn.get('arguments')}) [{call.get('id')}]"
    if message.get("role") == "tool":
        text = f"[{message.get('tool_call_id')}] {text}"
    return text


def _render_message(message: Message, *, tokens: int | None = None, note: str = "") -> str:
    role = str(message.get("role", "?"))
    head = click.style(f"{role:>9}", bold=True, fg={"user": "cyan", "assistant": "green"}.get(role, "yellow"))
    extra = []
    if tokens is not None:
        extra.append(f"{tokens} tok")
    if message.get("is_feedback"):
        extra.append("feedback")
    if note:
        extra.append(note)
    suffix = click.style(f"  ({', '.join(extra)})", dim=True) if extra else ""
    body = textwrap.indent(_text(message), " " * 11).lstrip()
    return f"{head}  {body}{suffix}"


def _render_turn(turn: Turn, model: str = "") -> str:
    from gateway.tokens import count_message

    lines = [click.style(f"── {turn.response_id}", dim=True)]
    if turn.system is not None:
        lines += [
            _render_message(m, tokens=count_message(m, model), note="new system prompt") for m in turn.system
        ]
    lines += [_render_message(m, tokens=count_message(m, model)) for m in turn.input]
    if turn.output is not None:
        lines.append(_render_message(turn.output, tokens=count_message(turn.output, model)))
    return "\n".join(lines)


_LAYERS = [
    ("system", "S", "yellow"),
    ("summary", "Σ", "magenta"),
    ("recap", "R", "blue"),
    ("history", "h", "cyan"),
    ("marker", "m", "white"),
    ("new", "N", "green"),
]


def _render_context(record: dict[str, Any], *, show_messages: bool) -> None:
    """The manifest: how the window was filled, what was left out, and what was sent."""
    if record.get("stateless"):
        click.echo(
            f"context      stateless pass-through: {record.get('sent_messages')} messages sent as given"
        )
    else:
        budget = int(record.get("budget") or 0)
        tokens = record.get("tokens") or {}
        click.echo(
            f"window       {record.get('context_window')} tokens, reserve {record.get('reserve_tokens')}, "
            f"budget {budget} ({record.get('encoding')})"
        )
        if record.get("context_window_source"):
            click.echo(f"window from  {record['context_window_source']}")
        calibration = record.get("calibration")
        if isinstance(calibration, dict):
            click.echo(
                f"counting     provider ≈ {calibration.get('ratio')} x ours + {calibration.get('overhead')}"
                f" + margin {calibration.get('margin')} ({calibration.get('samples')} prompts observed)"
            )
        refusal = record.get("after_refusal")
        if isinstance(refusal, dict):
            click.echo(f"refitted     after the provider refused: {refusal.get('message')}")
        click.echo(
            "tokens       "
            + " | ".join(f"{name} {tokens.get(name, 0)}" for name, _, _ in _LAYERS)
            + f" | total {tokens.get('total', 0)}"
        )
        width = 60
        bar = ""
        for name, char, color in _LAYERS:
            cells = round(width * int(tokens.get(name, 0)) / budget) if budget else 0
            bar += click.style(char * cells, fg=color)
        free = max(0, width - len(click.unstyle(bar)))
        click.echo(f"             [{bar}{'·' * free}] budget")
        click.echo(
            f"stored       {record.get('stored_messages')} messages in {record.get('stored_turns')} turns; "
            f"sent {record.get('sent_messages')} messages; {record.get('new_messages')} new"
        )
        truncated = record.get("truncated") or 0
        click.echo(
            f"truncated    {truncated} earlier messages omitted" if truncated else "truncated    nothing"
        )
        if record.get("summary_version") is not None:
            covers = record.get("summary_covers_messages")
            through = record.get("summary_covers_through")
            version = record.get("summary_version")
            click.echo(f"summary      v{version} covers {covers} messages, through {through}")
        included = record.get("included_response_ids") or []
        if included:
            click.echo(f"included     {len(included)} responses: {included[0]} … {included[-1]}")
    if show_messages:
        click.echo("sent (exact):")
        for m in record.get("messages") or []:
            click.echo("  " + _render_message(m))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gateway")
def main() -> None:
    """A conversation-continuity gateway for LLM providers (OpenAI-compatible proxy)."""


@main.command()
@_common
@click.option("--host", default=None, help="Bind address (default server.host).")
@click.option("--port", type=int, default=None, help="Port (default server.port).")
@click.option("--workers", type=int, default=1, show_default=True, help="Worker processes.")
@click.option("--log-level", default="info", show_default=True)
def serve(
    settings: Settings,
    *,
    config_path: str | None,
    host: str | None,
    port: int | None,
    workers: int,
    log_level: str,
) -> None:
    """Run the gateway."""
    from gateway.server import serve as run

    # Workers build their own app from the environment, so flags travel as env overrides.
    if config_path is not None:
        os.environ["GATEWAY_CONFIG"] = config_path
    if host is not None:
        os.environ["GATEWAY_SERVER__HOST"] = host
    if port is not None:
        os.environ["GATEWAY_SERVER__PORT"] = str(port)
    os.environ["GATEWAY_STORAGE__DATA_DIR"] = settings.storage.data_dir
    settings = load_settings(config_path)
    asyncio.run(Services.check_store(settings))
    run(settings, workers=workers, log_level=log_level)



@main.command()
@_common
def demo(settings: Settings, *, config_path: str | None) -> None:
    """Show continuity end to end on the built-in demo model (no provider needed)."""
    from gateway.demo import run_demo

    run_demo(settings)


@main.command()
@_common
@click.option("--limit", type=int, default=50, show_default=True)
def conversations(settings: Settings, *, config_path: str | None, limit: int) -> None:
    """Table of conversations, most recently active first."""

    async def collect(services: Services) -> list[tuple[Any, str, float | None, int]]:
        rows, _ = await services.queries.conversations("", limit=limit)
        return [(row.summary, row.state.state, row.view.last_activity, row.state.attempts) for row in rows]

    rows = _run(settings, collect)
    if not rows:
        click.echo(f"no conversations in {settings.storage.data_dir}")
        return
    click.echo(
        f"{'conversation':<32} {'turns':>6} {'messages':>9} {'tokens':>8}  {'last activity':<19}  state"
    )
    for row, state, last, attempts in rows:
        when = _when(last or row.last_activity)
        shown = state if not attempts else f"{state} (attempts {attempts})"
        click.echo(
            f"{row.conversation_id:<32} {row.turns:>6} {row.messages:>9} {row.tokens:>8}  {when:<19}  {shown}"
        )


@main.command()
@_common
@click.argument("conversation_id")
@click.option("--json", "as_json", is_flag=True, help="Print the history as JSON.")
def show(settings: Settings, *, config_path: str | None, conversation_id: str, as_json: bool) -> None:
    """The conversation's history as the model will see it."""
    from gateway.tokens import count_message

    async def read(services: Services) -> tuple[Any, list[Turn]]:
        view = await services.queries.view("", conversation_id)
        return view, await services.queries.turns("", conversation_id) if view.turns else []

    view, turns = _run(settings, read)
    if not view.turns:
        raise GatewayError(f"no conversation {conversation_id!r} in {settings.storage.data_dir}")
    if as_json:
        out = {
            "conversation_id": conversation_id,
            "system": view.system,
            "messages": [*(view.system or []), *view.history],
            "turns": [t.to_dict() for t in turns],
        }
        click.echo(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return
    total = 0
    for m in view.system or []:
        n = count_message(m)
        total += n
        click.echo(_render_message(m, tokens=n, note="system prompt"))
    for turn in turns:
        if turn.is_feedback_only:
            click.echo(click.style(f"── {turn.response_id} (feedback turn: not replayed)", dim=True))
            continue
        click.echo(click.style(f"── {turn.response_id}", dim=True))
        for m in [*turn.input, *([turn.output] if turn.output is not None else [])]:
            if m.get("is_feedback"):
                click.echo(_render_message(m, note="not replayed"))
                continue
            n = count_message(m)
            total += n
            click.echo(_render_message(m, tokens=n))
    click.echo(
        click.style(
            f"{view.turns} turns, {len(view.history)} messages, {total} tokens (cl100k_base)", dim=True
        )
    )


@main.command()
@_common
@click.argument("conversation_id")
@click.option("--poll", type=float, default=0.5, show_default=True, help="Seconds between checks.")
def tail(settings: Settings, *, config_path: str | None, conversation_id: str, poll: float) -> None:
    """Follow a conversation live, rendered (Ctrl-C to stop)."""
    from gateway.ids import check_conversation_id

    check_conversation_id(conversation_id)

    async def follow(services: Services) -> None:
        async for turn in services.queries.follow("", conversation_id, poll):
            click.echo(_render_turn(turn))

    where = f"{settings.storage.data_dir}/logs/conversations/{conversation_id}.jsonl"
    if settings.storage.backend != "jsonl":
        where = f"conversation {conversation_id} ({settings.storage.backend})"
    click.echo(click.style(f"following {where} (Ctrl-C to stop)", dim=True))
    try:
        _run(settings, follow)
    except KeyboardInterrupt:
        pass


@main.command()
@_common
@click.argument("response_id")
@click.option("--json", "as_json", is_flag=True, help="Print the raw response log records.")
@click.option("--brief", is_flag=True, help="Leave out the exact list of messages sent.")
def context(
    settings: Settings, *, config_path: str | None, response_id: str, as_json: bool, brief: bool
) -> None:
    """What was recorded for one response: request, context snapshot, reply, outcome."""
    records = _run(settings, lambda services: services.queries.records("", response_id))
    if as_json:
        for record in records:
            click.echo(orjson.dumps(record).decode())
        return
    for record in records:
        kind = record.get("type")
        if kind == "request":
            click.echo(f"response     {record.get('response_id')}")
            click.echo(f"conversation {record.get('conversation_id')}")
            target = f"{record.get('provider')}:{record.get('upstream_model')}"
            click.echo(f"model        {record.get('model')} → {target}")
            click.echo(f"created      {_when(record.get('created') or 0)}")
            for m in record.get("system") or []:
                click.echo(_render_message(m, note="new system prompt"))
            for m in record.get("input") or []:
                click.echo(_render_message(m, note="new"))
        elif kind == "context":
            _render_context(record, show_messages=not brief)
        elif kind == "response":
            click.echo(
                _render_message(record.get("message") or {}, note=f"finish={record.get('finish_reason')}")
            )
            click.echo(f"usage        {record.get('usage')}")
            click.echo(f"timings      {record.get('timings')}")
        elif kind == "commit":
            click.echo(click.style("committed    yes", fg="green"))
        elif kind == "incomplete":
            click.echo(click.style(f"incomplete   {record.get('reason')}: {record.get('error')}", fg="red"))


@main.command()
@_common
@click.argument("conversation_id")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def delete(settings: Settings, *, config_path: str | None, conversation_id: str, yes: bool) -> None:
    """Delete a conversation: its index, responses and summaries (or archive them if
    storage.archive_deleted is set). Safe while a gateway is running on the same data dir."""
    from gateway.ids import check_conversation_id

    check_conversation_id(conversation_id)
    if not yes and not click.confirm(f"Delete conversation {conversation_id!r}?", default=False):
        raise GatewayError("not deleted")

    async def run(services: Services) -> None:
        try:
            await services.conversations.delete("", conversation_id)
        except NotFound:
            raise _no_conversation(settings, conversation_id) from None

    _run(settings, run, writes=True)
    verb = "archived" if settings.storage.archive_deleted else "deleted"
    click.echo(f"{verb} {conversation_id}")


@main.command()
@_common
@click.argument("conversation_id")
@click.option("--keep-system-message", is_flag=True, help="Keep the system prompt.")
def reset(
    settings: Settings, *, config_path: str | None, conversation_id: str, keep_system_message: bool
) -> None:
    """Start a conversation afresh: appends a reset marker to its index (nothing is rewritten)."""

    async def run(services: Services) -> None:
        try:
            await services.conversations.reset("", conversation_id, keep_system_message=keep_system_message)
        except NotFound:
            raise _no_conversation(settings, conversation_id) from None

    _run(settings, run, writes=True)
    click.echo(f"reset {conversation_id}" + (" (system prompt kept)" if keep_system_message else ""))


# -- moving conversations between backends: the JSONL layout is the interchange format ----------


@main.command(name="export")
@_common
@click.option(
    "--to", "to_dir", required=True, type=click.Path(file_okay=False), help="Folder to write (empty or new)."
)
def export_command(settings: Settings, *, config_path: str | None, to_dir: str) -> None:
    """Write every conversation of the configured backend (all tenants) to DIR in the JSONL
    layout: logs/, archive/ and tenants/ exactly as the jsonl backend keeps them."""
    from gateway.services.transfer import export_data

    click.echo(export_data(settings, Path(to_dir)))


@main.command(name="import")
@_common
@click.option(
    "--from",
    "from_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="A JSONL data dir or an export (logs/, archive/, tenants/).",
)
def import_command(settings: Settings, *, config_path: str | None, from_dir: str) -> None:
    """Load conversations from DIR (the JSONL layout) into the configured backend. Refuses
    conversations (or files) that already exist there; imports all of a tenant or none of it."""
    from gateway.services.transfer import import_data

    click.echo(import_data(settings, Path(from_dir)))
