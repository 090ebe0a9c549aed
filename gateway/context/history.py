"""Pure history rules: what a stored conversation looks like to the model, and what is new.

No I/O and no async: every function takes plain lists of OpenAI message dicts.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import orjson

from gateway.context.recap_text import recap_without
from gateway.context.steps import Head
from gateway.context.tools import UNANSWERED_TOOL_RESULT as UNANSWERED_TOOL_RESULT
from gateway.context.tools import repair_tool_calls as repair_tool_calls
from gateway.context.tools import with_json_arguments
from gateway.types import JSONObject, Message

SYSTEM_ROLES = frozenset({"system", "developer"})
GATEWAY_MESSAGE_FIELDS = ("is_feedback", "compaction")
PREVIEW_CHARS = 120  # how much of the newest user message a list shows


def is_feedback(message: Message) -> bool:
    return message.get("is_feedback") is True


def leading_results(messages: Sequence[Message]) -> list[Message]:
    """The `tool` messages `messages` begin with."""
    return list(itertools.takewhile(lambda m: m.get("role") == "tool", messages))


def clean_message(message: Message) -> Message:
    """The message as a provider may see it: gateway-only fields removed."""
    if "is_feedback" not in message and "compaction" not in message:
        return message
    return cast(Message, {k: v for k, v in message.items() if k not in GATEWAY_MESSAGE_FIELDS})


def text_of(message: Mapping[str, object]) -> str:
    """A message's text: its content, or its text parts joined by spaces."""
    content = message.get("content")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def split_system(messages: Sequence[Message]) -> tuple[list[Message], list[Message]]:
    """Leading system/developer messages (the system prompt) and the rest.

    A compaction's summary (`compaction`) is history where it stands, never the system prompt.
    """
    i = 0
    while i < len(messages) and messages[i].get("role") in SYSTEM_ROLES and "compaction" not in messages[i]:
        i += 1
    return list(messages[:i]), list(messages[i:])


def _content_text(content: object) -> object:
    """Content in the form messages are compared in: what a model is given, not how it is laid out.

    Clients echo text as a string or as a list of text parts; and the three APIs carry the same
    image or file with different trimmings (chat keeps an image's `detail`, Responses drops
    "auto", Anthropic has none; an Anthropic PDF is named by its title or "document.pdf"). So
    adjacent text is joined, and an image is its URL, a file its data or id, audio its data.
    """
    if content is None:
        return ""
    if not isinstance(content, list):
        return content
    parts: list[object] = []
    for part in content:
        key = _part_key(part)
        if isinstance(key, str) and parts and isinstance(parts[-1], str):
            parts[-1] += key
        else:
            parts.append(key)
    if not parts:
        return ""
    return parts[0] if len(parts) == 1 and isinstance(parts[0], str) else parts


def _part_key(part: object) -> object:
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind == "text":
        return str(part.get("text", ""))
    inner = part.get(kind) if isinstance(kind, str) else None
    if not isinstance(inner, dict):
        return part
    if kind == "image_url":
        return ["image", inner.get("url")]
    if kind == "file":
        return ["file", inner.get("file_data") or inner.get("file_id")]
    if kind == "input_audio":
        return ["audio", inner.get("data")]
    return part


def _arguments_key(arguments: object) -> object:
    """A tool call's arguments as their JSON value, the form calls are compared in.

    Clients that resend a call (LangChain, `llm`) rebuild its arguments with `json.dumps`, so
    `{"city":"Paris"}` comes back as `{"city": "Paris"}`, the same call. Arguments that are not a
    JSON object (a small model's broken JSON, none at all) are `{}`: the Messages API gives such a
    call to its client as `input: {}`, which comes back so.
    """
    if isinstance(arguments, str) and arguments:
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return ["json", {}]
        return ["json", value if isinstance(value, dict) else {}]
    return ["json", {}]


