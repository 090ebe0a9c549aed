"""Conversation use cases (the Conversations API, `gateway reset` / `delete`).

Create, read, change metadata, add and delete items, reset, delete. Every write holds the
conversation's lock and is an append (a marker, or a response log for added items); only
deletion removes files.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from collections.abc import Callable

from gateway.config import Settings
from gateway.context import ConversationView, Message, Turn, split_system
from gateway.context.history import item_key
from gateway.context.items import Item, items_to_messages, message_to_items, parse_item_id
from gateway.context.tail import checkpoint
from gateway.exceptions import InvalidRequest, NotFound
from gateway.ids import check_conversation_id, mint_response_id
from gateway.services.cache import ConversationCache
from gateway.services.listing import Listing
from gateway.services.recap import withdraw_recaps
from gateway.services.requests import check_size
from gateway.services.summaries import withdraw
from gateway.services.turn import archive_expired, expired
from gateway.store import Store, StoreRegistry
from gateway.store.base import now
from gateway.types import JSONObject, Record, ascii_int

MAX_ADDED_ITEMS = 100


def view_items(view: ConversationView) -> list[Item]:
    """The conversation as items, oldest first: system prompt, then what the model sees."""
    items: list[Item] = []
    if view.system and view.system_owner:
        for k, message in enumerate(view.system):
            items.extend(message_to_items(message, view.system_owner, -(k + 1)))
    for message, owner, pos in zip(view.history, view.history_owner, view.history_pos, strict=True):
        items.extend(message_to_items(message, owner, pos, view.call_numbers.get(item_key(owner, pos))))
    return items


def item_place(view: ConversationView) -> Callable[[str], tuple[int, int, int] | None]:
    """An item id's place in `view_items`' order, whether or not the item is still listed.

    The order is system prompt, then turns in order, then positions, then a message's calls. None
    for an id that names no turn of the conversation.
    """
    turns = {rid: i for i, rid in enumerate(view.response_ids)}

    def place(item_id: str) -> tuple[int, int, int] | None:
        named = parse_item_id(item_id)
        if named is None:
            return None
        rid, position = named
        if position < 0:  # the system prompt's k-th message
            return (-1, -position, 0) if item_id.startswith("sys_") else None
        turn = turns.get(rid)
        if turn is None:
            return None
        call = ascii_int(item_id.rsplit("_", 1)[1]) if item_id.startswith("fc_") else -1
        return (turn, position, call) if call is not None else None

    return place


def find_item(view: ConversationView, item_id: str) -> Item:
    for item in view_items(view):
        if item["id"] == item_id:
            return item
    raise NotFound(f"No item {item_id!r} in this conversation", param="item_id")


def _row_after(view: ConversationView, marker: Record) -> JSONObject | None:
    """The list row of the conversation once `marker` is appended to `view`'s conversation.

    `marker` is one that names no stored message.
    """
    listing = Listing.after(view, lambda stand_in: stand_in.apply_marker(marker))
    return listing.record() if listing is not None else None


async def _must_exist(store: Store, cid: str) -> None:
    if not await store.exists(cid):
        raise NotFound(f"No conversation found with id {cid!r}", param="conversation_id")


class Conversations:
    def __init__(self, settings: Settings, stores: StoreRegistry, cache: ConversationCache) -> None:
        self.settings = settings
        self.stores = stores
        self.cache = cache
        self.lock_timeout = settings.storage.lock_timeout
        self.clock: Callable[[], float] = time.time

    async def _existing(self, store: Store, cid: str, *, locked: bool = False) -> ConversationView:
        """The conversation's view; NotFound when there is none, or it has expired (`ttl`).

        An expired one is what the next turn would archive: with its lock held (`locked`) it is
        archived now, so that no write reaches it (items added to it made it new again, and its
        old history went to the model with them)."""
        await _must_exist(store, cid)
        view = await self.cache.load(store, cid)
        if expired(view, self.settings.sessions.ttl, self.clock()):
            if locked:
                await archive_expired(store, self.cache, cid)
            raise NotFound(f"No conversation found with id {cid!r}: it expired", param="conversation_id")
        return view

    async def create(
        self, tenant: str, *, requested_id: object, metadata: dict[str, str], items: object
    ) -> tuple[str, ConversationView]:
        """A new conversation, with its first items: all of it, or (on any failure) none."""
        store = await self.stores.get(tenant)
        # Extension: a client may choose the id (as it does with chat completions).
        cid = (
            check_conversation_id(requested_id, param="id")
            if requested_id
            else f"conv_{secrets.token_hex(16)}"
        )
        if items:
            self._messages(items)  # a bad item is a 400 before anything is written
        async with store.lock(cid, self.lock_timeout):
            with contextlib.suppress(NotFound):  # (an expired one is archived: the id is free)
                await self._existing(store, cid, locked=True)
                raise InvalidRequest(
                    f"Conversation {cid!r} already exists", param="id", code="conversation_exists"
                )
            marker: Record = {"type": "conversation", "created_at": int(time.time()), "metadata": metadata}
            await store.append_marker(cid, marker, _row_after(ConversationView(), marker))
            if items:
                try:
                    await self._add_items(store, cid, items, locked=True)
                except BaseException:
                    # Not half made: the conversation goes with the items that failed.
                    with contextlib.suppress(Exception):
                        await store.delete_conversation(cid)
                    self.cache.forget(store, cid)
                    raise
        return cid, await self.cache.load(store, cid)

    async def get(self, tenant: str, cid: str) -> ConversationView:
        return await self._existing(await self.stores.get(tenant), cid)

    async def _marker(self, tenant: str, cid: str, marker: Record) -> ConversationView:
        store = await self.stores.get(tenant)
        async with store.lock(cid, self.lock_timeout):
            view = await self._existing(store, cid, locked=True)
            await store.append_marker(cid, marker, _row_after(view, marker))
            return await self.cache.load(store, cid)

    async def update_metadata(self, tenant: str, cid: str, metadata: dict[str, str]) -> ConversationView:
        return await self._marker(tenant, cid, {"type": "metadata", "metadata": metadata, "at": now()})

    async def reset(self, tenant: str, cid: str, *, keep_system_message: bool) -> ConversationView:
        return await self._marker(
            tenant, cid, {"type": "reset", "keep_system_message": keep_system_message, "at": now()}
        )

    async def _withdraw_recaps(self, store: Store, cid: str) -> None:
        """Before a deletion in `cid`: recaps elsewhere stop quoting it (services.recap)."""
        await withdraw_recaps(
            store, functools.partial(self.cache.load, store, keep=False), cid, self.lock_timeout
        )

    async def delete(self, tenant: str, cid: str) -> None:
        store = await self.stores.get(tenant)
        await self._withdraw_recaps(store, cid)
        async with store.lock(cid, self.lock_timeout):
            deleted = await store.delete_conversation(cid, archive=self.settings.storage.archive_deleted)
        if not deleted:
            raise NotFound(f"No conversation found with id {cid!r}", param="conversation_id")

    async def add_items(self, tenant: str, cid: str, raw_items: object) -> list[Item]:
        store = await self.stores.get(tenant)
        await _must_exist(store, cid)  # (an expired one is archived under its lock, then a 404)
        return await self._add_items(store, cid, raw_items)

    @staticmethod
    def _messages(raw_items: object) -> list[Message]:
        messages = items_to_messages(raw_items)
        if len(messages) > MAX_ADDED_ITEMS:
            raise InvalidRequest(f"At most {MAX_ADDED_ITEMS} items can be added at a time", param="items")
        return messages

    async def _add_items(
        self, store: Store, cid: str, raw_items: object, *, locked: bool = False
    ) -> list[Item]:
        messages = self._messages(raw_items)
        rid = mint_response_id("items")
        created_at = now()
        async with contextlib.AsyncExitStack() as stack:
            if not locked:
                await stack.enter_async_context(store.lock(cid, self.lock_timeout))
                view = await self._existing(store, cid, locked=True)
            else:  # (made just now, by `create`)
                view = await self.cache.load(store, cid)
            check_size(self.settings.storage.max_conversation_messages, cid, view, len(messages))
            # Items are added, as in OpenAI's API: leading system messages are the system prompt
            # only of a conversation that has nothing yet; later ones take their place in line
            # (they replaced the system prompt, which then never reached the model again).
            empty = not view.system and view.history_count == 0
            system, rest = split_system(messages) if empty else ([], messages)
            record: Record = {
                "type": "request",
                "kind": "items",
                "response_id": rid,
                "conversation_id": cid,
                "created": created_at,
                "system": system or None,
                "input": rest,
            }
            record["before"] = checkpoint(view)
            log = store.start(rid, record)
            turn = Turn(rid, tuple(rest), None, tuple(system) if system else None, created=created_at)
            listing = Listing.after(view, lambda stand_in: stand_in.extend(turn))
            log.list_as(listing.record() if listing is not None else None)
            try:
                appended = await log.commit(cid)
            except BaseException:
                await log.abandon("error")
                raise
            self.cache.appended(store, cid, appended, lambda view: view.extend(turn))
        created: list[Item] = []
        for k, message in enumerate(system):
            created.extend(message_to_items(message, rid, -(k + 1)))
        for pos, message in enumerate(rest):
            created.extend(message_to_items(message, rid, pos))
        return created

    async def delete_item(self, tenant: str, cid: str, item_id: str) -> ConversationView:
        store = await self.stores.get(tenant)
        find_item(await self._existing(store, cid), item_id)  # (a 404 withdraws nothing)
        await self._withdraw_recaps(store, cid)
        async with store.lock(cid, self.lock_timeout):
            view = await self._existing(store, cid, locked=True)
            find_item(view, item_id)
            named = parse_item_id(item_id)
            assert named is not None  # find_item only finds ids we made
            rid, position = named
            await withdraw(store, cid, rid, functools.partial(self.cache.load, store, cid))
            marker: Record = {"type": "delete_item", "response_id": rid, "position": position, "at": now()}
            if sum(parse_item_id(str(i["id"])) == named for i in view_items(view)) > 1:
                # One item of an answer that holds several (its text, its calls): that one alone,
                # as OpenAI deletes an item (the message's deletion would take the others too).
                if item_id.startswith("fc_"):
                    marker["call"] = int(item_id.rsplit("_", 1)[1])
                else:
                    marker["text"] = True
            await store.append_marker(cid, marker)
            return await self.cache.load(store, cid)
