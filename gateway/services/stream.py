"""The assistant message of a turn: from a completion, or rebuilt from a chunk stream."""

from __future__ import annotations

import logging
import secrets
from typing import cast

from gateway.context.tools import default_arguments
from gateway.exceptions import GatewayError, UpstreamProtocolError
from gateway.types import FunctionCall, JSONObject, Message, ToolCall, Usage, as_list, as_object

log = logging.getLogger("gateway.services")

# A piece of a streamed message with only these fields is text (or nothing): the common piece.
_TEXT_KEYS = frozenset(("role", "content"))
_OUTPUT_FIELDS = ("role", "content", "tool_calls", "function_call", "name", "refusal")


def _object(value: object) -> JSONObject:
    return cast(JSONObject, value) if isinstance(value, dict) else {}


def _malformed(message: JSONObject) -> str | None:
    """What makes a provider's message unfit to be stored and replayed (None: nothing).

    A stream's chunks are checked as they come; a whole answer is checked here: stored as it
    came, a number for `content` or an object for a call's `arguments` would go to the provider
    on every later turn (and a client resending its history would get a 400 of the gateway's
    own)."""
    content = message.get("content")
    parts = isinstance(content, list) and all(isinstance(p, dict) for p in content)
    if content is not None and not isinstance(content, str) and not parts:
        return "'content' is neither text nor a list of parts"
    for key in ("refusal", "name"):
        if message.get(key) is not None and not isinstance(message[key], str):
            return f"'{key}' is not a string"
    calls = message.get("tool_calls")
    if calls is not None and not (isinstance(calls, list) and all(_is_call(c) for c in calls)):
        return "'tool_calls' is malformed (each needs a string id, name and arguments)"
    legacy = message.get("function_call")
    if legacy is not None and not _is_function(legacy):
        return "'function_call' is malformed"
    return None


def _is_function(function: object) -> bool:
    # (Arguments left out are stored as "{}": a call without any is still a call.)
    return (
        isinstance(function, dict)
        and isinstance(function.get("name"), str)
        and (function.get("arguments") is None or isinstance(function["arguments"], str))
    )


def _is_call(call: object) -> bool:
    # (A call without an id gets one of the gateway's: `_complete_calls`.)
    if not isinstance(call, dict):
        return False
    return (call.get("id") is None or isinstance(call["id"], str)) and _is_function(call.get("function"))


def stream_error(exc: Exception, provider: str) -> GatewayError:
    """What a stream that failed after its headers reports in-band.

    The gateway's own error, or anything else as the provider's malformed stream (logged)."""
    if isinstance(exc, GatewayError):
        return exc
    log.warning("malformed stream from %s: %r", provider, exc)
    return UpstreamProtocolError(f"Provider {provider!r} sent a malformed stream ({type(exc).__name__})")


def new_call_id() -> str:
    """An id for a call its provider gave none (vLLM, Ollama and others, streamed or not)."""
    return f"call_{secrets.token_hex(12)}"


def _complete_calls(calls: list[JSONObject]) -> None:
    """A whole answer's calls as the client gets them and the gateway stores them.

    An id where the provider gave none (as streamed calls get one, rather than a 502) or one an
    earlier call of the answer has (results could not tell them apart, and Anthropic's clients
    refuse to send such calls back), and `"{}"` where it gave no arguments (null, left out or "";
    stored as "", a strict provider would refuse every later turn)."""
    seen: set[object] = set()
    for call in calls:
        if not call.get("id") or call["id"] in seen:
            call["id"] = new_call_id()
        seen.add(call["id"])
        default_arguments(call.get("function"))


