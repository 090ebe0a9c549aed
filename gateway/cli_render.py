"""How the `gateway` command shows conversations in a terminal.

Messages, turns, and a response's context manifest drawn as a bar of the model's window.
"""

from __future__ import annotations

import textwrap
from datetime import datetime
from typing import Any

import click
import orjson

from gateway.context import Message, Turn
from gateway.tokens import count_message
from gateway.types import Record, as_list, message, messages, number, obj
from gateway.writers import gone


def when(ts: float) -> str:
    return datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


# Control characters shown, never obeyed: a message is anyone's text, and an escape sequence in
# it would set the operator's terminal title, colours or clipboard (\n and \t stay as they are).
# So are the bidirectional controls, which would make text read other than it is ("exe.png").
_BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_VISIBLE = {
    **{c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c not in (0x09, 0x0A)},
    **{c: f"\\u{c:04x}" for c in _BIDI},
}


def visible(value: str) -> str:
    r"""`value` with its control and bidirectional characters written out (`\x1b`, `\u202e`)."""
    return value.translate(_VISIBLE)


def text(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(str(p.get("text", f"[{p.get('type')}]")) for p in content if isinstance(p, dict))
    text = content if isinstance(content, str) else ""
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        text += f"\n→ call {fn.get('name')}({fn.get('arguments')}) [{call.get('id')}]"
    if message.get("role") == "tool":
        text = f"[{message.get('tool_call_id')}] {text}"
    return visible(text)


def render_message(message: Message, *, tokens: int | None = None, note: str = "", dim: bool = False) -> str:
    """A message as `show` and `tail` print it; `dim`: all of it faint (one no longer sent: its
    head's own style ended a faintness put around the whole, and its text read as sent)."""
    role = str(message.get("role", "?"))
    colour = {"user": "cyan", "assistant": "green"}.get(role, "yellow")
    head = click.style(f"{role:>9}", bold=None if dim else True, dim=dim, fg=colour)
    extra = []
    if tokens is not None:
        extra.append(f"{tokens} tok")
    if message.get("is_feedback"):
        extra.append("feedback")
    if isinstance(message.get("compaction"), dict):
        extra.append("a compaction item the client sent back: the summary it stands for")
    if note:
        extra.append(note)
    suffix = click.style(f"  ({', '.join(extra)})", dim=True) if extra else ""
    body = textwrap.indent(text(message), " " * 11).lstrip()
    return f"{head}  {click.style(body, dim=True) if dim else body}{suffix}"


def render_compaction(record: Record) -> str:
    """Where a compaction happened (a `compaction` line of the summaries log): what it folded."""
    through, count = record.get("covers_through"), record.get("covered_messages")
    if record.get("trigger") == "context_management":
        why = f"context_management, past {record.get('threshold')} tokens"
        then = f"; from then on the window starts with summary v{record.get('summary_version')}"
    else:
        why, then = "POST /v1/responses/compact", "; the conversation itself goes on unchanged"
    folded = f"the {count} messages through {through}"
    if record.get("input_messages"):
        folded += f" and the {record['input_messages']} sent with the request"
    return f"compaction {record.get('id')} ({why}): {folded} summarized for the client{then}"


def render_marker(marker: Record) -> str:
    """An index marker as `gateway tail` shows it: what changed for the model from here on."""
    kind = marker.get("type")
    if kind == "reset":
        kept = " (the system prompt kept)" if marker.get("keep_system_message") else ""
        text = f"conversation reset{kept}: the history before this is no longer sent"
    elif kind == "delete_item":
        part = "the text of " if marker.get("text") else ""
        if "call" in marker:
            part = f"call {marker['call']} of "
        message = f"message {marker.get('position')} of {marker.get('response_id')}"
        text = f"{part}{message} deleted: no longer sent"
    elif kind == "delete_response":
        text = f"response {marker.get('response_id')} deleted: no longer sent"
    elif kind == "metadata":
        text = f"metadata set: {orjson.dumps(marker.get('metadata')).decode()}"
    elif kind == "restarted":
        text = "conversation deleted or expired: what follows is a new history under the same id"
    elif kind == "withdraw_recap":
        names = ", ".join(str(c) for c in as_list(marker.get("conversations")))
        text = f"recap: what it quoted of {names} withdrawn (deleted there): no longer sent"
    else:
        text = f"marker {orjson.dumps(marker).decode()}"
    return click.style(f"── {text}", dim=True)


def turn_heading(turn: Turn) -> str:
    """A turn's head line: its response id, and where the client's version branched.

    The branch is its edit of a message, or the same messages resent for a new answer
    (regenerated).
    """
    if turn.branch_at is None:
        return f"── {turn.response_id}"
    if turn.branch == "regenerated":
        why = "regenerated: the client asked again for an answer"
    elif turn.branch == "edited":
        why = "the client's edit"
    else:  # (recorded before the two were told apart)
        why = "the client's version branched"
    return (
        f"── {turn.response_id} ({why}: continues after message {turn.branch_at}; "
        "what followed is no longer sent)"
    )


def render_turn(turn: Turn, model: str = "") -> str:
    """A turn as `gateway tail` shows it."""
    head = turn_heading(turn)
    lines = [click.style(head, dim=True)]
    if turn.recap is not None:
        lines.append(render_message(turn.recap, tokens=count_message(turn.recap, model), note="recap"))
    if turn.system is not None:
        lines += [
            render_message(m, tokens=count_message(m, model), note="new system prompt") for m in turn.system
        ]
    lines += [render_message(m, tokens=count_message(m, model)) for m in turn.input]
    if turn.output is not None:
        lines.append(render_message(turn.output, tokens=count_message(turn.output, model)))
    return "\n".join(lines)


def render_summary_line(window: dict[str, Any]) -> None:
    """After the last turn a rolling summary covers: that it stands for the messages above."""
    where = f"gateway context {window['response_id']} shows exactly what was sent"
    version, count = window["summary_version"], window["summary_covers_messages"]
    folded = f"rolling summary v{version}: the {count} messages above were sent as this summary"
    click.echo(click.style(f"── {folded} ({where})", dim=True))
    window["summary_covers_messages"] = 0  # (said once)


def render_window_marker(window: dict[str, Any]) -> None:
    """Print where the last turn's window begins.

    The rolling summary it sent in place of the earliest messages (when not said already), and the
    marker the model got for those it left out."""
    where = f"gateway context {window['response_id']} shows exactly what was sent"
    if window["summary_covers_messages"]:
        render_summary_line(window)
    if window["omitted_messages"]:
        omitted = f"[{window['omitted_messages']} earlier messages omitted]"
        click.echo(click.style(f"── {omitted} (the last turn's window; {where})", dim=True))


LAYERS = [
    ("system", "S", "yellow"),
    ("summary", "Σ", "magenta"),
    ("recap", "R", "blue"),
    ("history", "h", "cyan"),
    ("marker", "m", "white"),
    ("tools", "T", "red"),
    ("new", "N", "green"),
]


def _ending(record: Record) -> str:
    """Why an attempt ended incomplete: its reason, and its error's message when it has one."""
    error = record.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    return f"{record.get('reason')}: {message}" if message else str(record.get("reason"))


def render_context(record: Record, *, show_messages: bool) -> None:
    """The manifest: how the window was filled, what was left out, and what was sent."""
    if record.get("stateless"):
        click.echo(
            f"context      stateless pass-through: {record.get('sent_messages')} messages sent as given"
        )
    else:
        budget = int(number(record.get("budget")) or 0)
        tokens = obj(record.get("tokens")) or {}
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
            + " | ".join(f"{name} {tokens.get(name, 0)}" for name, _, _ in LAYERS)
            + f" | overhead {tokens.get('overhead', 0)} | total {tokens.get('total', 0)}"
        )
        if record.get("server_prompt_tokens") is not None:
            counted = record["server_prompt_tokens"]
            click.echo(f"server count {counted} tokens (the provider's own count of this prompt)")
        width = 60
        bar = ""
        for name, char, color in LAYERS:
            cells = round(width * (number(tokens.get(name)) or 0) / budget) if budget else 0
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
        if "cut" in record:
            start = record.get("window_from") or "the conversation's first message"
            how = (
                "cut here (a new head)"
                if record.get("cut")
                else "the conversation's first"
                if not record.get("stored_turns")
                else "held (the previous turn's head)"
            )
            click.echo(f"head         {how}; history from {start}")
        if record.get("summary_version") is not None:
            covers = record.get("summary_covers_messages")
            through = record.get("summary_covers_through")
            version = record.get("summary_version")
            click.echo(f"summary      v{version} covers {covers} messages, through {through}")
        included = as_list(record.get("included_response_ids"))
        if included:
            click.echo(f"included     {len(included)} responses: {included[0]} … {included[-1]}")
    if show_messages:
        click.echo("sent (exact):")
        for m in messages(record.get("messages")):
            click.echo("  " + render_message(m))


