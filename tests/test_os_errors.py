"""What the OS refuses reaches clients as 503 storage_unavailable, whatever the code path:
a store that raises a bare OSError (EMFILE, EACCES) still gives the OpenAI-shaped 503."""

from __future__ import annotations

import errno

import pytest

from gateway.store.base import IndexRead, Version
from gateway.store.memory import MemoryStore
from gateway.types import Record
from gateway.upstream.mock import MockUpstream
from tests.conftest import build_client, make_settings


class RefusingStore(MemoryStore):
    """A store whose reads hit the OS's limits."""

    def __init__(self, code: int) -> None:
        super().__init__()
        self.code = code

    async def read_conversation(self, conversation_id: str, after: Version | None = None) -> IndexRead:
        raise OSError(self.code, "refused")

    async def read_index(self, conversation_id: str) -> list[str | Record]:
        raise OSError(self.code, "refused")


@pytest.mark.parametrize("code", [errno.EMFILE, errno.EACCES, errno.EIO])
async def test_a_bare_os_error_is_a_503_in_openai_shape(code: int) -> None:
    store = RefusingStore(code)
    async with build_client(make_settings(), store, MockUpstream()) as client:
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "mock/m", "conversation_id": "c", "messages": [{"role": "user", "content": "hi"}]},
        )
        items = await client.get("/v1/conversations/c/items")
    for r in (chat, items):
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "storage_unavailable" and error["type"]
        assert "refused" in error["message"] or "system" in error["message"]
