"""The JSONL store's conversation catalog (`catalog/conversations.jsonl`): pages without a scan
of the conversations folder, rebuilt for data dirs older than it, repaired when out of step."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.exceptions import NotFound
from gateway.services.cache import ConversationCache
from gateway.services.queries import Queries
from gateway.store import StoreRegistry
from gateway.store.jsonl import JsonlStore
from tests.conftest import make_settings
from tests.helpers import commit_turn, commit_with_row


async def fresh(root: Path) -> JsonlStore:
    """Another process's store: nothing of the catalog in memory yet."""
    s = JsonlStore(root)
    await s.open()
    return s


async def ids(store: JsonlStore, limit: int = 100, after: str | None = None) -> list[str]:
    return [cid for cid, _ in (await store.list_conversations(limit, after))[0]]


async def test_pages_and_deletes_do_not_scan_the_folder(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trunk = await commit_turn(jstore, "trunk", "one")
    await commit_turn(jstore, "trunk", "two")
    await jstore.fork("trunk", "trunk.fork-0123456789ab", trunk)
    for i in range(5):
        await commit_turn(jstore, f"c{i}", "hi")
    assert (await ids(jstore))[:2] == ["c4", "c3"]  # loaded once (a scan is allowed here)
    scans: list[str] = []

    def refuse(path: Any = ".") -> Any:
        scans.append(str(path))
        raise AssertionError(f"scanned {path}")

    monkeypatch.setattr(os, "scandir", refuse)
    await commit_turn(jstore, "c5", "new")
    assert await ids(jstore, 2) == ["c5", "c4"]
    assert await ids(jstore, 2, after="c4") == ["c3", "c2"]
    # Deleting the trunk keeps the response its fork still names; no folder scan for the family.
    assert await jstore.delete_conversation("trunk")
    assert await jstore.read_response(trunk)
    assert await jstore.exists("trunk.fork-0123456789ab") and not await jstore.exists("trunk")
    assert "trunk" not in await ids(jstore)
    assert scans == []


async def test_exists_reads_no_index(jstore: JsonlStore, tmp_path: Path) -> None:
    await commit_turn(jstore, "damaged", "hi")
    (tmp_path / "var" / "logs" / "conversations" / "damaged.jsonl").write_bytes(b"\xff not an id\n")
    assert await jstore.exists("damaged")  # read_index would raise CorruptRecord
    assert not await jstore.exists("absent")


async def test_a_data_dir_without_catalog_is_rebuilt_in_activity_order(
    jstore: JsonlStore, tmp_path: Path
) -> None:
    root = tmp_path / "var"
    for cid in ("old", "mid", "new"):
        await commit_turn(jstore, cid, "hi")
    for age, cid in ((300, "old"), (200, "mid"), (100, "new")):
        path = root / "logs" / "conversations" / f"{cid}.jsonl"
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime - age))
    catalog = root / "catalog" / "conversations.jsonl"
    if catalog.exists():
        catalog.unlink()  # as a data dir written before the catalog existed
    other = await fresh(root)
    assert await ids(other) == ["new", "mid", "old"]
    assert catalog.exists()
    lines = [orjson.loads(line) for line in catalog.read_bytes().splitlines()]
    assert [line["id"] for line in lines] == ["old", "mid", "new"]


async def test_torn_and_foreign_lines_are_skipped_and_the_folder_wins(
    jstore: JsonlStore, tmp_path: Path
) -> None:
    root = tmp_path / "var"
    await commit_turn(jstore, "a", "hi")
    await ids(jstore)  # the catalog exists from here on
    await commit_turn(jstore, "b", "hi")
    catalog = root / "catalog" / "conversations.jsonl"
    with open(catalog, "ab") as f:
        f.write(b'{"id": "torn", "a')  # a writer died mid-line...
    await commit_turn(jstore, "c", "hi")  # ...and the next line is glued to it
    with open(catalog, "ab") as f:
        f.write(b'{"id": "../../etc", "at": 1}\n[1, 2]\n')
    assert await ids(jstore) == ["c", "b", "a"]  # nothing foreign, the glued line kept
    assert await ids(await fresh(root)) == ["c", "b", "a"]


async def test_files_changed_behind_its_back_are_noticed(jstore: JsonlStore, tmp_path: Path) -> None:
    root = tmp_path / "var"
    folder = root / "logs" / "conversations"
    for cid in ("a", "b", "c"):
        await commit_turn(jstore, cid, "hi")
    assert await ids(jstore) == ["c", "b", "a"]
    (folder / "b.jsonl").unlink()  # removed by hand: left out at once
    assert await ids(jstore) == ["c", "a"]
    (folder / "copied.jsonl").write_bytes((folder / "a.jsonl").read_bytes())  # copied in by hand
    other = await fresh(root)
    await other.warm()
    assert await ids(other) == ["copied", "c", "a"]  # the next process that loads it finds it
    (root / "catalog" / "conversations.jsonl").unlink()  # removed: rebuilt from the folder
    assert sorted(await ids(jstore)) == ["a", "c", "copied"]


