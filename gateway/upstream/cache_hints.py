"""Prompt-cache hints: what tells a provider how to keep a conversation's prompt cached.

The gateway resends the whole conversation every turn; a provider that caches prompts reads
the part it saw before from its cache, when it is told how:
- OpenAI's own API: `prompt_cache_key`, one per conversation (OpenAI routes requests with the
  same key to the same cache); not other OpenAI-compatible servers, which cache a repeated
  prompt start by themselves, and some of which refuse a field they do not know;
- llama.cpp: `cache_prompt: true`, and on a server of several slots `id_slot`, one slot per
  conversation so that conversations taking turns do not evict each other's prompt;
- Anthropic (through litellm): `cache_control` breakpoints at the end of the stable head of
  the prompt and on its last message, where the next turn reads the cache up to.

A turn names its conversation to the upstream with `CACHE_KEY` in the body (`cache_key`: a
hash, never the tenant or the conversation id themselves); the upstream takes it out and puts
in the hints it stands for. The client's own hints always win. Pure rules over plain dicts,
apart from `SlotTable`, the slot each conversation keeps.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import cast
from urllib.parse import urlsplit

from gateway.types import as_object
from gateway.upstream.base import Body, take_field

# The gateway's private body field naming the conversation to the upstream (never sent on).
CACHE_KEY = "gateway.cache_key"
# Anthropic takes at most four `cache_control` breakpoints in a request, tools included.
ANTHROPIC_MAX_BREAKPOINTS = 4
# The leading messages the gateway keeps byte-identical between turns: system prompt, recap,
# summary, the `[N earlier messages omitted]` marker.
_HEAD_ROLES = frozenset({"system", "developer"})


def cache_key(tenant: str, conversation_id: str | None) -> str | None:
    """A stable, non-reversible name for one tenant's conversation (None without one)."""
    if conversation_id is None:
        return None
    return hashlib.sha256(f"{tenant}\0{conversation_id}".encode()).hexdigest()[:32]


def take_cache_key(body: Body) -> tuple[Body, str | None]:
    """The body without the gateway's `CACHE_KEY`, and the key it held."""
    return take_field(body, CACHE_KEY)


OPENAI_HOST = "api.openai.com"


def takes_prompt_cache_key(base_url: str) -> bool:
    """Whether the provider at `base_url` is OpenAI's own API, the one that reads `prompt_cache_key`."""
    try:
        return (urlsplit(base_url).hostname or "").lower() == OPENAI_HOST
    except ValueError:
        return False


def with_prompt_cache_key(body: Body, key: str | None) -> Body:
    """The body with OpenAI's `prompt_cache_key` for a conversation, unless the client sent its own."""
    if key is None or "prompt_cache_key" in body:
        return body
    return {**body, "prompt_cache_key": key}


