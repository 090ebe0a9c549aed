"""Rolling summaries (`context.strategy = "summarize"`), folded in the background.

When turns fall out of the window, the service asks for a summary covering them (and a little
more, so the next turns fit too). A background task folds the not-yet-covered turns, oldest
first, into the previous summary with `summary_model`, capped at `summary_max_tokens`, and
appends each new version to the conversation's summary log with its provenance. Coverage is
always a contiguous prefix of whole turns, so a dropped turn is either in the window or covered
by a committed summary version. Failures are recorded and retried with backoff; until a summary
is ready, truncation applies. Never on the request path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.config import Settings
from gateway.context import ConversationView, Message
from gateway.exceptions import UpstreamStatusError
from gateway.services.models import ModelFacts
from gateway.store.base import Record, Store, now
from gateway.tokens import count_message, count_text, encoding_name_for, truncate_text
from gateway.upstream import Router

log = logging.getLogger("gateway.summarizer")

SUMMARY_INSTRUCTIONS = (
    "You maintain the running summary of a conversation between a user and an assistant. "
    "Fold the new messages into the current summary. Keep every fact the user stated (names, "
    "preferences, numbers, decisions), what the assistant promised or did, and open questions. "
    "Write plain prose in at most {max_tokens} tokens. Reply with the summary only."
)
CHUNK_TOKENS = 3000
MAX_ATTEMPTS = 5
# A summary takes at most this share of the window of the model it is sent to.
SUMMARY_WINDOW_SHARE = 5
_INSTRUCTION_TOKENS = 96  # the instructions and the framing of the summarizer's prompt


def summary_cap(configured: int, window: int) -> int:
    """Tokens a summary may have: `summary_max_tokens`, at most a fifth of the window."""
    return max(16, min(configured, window // SUMMARY_WINDOW_SHARE))


def chunk_budget(window: int, cap: int, ratio: float, overhead: float, margin: int) -> int:
    """Tokens (ours) of new messages one summarizer call can take: its window less the answer
    (`cap`), the current summary (up to `cap`) and the instructions, in the provider's units."""
    room = window - cap - margin - overhead
    ours = int(room / ratio) - cap - _INSTRUCTION_TOKENS
    return max(32, min(CHUNK_TOKENS, ours))


@dataclass(frozen=True, slots=True)
class Summary:
    version: int
    covers_through: str  # the last response id whose messages it covers
    covered: int  # history messages covered, as of the view it applies to
    text: str
    model: str

    def message(self) -> Message:
        return {"role": "system", "content": f"Summary of the earlier conversation:\n{self.text}"}


def current_summary(records: list[Record], view: ConversationView) -> Summary | None:
    """The newest summary that applies to this view (a reset makes older ones inapplicable)."""
    for record in reversed(records):
        if record.get("type") != "summary":
            continue
        rid = record.get("covers_through")
        if not isinstance(rid, str) or rid not in view.history_end:
            continue
        return Summary(
            version=int(record.get("version", 0)),
            covers_through=rid,
            covered=view.history_end[rid],
            text=str(record.get("text", "")),
            model=str(record.get("model", "")),
        )
    return None


def render_for_summary(messages: list[Message]) -> str:
    lines = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        text = content if isinstance(content, str) else ""
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            text += f" [called {fn.get('name')}({fn.get('arguments')})]"
        lines.append(f"{m.get('role')}: {text}")
    return "\n".join(lines)


def snap_to_turn_end(view: ConversationView, position: int) -> int:
    """The first turn end at or after `position` that does not split a tool-call unit (the
    next message is not a tool result), or the end of history."""
    n = len(view.history)
    for end in view.history_end.values():  # increasing
        if end >= position and (end == n or view.history[end].get("role") != "tool"):
            return end
    return n