def output_message(message: object) -> Message:
    """The assistant message as it will be replayed: known fields, nulls dropped.

    A message that could not be replayed is the provider's bad answer (a 502), never stored."""
    if not isinstance(message, dict):
        raise UpstreamProtocolError("The provider's reply has no message")
    problem = _malformed(message)
    if problem is not None:
        raise UpstreamProtocolError(f"The provider's reply is malformed: {problem}")
    if message.get("tool_calls"):
        _complete_calls(cast(list[JSONObject], message["tool_calls"]))  # (in the client's copy too)
    out: JSONObject = {"role": "assistant"}
    for key in _OUTPUT_FIELDS[1:]:
        value = message.get(key)
        if value is not None and value != []:
            out[key] = value
    if "tool_calls" in out:
        calls = out["tool_calls"]
        out["tool_calls"] = [
            {"id": c["id"], "type": c.get("type") or "function", "function": dict(_object(c["function"]))}
            for c in cast(list[JSONObject], calls)  # (checked by `_malformed`, completed above)
        ]
        out.setdefault("content", None)
    audio = message.get("audio")
    if isinstance(audio, dict) and isinstance(audio.get("id"), str):
        # An audio answer is replayed by its id, as OpenAI documents (its data is not kept).
        out["audio"] = {"id": audio["id"]}
        out.setdefault("content", None)
    thinking = thinking_blocks(message.get("thinking_blocks"))
    if thinking:
        out["thinking_blocks"] = thinking
    out.setdefault("content", "")
    return cast(Message, out)


def thinking_blocks(value: object) -> list[JSONObject]:
    """A provider's `thinking_blocks` (litellm's, for Anthropic's thinking) kept as they came:
    objects with a `type` (none when it sent anything else)."""
    if not isinstance(value, list) or not all(
        isinstance(b, dict) and isinstance(b.get("type"), str) for b in value
    ):
        return []
    return cast(list[JSONObject], value)


SERVED = ("system_fingerprint", "service_tier")


def served_by(completion: JSONObject) -> JSONObject | None:
    """How a provider says it served an answer (a completion or a chunk): its `system_fingerprint`
    and `service_tier`, kept for the stored completion (None: it said neither)."""
    said = {key: completion[key] for key in SERVED if isinstance(completion.get(key), str)}
    return said or None


