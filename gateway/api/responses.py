"""The Responses API bridge, mapped onto the continuity core and upstream chat completions.

The endpoints: `POST /v1/responses` (streaming and not), `GET`, `DELETE` and `GET .../input_items`.

Every response belongs to a conversation: `conversation` names it (or, as on chat completions,
`conversation_id` or the `X-Conversation-Id` header), `previous_response_id` continues the
conversation of that response (branching into a new conversation that shares the prefix when it
is not the latest response), and otherwise a new one is started. Response
ids are the gateway's minted ids, so chat-completions and Responses turns see each other.
"""

from __future__ import annotations

import asyncio
import functools
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gateway.api.background import BackgroundRuns, Run, sequence_of
from gateway.api.compaction import compact_before_turn, input_compactions, lead_items
from gateway.api.http import (
    JSONBody,
    SSEResponse,
    read_json,
    services_of,
    tenant_of,
    turn_headers,
    until_disconnect,
)
from gateway.api.observe import failed_response, log_line, refused, stream_closed
from gateway.api.pages import list_params, paginate
from gateway.api.response_shapes import (
    ECHOED_AS_SENT,
    ending_events,
    failed_events,
    queued_events,
    replayed_events,
    response_error,
    response_events,
    response_object,
)
from gateway.api.schemas import InputTokensCount, ResponseCreate
from gateway.api.validation import parse_chat, validate
from gateway.context import Message
from gateway.context.content import check_model
from gateway.context.items import Item, items_to_messages, message_to_items
from gateway.context.records import StoredResponse
from gateway.exceptions import GatewayError, InvalidRequest
from gateway.ids import check_conversation_id
from gateway.services import Services
from gateway.services.counting import PromptCount
from gateway.services.requests import ChatRequest, take_prefill
from gateway.services.turn import PreparedTurn
from gateway.types import JSONObject, Record, as_object, number

# OpenAI's reasoning models refuse `max_tokens` ("Use 'max_completion_tokens' instead").
_REASONING_MODELS = re.compile(r"(o\d|gpt-5)")

# How long a cancel asked of a response that another process runs waits for it to end, in seconds.
CANCEL_WAIT = 10.0
# How long a stream of a response that another process runs waits for it to end, at most, and
# how often it says so meanwhile (an SSE comment, which clients skip).
FOLLOW_WAIT = 600.0
KEEP_ALIVE = 15.0


def output_cap(model: str) -> str:
    """The chat field `max_output_tokens` goes in.

    `max_completion_tokens` for OpenAI's reasoning models (o1, o3, o4-mini, gpt-5...), else
    `max_tokens`, which every OpenAI-compatible server knows (not all of them know the newer
    name).
    """
    name = model.rsplit("/", 1)[-1].lower()
    return "max_completion_tokens" if _REASONING_MODELS.match(name) else "max_tokens"


# Responses fields chat completions take under the same name, passed on as the client set them
# (those a response says back as sent among them).
_PASSED = (
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "user",
    "metadata",
    "service_tier",
    "seed",
    *ECHOED_AS_SENT,
)
_VERBOSITY = ("low", "medium", "high")


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (checked by `FunctionTool`) as chat-completions tools."""
    if tools is None:
        return None
    keys = ("name", "description", "parameters", "strict")
    return [{"type": "function", "function": {k: tool[k] for k in keys if k in tool}} for tool in tools]


def _tool_choice(choice: object) -> object:
    """A Responses `tool_choice` in chat completions' shape (function names nest in `function`)."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice.get("type") == "allowed_tools" and isinstance(choice.get("tools"), list):
        tools = [
            {"type": "function", "function": {"name": tool["name"]}}
            if isinstance(tool, dict) and tool.get("type") == "function" and "name" in tool
            else tool
            for tool in choice["tools"]
        ]
        return {
            "type": "allowed_tools",
            "allowed_tools": {"mode": choice.get("mode", "auto"), "tools": tools},
        }
    return choice


