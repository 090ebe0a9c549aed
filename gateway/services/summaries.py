"""Rolling summaries, the use case (`context.strategy = "summarize"` and post-processing).

Fold the turns that fell out of the window into the conversation's summary log with
`summary_model`.

Coverage is always a contiguous prefix of whole turns, so a dropped turn is either in the window
or covered by a committed summary version. Each version records its provenance. Scheduling and
retries are the background job's (`gateway.jobs.summarizer`); this never runs on a request path.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.config import Settings
from gateway.context.history import ConversationView, item_key
from gateway.context.summary import (
    SUMMARY_INSTRUCTIONS,
    chunk_budget,
    current_summary,
    last_version,
    render_for_summary,
    summary_cap,
    summary_version,
    withdrawal,
)
from gateway.exceptions import UpstreamStatusError
from gateway.services.cache import ConversationCache
from gateway.services.models import ModelFacts
from gateway.store import StoreRegistry
from gateway.store.base import Store, now
from gateway.tokens import count_message, count_text, encoding_name_for, truncate_text
from gateway.types import Message, as_object, first_choice
from gateway.upstream import Route, Router
from gateway.upstream.base import Body


async def withdraw(
    store: Store, cid: str, response_id: str, load: Callable[[], Awaitable[ConversationView]]
) -> None:
    """Withdraw the summary versions that drew on `response_id`'s messages, before those are deleted.

    The conversation's lock is held; `load` gives the whole conversation as it is before the
    deletion, read only when it has summaries. Withdrawn, they stop applying, so the model never
    sees a deleted message again, not even summarized. Recorded first: a crash between the two
    leaves summaries withdrawn for nothing, never a deleted message in one.
    """
    records = await store.read_side("summaries", cid)
    if not any(r.get("type") == "summary" for r in records):
        return
    record = withdrawal(await load(), response_id, now())
    if record is not None:
        await store.append_side("summaries", cid, record)


@dataclass(frozen=True, slots=True)
class SummaryCall:
    """One call to the summarizer model, as the tracing hook is told of it."""

    conversation_id: str | None  # (None: a compaction of a request's input alone)
    provider: str
    model: str  # the provider's own model name
    max_tokens: int
    seconds: float
    completion: Body | None  # the provider's answer (None: the call failed)
    error: BaseException | None = None


def _calls_tools(message: Message) -> bool:
    return message.get("role") == "assistant" and bool(message.get("tool_calls"))


def _count(value: object) -> int | None:
    """A token count a provider reported, or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _parts(messages: list[Message], costs: list[int], limit: int) -> list[list[Message]]:
    """`messages` in consecutive parts of at most `limit` tokens each.

    A single message larger than that is a part of its own, cut when rendered.
    """
    parts: list[list[Message]] = [[]]
    used = 0
    for message, cost in zip(messages, costs, strict=True):
        if parts[-1] and used + cost > limit:
            parts.append([])
            used = 0
        parts[-1].append(message)
        used += cost
    return parts