def cache_text(cache: Record) -> str:
    """A response's prompt figures (its `cache` record) in words."""
    whole, cached = cache.get("prompt_tokens"), cache.get("cached_tokens")
    if cached is None:
        return f"prompt {whole} tokens; the provider said nothing of its prompt cache"
    text = f"{cached} of {whole if whole is not None else '?'} prompt tokens from the provider's cache"
    if cache.get("cache_creation_tokens") is not None:
        text += f", {cache['cache_creation_tokens']} written to it"
    return f"{text} ({cache.get('source')})"


def render_log(records: list[Record], *, show_messages: bool) -> None:
    """A response log for a terminal: request, context manifest, reply, outcome."""
    for record in records:
        kind = record.get("type")
        if kind == "request":
            click.echo(f"response     {record.get('response_id')}")
            click.echo(f"conversation {record.get('conversation_id')}")
            target = f"{record.get('provider')}:{record.get('upstream_model')}"
            click.echo(visible(f"model        {record.get('model')} → {target}"))
            click.echo(f"created      {when(number(record.get('created')) or 0)}")
            for m in messages(record.get("system")):
                click.echo(render_message(m, note="new system prompt"))
            for m in messages(record.get("input")):
                click.echo(render_message(m, note="new"))
        elif kind == "context":
            render_context(record, show_messages=show_messages)
        elif kind == "response":
            click.echo(
                render_message(
                    message(record.get("message")) or {"role": "assistant"},
                    note=f"finish={record.get('finish_reason')}",
                )
            )
            click.echo(f"usage        {record.get('usage')}")
            cache = obj(record.get("cache"))
            if cache:
                click.echo(f"cache        {cache_text(cache)}")
            click.echo(f"timings      {record.get('timings')}")
        elif kind == "commit":
            click.echo(click.style("committed    yes", fg="green"))
        elif kind == "incomplete":
            click.echo(click.style(visible(f"incomplete   {_ending(record)}"), fg="red"))
    if records and records[-1].get("type") not in ("commit", "incomplete", "deleted"):
        # No ending yet: in flight, unless the process writing it is gone (killed mid-turn).
        if gone(records[0].get("writer")):
            ending = "incomplete   interrupted: the gateway process handling it stopped before it ended"
            click.echo(click.style(ending, fg="red"))
        else:
            click.echo(click.style("in progress  (no answer recorded yet)", fg="yellow"))