async def _conversation_for(
    services: Services, tenant: str, body: dict[str, Any], header: str | None = None
) -> tuple[str | None, str | None]:
    """(conversation id, previous response id) for a request.

    OpenAI's `conversation` names one that must exist. The gateway's own naming, as on chat
    completions (the `conversation_id` field, else the `X-Conversation-Id` header), starts the
    conversation when it is new. `previous_response_id` goes with neither field; it wins over the
    header, which a client may send with every request."""
    conversation = body.get("conversation")
    own = body.get("conversation_id")
    previous = body.get("previous_response_id")
    if conversation is not None and own is not None:
        raise InvalidRequest("Use 'conversation' or 'conversation_id', not both", param="conversation_id")
    named = "conversation" if conversation is not None else "conversation_id" if own is not None else None
    if named is not None and previous is not None:
        raise InvalidRequest(
            f"Use '{named}' or 'previous_response_id', not both", param="previous_response_id"
        )
    if conversation is not None:
        if isinstance(conversation, dict):
            if not isinstance(conversation.get("id"), str):
                said = "'conversation' must be a conversation id or an object with its 'id'"
                raise InvalidRequest(said, param="conversation.id")
            conversation = conversation["id"]
        cid = check_conversation_id(conversation, param="conversation")
        return await services.responses.named_conversation(tenant, cid), None
    if previous is not None:
        return await services.responses.continued_conversation(tenant, previous), previous
    if own is not None:
        return check_conversation_id(own, param="conversation_id"), None
    if header is not None:
        return check_conversation_id(header, param="X-Conversation-Id"), None
    if body.get("store") is False:
        return None, None
    return f"resp-{secrets.token_hex(12)}", None


