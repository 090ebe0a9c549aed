"""The `gateway` command: serve, demo, and read-only views of the data dir (no server needed)."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import click
import orjson

from gateway.cli_frame import (
    GatewayGroup,
    common_options,
    notice_missing_litellm,
    notice_unset_keys,
    run_with_services,
    say_notice,
)
from gateway.cli_render import (
    cache_text,
    render_compaction,
    render_log,
    render_marker,
    render_message,
    render_summary_line,
    render_turn,
    render_window_marker,
    turn_heading,
    when,
)
from gateway.config import Settings, load_settings
from gateway.context import Turn
from gateway.context.history import clean_message, message_key, repair_tool_calls
from gateway.context.summary import is_summary_message
from gateway.context.unsent import RESET, Unsent
from gateway.exceptions import GatewayError, NoGatewayData, NotFound
from gateway.services import Services
from gateway.services.listing import stored_tokens
from gateway.types import Message, Record

F = TypeVar("F", bound=Callable[..., Any])


def _where(settings: Settings) -> str:
    """Where the configured store keeps its conversations, for messages: a data dir as given."""
    storage = settings.storage
    return storage.data_dir if storage.backend == "jsonl" else storage.where()


def _no_conversation(settings: Settings, conversation_id: str) -> GatewayError:
    return GatewayError(f"no conversation {conversation_id!r} in {_where(settings)}")


def _need_data_dir(settings: Settings, conversation_id: str) -> None:
    """A command changing a conversation in a data dir that is not there: no such conversation
    (opening the store made the folders, leaving a mistyped --data-dir behind)."""
    if settings.storage.backend == "jsonl" and not Path(settings.storage.data_dir).exists():
        raise _no_conversation(settings, conversation_id)


_TENANT = re.compile(r"^t[0-9a-f]{16}$")


def _tenant_option(func: F) -> F:
    """--tenant on the commands that read or change one conversation or response."""
    return click.option(
        "--tenant",
        default=None,
        help="With [auth] keys: the tenant (its t… folder, as `gateway conversations` shows it; "
        "'default' for data written without a key). Default: wherever the id is found.",
    )(func)


def _checked_tenant(tenant: str | None) -> str | None:
    if tenant is None:
        return None
    if tenant == "default":
        return ""
    if not _TENANT.match(tenant):
        raise GatewayError(f"invalid --tenant {tenant!r}: a t… folder name (t + 16 hex digits) or 'default'")
    return tenant


def _shown_tenant(tenant: str) -> str:
    return tenant or "default"


async def _find_tenant(
    services: Services, tenant: str | None, read: Callable[[str], Awaitable[list[Any]]], what: str
) -> tuple[str, bool]:
    """(the tenant, whether `what` is there): --tenant's, else the one holding `what`, else the default one.

    Found by `read` (nothing, or NotFound, is not there); in several: an error asking for --tenant."""

    async def holds(name: str) -> bool:
        try:
            return bool(await read(name))
        except NotFound:
            return False

    chosen = _checked_tenant(tenant)
    if chosen is not None:
        return chosen, await holds(chosen)
    found = [t for t in await services.sessions.tenants() if await holds(t)]
    if len(found) > 1:
        shown = ", ".join(_shown_tenant(t) for t in found)
        raise GatewayError(f"{what} exists under several tenants ({shown}): name one with --tenant")
    return (found[0], True) if found else ("", False)


async def _conversation_tenant(services: Services, tenant: str | None, cid: str) -> tuple[str, bool]:
    """Where conversation `cid` is (see `_find_tenant`); a conversation just reset counts."""
    return await _find_tenant(
        services, tenant, lambda name: services.queries.index(name, cid), f"conversation {cid!r}"
    )


@click.group(cls=GatewayGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llm-continuity-gateway")
def main() -> None:
    """A conversation-continuity gateway for LLM providers (OpenAI-compatible proxy)."""


@main.command()
@common_options
@click.option("--host", default=None, help="Bind address (default server.host).")
@click.option("--port", type=int, default=None, help="Port (default server.port).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help="Worker processes.")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error", "critical"], case_sensitive=False),
    default="info",
    show_default=True,
)
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
    # A taken port is said before the store's folders are made (nothing is left behind).
    from gateway.server import bind

    bind(settings.server.host, settings.server.port).close()
    from gateway.tenants import Tenants

    Tenants.from_settings(settings)  # keys named but none found: one line, before anything starts
    asyncio.run(Services.check_store(settings))
    say_notice()
    notice_missing_litellm(settings)
    notice_unset_keys(settings)
    run(settings, workers=workers, log_level=log_level)


@main.command()
@common_options
@click.option(
    "--port", type=click.IntRange(0, 65535), default=0, help="Port on 127.0.0.1 (default: a free one)."
)
def demo(settings: Settings, *, config_path: str | None, port: int) -> None:
    """Show continuity end to end on the built-in demo model (no provider needed)."""
    from gateway.demo import run_demo

    run_demo(settings, port=port, config_path=config_path)


@main.command("example-config")
@click.option("--config", "config_path", default=None, help="Accepted, not read.")
@click.option("--data-dir", default=None, help="Accepted, not used.")
def example_config(config_path: str | None, data_dir: str | None) -> None:
    """Print the commented config file shipped with the gateway.

    `gateway example-config > gateway.toml`, then edit it: every key, its default and what it does."""
    click.echo((Path(__file__).resolve().parent / "data" / "gateway.toml").read_text(), nl=False)


@main.command()
@common_options
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True)
@_tenant_option
def conversations(settings: Settings, *, config_path: str | None, limit: int, tenant: str | None) -> None:
    """Table of conversations, most recently active first (every tenant's, unless --tenant)."""
    chosen = _checked_tenant(tenant)

    async def collect(services: Services) -> tuple[list[tuple[str, Any, str, float | None, int]], bool]:
        tenants = [chosen] if chosen is not None else await services.sessions.tenants()
        rows = []
        for name in tenants:
            page, _ = await services.queries.conversations(name, limit=limit)
            for row in page:
                last = row.listing.last_activity
                rows.append((name, row.summary, row.state.state, last, row.state.attempts))
        rows.sort(key=lambda r: r[3] or r[1].last_activity or 0.0, reverse=True)
        return rows[:limit], len(tenants) > 1 or bool(chosen)

    rows, by_tenant = run_with_services(settings, collect)
    if not rows:
        click.echo(f"no conversations in {_where(settings)}")
        return
    head = f"{'tenant':<18} " if by_tenant else ""
    click.echo(
        f"{head}{'conversation':<32} {'turns':>6} {'messages':>9} {'tokens':>8}  {'last activity':<19}  state"
    )
    for name, row, state, last, attempts in rows:
        at = when(last or row.last_activity)
        shown = state if not attempts else f"{state} (attempts {attempts})"
        lead = f"{_shown_tenant(name):<18} " if by_tenant else ""
        counts = f"{row.turns:>6} {row.messages:>9} {row.tokens:>8}"
        click.echo(f"{lead}{row.conversation_id:<32} {counts}  {at:<19}  {shown}")


@main.command()
@common_options
@click.argument("conversation_id")
@click.option("--json", "as_json", is_flag=True, help="Print the history as JSON.")
@_tenant_option
def show(
    settings: Settings, *, config_path: str | None, conversation_id: str, as_json: bool, tenant: str | None
) -> None:
    """Print the conversation's history as the model will see it."""

    async def read(
        services: Services,
    ) -> tuple[Any, list[Turn], tuple[str, Record] | None, Any, list[Record]] | None:
        name, exists = await _conversation_tenant(services, tenant, conversation_id)
        if not exists:
            return None
        view = await services.queries.view(name, conversation_id)
        try:
            last = await services.queries.latest_context(name, conversation_id)
        except NotFound:
            last = None
        # The last turn's prompt figures: its size, and how much the provider's cache served.
        cache = await services.queries.prompt_cache(name, last[0]) if last else None
        compactions = await services.queries.compactions(name, conversation_id)
        return view, await services.queries.turns(name, conversation_id), last, cache, compactions

    found = run_with_services(settings, read)
    if found is None:
        raise _no_conversation(settings, conversation_id)
    view, turns, last, cache, compactions = found
    window = _last_window(last)
    # What the last turn sent (its snapshot is a full copy): a cut may fall inside a turn.
    sent_list = last[1].get("messages") if window is not None and last is not None else None
    sent_list = sent_list if isinstance(sent_list, list) else None
    if as_json:
        out = _show_json(conversation_id, view, turns, window, sent_list, cache, compactions)
        click.echo(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return
    _ShowText(view, window, sent_list).print(turns, compactions, cache)


def _last_window(last: tuple[str, Record] | None) -> dict[str, Any] | None:
    """What the last turn's window left out (cut, or folded into the summary); None: nothing."""
    if last is None:
        return None
    cut, covers = last[1].get("truncated"), last[1].get("summary_covers_messages")
    cut = cut if isinstance(cut, int) and cut > 0 else 0
    covers = covers if isinstance(covers, int) and covers > 0 else 0
    if not (cut or covers):  # all of the history was sent as it is
        return None
    ids = last[1].get("included_response_ids")
    ids = [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []
    return {
        "response_id": last[0],
        "omitted_messages": cut,
        "included_response_ids": ids,  # as the turn's manifest says them: in order, itself aside
        "included": {*ids, last[0]},
        "summary_version": last[1].get("summary_version") if covers else None,
        "summary_covers_messages": covers,
        "summary_covers_through": last[1].get("summary_covers_through") if covers else None,
    }


def _show_json(
    conversation_id: str,
    view: Any,
    turns: list[Turn],
    window: dict[str, Any] | None,
    sent_list: list[Any] | None,
    cache: Any,
    compactions: list[Record],
) -> dict[str, Any]:
    """`gateway show --json`: the history, its token counts and the last turn's window."""
    from gateway.tokens import count_message

    counts = stored_tokens(view)
    messages = [*(view.system or []), *repair_tool_calls(view.history)]
    by_message = {id(m): n for m, n in zip([*(view.system or []), *view.history], counts, strict=True)}
    # The rolling summary as the last turn sent it (its text is not a message).
    summary = next((m for m in (sent_list or []) if is_summary_message(m)), None)
    return {
        "conversation_id": conversation_id,
        "system": view.system,
        "recap": view.recap,  # sent after the system prompt on every turn (sized to the window)
        "messages": messages,
        "message_tokens": [by_message.get(id(m)) or count_message(m) for m in messages],
        "tokens": sum(counts),
        "turns": [t.to_dict() for t in turns],
        "compactions": [{k: v for k, v in c.items() if k != "type"} for c in compactions],
        "last_turn_cache": cache,
        "last_window": None
        if window is None
        else {
            "response_id": window["response_id"],
            "omitted_messages": window["omitted_messages"],
            "included_response_ids": window["included_response_ids"],
            "summary_version": window["summary_version"],
            "summary_covers_messages": window["summary_covers_messages"],
            "summary_covers_through": window["summary_covers_through"],
            "summary": summary if window["summary_version"] is not None else None,
        },
    }


class _ShowText:
    """`gateway show` for a terminal: every turn, what of it the model is given and why not."""

    def __init__(self, view: Any, window: dict[str, Any] | None, sent_list: list[Any] | None) -> None:
        self.view, self.window = view, window
        # Each message's tokens as `gateway conversations` counts them (its turn's count if any).
        self.counts = stored_tokens(view)
        system_count = len(view.system or [])
        pairs = zip(view.history_owner, view.history_pos, strict=True)
        self.stored_count = dict(zip(pairs, self.counts[system_count:], strict=True))
        self.window_keys = (
            {message_key(cast(Message, m)) for m in sent_list if isinstance(m, dict)}
            if sent_list is not None
            else None
        )
        self.live = set(view.history_owner)  # turns whose messages the model still gets
        self.unsent = Unsent(view)  # and which of their messages it no longer gets, and why
        self.marked = False
        # Turns up to the one the rolling summary covers through were sent as the summary; its
        # line follows that turn. Those after it, outside the window, were left out (the marker's).
        self.summarized = window is not None and window["summary_covers_through"] is not None
        self.in_window_total = 0

    def print(self, turns: list[Turn], compactions: list[Record], cache: Any) -> None:
        from gateway.tokens import count_message

        view = self.view
        for m, n in zip(view.system or [], self.counts, strict=False):
            self.in_window_total += n
            click.echo(render_message(m, tokens=n, note="system prompt"))
        if view.recap is not None:  # sent after the system prompt on every turn (sized to the window)
            note = "recap, earlier today"
            click.echo(render_message(view.recap, tokens=count_message(view.recap), note=note))
        after: dict[object, list[Record]] = {}  # compactions, by the turn they cover through
        for record in compactions:
            after.setdefault(record.get("covers_through"), []).append(record)
        previous: str | None = None
        for turn in turns:
            for record in after.pop(previous, []):  # (said after the turn it covers through)
                click.echo(click.style(f"── {render_compaction(record)}", fg="magenta"))
            previous = turn.response_id
            self.turn(turn)
        for record in after.pop(previous, []):
            click.echo(click.style(f"── {render_compaction(record)}", fg="magenta"))
        said = f"{view.turns} turn" + ("" if view.turns == 1 else "s")
        footer = f"{said}, {len(view.history)} messages, {sum(self.counts)} tokens"
        if self.window is not None:
            footer += f" ({self.in_window_total} of them in the last turn's window)"
        click.echo(click.style(footer, dim=True))
        if isinstance(cache, dict):
            click.echo(click.style(f"last turn: {cache_text(cache)}", dim=True))

    def aside(self, turn: Turn) -> str | None:
        """Why the model is not given this turn (None: it is)."""
        window = self.window
        if turn.response_id not in self.live:
            if turn.response_id in self.unsent.view.reset_away:
                return f"no longer sent to the model: {RESET}"
            return "no longer sent to the model: left behind by a branch, reset or deleted"
        if window is not None and turn.response_id not in window["included"]:
            where = f"outside the last turn's window ({window['response_id']})"
            return f"{where}: {'in the rolling summary' if self.summarized else 'left out'}"
        return None

    def in_window(self, turn: Turn, m: Message, pos: int) -> bool:
        """Was it in the last turn's window (or is it that turn's answer)?"""
        if self.window_keys is None or self.window is None:
            return True
        if turn.response_id == self.window["response_id"] and pos == len(turn.input):
            return True
        return message_key(clean_message(m)) in self.window_keys

    def turn(self, turn: Turn) -> None:
        window = self.window
        if turn.is_feedback_only:
            click.echo(click.style(f"── {turn.response_id} (feedback turn: not replayed)", dim=True))
            return
        messages = [*turn.input, *([turn.output] if turn.output is not None else [])]
        aside = self.aside(turn)
        if aside is not None:
            click.echo(click.style(f"── {turn.response_id} ({aside})", dim=True))
            live = turn.response_id in self.live  # (else the heading says why none of it is sent)
            for pos, m in enumerate(messages):
                why = self.unsent.why(turn.response_id, pos) if live else None  # deleted since, say
                note = f"{why}: no longer sent" if why is not None else ""
                click.echo(render_message(m, note=note, dim=True))
            if (
                window is not None
                and self.summarized
                and turn.response_id == window["summary_covers_through"]
            ):
                self.summarized = False
                render_summary_line(window)
            return
        if window is not None and not self.marked and messages and self.in_window(turn, messages[0], 0):
            self.marked = True
            render_window_marker(window)
        click.echo(click.style(turn_heading(turn), dim=True))
        for pos, m in enumerate(messages):
            self.message(turn, m, pos)

    def message(self, turn: Turn, m: Message, pos: int) -> None:
        from gateway.tokens import count_message

        if m.get("is_feedback"):
            click.echo(render_message(m, note="not replayed"))
            return
        why = self.unsent.why(turn.response_id, pos)  # deleted, cut by a later edit, or an orphan
        if why is not None:
            click.echo(render_message(m, note=f"{why}: no longer sent", dim=True))
            return
        n = self.stored_count.get((turn.response_id, pos)) or count_message(m)
        parts, given = self.unsent.parts(turn.response_id, pos)  # (deleted alone: the rest is sent)
        deleted = f"{', '.join(parts)} deleted: no longer sent" if parts else ""
        m = given or m  # (as the model is given it)
        if not self.in_window(turn, m, pos):
            outside = "outside the last turn's window: left out or summarized"
            note = f"{outside}; {deleted}" if deleted else outside
            click.echo(render_message(m, tokens=n, note=note, dim=True))
            return
        if self.window is not None and not self.marked:  # the window begins inside this turn
            self.marked = True
            render_window_marker(self.window)
        self.in_window_total += n
        click.echo(render_message(m, tokens=n, note=deleted))


def _poll_seconds(ctx: click.Context, param: click.Parameter, seconds: float) -> float:
    """0.01 to 3600 seconds: not 0, negative or nan (a busy loop)."""
    if not 0.01 <= seconds <= 3600:  # (false for nan too)
        raise click.BadParameter(f"{seconds} is not between 0.01 and 3600 seconds")
    return seconds


@main.command()
@common_options
@click.argument("conversation_id")
@click.option(
    "--poll",
    type=float,
    callback=_poll_seconds,
    default=0.5,
    show_default=True,
    help="Seconds between checks.",
)
@click.option(
    "-f",
    "--follow",
    is_flag=True,
    help="Follow the conversation, as `tail -f` does. This is the default: the flag changes nothing.",
)
@_tenant_option
def tail(
    settings: Settings,
    *,
    config_path: str | None,
    conversation_id: str,
    poll: float,
    follow: bool,
    tenant: str | None,
) -> None:
    """Follow a conversation live, rendered, like `tail -f` (Ctrl-C to stop).

    Its turns so far, then each new one as it lands; one that does not exist yet is waited for.
    Following is the default, so `-f`/`--follow` may be given or left out."""
    from gateway.ids import check_conversation_id

    check_conversation_id(conversation_id)

    def where(name: str) -> str:
        if settings.storage.backend != "jsonl":
            return f"conversation {conversation_id} ({settings.storage.backend})"
        folder = Path(settings.storage.data_dir) / ("tenants/" + name if name else "")
        return f"{folder / 'logs' / 'conversations' / conversation_id}.jsonl"

    async def watch(services: Services) -> None:
        name, exists = await _conversation_tenant(services, tenant, conversation_id)
        say_notice()
        if not exists and tenant is None and settings.auth.keys_env:
            # Whose it will be is not known yet (with gateway keys, each key's conversations are
            # kept apart): wait for its first turn under any of them, then follow it there.
            click.echo(
                click.style(
                    f"waiting for conversation {conversation_id}'s first turn (Ctrl-C to stop)", dim=True
                )
            )
            while not exists:
                await asyncio.sleep(poll)
                name, exists = await _conversation_tenant(services, None, conversation_id)
            click.echo(click.style(f"following {where(name)} (Ctrl-C to stop)", dim=True))
        else:
            waiting = "" if exists else "; it does not exist yet: waiting for its first turn"
            click.echo(click.style(f"following {where(name)} (Ctrl-C to stop{waiting})", dim=True))
        async for entry in services.queries.follow(name, conversation_id, poll):
            click.echo(render_turn(entry) if isinstance(entry, Turn) else render_marker(entry))

    said_waiting = False
    try:
        while True:
            try:
                run_with_services(settings, watch)
                return
            except NoGatewayData as exc:  # (a database the gateway has not served yet: waited for)
                if not said_waiting:
                    click.echo(
                        click.style(f"{exc.message}: waiting for its first turn (Ctrl-C to stop)", dim=True)
                    )
                    said_waiting = True
                time.sleep(poll)
    except KeyboardInterrupt:
        pass


@main.command()
@common_options
@click.argument("response_id")
@click.option("--json", "as_json", is_flag=True, help="Print the raw response log records.")
@click.option("--brief", is_flag=True, help="Leave out the exact list of messages sent.")
@_tenant_option
def context(
    settings: Settings,
    *,
    config_path: str | None,
    response_id: str,
    as_json: bool,
    brief: bool,
    tenant: str | None,
) -> None:
    """What was recorded for one response: request, context snapshot, reply, outcome."""

    async def read(services: Services) -> list[Record]:
        def read(name: str) -> Awaitable[list[Record]]:
            return services.queries.records(name, response_id)

        name, _ = await _find_tenant(services, tenant, read, f"response {response_id!r}")
        return await services.queries.records(name, response_id)

    records = run_with_services(settings, read)
    if as_json:
        for record in records:
            click.echo(orjson.dumps(record).decode())
        return
    render_log(records, show_messages=not brief)


@main.command()
@common_options
@click.argument("conversation_id")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@_tenant_option
def delete(
    settings: Settings, *, config_path: str | None, conversation_id: str, yes: bool, tenant: str | None
) -> None:
    """Delete (or archive) a conversation: its index, responses and summaries.

    They are archived instead if storage.archive_deleted is set. Safe while a gateway is running
    on the same data dir."""
    from gateway.ids import check_conversation_id

    check_conversation_id(conversation_id)
    _need_data_dir(settings, conversation_id)
    if not yes and not click.confirm(f"Delete conversation {conversation_id!r}?", default=False):
        raise GatewayError("not deleted")

    async def run(services: Services) -> None:
        name, _ = await _conversation_tenant(services, tenant, conversation_id)
        try:
            await services.conversations.delete(name, conversation_id)
        except NotFound:
            raise _no_conversation(settings, conversation_id) from None

    run_with_services(settings, run, writes=True)
    verb = "archived" if settings.storage.archive_deleted else "deleted"
    click.echo(f"{verb} {conversation_id}")


@main.command()
@common_options
@click.argument("conversation_id")
@click.option("--keep-system-message", is_flag=True, help="Keep the system prompt.")
@_tenant_option
def reset(
    settings: Settings,
    *,
    config_path: str | None,
    conversation_id: str,
    keep_system_message: bool,
    tenant: str | None,
) -> None:
    """Start a conversation afresh: appends a reset marker to its index (nothing is rewritten)."""
    _need_data_dir(settings, conversation_id)

    async def run(services: Services) -> None:
        name, _ = await _conversation_tenant(services, tenant, conversation_id)
        try:
            await services.conversations.reset(name, conversation_id, keep_system_message=keep_system_message)
        except NotFound:
            raise _no_conversation(settings, conversation_id) from None

    run_with_services(settings, run, writes=True)
    click.echo(f"reset {conversation_id}" + (" (system prompt kept)" if keep_system_message else ""))


@main.command()
@common_options
@click.option("--repair", is_flag=True, help="Move damaged lines and files to quarantine/ (deletes nothing).")
def fsck(settings: Settings, *, config_path: str | None, repair: bool) -> None:
    """Check the data dir (or database) for damage.

    Damage is undecodable lines, torn last lines, index lines naming a response that is missing,
    empty or not committed. Exits 1 while any remains. With --repair, each damaged line or file
    is set aside (under the conversation's lock: safe while the gateway runs) so the
    conversation can go on."""
    jsonl = settings.storage.backend == "jsonl"
    where = settings.storage.data_dir if jsonl else f"the {settings.storage.backend} database"
    if jsonl and not Path(settings.storage.data_dir).is_dir():
        if Path(settings.storage.data_dir).exists():
            raise GatewayError(f"the data dir {settings.storage.data_dir} is a file, not a folder")
        raise GatewayError(f"there is no data dir at {settings.storage.data_dir}")
    if jsonl:
        blocked = _files_in_the_layout(Path(settings.storage.data_dir))
        for path in blocked:
            click.echo(
                f"{path}: a file where the gateway keeps a folder: no turn can be stored (move it away)"
            )
        if blocked:
            click.echo(f"{len(blocked)} problem(s) in {where}: not repaired by --repair")
            sys.exit(1)
    report = run_with_services(settings, lambda services: services.fsck.run(repair=repair), writes=repair)
    for damage in report.repaired:
        click.echo(f"repaired {damage.where}: {damage.problem} ({damage.action})")
    for damage in report.remaining:
        click.echo(f"{damage.where}: {damage.problem}" + ("" if repair else f" [repair: {damage.action}]"))
    if report.remaining:
        hint = " (gateway fsck --repair sets them aside)" if not repair else ""
        click.echo(f"{len(report.remaining)} problem(s) in {where}{hint}")
        sys.exit(1)
    done = f" after {len(report.repaired)} repair(s)" if report.repaired else ""
    click.echo(f"{where}: no damage found{done}")


def _files_in_the_layout(data_dir: Path) -> list[Path]:
    """Files where the JSONL layout has folders (`logs`, its `responses` and `conversations`,
    also a tenant's), which `serve` refuses and every turn would fail on."""
    roots = [data_dir, *sorted(p for p in (data_dir / "tenants").glob("*") if p.is_dir())]
    folders = [
        f for root in roots for f in (root / "logs", root / "logs/responses", root / "logs/conversations")
    ]
    return [f for f in folders if f.exists() and not f.is_dir()]


# -- moving conversations between backends: the JSONL layout is the interchange format ----------


@main.command(name="export")
@common_options
@click.option(
    "--to", "to_dir", required=True, type=click.Path(file_okay=False), help="Folder to write (empty or new)."
)
def export_command(settings: Settings, *, config_path: str | None, to_dir: str) -> None:
    """Write every conversation of the configured backend (all tenants) to DIR in the JSONL layout.

    The layout: logs/, archive/ and tenants/ exactly as the jsonl backend keeps them."""
    from gateway.services.transfer import export_data

    click.echo(export_data(settings, Path(to_dir)))


@main.command(name="import")
@common_options
@click.option(
    "--from",
    "from_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="A JSONL data dir or an export (logs/, archive/, tenants/).",
)
def import_command(settings: Settings, *, config_path: str | None, from_dir: str) -> None:
    """Load conversations from DIR (the JSONL layout) into the configured backend.

    Refuses conversations (or files) that already exist there; imports all of a tenant or none
    of it."""
    from gateway.services.transfer import import_data

    click.echo(import_data(settings, Path(from_dir)))