class StreamAccumulator:
    """Rebuilds the assistant message of choice 0 from a chunk stream."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.tool_calls: dict[int, ToolCall] = {}
        self._minted: set[int] = set()  # calls whose id is the gateway's (their provider gave none)
        self._moved: dict[int, int] = {}  # a provider's index -> the call it names now
        self.function_call: FunctionCall | None = None  # the legacy single call, in pieces
        self.audio_id: str | None = None
        self.thinking: list[JSONObject] = []  # thinking blocks, their pieces joined
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.timings: JSONObject | None = None  # llama.cpp's, in its last chunk: its cache figures
        self.served: JSONObject | None = None  # `served_by` of the chunk that finished the answer
        self.text_after: int | None = None  # how many calls had begun when the text began

    def add(self, chunk: JSONObject) -> None:
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = cast(Usage, usage)
        timings = chunk.get("timings")
        if isinstance(timings, dict):
            self.timings = timings
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if type(delta) is dict and delta.keys() <= _TEXT_KEYS:  # most pieces: text or nothing
                content = delta.get("content")
                if isinstance(content, str):
                    if content and self.text_after is None:
                        self.text_after = len(self.tool_calls)
                    self.content.append(content)
            else:
                self._add_delta(_object(delta))
            finish = choice.get("finish_reason")
            if finish:
                if self.finish_reason is None:  # (the piece that finishes the answer)
                    self._fill_arguments(choice)
                self.finish_reason = str(finish)
                self.served = served_by(chunk)

    def _add_delta(self, delta: JSONObject) -> None:
        """Take a piece of choice 0 that may carry more than text: a refusal, audio, calls."""
        content, refusal = delta.get("content"), delta.get("refusal")
        if isinstance(content, str):
            if content and self.text_after is None:
                self.text_after = len(self.tool_calls)
            self.content.append(content)
        if isinstance(refusal, str):
            self.refusal.append(refusal)
        legacy = delta.get("function_call")
        if isinstance(legacy, dict):
            legacy_call = self.function_call = self.function_call or {"name": "", "arguments": ""}
            for key in ("name", "arguments"):
                if isinstance(legacy.get(key), str):
                    legacy_call[key] += legacy[key]
        audio = delta.get("audio")
        if isinstance(audio, dict) and isinstance(audio.get("id"), str):
            self.audio_id = audio["id"]
        for block in thinking_blocks(delta.get("thinking_blocks")):
            self._add_thinking(block)
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            if isinstance(call, dict):
                self._add_call(call)

    def _add_thinking(self, block: JSONObject) -> None:
        """A piece of a thinking block: its text goes on the one open (until its signature came)."""
        last = self.thinking[-1] if self.thinking else None
        text, signature = block.get("thinking"), block.get("signature")
        if (
            block.get("type") == "thinking"
            and last is not None
            and last.get("type") == "thinking"
            and not last.get("signature")
        ):
            if isinstance(text, str):
                last["thinking"] = str(last.get("thinking") or "") + text
            if signature:
                last["signature"] = signature
            return
        self.thinking.append(dict(block))

    def _add_call(self, call: JSONObject) -> None:
        """Add one piece of a streamed tool call to its call.

        OpenAI sends each call's `index`, its id and whole name in its first piece, and its
        arguments in pieces after. Servers that do not are read so: without `index`, a piece
        continues the latest call unless it brings a name (its call has one); a piece that brings
        an id other than its call's starts the next call (Ollama sends `index: 0` for every call
        of a parallel batch, some servers no `index` or no id: read by index alone, two calls
        would merge into one named "ab" with arguments "{}{}"). The piece the client gets says
        the call it went to (`index`) and its id."""
        index = call.get("index")
        # (an index a server used again for another call goes on naming that call's place)
        at = self._moved.get(index, index) if isinstance(index, int) else max(self.tool_calls, default=0)
        slot = self.tool_calls.get(at)
        name = _object(call.get("function")).get("name")
        if slot is not None and (
            (call.get("id") and slot["id"] not in (None, call["id"]) and at not in self._minted)
            # (only without `index`: a server that says the name again in each piece of a call
            # numbers them)
            or (name and slot["function"].get("name") and not isinstance(index, int))
        ):
            at, slot = max(self.tool_calls) + 1, None
            if isinstance(index, int):
                self._moved[index] = at
        if slot is None:
            slot = self.tool_calls[at] = cast(
                ToolCall, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if not call.get("id") or any(other["id"] == call["id"] for other in self.tool_calls.values()):
                # A call streamed without an id (vLLM, Ollama and others do), or with an earlier
                # call's: one of the gateway's, in the piece the client gets too, so that its
                # result can name it (stored as null, it went back to the provider on every
                # later turn; twice, Anthropic's clients refuse to send it back).
                call["id"] = new_call_id()
                self._minted.add(at)
        if call.get("id"):
            if slot["id"] is None:
                slot["id"] = cast(str, call["id"])
            else:  # (one id per call, in its first piece, as OpenAI streams it: said again, the
                del call["id"]  # client's SDK added it up, "call_1call_1")
        call["index"] = at
        if call.get("type"):
            slot["type"] = cast(str, call["type"])
        fn = _object(call.get("function"))
        function = slot["function"]
        if fn.get("name") and fn["name"] != function.get("name"):
            function["name"] = function.get("name", "") + str(fn["name"])
        elif fn.get("name"):  # (said again: not appended, nor said to the client again)
            del fn["name"]
        if fn.get("arguments"):
            function["arguments"] = function.get("arguments", "") + str(fn["arguments"])

    def _fill_arguments(self, choice: JSONObject) -> None:
        """Give each call streamed without arguments so far `"{}"` in `choice`, the piece that
        finishes the answer, as the call is stored and as a whole answer's client gets it
        (`default_arguments`): what the client adds up is what is stored."""
        empty = [at for at in sorted(self.tool_calls) if not self.tool_calls[at]["function"].get("arguments")]
        if not empty:
            return
        delta = choice["delta"] = as_object(choice.get("delta"))
        calls = delta["tool_calls"] = as_list(delta.get("tool_calls"))
        pieces = {piece.get("index"): piece for piece in calls if isinstance(piece, dict)}
        for at in empty:
            piece = pieces.get(at)
            if piece is None:
                calls.append({"index": at, "function": {"arguments": "{}"}})
            else:
                piece["function"] = {**as_object(piece.get("function")), "arguments": "{}"}

    def message(self) -> Message:
        message: Message = {"role": "assistant", "content": "".join(self.content)}
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        if self.function_call is not None:
            message["function_call"] = self.function_call
        if self.audio_id is not None:
            message["audio"] = {"id": self.audio_id}
            if not message["content"]:
                message["content"] = None
        if self.thinking:
            message["thinking_blocks"] = self.thinking
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
            for call in message["tool_calls"]:  # a call streamed without arguments: as a whole answer's
                default_arguments(call["function"])
            if not message["content"]:
                message["content"] = None
        return message