async def test_the_catalog_is_compacted_when_it_outgrows_the_conversations(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gateway.store.jsonl.catalog as catalog_module

    monkeypatch.setattr(catalog_module, "_COMPACT_FLOOR", 4)
    await commit_turn(jstore, "talkative", "0")
    await ids(jstore)
    for i in range(30):
        await commit_turn(jstore, "talkative", str(i))
    catalog = tmp_path / "var" / "catalog" / "conversations.jsonl"
    assert len(catalog.read_bytes().splitlines()) > 20
    other = await fresh(tmp_path / "var")
    await other.warm()  # a server loads it at start
    assert await ids(other) == ["talkative"]
    assert len(catalog.read_bytes().splitlines()) == 1


async def test_a_first_page_needs_no_load(jstore: JsonlStore, tmp_path: Path) -> None:
    """A process that lists once (`gateway conversations`) reads the catalog's end only."""
    for i in range(30):
        await commit_turn(jstore, f"c{i:02d}", "hi")
    await jstore.warm()
    await commit_turn(jstore, "c05", "again")
    await jstore.delete_conversation("c29")
    other = await fresh(tmp_path / "var")
    page, more = await other.list_conversations(3)
    assert [cid for cid, _ in page] == ["c05", "c28", "c27"] and more
    assert not other.catalog.loaded
    assert await other.list_conversations(3) == (page, more)
    assert other.catalog.loaded  # a process that lists again loads it
    (tmp_path / "var" / "catalog" / "conversations.jsonl").unlink()  # e.g. after an import
    page, more = await (await fresh(tmp_path / "var")).list_conversations(3)
    assert [cid for cid, _ in page][1:] == ["c28", "c27"] and more  # rebuilt from file times


async def test_an_empty_data_dir_gets_no_catalog(jstore: JsonlStore, tmp_path: Path) -> None:
    assert await jstore.list_conversations(20) == ([], False)
    await jstore.warm()
    assert not (tmp_path / "var" / "catalog").exists()


async def test_concurrent_writers_lose_no_line(tmp_path: Path) -> None:
    """Two store instances (two worker processes) appending while a third rebuilds."""
    root = tmp_path / "var"
    a, b = await fresh(root), await fresh(root)
    await commit_turn(a, "seed", "hi")
    await ids(a)

    async def writer(store: JsonlStore, prefix: str) -> None:
        for i in range(15):
            await commit_turn(store, f"{prefix}{i}", "hi")

    async def rebuilder() -> None:
        for _ in range(5):
            (root / "catalog" / "conversations.jsonl").unlink(missing_ok=True)
            await ids(await fresh(root))
            await asyncio.sleep(0.001)

    await asyncio.gather(writer(a, "a"), writer(b, "b"), rebuilder())
    expected = {"seed", *(f"a{i}" for i in range(15)), *(f"b{i}" for i in range(15))}
    assert set(await ids(a)) == expected
    assert set(await ids(b)) == expected


async def test_search_reads_a_bounded_number_of_conversations(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    stores = StoreRegistry(settings)
    cache = ConversationCache()
    queries = Queries(stores, cache)
    store = await stores.get("")
    for i in range(12):
        await commit_turn(store, f"conv{i:02d}", "needle" if i % 3 == 0 else "hay")
        await asyncio.sleep(0.002)
    loaded: list[str] = []
    real = cache.load_many

    async def counting(store: Any, cids: list[str], **kw: Any) -> Any:
        loaded.extend(cids)
        return await real(store, cids, **kw)

    cache.load_many = counting  # type: ignore[method-assign]
    rows, after = await queries.search("", "needle", scan=5)
    assert [r.conversation_id for r in rows] == ["conv09"]  # conv11..conv07 looked at
    assert after == "conv07" and len(loaded) == 5
    rows, after = await queries.search("", "needle", scan=5, after=after)
    assert [r.conversation_id for r in rows] == ["conv06", "conv03"] and after == "conv02"
    rows, after = await queries.search("", "needle", scan=5, after=after)
    assert [r.conversation_id for r in rows] == ["conv00"] and after is None
    loaded.clear()
    rows, more = await queries.conversations("", limit=3)
    assert [r.conversation_id for r in rows] == ["conv11", "conv10", "conv09"] and more
    assert sorted(loaded) == ["conv09", "conv10", "conv11"]  # a page reads its own rows only
    with pytest.raises(NotFound):
        await queries.conversations("", limit=3, after="nope")
    await stores.close()


async def test_an_import_shows_in_a_running_process_list(tmp_path: Path) -> None:
    from gateway.services.transfer import import_data

    source = await fresh(tmp_path / "source")
    await commit_turn(source, "imported", "hi")
    target = await fresh(tmp_path / "var")
    await commit_turn(target, "local", "hi")
    await target.warm()
    assert await ids(target) == ["local"]
    await asyncio.to_thread(import_data, make_settings(tmp_path), tmp_path / "source")
    assert sorted(await ids(target)) == ["imported", "local"]


# -- list rows (catalog/rows.jsonl) ----------------------------------------------------------------


async def rows(store: JsonlStore, limit: int = 100) -> dict[str, Any]:
    page, _ = await store.list_rows(limit)
    return {listed.conversation_id: listed.row for listed in page}


async def test_rows_survive_a_compaction_and_a_rebuild(
    jstore: JsonlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gateway.store.jsonl.catalog as catalog_module

    monkeypatch.setattr(catalog_module, "_COMPACT_FLOOR", 4)
    root = tmp_path / "var"
    await commit_turn(jstore, "quiet", "hi")
    await ids(jstore)
    await commit_with_row(jstore, "quiet", {"n": "quiet"})
    for i in range(30):
        await commit_with_row(jstore, "talkative", {"n": i})
    await commit_turn(jstore, "rowless", "hi")
    expected = {"rowless": None, "talkative": {"n": 29}, "quiet": {"n": "quiet"}}
    assert await rows(jstore) == expected
    other = await fresh(root)
    await other.warm()  # compacted at load
    assert len((root / "catalog" / "conversations.jsonl").read_bytes().splitlines()) == 3
    assert len((root / "catalog" / "rows.jsonl").read_bytes().splitlines()) == 2
    assert await rows(other) == expected
    assert await rows(jstore) == expected  # a process that read the old files notices the new ones
    (root / "logs" / "conversations" / "copied.jsonl").write_bytes(b"")  # out of step: rebuilt
    third = await fresh(root)
    await third.warm()
    assert await rows(third) == {**expected, "copied": None}


async def test_a_row_is_not_handed_out_once_its_index_moved_on(jstore: JsonlStore, tmp_path: Path) -> None:
    """A change the catalog did not hear of (a journal replayed after a crash, a repair, a copy):
    the index is no longer at the row's version."""
    root = tmp_path / "var"
    await commit_turn(jstore, "c", "hi")
    await ids(jstore)
    await commit_with_row(jstore, "c", {"n": 1})
    assert await rows(await fresh(root)) == {"c": {"n": 1}}  # (the first page read from the end)
    index = root / "logs" / "conversations" / "c.jsonl"
    line = index.read_bytes().splitlines()[0]
    with open(index, "ab") as f:
        f.write(line + b"\n")
    assert await rows(jstore) == {"c": None}
    assert await rows(await fresh(root)) == {"c": None}


async def test_damaged_rows_are_no_rows(jstore: JsonlStore, tmp_path: Path) -> None:
    root = tmp_path / "var"
    await commit_turn(jstore, "a", "hi")
    await ids(jstore)
    await commit_with_row(jstore, "a", {"n": "a"})
    await commit_with_row(jstore, "b", {"n": "b"})
    rows_file = root / "catalog" / "rows.jsonl"
    data = rows_file.read_bytes()
    rows_file.write_bytes(data[: len(data) // 2 + 5])  # b's row torn (a's maybe too)
    assert (await rows(jstore))["b"] is None
    rows_file.write_bytes(b"x" * len(data))
    assert await rows(await fresh(root)) == {"a": None, "b": None}
    rows_file.unlink()
    assert await rows(await fresh(root)) == {"a": None, "b": None}


async def test_an_import_forgets_the_rows(tmp_path: Path) -> None:
    from gateway.store.jsonl.catalog import forget_catalogs

    store = await fresh(tmp_path / "var")
    await commit_turn(store, "a", "hi")
    await ids(store)
    await commit_with_row(store, "a", {"n": 1})
    assert (tmp_path / "var" / "catalog" / "rows.jsonl").exists()
    forget_catalogs(tmp_path / "var")
    assert not (tmp_path / "var" / "catalog").joinpath("rows.jsonl").exists()
    assert await rows(await fresh(tmp_path / "var")) == {"a": None}
