"""Start-up checks of the JSONL store: a data dir that cannot be written is named, with the cause."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from gateway.exceptions import StorageError
from gateway.store.jsonl import recovery, store
from gateway.store.jsonl.store import JsonlStore


def read_only(*args: object) -> None:
    raise OSError(errno.EROFS, "Read-only file system")


async def test_an_unwritable_data_dir_is_named_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store, "writable", read_only)
    with pytest.raises(StorageError) as raised:
        await JsonlStore(tmp_path / "var").open()
    message = str(raised.value)
    assert f"the data dir {tmp_path / 'var'} cannot be written (Read-only file system)" in message


async def test_a_journal_that_cannot_be_replayed_names_the_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a clean stop, a read-only mount failed with 'could not replay the journal: Read-only
    file system', naming neither the data dir nor what to do."""
    monkeypatch.setattr(recovery, "recover", read_only)
    with pytest.raises(StorageError) as raised:
        await JsonlStore(tmp_path / "var").open()
    assert str(raised.value).startswith(f"could not replay the journal: the data dir {tmp_path / 'var'}")


async def test_a_writable_data_dir_leaves_no_probe_behind(tmp_path: Path) -> None:
    s = JsonlStore(tmp_path / "var")
    await s.open()
    assert not [p for p in (tmp_path / "var").iterdir() if p.name.startswith(".writable")]
    await s.close()


@pytest.mark.parametrize("blocked", ["var", "var/logs", "var/logs/responses"])
async def test_a_data_dir_that_is_a_file_is_named_not_a_traceback(tmp_path: Path, blocked: str) -> None:
    """`gateway reset`, `delete` and `import` on such a data dir ended in a traceback
    (NotADirectoryError, FileExistsError): the folders' creation was not checked."""
    (tmp_path / blocked).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / blocked).write_text("not a folder")
    with pytest.raises(StorageError, match=f"the data dir {tmp_path / 'var'} cannot be written"):
        await JsonlStore(tmp_path / "var").open()


def test_an_import_into_a_data_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    from gateway.exceptions import GatewayError
    from gateway.services.transfer import import_data
    from tests.conftest import make_settings

    source = tmp_path / "exported" / "logs" / "responses"
    source.mkdir(parents=True)
    (source / "demo-0123456789ab.jsonl").write_text("{}\n")
    (tmp_path / "var").write_text("not a folder")
    settings = make_settings()
    settings = settings.model_copy(
        update={
            "storage": settings.storage.model_copy(
                update={"backend": "jsonl", "data_dir": str(tmp_path / "var")}
            )
        }
    )
    with pytest.raises(GatewayError, match=r"could not write .*\(Not a directory\): 0 of 1 files copied"):
        import_data(settings, tmp_path / "exported")


def test_an_export_that_cannot_read_a_file_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It said "could not write" the copy in the target of a file it could not read, and left
    out a folder or FIFO where a file should be without a word (exit 0, data missing)."""
    from gateway.exceptions import GatewayError
    from gateway.services.transfer import export_data
    from tests.conftest import make_settings

    source = tmp_path / "var" / "logs" / "responses"
    source.mkdir(parents=True)
    broken = source / "demo-0123456789ab.jsonl"
    broken.write_text("{}\n")
    real_read = Path.read_bytes

    def unreadable(path: Path) -> bytes:
        if path == broken:
            raise OSError(5, "Input/output error", str(path))
        return real_read(path)

    monkeypatch.setattr(Path, "read_bytes", unreadable)
    with pytest.raises(
        GatewayError, match=r"could not read .*demo-0123456789ab.jsonl \(Input/output error\)"
    ):
        export_data(make_settings(tmp_path), tmp_path / "exported")
    monkeypatch.undo()
    broken.unlink()
    broken.mkdir()
    with pytest.raises(GatewayError, match=r"demo-0123456789ab.jsonl is not a file"):
        export_data(make_settings(tmp_path), tmp_path / "exported2")
    assert not (tmp_path / "exported2").exists()


async def test_a_response_read_through_a_file_where_a_folder_was_says_why(tmp_path: Path) -> None:
    """It was "No response" (`exists()` says False of a path through a file): `gateway context`
    and `GET /v1/responses/{id}` hid that the data dir cannot be read."""
    s = JsonlStore(tmp_path / "var")
    await s.open()
    await s.close()
    responses = tmp_path / "var" / "logs" / "responses"
    responses.rmdir()
    responses.write_text("not a folder")
    with pytest.raises(StorageError, match="could not read the response: Not a directory") as raised:
        await JsonlStore(tmp_path / "var").read_response("demo-0123456789ab")
    # The file by its folder and name (a CLI's operator is told which), never a server path.
    assert raised.value.message.endswith("(responses/demo-0123456789ab.jsonl)")
    assert str(tmp_path) not in raised.value.message


async def test_a_fifo_where_a_data_file_should_be_does_not_stop_the_reads(tmp_path: Path) -> None:
    """Opening a FIFO waits for a writer: one in place of a response file or an index froze the
    event loop (every request with it) and the CLI's read commands."""
    import os
    import signal

    from gateway.exceptions import GatewayError

    def waited(signum: int, frame: object) -> None:  # (a blocked open is no await to time out)
        raise TimeoutError("a read waited on the FIFO")

    store = JsonlStore(tmp_path / "var")
    await store.open()
    os.mkfifo(store.data_dir.responses_dir / "demo-0123456789ab.jsonl")
    os.mkfifo(store.data_dir.conversations_dir / "c1.jsonl")
    before = signal.signal(signal.SIGALRM, waited)
    signal.alarm(5)
    try:
        assert await store.read_response("demo-0123456789ab") == []
        try:
            await store.read_index("c1")
        except GatewayError:
            pass  # (an answer, whichever: not a wait)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
        await store.close()