class Summaries:
    def __init__(
        self,
        settings: Settings,
        router: Router,
        stores: StoreRegistry,
        facts: ModelFacts,
        cache: ConversationCache,
    ) -> None:
        self.settings = settings
        self.router = router
        self.stores = stores
        self.facts = facts
        self.cache = cache
        # Called once per summary version written (rolling or post-processing): the metrics hook.
        self.on_version: Callable[[], None] = lambda: None
        # Called after each call to the summarizer model, answered or failed: the tracing hook.
        self.on_call: Callable[[SummaryCall], None] = lambda call: None

    def model_for(self, model: str) -> str:
        """The model that summarizes a conversation held with `model`."""
        return self.settings.context.summary_model or model

    async def summarize_all(self, tenant: str, cid: str, model: str) -> str:
        """Fold the whole conversation into its summary now (post-processing); the text."""
        store = await self.stores.get(tenant)
        view = await self.cache.load(store, cid, keep=False)  # an idle conversation
        if not view.history_owner:
            return ""
        await self.fold(tenant, cid, view.history_owner[-1], self.model_for(model), keep=False)
        records = await store.read_side("summaries", cid, keep=False)
        summary = current_summary(records, await self.cache.load(store, cid, keep=False))
        return summary.text if summary else ""

    async def _fold_text(
        self,
        cid: str | None,
        route: Route,
        window: int,
        cap: int,
        limit: int,
        model: str,
        text: str,
        chunk: list[Message],
        usage: dict[str, int] | None = None,
    ) -> str:
        """The summary `text` with `chunk` folded in: one call to the summarizer model.

        Its usage is added to `usage`, when given.
        """
        rendered = truncate_text(render_for_summary(chunk), limit, model)
        asked = f"Current summary:\n{text or '(none yet)'}\n\nNew messages:\n" + rendered
        sent: list[Message] = [
            {"role": "system", "content": SUMMARY_INSTRUCTIONS.format(max_tokens=cap)},
            {"role": "user", "content": asked},
        ]
        body: Body = {
            "model": route.model,
            "messages": sent,
            "max_tokens": cap,
            "stream": False,
        }
        started = time.perf_counter()
        try:
            # In a context of its own: not a call of the request that may be waiting on it (a
            # compaction before a turn), whose trace would count it as the turn's and send the
            # provider that trace's `traceparent`; the summarizer's call is reported on its own.
            completion = await asyncio.create_task(
                route.upstream.complete(body), context=contextvars.Context()
            )
        except BaseException as exc:
            seconds = time.perf_counter() - started
            self.on_call(SummaryCall(cid, route.provider, route.model, cap, seconds, None, exc))
            if isinstance(exc, UpstreamStatusError) and exc.refusal is not None:
                # Learned from; the retry plans smaller chunks.
                self.facts.refused(route, 0, exc.refusal, window)
            raise
        seconds = time.perf_counter() - started
        self.on_call(SummaryCall(cid, route.provider, route.model, cap, seconds, completion))
        reply = as_object(first_choice(completion).get("message")).get("content") or ""
        text = truncate_text(str(reply).strip(), cap, model)
        if usage is not None:  # the provider's counts, else our own
            reported = as_object(completion.get("usage"))
            prompt, answer = _count(reported.get("prompt_tokens")), _count(reported.get("completion_tokens"))
            if prompt is None:
                prompt = sum(count_message(m, model) for m in sent)
            usage["prompt_tokens"] += prompt
            usage["completion_tokens"] += answer if answer is not None else count_text(text, model)
        return text

    async def summarize(
        self, tenant: str, cid: str | None, model: str, messages: list[Message], text: str = ""
    ) -> tuple[str, dict[str, int]]:
        """`messages` folded into the summary `text` now by `model`, recorded nowhere.

        `messages` are of conversation `cid` (None: of no stored conversation), as the tracing
        hook is told; they go in parts that
        fit `model`'s window. Returns the new text and the summarizer's usage (`prompt_tokens`,
        `completion_tokens`). For compaction, which the client asks for and waits on.
        """
        store = await self.stores.get(tenant)
        route = self.router.resolve(model)
        facts = await self.facts.window(route, model, store)
        cap = summary_cap(self.settings.context.summary_max_tokens, facts.tokens)
        calib = facts.calibration
        limit = chunk_budget(facts.tokens, cap, calib.ratio, calib.overhead, calib.margin)
        text = truncate_text(text, cap, model)
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        if messages:
            costs = [count_message(m, model) for m in messages]
            for part in _parts(messages, costs, limit):
                text = await self._fold_text(cid, route, facts.tokens, cap, limit, model, text, part, usage)
        return text, usage

    async def record_failure(self, tenant: str, cid: str, attempt: int, message: str) -> None:
        store = await self.stores.get(tenant)
        await store.append_side(
            "summaries",
            cid,
            {"type": "summary_failed", "attempt": attempt, "error": message[:500], "created": now()},
        )

    async def fold(
        self,
        tenant: str,
        cid: str,
        target: str,
        model: str,
        *,
        keep: bool = True,
        base_version: int | None = None,
    ) -> None:
        """Fold the turns not yet covered, through response `target`, into new summary versions.

        Whole turns, in chunks that fit `model`'s window. The lock is held only to read. `keep`:
        whether the view may take a place in the cache (not for idle conversations).
        `base_version`: go on from that version (0: from none) rather than from the newest, which
        may cover more than `target` (post-processing's, of the whole conversation).
        """
        store = await self.stores.get(tenant)
        encoding = encoding_name_for(model)
        async with store.lock(cid, self.settings.storage.lock_timeout):
            view = await self.cache.load(store, cid, keep=keep)
            records = await store.read_side("summaries", cid, keep=keep)
            newest = current_summary(records, view)
            summary = newest
            if base_version is not None:
                summary = summary_version(records, view, base_version) if base_version else None
            end = view.history_end.get(target)
            if end is None:
                return  # the conversation was reset or deleted meanwhile
            start = summary.covered if summary else 0
            if end <= start:
                return
            messages = list(view.history[start:end])
            owners = list(view.history_owner[start:end])
            positions = list(view.history_pos[start:end])
        text = summary.text if summary else ""
        base = newest.version if newest else 0  # (the newest when it began: none made since)
        route = self.router.resolve(model)
        facts = await self.facts.window(route, model, store)
        cap = summary_cap(self.settings.context.summary_max_tokens, facts.tokens)
        calib = facts.calibration
        limit = chunk_budget(facts.tokens, cap, calib.ratio, calib.overhead, calib.margin)
        text = truncate_text(text, cap, model)  # written for a larger window, maybe
        i = 0
        while i < len(messages):
            # Whole turns, about CHUNK_TOKENS at a time.
            j = i
            used = 0
            costs: list[int] = []
            while j < len(messages):
                k = j + 1
                while k < len(messages) and owners[k] == owners[j]:
                    k += 1
                cost = [count_message(m, model) for m in messages[j:k]]
                # A version never ends between a tool call and its results (the next turn's):
                # the results would be orphans beside the summary, dropped from every window.
                if j > i and used + sum(cost) > limit and not _calls_tools(messages[j - 1]):
                    break
                used += sum(cost)
                costs += cost
                j = k
            while j > i and _calls_tools(messages[j - 1]):  # its results are not stored yet
                j = next(x for x in range(j - 1, i - 1, -1) if x == i or owners[x - 1] != owners[j - 1])
                costs = costs[: j - i]
            if j == i:
                return
            started = time.perf_counter()
            # A turn larger than one call (a long chat sent in one request) goes in several
            # calls; its version is recorded once all of it is folded in.
            for part in _parts(messages[i:j], costs, limit):
                text = await self._fold_text(cid, route, facts.tokens, cap, limit, model, text, part)
            folded = [item_key(owner, pos) for owner, pos in zip(owners[i:j], positions[i:j], strict=True)]
            async with store.lock(cid, self.settings.storage.lock_timeout):
                # What was deleted, reset or summarized meanwhile is not folded in (or over).
                view = await self.cache.load(store, cid, keep=keep)
                records = await store.read_side("summaries", cid, keep=keep)
                now_current = current_summary(records, view)
                if (
                    (now_current.version if now_current else 0) != base
                    or any(key in view.deleted_items for key in folded)
                    or view.history_end.get(owners[j - 1]) is None  # deleted, expired or reset
                ):
                    return
                base = last_version(records) + 1
                await store.append_side(
                    "summaries",
                    cid,
                    {
                        "type": "summary",
                        "version": base,
                        "covers_through": owners[j - 1],
                        "covered_response_ids": sorted(set(owners[i:j]), key=owners.index),
                        "covered_messages": start + j,
                        "text": text,
                        "tokens": count_text(text, model),
                        "encoding": encoding,
                        "model": model,
                        "created": now(),
                        "ms": round((time.perf_counter() - started) * 1000, 1),
                    },
                )
            self.on_version()
            i = j
