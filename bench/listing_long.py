"""A list page with a long conversation on it: `GET /v1/conversations?limit=20` with 10,000
stored conversations, the newest of which holds 10,000 messages, and the cold first request on
such a conversation; JSONL and PostgreSQL, this checkout and (with `--baseline DIR`) another
one, in the same run.

    .venv/bin/python -m bench.listing_long [--quick] [--baseline DIR] [--no-postgres] [--no-jsonl]

(also run by bench/listing.py, so by `make bench`). Every target gets a data dir (or database)
of its own, seeded the same way: `--long-conversations` minus `--long-copies` conversations of one
creation marker (as `POST /v1/conversations` makes them, a month old), then `--long-copies`
conversations of `--long-messages` messages cloned from a template conversation the gateway served
(bench/seed.py: the gateway's own records, its `before` checkpoints included). The first copy is
the newest conversation, so it is on the first page; the others are older than every other
conversation, so they are not. The template is served once per run by this checkout's gateway
on its built-in `demo` model, which also answers the measured requests.

Measured per target, in this order, on a gateway started on the seeded data (the JSONL catalog
is rebuilt from the folder at start, as for a data dir that predates it):
- `list_first_ms`: the first `GET /v1/conversations?limit=20` after start;
- `list_p50_ms`: p50 of `--long-repeat` more;
- `cold_first_request_ms`: p50 over the copies of the first chat request on each (one new
  user message; the conversation was never loaded by the gateway before: a list does not keep
  what it read);
- `list_after_turn_p50_ms`: p50 of `--long-repeat` lists after those turns (the first copy was
  just talked to, the others are now on the first page too);
- `cli_conversations_ms`: `gateway conversations --limit 20` (a new process), once the server
  has stopped, median of `--long-cli-repeat`.
Writes `long` into var/bench/listing-latest.json (via bench/listing.py) or, alone,
var/bench/listing-long-latest.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from gateway.store.jsonl.layout import DataDir

from .client import Connection
from .listing import REPO, Target, get, start_postgres, wait_idle
from .procs import HOST
from .seed import (
    clone_conversation,
    cloned_turns,
    insert_created,
    read_conversation,
    user_text,
    write_created,
)

CHAT = "/v1/chat/completions"
TEMPLATE = "bench-template"
LIST = "/v1/conversations?limit=20"


def chat_body(cid: str, i: int) -> bytes:
    return orjson.dumps(
        {"model": "demo", "conversation_id": cid, "messages": [{"role": "user", "content": user_text(i)}]}
    )


async def grow(port: int, cid: str, turns: int) -> None:
    conn = Connection(HOST, port)
    try:
        for i in range(turns):
            r = await conn.request("POST", CHAT, chat_body(cid, i))
            if r.status != 200:
                raise RuntimeError(f"template: HTTP {r.status}: {r.body[:300]!r}")
    finally:
        conn.close()


def make_template(tmp: Path, turns: int) -> list[list[dict[str, Any]]]:
    """A conversation of `turns` one-message turns served by this checkout's gateway."""
    data_dir = tmp / "template"
    target = Target("template", tmp, data_dir)
    target.start()
    try:
        asyncio.run(grow(target.port, TEMPLATE, turns))
    finally:
        target.stop()
    return read_conversation(data_dir, TEMPLATE)


def long_ids(copies: int) -> list[str]:
    return [f"long-{c:02d}" for c in range(copies)]


def seed_jsonl(data_dir: Path, args: argparse.Namespace, template: list[list[dict[str, Any]]]) -> float:
    t = time.perf_counter()
    layout = DataDir(data_dir)
    layout.create()
    start = time.time() - 86400 * 30
    write_created(layout, start, args.long_conversations - args.long_copies)
    for c, cid in enumerate(long_ids(args.long_copies)):
        clone_conversation(data_dir, cid, args.long_messages, template)
        if c:  # older than every other conversation: not on the first page
            at = start - 86400 - c
            os.utime(layout.index_path(cid), (at, at))
    return time.perf_counter() - t


async def seed_postgres(dsn: str, args: argparse.Namespace, template: list[list[dict[str, Any]]]) -> float:
    """The same rows as `seed_jsonl`, in the database (namespace "")."""
    import asyncpg

    t = time.perf_counter()
    conn = await asyncpg.connect(dsn)
    try:
        start = time.time() - 86400 * 30
        total = args.long_conversations - args.long_copies
        await insert_created(conn, start, total)
        for c, cid in enumerate(long_ids(args.long_copies)):
            turns = list(cloned_turns(cid, args.long_messages, template))
            at = time.time() if c == 0 else start - 86400 - c
            await conn.executemany(
                "INSERT INTO gateway_responses (namespace, response_id, seq, kind, record) "
                "VALUES ('', $1, $2, $3, $4::json)",
                [
                    (rid, seq, str(record.get("type") or ""), orjson.dumps(record).decode())
                    for rid, records in turns
                    for seq, record in enumerate(records)
                ],
            )
            await conn.executemany(
                "INSERT INTO gateway_index (namespace, conversation_id, seq, response_id, at) "
                "VALUES ('', $1, $2, $3, $4)",
                [(cid, n, rid, at) for n, (rid, _) in enumerate(turns, start=1)],
            )
            await conn.execute(
                "INSERT INTO gateway_conversations (namespace, conversation_id, last_seq, updated_at) "
                "VALUES ('', $1, $2, $3)",
                cid,
                len(turns),
                at,
            )
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    return time.perf_counter() - t