def _chat_body(
    body: dict[str, Any],
    request: ResponseCreate,
    compactions: dict[str, Message] | None = None,
    *,
    input_optional: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat-completions request for a Responses request, and the params to echo back.

    `compactions`: the messages its compaction items stand for (`input_compactions`).
    `input_optional`: no messages at all is no error (a count of a conversation as it stands).
    """
    messages = _input_messages(body.get("input"), request.instructions, compactions, input_optional)
    tools = _tools(body.get("tools"))
    chat: dict[str, Any] = {"model": request.model, "messages": messages, "stream": bool(request.stream)}
    chat.update({key: body[key] for key in _PASSED if body.get(key) is not None and key != "metadata"})
    if body.get("is_feedback") is not None:  # (the gateway's flag: the last input item is feedback)
        chat["is_feedback"] = body["is_feedback"]
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if request.max_output_tokens is not None:
        chat[output_cap(request.model)] = request.max_output_tokens
    background = _background(body)
    text = _text(body.get("text"))
    response_format = _response_format(text.get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    if text.get("verbosity") is not None:
        chat["verbosity"] = text["verbosity"]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        chat["reasoning_effort"] = reasoning["effort"]
    if background:  # (run as a stream: its events are kept for clients that follow it)
        chat["stream"] = True
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    return chat, _echoed(body, request, tools, text, background)


def _system_prompt_count(body: dict[str, Any], request: ResponseCreate) -> int | None:
    """How many leading messages of a Responses turn are the system prompt (`ChatRequest`):
    its `instructions` when it names OpenAI's `conversation` or `previous_response_id`, whose
    input items are appended; else None, as on chat completions (the gateway's own naming)."""
    if body.get("conversation") is None and body.get("previous_response_id") is None:
        return None
    return 0 if request.instructions is None else 1


def _input_messages(
    raw_input: object,
    instructions: str | None,
    compactions: dict[str, Message] | None,
    input_optional: bool,
) -> list[Message]:
    """The messages of a request's `input` (text or items) after its `instructions`."""
    if raw_input is None:
        messages: list[Message] = []
    elif isinstance(raw_input, str):
        messages = [{"role": "user", "content": raw_input}]
    else:
        messages = items_to_messages(raw_input, param="input", compactions=compactions)
    if instructions is not None:
        messages = [{"role": "system", "content": instructions}, *messages]
    if not messages and not input_optional:
        said = "'input' is empty" if raw_input is not None else "'input' is required"
        raise InvalidRequest(said, param="input")
    return messages


def _background(body: dict[str, Any]) -> bool:
    """Whether the request asks for a background response (which must be stored)."""
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise InvalidRequest("'background' must be true or false", param="background")
    if background and body.get("store") is False:
        raise InvalidRequest("A background response must be stored: leave out 'store: false'", param="store")
    return bool(background)


def _echoed(
    body: dict[str, Any],
    request: ResponseCreate,
    tools: list[dict[str, Any]] | None,
    text: dict[str, Any],
    background: bool,
) -> dict[str, Any]:
    """The request's parameters as a response object echoes them back."""
    reasoning = body.get("reasoning")
    return {
        "instructions": request.instructions,
        "metadata": body.get("metadata"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice_raw": body.get("tool_choice", "auto"),
        "tools": tools,
        "max_output_tokens": body.get("max_output_tokens"),
        "store": body.get("store") is not False,  # (null: the default)
        "truncation": request.truncation or "auto",
        "user": body.get("user"),
        **{key: body[key] for key in ECHOED_AS_SENT if body.get(key) is not None},
        "text": {"format": {"type": "text"}, **text} if text else None,
        "reasoning": reasoning if isinstance(reasoning, dict) else None,
        "background": background,
    }


def _text(text: object) -> dict[str, Any]:
    """The Responses `text` options: `format` and `verbosity`, each optional."""
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise InvalidRequest("'text' must be an object: {format, verbosity}", param="text")
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity not in _VERBOSITY:
        raise InvalidRequest("'text.verbosity' must be 'low', 'medium' or 'high'", param="text.verbosity")
    return {key: text[key] for key in ("format", "verbosity") if text.get(key) is not None}


def _response_format(fmt: object) -> dict[str, Any] | None:
    """A Responses `text.format` as chat completions' `response_format` (None: plain text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(
            "'text.format' must be {type: text}, {type: json_object} or {type: json_schema, name, schema}",
            param="text.format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
        raise InvalidRequest("'text.format' json_schema needs a name and a schema", param="text.format")
    keys = ("name", "schema", "strict", "description")
    return {"type": "json_schema", "json_schema": {k: fmt[k] for k in keys if k in fmt}}


async def create_response(request: Request) -> Response:
    services = services_of(request)
    service = services.turns
    tenant = tenant_of(request)
    metrics = request.app.state.metrics
    started = time.perf_counter()
    body: Any = None
    cid: str | None = None
    try:
        body = await read_json(request, services.settings.server.max_body_bytes)
        if isinstance(body, dict) and body.get("prompt") is not None:  # (said "'input' must be ...")
            raise InvalidRequest(
                "'prompt' templates are not supported: send the 'input' itself", param="prompt"
            )
        parsed = validate(ResponseCreate, body)
        chat_body, params = _chat_body(
            body, parsed, await input_compactions(services, tenant, body.get("input"))
        )
        chat = parse_chat(chat_body)  # every validation error before a fork is made
        take_prefill(chat)  # (input ending with assistant text: a provider goes on from it)
        cid, previous = await _conversation_for(
            services, tenant, body, request.headers.get("x-conversation-id")
        )
        if cid is not None:
            chat_body["conversation_id"] = chat.conversation_id = cid
        chat.previous_response_id = previous
        chat.truncation = params["truncation"]
        chat.system_prompt_count = _system_prompt_count(body, parsed)
        # A turn in a conversation is kept, `store: false` or not: naming one asks for that.
        params["store"] = params["store"] or cid is not None
        # What the Responses API echoes back, kept in the request record for a later GET.
        chat.echo = {**params, "previous_response_id": previous}
        if params["background"]:
            request.app.state.background.check_room(tenant)
        lead = await compact_before_turn(services, tenant, body, chat, previous)
        if previous is not None and chat.truncation == "disabled":
            # A window it refuses is refused before a turn on an earlier response makes its branch.
            await service.count(chat, tenant)
        turn = await service.prepare(chat, tenant)
    except GatewayError as exc:
        _said_of_input(exc)
        refused(request, body, exc, started, event="response", conversation_id=cid)
        raise
    cid = turn.conversation_id
    position = len(turn.new)
    common: dict[str, Any] = {
        "response_id": turn.response_id,
        "model": chat.model,
        "position": position,
        "params": params,
        "conversation_id": cid,
        "previous_response_id": previous,
    }
    headers = turn_headers(turn)
    if params["background"]:
        queued = response_object(
            created=turn.created or time.time(),
            message=None,
            finish_reason=None,
            usage=None,
            status="queued",
            lead=lead,
            **common,
        )
        run = start_background(request, turn, common, lead, queued)
        await service.visible(turn)  # its id is handed out next: a GET or cancel must find it
        if body.get("stream"):
            return SSEResponse(run.follow(-1), headers=headers, on_close=_nothing)
        return JSONBody(queued, headers=headers)
    if not chat.stream:
        try:
            async with service.closing(turn):
                await until_disconnect(service.complete(turn), request.receive, started=started)
        except BaseException as exc:
            _said_of_input(exc)
            return failed_response(turn.closed(), exc, metrics, headers, event="response")
        outcome = turn.closed()
        log_line(outcome, 200, "complete", metrics, event="response")
        return JSONBody(
            response_object(
                created=outcome.created or time.time(),
                message=outcome.message,
                finish_reason=outcome.finish_reason,
                usage=outcome.usage,
                lead=lead,
                served=outcome.served,
                **common,
            ),
            headers=headers,
        )
    try:
        async with service.closing(turn, on_failure_only=True):
            chunks = await until_disconnect(service.open_chunks(turn), request.receive, started=started)
    except BaseException as exc:
        _said_of_input(exc)
        return failed_response(turn.closed(), exc, metrics, headers, event="response")

    async def on_close(exc: BaseException | None) -> None:
        stream_closed(await chunks.aclose(exc), exc, metrics, event="response")

    return SSEResponse(response_events(turn, chunks, common, lead), headers=headers, on_close=on_close)


def _said_of_input(exc: BaseException) -> None:
    """An error the chat core says of its fields is said of the Responses API's: `messages` is
    `input`, the answer's cap `max_output_tokens`. A field the client itself sent and the API
    does not take (`unknown_parameter`) is named as sent."""
    if not isinstance(exc, GatewayError) or exc.code == "unknown_parameter":
        return
    if exc.param == "messages":
        exc.param = "input"
    elif exc.param in ("max_tokens", "max_completion_tokens"):
        exc.message = exc.message.replace(f"'{exc.param}'", "'max_output_tokens'")
        exc.param = "max_output_tokens"


async def _nothing(exc: BaseException | None) -> None:
    """A follower of a background response left: the response goes on without it."""


def start_background(
    request: Request,
    turn: PreparedTurn,
    common: dict[str, Any],
    lead: list[JSONObject] | None,
    queued: dict[str, Any],
) -> Run:
    """Run a prepared turn to its end as a background response, its events kept.

    Its first events (`queued`: the response as made) are kept at once, so that a stream of it
    begins before the provider's first chunk."""
    service = services_of(request).turns
    metrics = request.app.state.metrics

    async def work(run: Run) -> None:
        failure: BaseException | None = None
        try:
            async with service.closing(turn):
                chunks = await service.open_chunks(turn)
                async for frame in response_events(turn, chunks, common, lead, queued=True):
                    run.add(frame)
        except asyncio.CancelledError as exc:
            failure = exc
            if run.cancelled:  # (`cancel`): its followers see how it ended, as a replay says it
                ended = {**queued, "status": "cancelled"}  # (no answer, as it was made)
                for frame in ending_events(ended, sequence_of(run.events[-1]) if run.events else 1):
                    run.add(frame)
            raise
        except Exception as exc:  # noqa: BLE001 - said in the run's events and its log
            failure = exc
            error = exc if isinstance(exc, GatewayError) else GatewayError(repr(exc)[:300])
            for frame in failed_events(turn.created or time.time(), error, common, queued=True):
                run.add(frame)
        finally:
            stream_closed(turn.closed(), failure, metrics, event="response")

    async def abandon() -> None:
        cancelled = asyncio.CancelledError()
        try:
            async with service.closing(turn):
                raise cancelled
        except asyncio.CancelledError:
            stream_closed(turn.closed(), cancelled, metrics, event="response")

    runs: BackgroundRuns = request.app.state.background
    tenant, stored = tenant_of(request), services_of(request).responses
    asked = functools.partial(stored.cancel_asked, tenant, turn.response_id)
    run = runs.start(turn.response_id, tenant, work, abandon, asked)
    for frame in queued_events(queued):
        run.add(frame)
    return run


async def count_input_tokens(request: Request) -> Response:
    """`POST /v1/responses/input_tokens`: the prompt `POST /v1/responses` with this body would send, counted.

    The same window is planned (history, instructions, tools, the new input); nothing is sent or
    stored, and the conversation is only read.
    """
    services = services_of(request)
    tenant = tenant_of(request)
    body = await read_json(request, services.settings.server.max_body_bytes)
    checked = validate(InputTokensCount, body)
    named = (
        any(body.get(key) is not None for key in ("conversation", "conversation_id", "previous_response_id"))
        or request.headers.get("x-conversation-id") is not None
    )
    compactions = await input_compactions(services, tenant, body.get("input"))
    chat_body, params = _chat_body(body, checked, compactions, input_optional=named)
    if chat_body["messages"]:
        chat = parse_chat(chat_body)
    else:  # the conversation alone
        check_model(checked.model)
        chat = ChatRequest(chat_body, checked.model, [], False, False, None)
    # (counted as the stored turn it would be: `store` is none of a count's parameters)
    cid, chat.previous_response_id = await _conversation_for(
        services, tenant, {**body, "store": True}, request.headers.get("x-conversation-id")
    )
    chat.conversation_id = cid
    chat.truncation = params["truncation"]
    chat.system_prompt_count = _system_prompt_count(body, checked)
    counted = await services.turns.count(chat, tenant)
    return JSONBody(
        {
            "object": "response.input_tokens",
            "input_tokens": counted.input_tokens,
            "gateway": count_details(counted),
        }
    )


def count_details(counted: PromptCount) -> JSONObject:
    """What a count says beside its `input_tokens` (the extension `gateway`).

    How it was counted, and the window it counts.
    """
    plan = counted.plan
    return {
        "counted_by": counted.counted_by,
        "tokens": plan.window.tokens,  # the gateway's own count, by part (as a context snapshot)
        "context_window": plan.context_window,
        "reserve_tokens": plan.reserve,
        "sent_messages": len(plan.window.messages),
        "truncated": plan.window.omitted,
        "summary_version": plan.summary.version if plan.summary else None,
    }


def _without_type(record: Record | None) -> Record | None:
    return {k: v for k, v in record.items() if k != "type"} if record is not None else None


async def get_response(request: Request) -> Response:
    """The response in the Responses API shape, plus the gateway's log (`gateway`)."""
    rid = request.path_params["response_id"]
    tenant = tenant_of(request)
    streamed = request.query_params.get("stream", "false").lower() not in ("false", "0")
    run = request.app.state.background.get(rid, tenant)
    if streamed:
        after = _starting_after(request.query_params.get("starting_after"))
        if run is not None:
            return SSEResponse(run.follow(after), headers={}, on_close=_nothing)
    elif run is not None and not run.done:
        return JSONBody(await _in_progress(request, rid, tenant, "in_progress" if run.started else "queued"))
    stored = await services_of(request).responses.get(tenant, rid)
    echo = stored.request.get("responses")  # a Responses-API turn: what its create returned
    if streamed:
        if not (isinstance(echo, dict) and echo.get("background")):
            # (OpenAI streams only a background response's events again)
            raise InvalidRequest(
                "Only a background response is streamed again: retrieve this one without stream",
                param="stream",
            )
        return SSEResponse(_replayed_once_ended(request, stored, after), headers={}, on_close=_nothing)
    obj = _stored_object(stored)
    obj["gateway"] = {
        "request": _without_type(stored.request),
        "context": _without_type(stored.context),
        "response": _without_type(stored.response),
        "outcome": stored.outcome,
    }
    return JSONBody(obj)


async def _replayed_once_ended(request: Request, stored: StoredResponse, after: int) -> AsyncIterator[bytes]:
    """A background response run elsewhere (another process, a replica), replayed from its log
    once it has ended: its events after sequence number `after`."""
    if stored.status == "in_progress":  # (it ends within its provider's timeout, or fails)
        settings, responses = services_of(request).settings, services_of(request).responses
        wait = max((p.timeout for p in settings.providers.values()), default=FOLLOW_WAIT)
        until = time.monotonic() + wait
        while stored.status == "in_progress" and time.monotonic() < until:
            stored = await responses.ended(tenant_of(request), stored.response_id, KEEP_ALIVE)
            if stored.status == "in_progress":
                yield b": running in another process\n\n"  # (an SSE comment: the connection lives)
    for frame in replayed_events(_stored_object(stored), after):
        yield frame


def _stored_object(stored: StoredResponse) -> dict[str, Any]:
    """A stored response in the Responses API shape (without the gateway's log)."""
    rid = stored.response_id
    params = stored.params
    echo = stored.request.get("responses")  # a Responses-API turn: what its create returned
    status = _status(stored.status, stored.outcome, echo)
    return response_object(
        response_id=rid,
        created=stored.created,
        model=stored.model,
        message=stored.message,
        position=len(stored.input),
        finish_reason=stored.finish_reason,
        usage=stored.usage,
        params=echo
        if isinstance(echo, dict)
        else {
            "tools": params.get("tools"),
            "temperature": params.get("temperature"),
            "top_p": params.get("top_p"),
            "user": params.get("user"),
            "max_output_tokens": params.get("max_tokens") or params.get("max_completion_tokens"),
        },
        conversation_id=stored.conversation_id,
        previous_response_id=echo.get("previous_response_id") if isinstance(echo, dict) else None,
        status=status,
        error=None if status == "cancelled" else response_error(stored.error),  # (OpenAI's: null)
        lead=lead_items(echo),
        completed=number(stored.outcome.get("committed")),
        served=stored.served,
        text_after=stored.text_after_calls,
    )


def _status(status: str, outcome: Record, echo: object) -> str | None:
    """The Responses status of a stored response (None: from its finish reason).

    A background response stopped by a cancel is `cancelled`.
    """
    background = isinstance(echo, dict) and echo.get("background")
    cancelled = outcome.get("type") == "incomplete" and outcome.get("reason") == "cancelled"
    if background and cancelled and outcome.get("error") is None:  # (not the server's stop)
        return "cancelled"
    return status if status != "completed" else None


MAX_SEQUENCE = 2**53 - 1  # (a JSON number every client reads exactly)


def _starting_after(value: str | None) -> int:
    """The client's place in a stream: digits (not `+5`, `1_0` or `５`, which `int` takes), below
    MAX_SEQUENCE, so that the event after it is numbered exactly too (a larger one was a 500)."""
    if value is None:
        return -1
    if not (value.isascii() and value.isdigit()) or int(value) >= MAX_SEQUENCE:
        raise InvalidRequest(
            f"'starting_after' must be a sequence number (0 to {MAX_SEQUENCE - 1})", param="starting_after"
        )
    return int(value)


async def _in_progress(request: Request, rid: str, tenant: str, status: str) -> dict[str, Any]:
    """A background response still running here, as a poll sees it."""
    stored = await services_of(request).responses.get(tenant, rid)
    echo = stored.request.get("responses")
    params = echo if isinstance(echo, dict) else {}
    return response_object(
        response_id=rid,
        created=stored.created,
        model=stored.model,
        message=None,
        position=len(stored.input),
        finish_reason=None,
        usage=None,
        params=params,
        conversation_id=stored.conversation_id,
        previous_response_id=params.get("previous_response_id"),
        status=status,
        lead=lead_items(echo),
    )


async def cancel_response(request: Request) -> Response:
    """`POST /v1/responses/{id}/cancel`: a background response still running stops.

    Its turn is closed as cancelled (nothing enters the conversation, which takes its next turn).
    """
    rid = request.path_params["response_id"]
    tenant = tenant_of(request)
    runs: BackgroundRuns = request.app.state.background
    run = runs.get(rid, tenant)
    stored = await services_of(request).responses.get(tenant, rid)
    echo = stored.request.get("responses")
    if not (isinstance(echo, dict) and echo.get("background")):
        raise InvalidRequest("Only a background response can be cancelled", param="response_id")
    if run is not None:
        await runs.cancel(run)
    elif stored.status == "in_progress":  # run by another process (a worker, a replica): asked there
        await services_of(request).responses.ask_cancel(tenant, rid)
        await services_of(request).responses.ended(tenant, rid, CANCEL_WAIT)
    return await get_response(request)


async def delete_response(request: Request) -> Response:
    rid = request.path_params["response_id"]
    await services_of(request).responses.delete(tenant_of(request), rid)
    return JSONBody({"id": rid, "object": "response.deleted", "deleted": True})


async def list_input_items(request: Request) -> Response:
    rid = request.path_params["response_id"]
    stored = await services_of(request).responses.get(tenant_of(request), rid)
    items: list[Item] = []
    instructions = as_object(stored.request.get("responses")).get("instructions")
    for k, message in enumerate(stored.system):
        if message.get("role") == "system" and message.get("content") == instructions:
            continue  # the request's `instructions` (which set it): OpenAI lists the input alone
        items.extend(message_to_items(message, rid, -(k + 1)))
    for pos, message in enumerate(stored.input):
        items.extend(message_to_items(message, rid, pos))
    return JSONBody(paginate(items, list_params(request.query_params)))