def message_key(message: Message) -> bytes:
    """A canonical form for "is this the same message?".

    It is blind to null fields, part layout, an image's detail and a file's name, a message's
    `name` (Anthropic's and Responses' messages have none), how a tool call's arguments are
    spaced or ordered, and the order of its tool calls (LangChain resends a message's calls in
    another order when one's arguments are not JSON: the conversation branched on the model's
    own answer).
    """
    calls = [
        (
            str(c.get("id")),
            str((c.get("function") or {}).get("name")),
            _arguments_key((c.get("function") or {}).get("arguments")),
        )
        for c in message.get("tool_calls") or ()
        if isinstance(c, dict)
    ]
    calls.sort(key=lambda call: (call[0], call[1], orjson.dumps(call[2], option=orjson.OPT_SORT_KEYS)))
    audio = message.get("audio")
    canon = (
        message.get("role"),
        _content_text(message.get("content")),
        calls or None,
        message.get("tool_call_id"),
        audio.get("id") if isinstance(audio, dict) else None,  # an audio answer, by its id
        message.get("refusal") or None,
    )
    return orjson.dumps(canon, option=orjson.OPT_SORT_KEYS)


def item_key(response_id: str, position: int) -> str:
    """Identity of a stored message: its response and its position in input + [output].

    System prompt messages have negative positions: -1, -2, ...
    """
    return f"{response_id}#{position}"


@dataclass(frozen=True, slots=True)
class Turn:
    """One acknowledged exchange: the new input messages and the assistant's reply."""

    response_id: str
    input: tuple[Message, ...]
    output: Message | None  # None for items added through the Conversations API
    system: tuple[Message, ...] | None = None  # set when this turn replaced the system prompt
    # Token counts made once, when the turn was stored, with `encoding` (None: not counted).
    encoding: str | None = None
    input_tokens: tuple[int, ...] | None = None
    output_tokens: int | None = None
    system_tokens: tuple[int, ...] | None = None
    created: float | None = None
    model: str | None = None
    user: str | None = None
    recap: Message | None = None  # "Earlier today" system message injected when it started
    timezone: str | None = None
    # The client's history diverged (an edit, a regenerate): history is cut back to its first
    # `branch_at` messages before this turn's messages (the rest stays in the logs). `branch`
    # says which it was ("edited" or "regenerated", `context.reconcile.Reconciled`); None for a
    # branch recorded before the gateway told them apart.
    branch_at: int | None = None
    branch: str | None = None
    head: Head | None = None  # where this turn's window began (None: not recorded)

    @property
    def is_feedback_only(self) -> bool:
        return bool(self.input) and all(is_feedback(m) for m in self.input)

    def to_dict(self) -> JSONObject:
        return {
            "response_id": self.response_id,
            "input": list(self.input),
            "output": self.output,
            "system": list(self.system) if self.system is not None else None,
        }


class NotLoaded(Exception):
    """A partly loaded view was asked for what it does not hold: load the whole conversation."""


