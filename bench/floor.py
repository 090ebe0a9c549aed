"""The floor of a durable turn: the least a Python server can do per new-conversation turn in
the gateway's on-disk layout, with nothing else.

    python -m bench.floor --port 9003 --upstream http://127.0.0.1:9000 --data-dir DIR

Per request: the body parsed (orjson), a response id minted, the request forwarded over an
aiohttp session and its answer parsed, one journal append made durable by an fdatasync shared
by the turns committing together (run on the loop by a turn committing alone), then the
response file and the conversation index created and written, and the answer sent. The journal
is a preallocated file written over in turn, like the gateway's. On uvicorn
with uvloop and httptools, as raw ASGI.

What it leaves out is everything else a turn of the gateway does: validation and error shapes,
authentication, the conversation's lock, loading its history, counting tokens, planning the
window, the context snapshot, the conversation catalog, the log line and the metrics. So
"gateway CPU per request / floor CPU per request" is what those cost, and the floor's
throughput is the most this layout allows a Python process on the machine the run is on.
It is a benchmark reference, not a server: it answers nothing but the mock's chat completions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import orjson
import uvicorn

from .forwarder import SERVE_OPTIONS, _send_whole

JOURNAL_BYTES = 2 << 20


class FloorTurns:
    def __init__(self, upstream: str, data_dir: str) -> None:
        self.url = upstream.rstrip("/") + "/v1/chat/completions"
        self.responses = os.path.join(data_dir, "responses")
        self.conversations = os.path.join(data_dir, "conversations")
        os.makedirs(self.responses, exist_ok=True)
        os.makedirs(self.conversations, exist_ok=True)
        # Written over in place, as the gateway's journal is: its size and block map never
        # change, so an fdatasync writes data and nothing else.
        self.journal = os.open(
            os.path.join(data_dir, f"journal-{os.getpid()}"), os.O_RDWR | os.O_CREAT, 0o644
        )
        os.pwrite(self.journal, bytes(JOURNAL_BYTES), 0)
        os.fsync(self.journal)
        self.journal_at = 0
        self.session: Any = None
        self.open_turns = 0
        self.waiting: list[asyncio.Future[None]] = []
        self.syncing = False
        self.random = b""
        self.used = 0

    def mint(self) -> str:
        if self.used + 12 > len(self.random):
            self.random, self.used = os.urandom(4096), 0
        token = self.random[self.used : self.used + 12].hex()
        self.used += 12
        return token

    async def durable(self) -> None:
        """Until the journal's appends so far are on disk: one fdatasync for every turn that
        asks while one runs (group commit), on the loop for a turn alone."""
        if self.open_turns == 1 and not self.syncing:
            os.fdatasync(self.journal)
            return
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append(future)
        if self.syncing:
            await future
            return
        self.syncing = True
        try:
            while self.waiting:
                batch, self.waiting = self.waiting, []
                await loop.run_in_executor(None, os.fdatasync, self.journal)
                for waiter in batch:
                    waiter.set_result(None)
        finally:
            self.syncing = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["path"] in ("/readyz", "/healthz"):
            await _send_whole(send, 200, b"application/json", b'{"status":"ready"}')
            return
        message = await receive()
        body = message.get("body", b"")
        while message.get("more_body"):
            message = await receive()
            body += message.get("body", b"")
        self.open_turns += 1
        try:
            payload = await self._turn(orjson.loads(body))
        finally:
            self.open_turns -= 1
        await _send_whole(send, 200, b"application/json", payload)

    async def _turn(self, request: dict[str, Any]) -> bytes:
        conversation = request.pop("conversation_id", None) or self.mint()
        response_id = "chatcmpl-floor-" + self.mint()
        first = orjson.dumps({"type": "request", "id": response_id, "messages": request["messages"]})
        async with self.session.post(
            self.url, data=orjson.dumps(request), headers={"content-type": "application/json"}
        ) as answer:
            raw = await answer.read()
        completion = orjson.loads(raw)
        completion["id"] = response_id
        choice = completion["choices"][0]
        last = orjson.dumps(
            {"type": "response", "message": choice["message"], "usage": completion.get("usage")}
        )
        records = first + b"\n" + last + b"\n"
        entry = orjson.dumps({"response_id": response_id, "conversation_id": conversation})
        data = entry + b"\n" + records
        if self.journal_at + len(data) > JOURNAL_BYTES:
            self.journal_at = 0
        os.pwrite(self.journal, data, self.journal_at)
        self.journal_at += len(data)
        await self.durable()
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
        for path, data in (
            (os.path.join(self.responses, response_id + ".jsonl"), records),
            (os.path.join(self.conversations, conversation + ".jsonl"), response_id.encode() + b"\n"),
        ):
            fd = os.open(path, flags, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return orjson.dumps(completion)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        import aiohttp

        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=512), auto_decompress=False
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the floor of a durable turn (benchmark reference)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9003)
    parser.add_argument("--upstream", required=True, help="e.g. http://127.0.0.1:9000")
    parser.add_argument("--data-dir", required=True)
    args = parser.parse_args(argv)
    uvicorn.run(FloorTurns(args.upstream, args.data_dir), host=args.host, port=args.port, **SERVE_OPTIONS)


if __name__ == "__main__":
    main()
