"""The store seam: append-only response logs and per-conversation indexes, as raw records.

A response log is a list of JSON records (request, context, response, and a final commit or
incomplete marker). A conversation index names the committed response ids in order. The
one ordering rule: a response is complete and durable before its id enters an index.
A store hands out records and a per-conversation `Version`; the services build and cache the
conversation views from them (`gateway.services.cache`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

from gateway.exceptions import InvalidRequest, NotFound, StorageError
from gateway.types import Api, JSONObject, Record

K = TypeVar("K")
V = TypeVar("V")


class LRU(OrderedDict[K, V]):
    """A per-process cache that keeps at most `limit` entries, dropping the least recently used.

    Caches keyed by conversation must not grow with the number of conversations ever seen.
    With `weigh` and `budget`, also at most `budget` in total weight (the entry just stored is
    kept even if it alone weighs more), so entries that grow (a conversation) stay bounded too.
    An entry changed in place is weighed again when it is stored again.
    """

    def __init__(self, limit: int, *, weigh: Callable[[V], int] | None = None, budget: int = 0) -> None:
        super().__init__()
        self.limit = max(1, limit)
        self.weigh = weigh
        self.budget = budget
        self.weight = 0
        self._weights: dict[K, int] = {}

    def get(self, key: K, default: None = None) -> V | None:  # type: ignore[override]
        if key in self:
            self.move_to_end(key)
            return self[key]
        return default

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if self.weigh is not None:
            weight = self.weigh(value)
            self.weight += weight - self._weights.get(key, 0)
            self._weights[key] = weight
        heavy = self.weigh is not None
        while len(self) > self.limit or (heavy and self.weight > self.budget and len(self) > 1):
            self.popitem(last=False)

    def _forgotten(self, key: K) -> None:
        self.weight -= self._weights.pop(key, 0)

    def __delitem__(self, key: K) -> None:
        super().__delitem__(key)
        self._forgotten(key)

    def pop(self, key: K, *default: V | None) -> V | None:  # type: ignore[override]
        if key not in self:
            return default[0] if default else super().pop(key)
        value = super().pop(key)
        self._forgotten(key)
        return value

    def popitem(self, last: bool = True) -> tuple[K, V]:
        key, value = super().popitem(last)
        self._forgotten(key)
        return key, value

    def clear(self) -> None:
        super().clear()
        self._weights.clear()
        self.weight = 0


# The side logs every backend keeps beside the conversations (`append_side` / `read_side`).
SideLog = Literal[
    "summaries", "lifecycle", "users", "digests", "models", "compactions", "metadata", "cancels"
]
SIDE_LOGS: frozenset[str] = frozenset(get_args(SideLog))


def now() -> float:
    return time.time()


def writes_refused(reason: str) -> StorageError:
    """The error of every write after an fsync failed (`reason`: which, and why)."""
    return StorageError(
        f"storage refuses writes since an fsync failed ({reason}); check the disk and restart the gateway"
    )


@dataclass(frozen=True, slots=True)
class Version:
    """Where a reader of a conversation's index got to.

    `generation` changes when the index is replaced (deleted and begun anew), `position` grows
    with every append.
    """

    generation: int | str
    position: int


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """One index entry: a committed response's id and its records, or a marker record.

    A response's context snapshots are left out: they are not needed to rebuild history.
    """

    response_id: str | None
    marker: Record | None
    records: list[Record]


@dataclass(frozen=True, slots=True)
class IndexRead:
    """What changed in a conversation's index since a `Version`."""

    entries: list[IndexEntry]
    version: Version | None  # None: there is no such conversation
    restarted: bool  # the entries start from the beginning (new, or replaced since)


@dataclass(frozen=True, slots=True)
class IndexList:
    """A whole index as `read_entries` gives it.

    Response ids and marker records, in order, and the version it is at (None: there is no such
    conversation).
    """

    entries: list[str | Record]
    version: Version | None


@dataclass(frozen=True, slots=True)
class Listed:
    """A conversation on a page of the list.

    Its id, its last change, the version it is at (None: not known), and the row kept for it at
    that version, if any (`row` of an append, or `keep_rows`): a row kept for another version is
    never handed out. A row is the services' JSON (what a list shows of the conversation);
    stores keep it as it is.
    """

    conversation_id: str
    changed: float
    version: Version | None = None
    row: JSONObject | None = None


@dataclass(frozen=True, slots=True)
class Damage:
    """What `Store.check` found (`gateway fsck`).

    Where (a file relative to the store's root and its line, or a table and row), what is wrong,
    and what repairing does or did about it.
    """

    path: str
    line: int | None
    problem: str
    action: str  # done (`repaired`), or what a repair would do
    repaired: bool = False

    @property
    def where(self) -> str:
        return self.path if self.line is None else f"{self.path}:{self.line}"