class Summarizer:
    def __init__(
        self,
        settings: Settings,
        router: Router,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        facts: ModelFacts | None = None,
    ) -> None:
        self.settings = settings
        self.router = router
        self.sleep = sleep
        self.facts = facts or ModelFacts(settings)
        # Keyed by (store, conversation): every tenant has its own store.
        self._tasks: dict[tuple[int, str], asyncio.Task[None]] = {}
        self._targets: dict[tuple[int, str], tuple[str, str]] = {}  # -> (covers_through, model)
        self.failures: dict[tuple[int, str], int] = {}
        self.on_outcome: Callable[[str], None] = lambda outcome: None  # metrics hook

    def schedule(self, store: Store, conversation_id: str, covers_through: str, model: str) -> None:
        """Ask for coverage through `covers_through`; one task per conversation folds it."""
        key = (id(store), conversation_id)
        self._targets[key] = (covers_through, self.settings.context.summary_model or model)
        task = self._tasks.get(key)
        if task is None or task.done():
            task = self._tasks[key] = asyncio.create_task(self._run(store, conversation_id))
            task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        """Finished tasks are dropped: the map holds only conversations being folded."""
        for key, value in list(self._tasks.items()):
            if value is task:
                del self._tasks[key]

    async def summarize_all(self, store: Store, cid: str, model: str) -> str:
        """Fold the whole conversation into its summary now (post-processing); the text."""
        view = await store.load(cid)
        if not view.history_owner:
            return ""
        await self._fold(store, cid, view.history_owner[-1], self.settings.context.summary_model or model)
        summary = current_summary(await store.read_summaries(cid), await store.load(cid))
        return summary.text if summary else ""

    async def wait_idle(self) -> None:
        while any(not t.done() for t in self._tasks.values()):
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def aclose(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _run(self, store: Store, cid: str) -> None:
        key = (id(store), cid)
        attempt = 0
        while key in self._targets:
            target, model = self._targets[key]
            try:
                await self._fold(store, cid, target, model)
                self.on_outcome("ok")
                if self._targets.get(key) == (target, model):
                    del self._targets[key]
                self.failures.pop(key, None)
                attempt = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded, retried, never raised
                attempt += 1
                self.on_outcome("failed")
                self.failures[key] = self.failures.get(key, 0) + 1
                message = getattr(exc, "message", None) or repr(exc)
                log.warning("summary of %s failed (attempt %d): %s", cid, attempt, message)
                try:
                    await store.append_summary(
                        cid,
                        {
                            "type": "summary_failed",
                            "attempt": attempt,
                            "error": message[:500],
                            "created": now(),
                        },
                    )
                except Exception:  # noqa: BLE001
                    pass
                if attempt >= MAX_ATTEMPTS:
                    self._targets.pop(key, None)
                    return
                await self.sleep(min(2.0 ** (attempt - 1), 60.0))

    async def _fold(self, store: Store, cid: str, target: str, model: str) -> None:
        encoding = encoding_name_for(model)
        async with store.lock(cid, self.settings.storage.lock_timeout):
            view = await store.load(cid)
            records = await store.read_summaries(cid)
            summary = current_summary(records, view)
            end = view.history_end.get(target)
            if end is None:
                return  # the conversation was reset or deleted meanwhile
            start = summary.covered if summary else 0
            if end <= start:
                return
            messages = list(view.history[start:end])
            owners = list(view.history_owner[start:end])
        text = summary.text if summary else ""
        version = summary.version if summary else 0
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
            while j < len(messages):
                k = j + 1
                while k < len(messages) and owners[k] == owners[j]:
                    k += 1
                cost = sum(count_message(m, model) for m in messages[j:k])
                if j > i and used + cost > limit:
                    break
                used += cost
                j = k
            chunk = messages[i:j]
            rendered = truncate_text(render_for_summary(chunk), limit, model)
            body: dict[str, Any] = {
                "model": route.model,
                "messages": [
                    {"role": "system", "content": SUMMARY_INSTRUCTIONS.format(max_tokens=cap)},
                    {
                        "role": "user",
                        "content": f"Current summary:\n{text or '(none yet)'}\n\nNew messages:\n"
                        + rendered,
                    },
                ],
                "max_tokens": cap,
                "stream": False,
            }
            started = time.perf_counter()
            try:
                completion = await route.upstream.complete(body)
            except UpstreamStatusError as exc:
                if exc.refusal is not None:  # learned from; the retry plans smaller chunks
                    self.facts.refused(route, 0, exc.refusal, facts.tokens)
                raise
            reply = ((completion.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
            text = truncate_text(str(reply).strip(), cap, model)
            version += 1
            await store.append_summary(
                cid,
                {
                    "type": "summary",
                    "version": version,
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
            i = j