async def measure(port: int, args: argparse.Namespace) -> dict[str, Any]:
    conn = Connection(HOST, port)
    out: dict[str, Any] = {}
    try:
        first, page = await get(conn, LIST)
        out["list_first_ms"] = round(first, 2)
        ids = [row["id"] for row in page["data"]]
        if ids[:1] != long_ids(1) or len(ids) != 20:
            raise RuntimeError(f"the long conversation is not first on the first page: {ids[:3]}")
        messages = page["data"][0].get("messages")
        if messages is not None and messages != args.long_messages:
            raise RuntimeError(f"the long conversation lists {messages} messages, not {args.long_messages}")
        out["list_p50_ms"] = round(
            statistics.median([(await get(conn, LIST))[0] for _ in range(args.long_repeat)]), 2
        )
        cold = []
        for k, cid in enumerate(long_ids(args.long_copies)):
            r = await conn.request("POST", CHAT, chat_body(cid, args.long_messages // 2 + k), timeout=600)
            if r.status != 200:
                raise RuntimeError(f"cold request on {cid}: HTTP {r.status}: {r.body[:300]!r}")
            cold.append(r.latency * 1000)
        out["cold_first_request_ms"] = round(statistics.median(cold), 2)
        out["cold_first_request_all_ms"] = [round(x, 1) for x in cold]
        after = [(await get(conn, LIST))[0] for _ in range(args.long_repeat)]
        out["list_after_turn_p50_ms"] = round(statistics.median(after), 2)
    finally:
        conn.close()
    return out


def run_target(target: Target, args: argparse.Namespace) -> dict[str, Any]:
    target.start()
    try:
        assert target.server is not None
        wait_idle(target.server.pid)  # startup work (the tokenizer's warm-up) is not the list's
        out = asyncio.run(measure(target.port, args))
    finally:
        target.stop()
    out["cli_conversations_ms"] = round(target.cli_ms(args.long_cli_repeat), 1)
    return out


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Every target's figures, by target name."""
    t = time.perf_counter()
    template = make_template(tmp, args.template_turns)
    print(
        f"bench long list: template of {len(template)} turns in {time.perf_counter() - t:.1f} s", flush=True
    )
    codes: dict[str, Path | None] = {"": None}
    if args.baseline:
        codes["baseline_"] = Path(args.baseline).resolve()
    results: dict[str, Any] = {}
    if not args.no_jsonl:
        for prefix, code in codes.items():
            name = f"{prefix}jsonl"
            data_dir = tmp / f"long-{name}"
            seconds = seed_jsonl(data_dir, args, template)
            print(f"  {name}: seeded in {seconds:.1f} s; measuring", flush=True)
            results[name] = run_target(Target(f"long_{name}", tmp, data_dir, code=code), args)
            shutil.rmtree(data_dir, ignore_errors=True)
    if not args.no_postgres:
        cluster, status = start_postgres()
        if cluster is None:
            results["postgres"] = status
        else:
            try:
                for prefix, code in codes.items():
                    name = f"{prefix}postgres"
                    dsn = cluster.create_database("long")
                    target = Target(f"long_{name}", tmp, tmp / f"long-{name}", dsn=dsn, code=code)
                    target.start()  # its own schema, by its own code
                    target.stop()
                    seconds = asyncio.run(seed_postgres(dsn, args, template))
                    print(f"  {name}: seeded in {seconds:.1f} s; measuring", flush=True)
                    results[name] = run_target(target, args)
            finally:
                cluster.stop()
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--long-conversations", type=int, default=10_000)
    parser.add_argument("--long-messages", type=int, default=10_000)
    parser.add_argument("--long-copies", type=int, default=5, help="cold requests (their p50)")
    parser.add_argument("--long-repeat", type=int, default=20)
    parser.add_argument("--long-cli-repeat", type=int, default=3, help="`gateway conversations` runs")
    parser.add_argument("--template-turns", type=int, default=150)


def print_table(results: dict[str, Any]) -> None:
    names = [n for n, r in results.items() if isinstance(r, dict)]
    keys = [
        "list_first_ms",
        "list_p50_ms",
        "cold_first_request_ms",
        "list_after_turn_p50_ms",
        "cli_conversations_ms",
    ]
    print("\nlong conversation on the first page".ljust(30) + "".join(n.rjust(20) for n in names))
    for k in keys:
        print(k.ljust(30) + "".join(str(results[n].get(k, "–")).rjust(20) for n in names))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a list page with a long conversation on it")
    add_arguments(parser)
    parser.add_argument("--baseline", default=None, help="another version's checkout, measured alike")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--no-jsonl", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 copies, 5 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.long_copies, args.long_repeat = 2, 5
    tmp = Path(tempfile.mkdtemp(prefix="gateway-long-"))
    try:
        results = run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(results)
    out = REPO / "var" / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "listing-long-latest.json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    print("wrote var/bench/listing-long-latest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