class SlotTable:
    """The llama.cpp slot each conversation keeps its prompt in, for one server of `total` slots.

    A conversation keeps its slot until another takes it; a new conversation takes the slot
    used least recently, so up to `total` conversations taking turns never evict each other.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        # slot -> the conversation holding it, least recently used first
        self._holders: OrderedDict[int, str | None] = OrderedDict.fromkeys(range(total))
        self._slot_of: dict[str, int] = {}

    def slot_for(self, key: str) -> int:
        """The slot of conversation `key`, taken now if it holds none (and marked as used)."""
        slot = self._slot_of.get(key)
        if slot is None:
            slot, previous = next(iter(self._holders.items()))
            if previous is not None:
                del self._slot_of[previous]
            self._holders[slot] = key
            self._slot_of[key] = slot
        self._holders.move_to_end(slot)
        return slot


def with_llamacpp_hints(body: Body, key: str | None, slots: SlotTable | None) -> Body:
    """The body with llama.cpp's `cache_prompt: true` and, where it has one, the conversation's slot.

    A conversation on a server of several slots keeps its slot (`id_slot`); the client's own
    values win.
    """
    hints: Body = {"cache_prompt": True}
    if key is not None and slots is not None and "id_slot" not in body:
        hints["id_slot"] = slots.slot_for(key)
    return {**hints, **body}


def count_breakpoints(messages: Sequence[object], tools: object = None) -> int:
    """The `cache_control` breakpoints a request already holds: on messages, their blocks, its tools."""
    found = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        found += bool(message.get("cache_control"))
        content = message.get("content")
        if isinstance(content, list):
            found += sum(bool(block.get("cache_control")) for block in content if isinstance(block, dict))
    if isinstance(tools, list):
        found += sum(bool(tool.get("cache_control")) for tool in tools if isinstance(tool, dict))
    return found


def _head_end(messages: Sequence[object]) -> int | None:
    """The index of the last leading system message (the prompt's stable head), if any."""
    end = None
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _HEAD_ROLES:
            break
        end = index
    return end


def _blocks(message: object) -> list[object] | None:
    """The message's content as a list of blocks (a copy), None when it has none to end with a breakpoint.

    That is: no content (an assistant's bare `tool_calls`), or an empty text last (litellm drops
    an empty text block, and its breakpoint with it).
    """
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str) and content:
        return [{"type": "text", "text": content}]
    if isinstance(content, list) and content and isinstance(content[-1], dict):
        last = content[-1]
        if last.get("type") != "text" or last.get("text"):
            return list(content)
    return None


def _newest_breakpoints(messages: list[object], keep: int) -> list[object]:
    """The messages with at most `keep` of their breakpoints, the newest (the others removed,
    from copies).

    A client's breakpoints stay in the stored conversation and come back turn after turn: one
    more each turn, until Anthropic refused the fifth and every turn after it. Those before the
    newest `keep` only mark prefixes the newer ones cover."""
    marked: list[tuple[int, int]] = []  # (message, block; -1: the message itself)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        if message.get("cache_control"):
            marked.append((i, -1))
        content = message.get("content")
        if isinstance(content, list):
            marked += [(i, k) for k, block in enumerate(content) if as_object(block).get("cache_control")]
    for i, k in marked[: max(0, len(marked) - max(0, keep))]:
        changed = dict(as_object(messages[i]))
        if k < 0:
            changed.pop("cache_control", None)
        else:
            blocks = list(cast(list[object], changed["content"]))
            blocks[k] = {key: v for key, v in as_object(blocks[k]).items() if key != "cache_control"}
            changed["content"] = blocks
        messages[i] = changed
    return messages


def with_cache_breakpoints(messages: Sequence[object], tools: object = None) -> list[object]:
    """The messages with Anthropic `cache_control` breakpoints, in litellm's format.

    A breakpoint is on the last content block of a message. One on the last message that can end
    with one, where the next turn reads the cache up to; then one at the end of the stable head
    (the leading system messages), which a cut of the history leaves in place; at most
    Anthropic's four in all, the client's own counted (the newest of them, when more came back
    with the stored conversation than that). The messages given are left as they are: the ones
    marked are copies.
    """
    out = _newest_breakpoints(list(messages), ANTHROPIC_MAX_BREAKPOINTS - count_breakpoints([], tools))
    room = ANTHROPIC_MAX_BREAKPOINTS - count_breakpoints(out, tools)
    head = _head_end(out)
    after_head = range(len(out) - 1, -1 if head is None else head, -1)
    last = next((i for i in after_head if _blocks(out[i]) is not None), None)
    for index in (last, head):
        if index is None or room <= 0:
            continue
        message = as_object(out[index])
        blocks = _blocks(message)
        if blocks is None or message.get("cache_control") or as_object(blocks[-1]).get("cache_control"):
            continue  # nothing to end with one, or the client's own breakpoint is there already
        blocks[-1] = {**as_object(blocks[-1]), "cache_control": {"type": "ephemeral"}}
        out[index] = {**message, "content": blocks}
        room -= 1
    return out