@dataclass(slots=True)
class ConversationView:
    """A conversation rebuilt from its turns, extended in place as turns are appended.

    `history` is what the model sees (feedback left out); `transcript` is everything the
    client said and heard, which is what a full-history client sends back.

    A view may hold only the conversation's newest part (`resume`): its first `history_base`
    history and `transcript_base` transcript messages are not loaded (positions, as in
    `history_end`, count them all). What needs them raises `NotLoaded`; the caller then loads
    the whole conversation.
    """

    system: list[Message] | None = None
    history: list[Message] = field(default_factory=list)
    transcript: list[Message] = field(default_factory=list)
    response_ids: list[str] = field(default_factory=list)
    turns: int = 0
    # Parallel to `history`: the response that stored each message, and its token count in
    # `encoding` (None where it is not known yet; the service fills those in once).
    history_owner: list[str] = field(default_factory=list)
    history_tokens: list[int | None] = field(default_factory=list)
    system_tokens: list[int | None] | None = None
    encoding: str | None = None
    needs_count: bool = False
    has_tools: bool = False  # any tool call or result in history: the window must repair
    history_end: dict[str, int] = field(default_factory=dict)  # response id -> end in history
    # Where each history message sits in its response (position in input + [output]), which
    # is what a Conversations API item id names; and who set the system prompt.
    history_pos: list[int] = field(default_factory=list)
    system_owner: str | None = None
    created_at: float | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    deleted_items: set[str] = field(default_factory=set)
    # item key -> the numbers its calls had at first, for an answer some of whose calls were
    # deleted (its `fc_..._K` item ids stay what they were)
    call_numbers: dict[str, list[int]] = field(default_factory=dict)
    # item key -> what of that answer was deleted while the rest is still sent ("its text",
    # "call K")
    deleted_parts: dict[str, list[str]] = field(default_factory=dict)
    # What resets took out of what the model is given: the responses whose messages were in
    # history, and (as `item_key(id, -1)`) the one whose system prompt went with them.
    reset_away: set[str] = field(default_factory=set)
    last_deletion: float | None = None  # when an item or a response was last deleted
    last_activity: float | None = None
    last_model: str | None = None
    user: str | None = None
    timezone: str | None = None
    recap: Message | None = None
    created_of: dict[str, float] = field(default_factory=dict)  # response id -> when it started
    _keys: dict[str, list[bytes]] = field(default_factory=dict)
    entries: int = 0  # index entries applied (turns, markers, and entries skipped as damaged)
    recap_owner: str | None = None
    history_base: int = 0
    transcript_base: int = 0
    # Responses indexed before the loaded part (since the last reset): what they hold is unknown.
    prefix_ids: frozenset[str] = frozenset()
    head: Head | None = None  # where the newest turn's window began (None: no turn recorded one)
    # What the history messages not loaded add up to, as their checkpoint recorded it (None:
    # it did not): their tokens, and the newest user message's text among them ("": none).
    tokens_base: int | None = 0
    preview_base: str | None = ""
    # The newest turns when they are feedback alone (left out of history) and the last ended in
    # tool calls: the messages a result for those calls goes on from, sent with it once.
    feedback_calls: list[Message] = field(default_factory=list)

    @property
    def partial(self) -> bool:
        return bool(self.history_base or self.transcript_base or self.prefix_ids)

    @property
    def history_count(self) -> int:
        return self.history_base + len(self.history)

    @property
    def transcript_count(self) -> int:
        return self.transcript_base + len(self.transcript)

    def history_tokens_total(self) -> int | None:
        """The tokens of every history message, those not loaded included, as counted.

        None when one is not counted yet, or the part not loaded did not record its own.
        """
        if self.tokens_base is None:
            return None
        try:
            return self.tokens_base + sum(cast(list[int], self.history_tokens))
        except TypeError:  # a message not counted yet
            return None

    def preview(self) -> str | None:
        """The newest user message's text, cut to PREVIEW_CHARS.

        "" when there is none; None when it is in the part not loaded and that part did not record
        it.
        """
        for message in reversed(self.history):
            if message.get("role") == "user":
                return text_of(message)[:PREVIEW_CHARS]
        return self.preview_base

    def at_end(self) -> ConversationView:
        """An empty view standing where this one ends, holding none of its messages.

        What is appended next (a turn, or a marker that names no stored message) applies to it as
        to this one, at the cost of that change alone, and its counts then say what the
        conversation holds after it (what a list shows: `services/listing.py`). A change that needs
        the messages (a branch cut before the end) raises NotLoaded.
        """
        return ConversationView(
            system=list(self.system) if self.system is not None else None,
            turns=self.turns,
            system_tokens=list(self.system_tokens) if self.system_tokens is not None else None,
            encoding=self.encoding,
            system_owner=self.system_owner,
            created_at=self.created_at,
            metadata=dict(self.metadata),
            last_deletion=self.last_deletion,
            last_activity=self.last_activity,
            last_model=self.last_model,
            user=self.user,
            timezone=self.timezone,
            recap=self.recap,
            entries=self.entries,
            recap_owner=self.recap_owner,
            history_base=self.history_count,
            transcript_base=self.transcript_count,
            head=self.head,
            tokens_base=self.history_tokens_total(),
            preview_base=self.preview(),
        )

    def loaded_from(self, position: int) -> int:
        """`position` in history as an index into the loaded `history` (NotLoaded below it)."""
        if position < self.history_base:
            raise NotLoaded(f"history message {position} is not loaded")
        return position - self.history_base

    def extend(self, turn: Turn) -> None:
        """Add a stored turn: its facts, its system prompt, its transcript and its history."""
        if turn.branch_at is not None:
            self.cut_history(turn.branch_at)
        self.entries += 1
        self._note_facts(turn)
        same_encoding = turn.encoding is not None and turn.encoding == self.encoding
        if self.encoding is None and turn.encoding is not None and not self.history_count:
            self.encoding = turn.encoding
            same_encoding = True
        if turn.system is not None:
            self.system = list(turn.system)
            self.system_owner = turn.response_id
            counts = turn.system_tokens if same_encoding else None
            self.system_tokens = list(counts) if counts is not None else [None] * len(turn.system)
            self.needs_count = self.needs_count or counts is None
        self.transcript.extend(clean_message(m) for m in turn.input)
        if turn.output is not None:
            self.transcript.append(turn.output)
        self.turns += 1
        self.response_ids.append(turn.response_id)
        if turn.head is not None:
            self.head = turn.head
        if turn.is_feedback_only:
            self._follow_feedback(turn)
        else:
            self.feedback_calls = []
            self._add_history(turn, same_encoding)

    def _follow_feedback(self, turn: Turn) -> None:
        """Note a feedback turn that ended in tool calls, with the feedback it goes on from."""
        out = turn.output
        if out is None or not out.get("tool_calls"):
            self.feedback_calls = []
            return
        goes_on = bool(self.feedback_calls) and all(m.get("role") == "tool" for m in turn.input)
        before = self.feedback_calls if goes_on else []
        self.feedback_calls = [*before, *(clean_message(m) for m in turn.input), out]

    def pending_feedback_calls(self, new: Sequence[Message]) -> list[Message]:
        """The feedback exchange `new` goes on from: [] unless `new` begins with results for its
        calls (and only for them), whatever follows.

        A feedback turn the model answered with tool calls is left out of history whole; the
        results the client sends for those calls go on from it (and are feedback too).
        """
        if not self.feedback_calls:
            return []
        results = leading_results(new)
        if not results:
            return []
        calls = self.feedback_calls[-1].get("tool_calls")
        pending = {c.get("id") for c in calls if isinstance(c, dict)} if isinstance(calls, list) else set()
        return self.feedback_calls if all(m.get("tool_call_id") in pending for m in results) else []

    def _note_facts(self, turn: Turn) -> None:
        """A turn's time, model, user, time zone and recap, as the conversation's latest."""
        if turn.created is not None:
            if self.created_at is None:
                self.created_at = turn.created
            self.last_activity = max(self.last_activity or 0.0, turn.created)
            self.created_of[turn.response_id] = turn.created
        self.last_model = turn.model or self.last_model
        self.user = turn.user or self.user
        self.timezone = turn.timezone or self.timezone
        if turn.recap is not None:
            self.recap, self.recap_owner = turn.recap, turn.response_id

    def _add_history(self, turn: Turn, same_encoding: bool) -> None:
        """Add to history a turn's messages the model gets again (not feedback, not deleted).

        They come with their counts when those were made in this view's encoding.
        """
        counts_in = turn.input_tokens if same_encoding and turn.input_tokens is not None else None
        if counts_in is None or turn.output_tokens is None or not same_encoding:
            self.needs_count = True
        deleted = self.deleted_items
        rid = turn.response_id
        for i, m in enumerate(turn.input):
            if is_feedback(m) or (deleted and item_key(rid, i) in deleted):
                continue
            tokens = counts_in[i] if counts_in is not None and i < len(counts_in) else None
            self._append(clean_message(m), rid, i, tokens)
            if m.get("role") == "tool":
                self.has_tools = True
        out = turn.output
        if out is not None and not (deleted and item_key(rid, len(turn.input)) in deleted):
            self._append(out, rid, len(turn.input), turn.output_tokens if same_encoding else None)
        self.history_end[rid] = self.history_count

    def _append(self, message: Message, owner: str, position: int, tokens: int | None) -> None:
        if "tool_calls" in message:
            self.has_tools = True
            message = with_json_arguments(message)  # (as the model is given it again)
        self.history.append(message)
        self.history_owner.append(owner)
        self.history_pos.append(position)
        self.history_tokens.append(tokens)

    def apply_marker(self, marker: JSONObject) -> None:
        """Index lines that are not response ids: creation, metadata, resets, item deletions."""
        kind = marker.get("type")
        deletion = kind in ("delete_response", "delete_item")
        if deletion and marker.get("response_id") in self.prefix_ids:
            position = marker.get("position")
            if kind == "delete_response" or not isinstance(position, int) or position >= 0:
                raise NotLoaded("a deletion in the part of history not loaded")
        self.entries += 1
        if kind in ("reset", "delete_response", "delete_item"):
            self.feedback_calls = []
        at = marker.get("at") or marker.get("created_at")
        if isinstance(at, int | float):
            self.last_activity = max(self.last_activity or 0.0, float(at))
            if deletion:
                self.last_deletion = max(self.last_deletion or 0.0, float(at))
        if kind == "reset":
            self.reset(keep_system_message=bool(marker.get("keep_system_message")))
        elif kind in ("conversation", "metadata"):
            self._describe(marker, created=kind == "conversation")
        elif kind == "delete_response":
            owner = marker.get("response_id")
            if isinstance(owner, str):
                self._delete_response(owner)
        elif kind == "delete_item":
            self._delete_marked(marker)
        elif kind == "withdraw_recap":  # other conversations' content deleted since it was made
            withdrawn = marker.get("conversations")
            if isinstance(withdrawn, list) and self.recap is not None:
                self.recap = recap_without(self.recap, {str(cid) for cid in withdrawn})
                if self.recap is None:
                    self.recap_owner = None

    def _describe(self, marker: JSONObject, *, created: bool) -> None:
        """A `conversation` (its creation) or `metadata` marker: the time made, the metadata."""
        if created and self.created_at is None:
            at = marker.get("created_at")
            self.created_at = float(at) if isinstance(at, int | float) else None
        metadata = marker.get("metadata")
        if isinstance(metadata, dict):
            self.metadata = {str(k): str(v) for k, v in metadata.items()}

    def _delete_response(self, owner: str) -> None:
        """Every message of a response deleted; as a load from the files sees it: no turn at all."""
        pairs = zip(self.history_owner, self.history_pos, strict=True)
        for position in [p for o, p in pairs if o == owner]:
            self.delete_item(owner, position)
        if owner in self.response_ids:
            self.response_ids.remove(owner)
            self.turns -= 1

    def delete_item(self, response_id: str, position: int) -> None:
        self.deleted_items.add(item_key(response_id, position))
        if position < 0 and self.system_owner == response_id:
            self.system = None
            self.system_tokens = None
            self.system_owner = None
            return
        for i in range(len(self.history) - 1, -1, -1):
            if self.history_owner[i] == response_id and self.history_pos[i] == position:
                for column in (self.history, self.history_owner, self.history_pos, self.history_tokens):
                    del column[i]
                self._keys.pop("history", None)
                self._ends()
                return

    def _delete_marked(self, marker: JSONObject) -> None:
        """A `delete_item` marker: a stored message, or one item of an answer (`call`, `text`)."""
        rid, pos, call = marker.get("response_id"), marker.get("position"), marker.get("call")
        if not isinstance(rid, str) or not isinstance(pos, int):
            return
        if isinstance(call, int) or marker.get("text") is True:
            self.delete_part(rid, pos, call if isinstance(call, int) else None)
        else:
            self.delete_item(rid, pos)

    def delete_part(self, response_id: str, position: int, call: int | None) -> None:
        """One item of an answer that holds several (its text, its calls): call number `call`,
        or its text when None. The answer goes on without it, and goes when nothing is left."""
        for i in range(len(self.history) - 1, -1, -1):
            if self.history_owner[i] == response_id and self.history_pos[i] == position:
                message, key = self.history[i], item_key(response_id, position)
                calls = list(message.get("tool_calls") or [])
                numbers = self.call_numbers.get(key) or list(range(len(calls)))
                if call is None:
                    kept = {k: v for k, v in message.items() if k not in ("content", "refusal", "audio")}
                    kept["content"] = None
                else:
                    pairs = [(n, c) for n, c in zip(numbers, calls, strict=False) if n != call]
                    kept = {k: v for k, v in message.items() if k != "tool_calls"}
                    if pairs:
                        kept["tool_calls"] = [c for _, c in pairs]
                    self.call_numbers[key] = [n for n, _ in pairs]
                if not kept.get("tool_calls") and not kept.get("content"):
                    self.delete_item(response_id, position)
                    return
                self.history[i] = cast(Message, kept)
                self._keys.pop("history", None)
                self.deleted_parts.setdefault(key, []).append("its text" if call is None else f"call {call}")
                return

    def position_of(self, key: str) -> int | None:
        """Where the stored message with item key `key` is in history.

        None when it is not in the loaded history: deleted, cut by a branch, or older than what is
        loaded.
        """
        response_id, _, position = key.rpartition("#")
        end = self.history_end.get(response_id)
        if end is None or not position.lstrip("-").isdigit():
            return None
        for i in range(end - 1 - self.history_base, -1, -1):
            if self.history_owner[i] != response_id:
                return None
            if self.history_pos[i] == int(position):
                return i + self.history_base
        return None

    def sent_items(self) -> set[tuple[str, int]]:
        """(response id, position) of every stored message the model still gets.

        That is every one not deleted, not cut by a later edit, and not a tool result whose call was
        deleted (the window's repair drops it).
        """
        kept = {id(m) for m in repair_tool_calls(self.history)}
        pairs = zip(self.history, self.history_owner, self.history_pos, strict=True)
        return {(owner, pos) for m, owner, pos in pairs if id(m) in kept}

    def cut_history(self, keep: int) -> None:
        """Keep only the first `keep` history messages; the transcript becomes that history.

        This is a branch: the client's version of the conversation continues from there.
        """
        keep = self.loaded_from(max(0, keep))
        for column in (self.history, self.history_owner, self.history_pos, self.history_tokens):
            del column[keep:]
        self._ends()
        self.has_tools = any(m.get("role") == "tool" or "tool_calls" in m for m in self.history)
        self.transcript = list(self.history)
        self.transcript_base = self.history_base
        self._keys = {}
        self.feedback_calls = []

    def _ends(self) -> None:
        self.history_end = {}
        for j, owner in enumerate(self.history_owner, start=self.history_base + 1):
            self.history_end[owner] = j

    def copy(self) -> ConversationView:
        """A copy whose changes never reach this view, nor this view's later changes it.

        Changes are counts filled in, a branch cut. A reader that plans without the conversation's
        lock works on one.
        """
        return dataclasses.replace(
            self,
            history=list(self.history),
            transcript=list(self.transcript),
            response_ids=list(self.response_ids),
            history_owner=list(self.history_owner),
            history_tokens=list(self.history_tokens),
            history_end=dict(self.history_end),
            history_pos=list(self.history_pos),
            deleted_items=set(self.deleted_items),
            call_numbers=dict(self.call_numbers),
            deleted_parts={k: list(v) for k, v in self.deleted_parts.items()},
            reset_away=set(self.reset_away),
            metadata=dict(self.metadata),
            created_of=dict(self.created_of),
            system=list(self.system) if self.system is not None else None,
            system_tokens=list(self.system_tokens) if self.system_tokens is not None else None,
            _keys={},
            feedback_calls=list(self.feedback_calls),
        )

    def branched(self, keep: int) -> ConversationView:
        """A copy cut back to its first `keep` history messages (this view is not changed)."""
        copy = self.copy()
        copy.cut_history(keep)
        return copy

    def reset(self, *, keep_system_message: bool) -> None:
        self.reset_away.update(self.history_owner)
        if not keep_system_message and self.system_owner is not None:
            self.reset_away.add(item_key(self.system_owner, -1))
        if not keep_system_message:
            self.system = None
            self.system_tokens = None
        self.history = []
        self.history_owner = []
        self.history_tokens = []
        self.history_end = {}
        self.history_pos = []
        self.has_tools = False
        if not keep_system_message:
            self.system_owner = None
        self.recap = self.recap_owner = None
        self.transcript = []
        self.response_ids = []
        self.turns = 0
        self._keys = {}
        self.history_base = self.transcript_base = 0
        self.prefix_ids = frozenset()
        self.head = Head(after_reset=True)
        self.tokens_base, self.preview_base = 0, ""
        self.feedback_calls = []
        self.needs_count = self.system_tokens is not None and None in self.system_tokens

    def count_tokens(self, encoding: str, count: Callable[[Message], int]) -> None:
        """Fill in missing counts (all of them if the encoding changed).

        Counts already made are never redone for the same encoding.
        """
        if encoding != self.encoding:
            self.encoding = encoding
            self.history_tokens = [None] * len(self.history)
            if self.system is not None:
                self.system_tokens = [None] * len(self.system)
        for i, n in enumerate(self.history_tokens):
            if n is None:
                self.history_tokens[i] = count(self.history[i])
        if self.system is not None:
            tokens = self.system_tokens or [None] * len(self.system)
            self.system_tokens = [
                n if n is not None else count(m) for n, m in zip(tokens, self.system, strict=False)
            ]
        self.needs_count = False

    def keys(self, which: str) -> list[bytes]:
        """Canonical keys of `history` or `transcript`, computed once and extended lazily."""
        messages = self.history if which == "history" else self.transcript
        cached = self._keys.setdefault(which, [])
        if len(cached) < len(messages):
            cached.extend(message_key(m) for m in messages[len(cached) :])
        return cached


def rebuild_view(turns: Iterable[Turn]) -> ConversationView:
    view = ConversationView()
    for turn in turns:
        view.extend(turn)
    return view
