"""The `gateway` command line, run as a user would: real subprocesses on a real data dir."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from openai import OpenAI

from tests.conftest import REPO, GatewayProcess
from tests.mockserver import MockServer

T = TypeVar("T")


def gw(
    *args: str, cwd: Path = REPO, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def seed_offline(
    tmp_path: Path,
    context: dict[str, Any],
    work: Callable[[Any], Awaitable[T]],
    upstream: Any = None,
    **sections: dict[str, Any],
) -> T:
    """Run `work(client)` against the app in this process on the JSONL data dir
    `tmp_path/var` (no server, no fsync), with these `[context]` settings (and `upstream`, a
    MockUpstream, when given); its result."""
    import asyncio

    from gateway.config import load_settings
    from gateway.store.jsonl import JsonlStore
    from gateway.upstream.mock import MockUpstream
    from tests.conftest import build_client

    settings = load_settings(
        REPO / "tests" / "empty.toml",
        environ={},
        overrides={
            "default_provider": "mock",
            "providers": {"mock": {"kind": "openai", "base_url": "http://mock.invalid/v1"}},
            "storage": {"backend": "jsonl", "data_dir": str(tmp_path / "var"), "durability": "none"},
            "context": context,
            **sections,
        },
    )

    async def run() -> T:
        store = JsonlStore(tmp_path / "var", durability="none")
        async with build_client(settings, store, upstream or MockUpstream()) as client:
            return await work(client)

    return asyncio.run(run())


def test_demo_shows_recall_on_a_fresh_dir(tmp_path: Path) -> None:
    result = gw("demo", "--data-dir", str(tmp_path / "var"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Your name is Bob." in out
    assert "Your favourite colour is teal." in out
    assert 'You first said: "Hi! My name is Bob' in out
    assert len(list((tmp_path / "var" / "logs" / "responses").glob("demo-*.jsonl"))) == 6


def _seed(gateway: GatewayProcess, conversation_id: str = "cli-1") -> list[str]:
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    ids = []
    for text in ["my name is Cli", "what is my name?"]:
        ids.append(
            client.chat.completions.create(
                model="mock/tiny",
                messages=[{"role": "user", "content": text}],
                extra_body={"conversation_id": conversation_id},
            ).id
        )
    return ids


def test_conversations_show_context(gateway: GatewayProcess, upstream: MockServer) -> None:
    ids = _seed(gateway)
    data = ["--data-dir", str(gateway.data_dir)]
    listing = gw("conversations", *data)
    assert listing.returncode == 0
    row = next(line for line in listing.stdout.splitlines() if line.startswith("cli-1"))
    assert row.split()[1:3] == ["2", "4"]
    show = gw("show", "cli-1", *data)
    assert show.returncode == 0
    assert ids[0] in show.stdout and "Your name is Cli." in show.stdout and "tok" in show.stdout
    as_json = gw("show", "cli-1", "--json", *data)
    import json

    doc = json.loads(as_json.stdout)
    assert [m["content"] for m in doc["messages"]][-1] == "Your name is Cli."
    # Tokens: per message in --json, and the same total as `gateway conversations`
    assert len(doc["message_tokens"]) == 4 and all(n > 0 for n in doc["message_tokens"])
    assert doc["tokens"] == sum(doc["message_tokens"]) == int(row.split()[3])
    assert f"4 messages, {doc['tokens']} tokens" in show.stdout
    ctx = gw("context", ids[1], *data)
    assert ctx.returncode == 0 and "sent 3 messages" in ctx.stdout and "committed" in ctx.stdout
    assert "Your name is Cli." in ctx.stdout and "sent (exact):" in ctx.stdout
    # The second turn kept the first one's head: the provider's cache could serve all before it.
    assert "head         held (the previous turn's head); history from the conversation's first" in ctx.stdout


def test_a_response_id_that_begins_with_a_dash_is_an_argument(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    """The model `/m` mints `-m-…`: `gateway context` takes it as the id, not as options."""
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    rid = client.chat.completions.create(
        model="/m", messages=[{"role": "user", "content": "hi"}], extra_body={"conversation_id": "dash"}
    ).id
    assert rid.startswith("-m-")
    for args in (["context", rid], ["context", "--brief", rid], ["context", rid, "--json"]):
        result = gw(*args, "--data-dir", str(gateway.data_dir))
        assert result.returncode == 0, (args, result.stderr)
        assert rid in result.stdout


def test_errors_are_one_line_and_nonzero(tmp_path: Path) -> None:
    result = gw("show", "nope", "--data-dir", str(tmp_path))
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.toml"
    bad.write_text('[storage]\ndurability = "maybe"\n')
    result = gw("conversations", "--config", str(bad))
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "storage.durability" in result.stderr
    result = gw("serve", "--config", str(bad))
    assert result.returncode != 0 and "storage.durability" in result.stderr
    result = gw("context", "../../etc/passwd", "--data-dir", str(tmp_path))
    assert result.returncode != 0
    # Usage mistakes too: one line naming the problem and where help is, not a usage block.
    for args, names in (
        (["show", "c1", "--bogus"], ["--bogus", "gateway show --help"]),
        (["bogus"], ["bogus", "gateway --help"]),
        (["conversations", "--limit", "0", "--data-dir", str(tmp_path)], ["--limit"]),
        (["show"], ["CONVERSATION_ID"]),
        (["serve", "--log-level", "bogus"], ["--log-level"]),
        (["serve", "--workers", "0"], ["--workers"]),
        (["tail", "c1", "--poll", "0"], ["--poll"]),
        (["tail", "c1", "--poll", "nan"], ["--poll"]),  # (else a busy loop)
        (["demo", "--port", "99999"], ["--port"]),  # (was a 38-line traceback)
        (["demo", "--port", "-5"], ["--port"]),
    ):
        result = gw(*args)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
        assert all(name in result.stderr for name in names), result.stderr
    # A bad flag value is blamed on the flag, not on the variable it travels in to the workers.
    result = gw("serve", "--port", "99999", "--data-dir", str(tmp_path))
    assert result.returncode == 1 and "server.port" in result.stderr
    assert "[command-line flag]" in result.stderr and "GATEWAY_SERVER__PORT" not in result.stderr
    # Nothing to export is not "exported 0 files"; a folder named as the config file is not "missing".
    result = gw("export", "--data-dir", str(tmp_path / "none"), "--to", str(tmp_path / "dump"))
    assert result.returncode == 1 and "holds no gateway data" in result.stderr
    assert not (tmp_path / "dump").exists()
    result = gw("conversations", "--config", str(tmp_path))
    assert result.returncode == 1 and "is a directory" in result.stderr
    result = gw("conversations", "--data-dir", str(tmp_path), env={"GATEWAY_CONFIG": ""})
    assert result.returncode == 0, result.stderr  # an empty GATEWAY_CONFIG is unset
    # A change to a conversation in a data dir that is not there made the folders (a mistyped
    # --data-dir left behind).
    for args in (["reset", "c1"], ["delete", "c1", "--yes"]):
        result = gw(*args, "--data-dir", str(tmp_path / "typo"))
        assert result.returncode == 1 and "no conversation 'c1'" in result.stderr
        assert not (tmp_path / "typo").exists()
    # A bare `gateway` is not a mistake: its help, as `gateway --help` prints it (was an "error").
    bare, asked = gw(), gw("--help")
    assert (bare.returncode, bare.stdout, bare.stderr) == (0, asked.stdout, "")


def test_tail_follows_new_turns(gateway: GatewayProcess, upstream: MockServer) -> None:
    out_path = gateway.data_dir.parent / "tail.out"
    with open(out_path, "w") as out_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gateway",
                "tail",
                "-f",  # (as `tail -f` takes it: following is the default)
                "cli-tail",  # its own conversation: the module's gateway is shared
                "--poll",
                "0.1",
                "--data-dir",
                str(gateway.data_dir),
            ],
            cwd=REPO,
            stdout=out_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            # Following, not a one-off dump: tail is up (its header printed, polling an index
            # that does not exist yet) before the first turn is made.
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and "following" not in out_path.read_text():
                time.sleep(0.05)
            time.sleep(0.3)  # a few polls of the missing index
            assert "following" in out_path.read_text() and "Cli" not in out_path.read_text()
            assert proc.poll() is None
            _seed(gateway, "cli-tail")
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and "Your name is Cli." not in out_path.read_text():
                time.sleep(0.1)
            out = out_path.read_text()
            assert "my name is Cli" in out and "Your name is Cli." in out
            # A reset shows where it happened (the next answer knows nothing before it).
            reset = httpx.post(f"{gateway.url}/v1/conversations/cli-tail/reset", json={}, timeout=10)
            assert reset.status_code == 200
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and "conversation reset" not in out_path.read_text():
                time.sleep(0.1)
            assert "conversation reset: the history before this is no longer sent" in out_path.read_text()
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def test_tail_with_gateway_keys_follows_a_new_conversation_under_its_key(
    tmp_path: Path, upstream: MockServer
) -> None:
    """With gateway keys, `gateway tail NEW` watched the default tenant's folder, where no turn
    of a keyed client ever lands: it stayed silent unless given --tenant."""
    from tests.conftest import write_config

    config = write_config(tmp_path / "g.toml", upstream.url, extra='\n[auth]\nkeys_env = "GW_TAIL_KEYS"\n')
    env = {"GW_TAIL_KEYS": "key-a,key-b"}
    gw = GatewayProcess(config, tmp_path / "var", env=env).start()
    out_path = tmp_path / "tail.out"
    try:
        with open(out_path, "w") as out_file:
            command = [sys.executable, "-m", "gateway", "tail", "keyed-new", "--poll", "0.1"]
            proc = subprocess.Popen(
                [*command, "--config", str(config), "--data-dir", str(gw.data_dir)],
                cwd=REPO,
                stdout=out_file,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            )
            try:
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and "waiting for" not in out_path.read_text():
                    time.sleep(0.05)
                client = OpenAI(base_url=f"{gw.url}/v1", api_key="key-b", max_retries=0)
                client.chat.completions.create(
                    model="mock/tiny",
                    messages=[{"role": "user", "content": "my name is Keyed"}],
                    extra_body={"conversation_id": "keyed-new"},
                )
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and "my name is Keyed" not in out_path.read_text():
                    time.sleep(0.1)
                out = out_path.read_text()
                assert "my name is Keyed" in out, out
                assert "following " in out and "/tenants/" in out  # the key's own folder
            finally:
                proc.terminate()
                proc.wait(timeout=10)
    finally:
        gw.stop()


def test_serve_precedence_flag_over_env(tmp_path: Path, upstream: MockServer) -> None:
    from tests.conftest import write_config

    config = write_config(tmp_path / "g.toml", upstream.url)
    env_dir = tmp_path / "from-env"
    proc = GatewayProcess(
        config, tmp_path / "from-flag", env={"GATEWAY_STORAGE__DATA_DIR": str(env_dir)}
    ).start()
    try:
        client = OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0)
        client.chat.completions.create(
            model="mock/t", messages=[{"role": "user", "content": "hi"}], extra_body={"conversation_id": "p"}
        )
        assert (tmp_path / "from-flag" / "logs" / "conversations" / "p.jsonl").exists()
        assert not env_dir.exists()
    finally:
        proc.stop()


def test_reset_and_delete_from_the_cli_while_serving(gateway: GatewayProcess, upstream: MockServer) -> None:
    _seed(gateway)
    data = ["--data-dir", str(gateway.data_dir)]
    result = gw("reset", "cli-1", "--keep-system-message", *data)
    assert result.returncode == 0, result.stderr
    shown = gw("show", "cli-1", *data)  # a conversation just reset still exists: no turn yet
    assert shown.returncode == 0, shown.stderr
    assert "no longer sent to the model" in shown.stdout and "0 turns, 0 messages" in shown.stdout
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="mock/t",
        messages=[{"role": "user", "content": "what is my name?"}],
        extra_body={"conversation_id": "cli-1"},
    )
    assert r.choices[0].message.content == "I don't know your name yet."  # the running server saw the reset
    result = gw("delete", "cli-1", "--yes", *data)
    assert result.returncode == 0 and "deleted cli-1" in result.stdout
    assert not (gateway.data_dir / "logs" / "conversations" / "cli-1.jsonl").exists()
    assert gw("delete", "cli-1", "--yes", *data).returncode != 0
    client.chat.completions.create(
        model="mock/t", messages=[{"role": "user", "content": "hi"}], extra_body={"conversation_id": "cli-1"}
    )
    assert [m["role"] for m in upstream.requests[-1]["messages"]] == ["user"]


@pytest.mark.parametrize("backend", ["postgres", "jsonl"])
def test_serve_with_a_store_it_cannot_open_is_one_line_and_exit_1(tmp_path: Path, backend: str) -> None:
    """An unreachable database (or a data dir that is a file) stops `serve` before any worker
    starts: one line naming the store, status 1, no traceback, no password."""
    config = tmp_path / "gateway.toml"
    if backend == "postgres":
        config.write_text(
            '[storage]\nbackend = "postgres"\ndsn = "postgresql://gw:s3cret@127.0.0.1:1/nothing"\n'
        )
        data_dir = tmp_path / "var"
    else:
        data_dir = tmp_path / "afile"
        data_dir.write_text("not a folder")
        config.write_text("")
    result = gw("serve", "--config", str(config), "--data-dir", str(data_dir), "--port", "1", timeout=30)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert ("storage" in lines[0] or "store" in lines[0]) and "s3cret" not in lines[0]


def test_show_marks_what_the_last_window_left_out(tmp_path: Path) -> None:
    """`gateway show`: the history as the model sees it. When the last turn's window cut older
    turns, they are shown apart (dimmed, named) and the marker the model got stands where the
    window began; --json says the same under `last_window`."""
    import json

    from tests.helpers import say_each

    ids = seed_offline(
        tmp_path,
        {"max_history_messages": 4},
        lambda client: say_each(client, "w", [f"q{n}" for n in range(5)]),
    )
    shown = gw("show", "w", "--data-dir", str(tmp_path / "var"))
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    # max_history_messages = 4: the last turn was sent q2 a2 q3 a3 (+ q4), after the marker
    marker = out.index("[4 earlier messages omitted]")
    for rid in ids[:2]:
        assert out.index(rid) < marker and f"{rid} (outside the last turn's window ({ids[-1]})" in out
    assert all(out.index(f"── {rid}\n") > marker for rid in ids[2:])
    as_json = json.loads(gw("show", "w", "--json", "--data-dir", str(tmp_path / "var")).stdout)
    assert as_json["last_window"] == {
        "response_id": ids[-1],
        "omitted_messages": 4,
        "included_response_ids": ids[2:-1],  # as the manifest says them: in order, the turn itself aside
        "summary_version": None,
        "summary_covers_messages": 0,
        "summary_covers_through": None,
        "summary": None,
    }
    assert as_json["recap"] is None


def test_context_and_show_say_what_the_providers_cache_served(tmp_path: Path) -> None:
    import json

    from gateway.upstream.base import completion_from_text
    from gateway.upstream.mock import MockUpstream
    from tests.helpers import say_each

    def cached(body: dict[str, Any]) -> Any:
        completion = completion_from_text("m", "ok", prompt_tokens=1100)
        completion["usage"]["prompt_tokens_details"] = {"cached_tokens": 1024}
        return completion

    ids = seed_offline(tmp_path, {}, lambda client: say_each(client, "k", ["q0", "q1"]), MockUpstream(cached))
    data = ["--data-dir", str(tmp_path / "var")]
    said = "1024 of 1100 prompt tokens from the provider's cache (usage)"
    context = gw("context", ids[-1], "--brief", *data)
    assert context.returncode == 0, context.stderr
    assert f"cache        {said}" in context.stdout
    shown = gw("show", "k", *data)
    assert shown.returncode == 0, shown.stderr
    assert f"last turn: {said}" in shown.stdout
    as_json = json.loads(gw("show", "k", "--json", *data).stdout)
    assert as_json["last_turn_cache"] == {"prompt_tokens": 1100, "cached_tokens": 1024, "source": "usage"}


def test_show_says_which_messages_a_rolling_summary_stands_for(tmp_path: Path) -> None:
    """With `summarize`, the turns a summary covers are not sent as they are: `show` dims them
    and says where the summary stands, even when the window cut nothing else."""
    import json

    from tests.conftest import app_of
    from tests.helpers import say_each

    async def talk(client: Any) -> list[str]:
        ids = await say_each(client, "s", [f"q{n}" for n in range(6)])
        for n in range(6, 12):  # until a cut brings the summary in (it enters only at a cut)
            await app_of(client).state.summarizer.wait_idle()
            ids += await say_each(client, "s", [f"q{n}"])
            if (await client.get("/v1/conversations/s/context")).json().get("summary_version"):
                break
        return ids

    context = {"strategy": "summarize", "max_history_messages": 6, "keep_recent_messages": 2}
    ids = seed_offline(tmp_path, context, talk)
    as_json = json.loads(gw("show", "s", "--json", "--data-dir", str(tmp_path / "var")).stdout)
    window = as_json["last_window"]
    assert window["summary_version"] is not None and window["summary_covers_messages"] > 0
    assert window["omitted_messages"] == 0  # the summary, and every turn after it
    # The summary as the model got it (only its version was there: not what the model was given)
    summary = window["summary"]
    assert summary["role"] == "system" and summary["content"].startswith(
        "Summary of the earlier conversation"
    )
    out = gw("show", "s", "--data-dir", str(tmp_path / "var")).stdout
    version, count = window["summary_version"], window["summary_covers_messages"]
    line = f"rolling summary v{version}: the {count} messages above were sent as this summary"
    assert line in out and out.index(f"── {ids[0]} ") < out.index(line) < out.index(f"── {ids[-1]}\n")


def test_show_puts_the_summary_after_the_turns_it_covers(tmp_path: Path) -> None:
    """`show` put the summary's line below every turn outside the window, those only omitted
    (after the turns it covers) too, and called them all "left out or summarized"."""
    import json

    from tests.conftest import app_of
    from tests.helpers import say_each

    async def talk(client: Any) -> list[str]:
        ids = await say_each(client, "s", [f"q{n}" for n in range(6)])
        await app_of(client).state.summarizer.wait_idle()
        return ids + await say_each(client, "s", [f"q{n}" for n in range(6, 10)])

    context = {"strategy": "summarize", "max_history_messages": 6, "keep_recent_messages": 2}
    ids = seed_offline(tmp_path, context, talk)
    window = json.loads(gw("show", "s", "--json", "--data-dir", str(tmp_path / "var")).stdout)["last_window"]
    assert window["summary_covers_messages"] > 0 and window["omitted_messages"] > 0
    through = window["summary_covers_through"]
    out = gw("show", "s", "--data-dir", str(tmp_path / "var")).stdout
    line = out.index(f"rolling summary v{window['summary_version']}: the ")
    after = ids[ids.index(through) + 1]  # the first turn the summary does not cover: omitted
    marker = out.index("earlier messages omitted]")
    assert out.index(f"── {through} ") < line < out.index(f"── {after} ") < marker
    assert f"{ids[0]} (outside the last turn's window ({ids[-1]}): in the rolling summary)" in out
    assert f"{after} (outside the last turn's window ({ids[-1]}): left out)" in out


def test_show_marks_a_deleted_message_of_a_summarized_turn(tmp_path: Path) -> None:
    """A turn outside the window (summarized) was printed without its messages' marks: one
    deleted since showed as any other, though the inspector struck it out."""
    from tests.conftest import app_of
    from tests.helpers import say_each

    async def talk(client: Any) -> list[str]:
        ids = await say_each(client, "s", [f"q{n}" for n in range(6)])
        await app_of(client).state.summarizer.wait_idle()
        ids += await say_each(client, "s", [f"q{n}" for n in range(6, 10)])
        deleted = await client.delete(f"/v1/conversations/s/items/msg_{ids[0]}_0")
        assert deleted.status_code == 200, deleted.text
        return ids

    context = {"strategy": "summarize", "max_history_messages": 6, "keep_recent_messages": 2}
    ids = seed_offline(tmp_path, context, talk)
    out = gw("show", "s", "--data-dir", str(tmp_path / "var")).stdout
    turn = out[out.index(f"── {ids[0]} ") : out.index(f"── {ids[1]} ")]
    question, answer = turn.splitlines()[1:3]
    assert "q0" in question and "deleted: no longer sent" in question
    assert "deleted" not in answer


def test_show_marks_what_is_no_longer_sent(gateway: GatewayProcess, upstream: MockServer) -> None:
    """`gateway show` is the history as the model will see it: a deleted item, and a tool
    result whose call was deleted, are shown dimmed with why, and left out of `--json`."""
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    conv = client.conversations.create(
        items=[
            {"type": "message", "role": "user", "content": "first question"},
            {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny and warm"},
            {"type": "message", "role": "user", "content": "second question"},
        ]
    )
    items = client.conversations.items.list(conv.id, order="asc").data
    by_text = {getattr(i, "content", None) and i.content[0].text: i.id for i in items if i.type == "message"}
    client.conversations.items.delete(by_text["first question"], conversation_id=conv.id)
    call = next(i.id for i in items if i.type == "function_call")
    client.conversations.items.delete(call, conversation_id=conv.id)
    data = ["--data-dir", str(gateway.data_dir)]
    out = gw("show", conv.id, *data).stdout
    assert "first question" in out and "deleted: no longer sent" in out
    assert (
        "sunny and warm" in out
        and "no tool call left to answer (deleted, or answered before it came): no longer sent" in out
    )
    import json

    doc = json.loads(gw("show", conv.id, "--json", *data).stdout)
    assert [m.get("content") for m in doc["messages"]] == ["second question"]


def test_show_marks_a_cut_inside_one_turn(tmp_path: Path) -> None:
    """A long chat moved in with one request is one turn; the window cut inside it: the
    messages it left out are dimmed one by one, the rest shown as sent."""
    moved = []
    for i in range(20):
        moved += [
            {"role": "user", "content": f"question {i}: " + "word " * 30},
            {"role": "assistant", "content": f"answer {i}"},
        ]

    async def move_in(client: Any) -> None:
        body = {
            "model": "mock/m",
            "conversation_id": "moved",
            "messages": [*moved, {"role": "user", "content": "now?"}],
        }
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text

    seed_offline(tmp_path, {"max_context_tokens": 600}, move_in)
    out = gw("show", "moved", "--data-dir", str(tmp_path / "var")).stdout
    left_out = [line for line in out.splitlines() if "outside the last turn's window" in line]
    assert left_out and "question 0:" in left_out[0]
    assert not any("question 19:" in line for line in left_out)  # the newest were sent
    marker = out.index("earlier messages omitted]")
    assert out.index("question 0:") < marker < out.index("question 19:")


def test_show_writes_control_characters_out_instead_of_obeying_them(tmp_path: Path) -> None:
    """A message is anyone's text: an escape sequence in it set the operator's terminal title,
    colours or clipboard in `gateway show`."""
    from tests.helpers import say_each

    seed_offline(
        tmp_path,
        {},
        lambda client: say_each(client, "esc", ["hi \x1b]0;pwned\x07 \x1b[31mRED", "see \u202egnp.exe"]),
    )
    out = gw("show", "esc", "--data-dir", str(tmp_path / "var")).stdout
    assert "\x1b" not in out and "\x07" not in out
    assert "hi \\x1b]0;pwned\\x07 \\x1b[31mRED" in out
    # A right-to-left override made a name read backwards ("exe.png"): written out too.
    assert "\u202e" not in out and "see \\u202egnp.exe" in out


def test_show_and_tail_show_the_recap_and_tail_shows_an_edit(tmp_path: Path) -> None:
    """`show` left out the recap sent on every turn; `tail` showed an edited turn right after
    the abandoned one, with nothing to say the history branched."""

    async def say(client: Any, cid: str, messages: list[dict[str, Any]]) -> str:
        body = {"model": "mock/m", "conversation_id": cid, "user": "u1", "messages": messages}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["message"]["content"])

    async def talk(client: Any) -> None:
        await say(client, "first", [{"role": "user", "content": "my name is Ada"}])
        q1 = {"role": "user", "content": "hello"}
        a1 = await say(client, "second", [q1])  # a new conversation of u1's: it gets the recap
        await say(client, "second", [{"role": "user", "content": "where was I?"}])
        edited = [q1, {"role": "assistant", "content": a1}, {"role": "user", "content": "where am I?"}]
        await say(client, "second", edited)  # the client's edit of its second question

    seed_offline(tmp_path, {}, talk, sessions={"recap": True})
    data = ["--data-dir", str(tmp_path / "var")]
    shown = gw("show", "second", *data).stdout
    assert "Earlier today" in shown and "recap, earlier today" in shown
    tail = subprocess.Popen(
        [sys.executable, "-m", "gateway", "tail", "second", "--poll", "0.05", *data],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        out = ""
        deadline = time.monotonic() + 15
        assert tail.stdout is not None
        while time.monotonic() < deadline and "where am I?" not in out:
            out += tail.stdout.readline()
    finally:
        tail.terminate()
        tail.wait(10)
    assert "tok, recap)" in out and "the client's edit: continues after message 2" in out
