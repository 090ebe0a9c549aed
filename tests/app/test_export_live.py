"""`gateway export` of a JSONL data dir a gateway is writing: the copy keeps the ordering rule."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from gateway.ids import mint_response_id
from gateway.services.transfer import export_data
from gateway.store.jsonl.fsck import survey
from gateway.store.jsonl.layout import DataDir
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings


async def test_an_export_made_while_turns_commit_names_no_response_it_lacks(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Every file was listed once, then the indexes copied last: lines a turn added meanwhile named
    responses the copy had not listed (84 and 116 of them in two live exports), which readers skip
    and `fsck` reports."""
    settings = make_settings(tmp_path)
    async with build_client(settings, None, MockUpstream()) as client:
        for text in ("one", "two"):
            body = {
                "model": "mock/m",
                "conversation_id": "c-1",
                "messages": [{"role": "user", "content": text}],
            }
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    source = DataDir(tmp_path / "var")
    index = source.conversations_dir / "c-1.jsonl"
    copy2 = shutil.copy2
    late = mint_response_id("mock/m")

    def copy_while_a_turn_commits(src: Any, dst: Any, **kw: Any) -> Any:
        if not source.response_path(late).exists():  # a turn commits: its file, then its line
            committed = next(source.responses_dir.glob("*.jsonl"))
            source.response_path(late).write_bytes(committed.read_bytes())
            with index.open("ab") as f:
                f.write(f"{late}\n".encode())
        return copy2(src, dst, **kw)

    monkeypatch.setattr(shutil, "copy2", copy_while_a_turn_commits)
    export_data(settings, tmp_path / "copy")
    copied = DataDir(tmp_path / "copy")
    assert survey(copied).damage == []
    assert late not in (copied.conversations_dir / "c-1.jsonl").read_text()