@dataclass(frozen=True, slots=True)
class Appended:
    """An append to an index: the version just before it and just after it.

    A reader that was at `before` may apply the appended entry itself and be at `after`.
    """

    before: Version
    after: Version


class ResponseLog(ABC):
    """An open response log being written for one request."""

    response_id: str

    @abstractmethod
    def append(self, record: Record) -> None:
        """Add a record (not yet durable: only `commit` makes the response count)."""

    row: JSONObject | None = None  # see `list_as`

    def list_as(self, row: JSONObject | None) -> None:
        """Set what a list shows of the conversation once this response is in it (see `Listed`).

        `commit` keeps it with the index append.
        """
        self.row = row

    @abstractmethod
    async def commit(self, conversation_id: str | None) -> Appended | None:
        """Write the commit record, make it durable, then append the id to the index.

        Returns the append, when there is a conversation; the row of `list_as` goes with it.
        """

    @abstractmethod
    async def abandon(self, reason: str, error: JSONObject | None = None) -> None:
        """Close the log marked incomplete; nothing enters any index."""

    def meanwhile(self) -> None:  # noqa: B027 - optional hook
        """Do the work the log can do while the provider answers, off the client's wait.

        Called once the provider has the request (or its answer has begun); the work is the JSONL
        file's creation. Never raises; `commit` and `abandon` do it themselves when it was not
        called.
        """

    async def visible(self) -> None:  # noqa: B027 - optional hook (a log readable from its start)
        """Return once a reader, in any process, finds this log: its id may be handed out.

        Best effort, it never raises: a log the store cannot take yet is written by `commit`, or
        marked by `abandon`."""

    @property
    def commit_waits(self) -> bool:
        """Would `commit` wait (for a database, or a sync shared with other turns)?

        When it would not, the service runs it in the turn's own task (see `run_to_end`).
        """
        return True


