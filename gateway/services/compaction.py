"""Compaction, on every backend: a conversation folded into a summary the client holds a reference to.

For OpenAI's `POST /v1/responses/compact` and `context_management` on `POST /v1/responses`. The
gateway's summarizer folds what a conversation said; the reference is a `compaction` item (see
`gateway.context.compaction`), expanded again when the item comes back.

A compaction is a record in the tenant's `compactions` side log (its summary and what it
covers); one made for a stored conversation also leaves a `compaction` line in that
conversation's summaries log, so `gateway show` and the inspector can say where it happened.
`context_management` compacts through the rolling-summary machinery (`Summaries.fold`): the
summary version it writes is where that turn's window, and the turns after it, begin.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import Settings
from gateway.context import clean_message
from gateway.context.compaction import (
    ID_BYTES,
    SECRET_BYTES,
    Reference,
    compaction_item,
    compaction_message,
    compaction_target,
    read_reference,
    unverified,
    whole_prompt_tokens,
)
from gateway.context.history import ConversationView
from gateway.context.items import message_to_items
from gateway.context.summary import Summary, current_summary, summary_version
from gateway.exceptions import InvalidRequest, NotFound
from gateway.ids import mint_response_id
from gateway.services.cache import ConversationCache
from gateway.services.counting import branch_view
from gateway.services.models import ModelFacts
from gateway.services.summaries import Summaries
from gateway.store import StoreRegistry
from gateway.store.base import Store, now
from gateway.tokens import count_text, counter_for
from gateway.types import JSONObject, Message, Record
from gateway.upstream import Router


@dataclass(frozen=True, slots=True)
class Compacted:
    """A compaction made by `POST /v1/responses/compact`: OpenAI's compacted response's parts."""

    response_id: str
    created: float
    kept: list[JSONObject]  # the user messages, as items, as they were
    item: JSONObject  # the compaction item
    usage: dict[str, int]  # the summarizer's (`prompt_tokens`, `completion_tokens`)


@dataclass(frozen=True, slots=True)
class TurnCompaction:
    """A compaction made for a turn (`context_management`).

    Its item and the summary version the turn's window starts with.
    """

    item: JSONObject
    version: int


# With no `compact_threshold`, a conversation is compacted past this share of the model's window.
DEFAULT_THRESHOLD_SHARE = 0.8


class Compactions:
    def __init__(
        self,
        settings: Settings,
        stores: StoreRegistry,
        cache: ConversationCache,
        summaries: Summaries,
        facts: ModelFacts,
        router: Router,
    ) -> None:
        self.settings = settings
        self.stores = stores
        self.cache = cache
        self.summaries = summaries
        self.facts = facts
        self.router = router

    # -- compaction items coming back ----------------------------------------------------------
    async def resolve(self, tenant: str, refs: list[tuple[str, str]]) -> dict[str, Message]:
        """The summary message each `(where, encrypted_content)` stands for, by its content.

        A 400 `invalid_encrypted_content` for one that is not the gateway's, is altered, or was
        made for another tenant (it names nothing in this tenant's store).
        """
        out: dict[str, Message] = {}
        if not refs:
            return out
        store = await self.stores.get(tenant)
        for where, content in refs:
            if content in out:
                continue
            reference = read_reference(content)
            record = await _opened(store, reference) if reference is not None else None
            if reference is None or record is None:
                raise unverified(content, where)
            item = compaction_item(reference.compaction_id, content)
            out[content] = compaction_message(str(record.get("text", "")), item)
        return out

    # -- POST /v1/responses/compact ------------------------------------------------------------
    async def compact(
        self,
        tenant: str,
        model: str,
        messages: list[Message],
        *,
        conversation: str | None = None,
        previous: str | None = None,
    ) -> Compacted:
        """Compact a conversation's history followed by `messages` (the request's input).

        The history is through `previous`, or all of `conversation`. All of it is folded into one
        summary (from the conversation's own summary, where one covers its beginning), and the
        user messages kept as they were. Nothing of the conversation changes but the line that
        says it was compacted.
        """
        store = await self.stores.get(tenant)
        response_id = mint_response_id(model)
        kept: list[JSONObject] = []
        prior, folded, covers_through, end = "", list(messages), None, 0
        if conversation is not None:
            if previous is not None:  # (one still running is compacted once it ended, as a turn waits)
                await store.settled(conversation, self.settings.storage.lock_timeout)
            # Through a response that is not where the conversation goes on (an older one, one a
            # reset or an edit left behind): its history, as a turn continuing it branches with.
            branch = None
            if previous is not None:
                branch = await branch_view(store, conversation, previous, self.cache.skipped)
            view = branch if branch is not None else await self.cache.load(store, conversation)
            through: int | None = view.history_count  # (a branch ends with `previous`)
            if previous is not None and branch is None:
                through = view.history_end.get(previous)
            if through is None:
                raise NotFound(
                    f"Response {previous!r} is no longer part of a conversation", param="previous_response_id"
                )
            end = through
            summary = None  # (a branch has none of its own yet)
            if branch is None:
                summary = current_summary(await store.read_side("summaries", conversation), view)
            start = summary.covered if summary is not None and summary.covered <= end else 0
            prior = summary.text if summary is not None and start else ""
            folded = [*view.history[start:end], *messages]
            for m, owner, pos in zip(view.history[:end], view.history_owner, view.history_pos, strict=False):
                if m.get("role") == "user":
                    kept += message_to_items(m, owner, pos)
            covers_through = view.history_owner[end - 1] if end else None
        kept += [
            item
            for k, m in enumerate(messages)
            if m.get("role") == "user"
            for item in message_to_items(m, response_id, k)
        ]
        if not folded and not prior:
            raise InvalidRequest(
                "Nothing to compact: give 'input', or 'previous_response_id' or 'conversation' with history",
                param="input",
            )
        model_used = self.summaries.model_for(model)
        text, usage = await self.summaries.summarize(tenant, conversation, model_used, folded, prior)
        record: Record = {
            "conversation_id": conversation,
            "covers_through": covers_through,
            "covered_messages": end,
            "input_messages": len(messages),
            "trigger": "compact",
            "response_id": response_id,
        }
        item = await self._record(store, text, model_used, record)
        return Compacted(response_id, now(), kept, item, usage)

    async def _record(self, store: Store, text: str, model: str, about: Record) -> JSONObject:
        """Record a compaction and return its item.

        The record holds its summary and what it covers; it goes in its conversation's summaries
        log too, when it has one.
        """
        reference = Reference.of(secrets.token_bytes(ID_BYTES + SECRET_BYTES))
        created = now()
        record: Record = {
            "type": "compaction",
            "id": reference.compaction_id,
            "check": reference.check,
            **about,
            "text": text,
            "tokens": count_text(text, model),
            "model": model,
            "created": created,
        }
        await store.append_side("compactions", reference.compaction_id, record)
        cid = about.get("conversation_id")
        if isinstance(cid, str):
            line = {k: v for k, v in record.items() if k not in ("check", "text")}
            await store.append_side("summaries", cid, line)
        return compaction_item(reference.compaction_id, reference.encode())

    # -- context_management on POST /v1/responses --------------------------------------------
    async def compact_if_due(
        self,
        tenant: str,
        cid: str,
        previous: str | None,
        model: str,
        threshold: int | None,
        messages: list[Message],
    ) -> TurnCompaction | None:
        """Before a turn of conversation `cid`, compact it when its prompt passes `threshold` tokens.

        The prompt is as it would be sent whole: system prompt, the summary the window sends (the
        one its head holds, not a newer one waiting for the next cut, such as post-processing's
        of the whole conversation), every message after it, and `messages`, the turn's input. A
        `threshold` of None is DEFAULT_THRESHOLD_SHARE of the model's window. Compacting folds
        every turn but the newest into a new summary version and records the compaction. None
        when none is due (or the turn goes on from an older response, on a branch of its own: not
        compacted).
        """
        store = await self.stores.get(tenant)
        if not await store.exists(cid):
            return None
        if threshold is None:
            window = await self.facts.window(self.router.resolve(model), model, store)
            threshold = int(window.tokens * DEFAULT_THRESHOLD_SHARE)
        encoding, count = counter_for(model)
        lock_timeout = self.settings.storage.lock_timeout
        async with store.lock(cid, lock_timeout):
            view = await self.cache.load(store, cid)
            if previous is not None and (not view.response_ids or view.response_ids[-1] != previous):
                return None
            await _counted(view, encoding, count)
            records = await store.read_side("summaries", cid)
            held = view.head.summary if view.head is not None else None
            summary = summary_version(records, view, held) if held is not None else None
            covered = summary.covered if summary is not None else 0
            new_tokens = sum(count(clean_message(m)) for m in messages)
            summary_tokens = count_text(summary.text, model) if summary is not None else 0
            if whole_prompt_tokens(view, covered, summary_tokens, new_tokens) <= threshold:
                return None
            target = compaction_target(view, covered)
        if target is None:
            return None
        summarizer = self.summaries.model_for(model)
        # From the summary the window sends: a newer one may cover the newest turn as well.
        await self.summaries.fold(
            tenant, cid, target, summarizer, base_version=summary.version if summary else 0
        )
        async with store.lock(cid, lock_timeout):
            view = await self.cache.load(store, cid)
            made = current_summary(await store.read_side("summaries", cid), view)
            if made is None or not _newer(made, summary):
                return None  # nothing folded (deleted or reset meanwhile)
            about: Record = {
                "conversation_id": cid,
                "covers_through": made.covers_through,
                "covered_messages": made.covered,
                "summary_version": made.version,
                "trigger": "context_management",
                "threshold": threshold,
            }
            item = await self._record(store, made.text, made.model or summarizer, about)
        return TurnCompaction(item, made.version)


async def _opened(store: Store, reference: Reference) -> Record | None:
    """The compaction record `reference` names in `store`, when the reference opens it."""
    records = await store.read_side("compactions", reference.compaction_id, keep=False)
    return next((r for r in records if reference.opens(r)), None)


def _newer(made: Summary, before: Summary | None) -> bool:
    return before is None or made.version > before.version


async def _counted(view: ConversationView, encoding: str, count: Callable[[Message], int]) -> None:
    """The view's token counts made (as the planner makes them: off the loop when long)."""
    if view.encoding == encoding and not view.needs_count:
        return
    if len(view.history) > 64:
        await asyncio.to_thread(view.count_tokens, encoding, count)
    else:
        view.count_tokens(encoding, count)