class Store(ABC):
    """Where conversations live. Every method is safe to call from the event loop."""

    @property
    def refusing_writes(self) -> str | None:
        """Why this store acknowledges no more writes (a failed fsync), or None."""
        return None

    def refuse_if_failed(self) -> None:
        reason = self.refusing_writes
        if reason is not None:
            raise writes_refused(reason)

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Prepare the backend (create folders, connect)."""

    async def probe(self) -> None:  # noqa: B027 - optional hook
        """A cheap real write (or round trip); raises StorageError when it cannot be done."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""

    @abstractmethod
    def lock(self, conversation_id: str, timeout: float) -> AbstractAsyncContextManager[None]:
        """Serialize turns on one conversation; raise ConversationBusy after `timeout` s."""

    async def settled(self, conversation_id: str, timeout: float) -> None:
        """Return once the turn running on a conversation (a background response's, say) has
        ended, as a turn would wait for it: its lock is taken and let go."""
        async with self.lock(conversation_id, timeout):
            pass

    @abstractmethod
    async def read_conversation(self, conversation_id: str, after: Version | None = None) -> IndexRead:
        """The index entries after `after` (all of them when None, or when the index was replaced since).

        A torn last line is repaired only by a holder of the lock.
        """

    async def read_entries(self, conversation_id: str) -> IndexList:
        """The whole index alone, whatever the conversation's size.

        At the version `read_conversation` would give (read the responses needed with
        `read_turns`). This default reads every response: backends override it.
        """
        read = await self.read_conversation(conversation_id)
        entries = [e.marker if e.marker is not None else str(e.response_id) for e in read.entries]
        return IndexList(entries, read.version)

    async def read_turns(self, response_ids: Sequence[str]) -> list[list[Record]]:
        """The records of these responses, in order, context snapshots left out.

        As `read_conversation` gives them: empty for a missing response.
        """
        out: list[list[Record]] = []
        for rid in response_ids:
            try:
                records = await self.read_response(rid)
            except NotFound:
                records = []
            out.append([r for r in records if r.get("type") != "context"])
        return out

    @abstractmethod
    def start(self, response_id: str, request: Record) -> ResponseLog:
        """Open the response log for a new request with its first record."""

    @abstractmethod
    async def read_response(self, response_id: str) -> list[Record]:
        """All records of a response log; NotFound if there is none."""

    @abstractmethod
    async def read_index(self, conversation_id: str) -> list[str | Record]:
        """The raw index entries (response ids and marker records); NotFound if none."""

    @abstractmethod
    async def append_marker(
        self, conversation_id: str, marker: Record, row: JSONObject | None = None
    ) -> Appended:
        """Append a marker (creation, metadata, reset, item deletion) to the index durably.

        Call under `lock`; creates the conversation if it does not exist. `row`: as `commit`'s.
        """

    @abstractmethod
    async def delete_conversation(self, conversation_id: str, *, archive: bool = False) -> bool:
        """Remove (or archive) the index, its responses and summaries.

        Call under `lock`. False if there was no such conversation.
        """

    async def fork(self, source: str, target: str, through: str) -> None:
        """Start conversation `target` with `source`'s index up to and including response `through`.

        Ids only: the response files are shared, not copied. Call under both locks.
        """
        raise InvalidRequest("Branching from an earlier response is not supported by this storage backend")

    async def sharing(self, conversation_id: str, response_id: str) -> list[str]:
        """The other conversations whose index names `response_id` too.

        Branches made with `fork` share their prefix's responses. A backend without `fork` has
        none.
        """
        return []

    async def tombstone(self, response_id: str) -> None:
        """Mark a response deleted: a final `deleted` record; loaders then skip it."""
        raise InvalidRequest("Deleting responses is not supported by this storage backend")

    async def try_processor_lease(self) -> bool | None:
        """Take the lifecycle processor's lease for everything this backend holds.

        Only if the backend provides one (shared databases do); None means: use the data dir's
        lock file.
        """
        return None

    async def check(self, *, repair: bool = False, lock_timeout: float = 30.0) -> list[Damage]:
        """Look for damage a reader would trip on (`gateway fsck`).

        With `repair`, set each damaged line or record aside (never deleting it), holding the
        conversation's lock, and return what was done plus whatever is still wrong. A backend with
        nothing on disk has nothing to check.
        """
        return []

    async def exists(self, conversation_id: str) -> bool:
        try:
            await self.read_index(conversation_id)
        except NotFound:
            return False
        return True

    @abstractmethod
    async def list_responses(
        self,
        limit: int,
        *,
        api: Api,
        model: str | None = None,
        after: str | None = None,
        descending: bool = False,
    ) -> tuple[list[str], bool]:
        """A page of the committed, not deleted responses whose request came through `api`.

        `api` as `gateway.types.request_api` names it; with `model`, only those that named that
        model. At most `limit` ids in the order of their request's `created` time (ties: by id),
        oldest first unless `descending`, after response `after` (any response log with a request
        record, a deleted one included: NotFound when there is none); and whether more follow. No
        backend reads every response for a page (each says what a page costs).
        """

    @abstractmethod
    async def append_side(self, kind: SideLog, key: str, record: Record) -> None:
        """Append to a side log.

        `summaries`/`lifecycle` (key: conversation id), `users` (key: hashed user), `digests`
        (key: hashed user and day), `models` (key: provider and model), `compactions` (key:
        compaction id), `metadata` (key: response id; metadata set on a stored chat completion
        since), `cancels` (key: response id; a cancel asked of a background response that another
        process runs).
        """

    @abstractmethod
    async def read_side(self, kind: SideLog, key: str, *, keep: bool = True) -> list[Record]:
        """Every record of a side log, oldest first (empty if none).

        A backend may cache what it read; `keep=False` (readers that go over many conversations:
        the lifecycle pass, lists) uses a cached copy but adds none.
        """

    @abstractmethod
    async def conversation_ids(self) -> list[tuple[str, float]]:
        """(conversation id, last change time) of every conversation, most recent first.

        Cheap: no record is parsed.
        """

    async def list_conversations(
        self, limit: int, after: str | None = None
    ) -> tuple[list[tuple[str, float]], bool]:
        """A page of `conversation_ids`, and whether more follow.

        At most `limit` (id, last change time), most recent first (ties: greater id first), after
        conversation `after` (NotFound when there is no such conversation). Backends answer in
        O(page).
        """
        ids = sorted(await self.conversation_ids(), key=lambda p: (p[1], p[0]), reverse=True)
        start = 0
        if after is not None:
            names = [cid for cid, _ in ids]
            if after not in names:
                raise NotFound(f"No conversation {after!r} in this list", param="after")
            start = names.index(after) + 1
        return ids[start : start + limit], len(ids) > start + limit

    async def list_rows(self, limit: int, after: str | None = None) -> tuple[list[Listed], bool]:
        """`list_conversations`, each conversation with the row kept for it as it is now.

        This default keeps none (every row is then made from the conversation).
        """
        page, more = await self.list_conversations(limit, after)
        return [Listed(cid, changed) for cid, changed in page], more

    async def keep_rows(self, rows: list[tuple[str, Version, JSONObject]]) -> None:  # noqa: B027 - optional
        """Keep each (conversation, version, row): a row a list made for lack of one, for the next list.

        Best effort, and never for another version than the one named.
        """

    async def read_many(self, wanted: list[tuple[str, Version | None]]) -> list[IndexRead]:
        """`read_conversation` of several conversations (each after its version): a page of a list.

        In one go where the backend can (PostgreSQL: one query).
        """
        return [await self.read_conversation(cid, after) for cid, after in wanted]

    async def read_sides(self, kind: SideLog, keys: list[str]) -> list[list[Record]]:
        """`read_side(kind, key, keep=False)` of several keys, in one go where the backend can."""
        return [await self.read_side(kind, key, keep=False) for key in keys]

    async def warm(self) -> None:  # noqa: B027 - optional hook
        """Load what listing needs before the first request (a server calls it at start)."""
