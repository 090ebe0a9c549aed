"""`gateway fsck` on a data dir damaged by hand: each problem named with its file and line and a
non-zero exit; `--repair` sets every damaged line or file aside in quarantine/ (with notes),
after which fsck is clean and every damaged conversation takes a turn through `gateway serve`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson

from tests.conftest import REPO, GatewayProcess, sdk, write_config
from tests.mockserver import MockServer

CONVERSATIONS = ["mid-index", "mid-response", "side-log", "missing", "empty"]


def fsck(data_dir: Path, config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "fsck", "--config", str(config), "--data-dir", str(data_dir)]
        + list(args),
        cwd=REPO,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=60,
    )


def chat(gateway: GatewayProcess, cid: str, text: str) -> str:
    reply = sdk(gateway).chat.completions.create(
        model="mock/m", messages=[{"role": "user", "content": text}], extra_body={"conversation_id": cid}
    )
    return reply.choices[0].message.content or ""


def index_of(data_dir: Path, cid: str) -> list[str]:
    return (data_dir / "logs" / "conversations" / f"{cid}.jsonl").read_text().splitlines()


def damage(data_dir: Path) -> dict[str, str]:
    """Break each conversation in its own way; the response ids that were broken."""
    logs = data_dir / "logs"
    broken: dict[str, str] = {}
    index = logs / "conversations" / "mid-index.jsonl"
    lines = index.read_bytes().split(b"\n")
    lines[1] = b"\x00\x00garbage from a bad disk"  # line 2 of 3
    index.write_bytes(b"\n".join(lines))
    rid = index_of(data_dir, "mid-response")[1]
    path = logs / "responses" / f"{rid}.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[1] = b'{"type": "context", "tokens": {'  # line 2 (the context snapshot) of 4
    path.write_bytes(b"\n".join(lines))
    broken["mid-response"] = rid
    side = logs / "summaries" / "side-log.jsonl"
    side.parent.mkdir(parents=True, exist_ok=True)
    failed = {"type": "summary_failed", "attempt": 1, "error": "x", "at": 1.0}
    side.write_bytes(orjson.dumps(failed) + b"\n{not json\n" + orjson.dumps(failed) + b"\n")
    broken["missing"] = index_of(data_dir, "missing")[1]
    (logs / "responses" / f"{broken['missing']}.jsonl").unlink()
    with open(logs / "conversations" / "missing.jsonl", "ab") as f:
        f.write(b"mock-m-0123456789")  # and a torn last line (line 4)
    broken["empty"] = index_of(data_dir, "empty")[1]
    (logs / "responses" / f"{broken['empty']}.jsonl").write_bytes(b"")
    return broken


def test_fsck_reports_each_damage_and_repair_lets_every_conversation_go_on(
    tmp_path: Path, upstream: MockServer
) -> None:
    summarize = '[context]\nstrategy = "summarize"\n'  # the summaries side log is read on every turn
    config = write_config(tmp_path / "gateway.toml", upstream.url, extra=summarize)
    data_dir = tmp_path / "var"
    gateway = GatewayProcess(config, data_dir).start()
    try:
        for cid in CONVERSATIONS:
            for n in range(3):
                chat(gateway, cid, f"my number in {cid} is {n}")
    finally:
        gateway.stop()
    assert fsck(data_dir, config).returncode == 0

    broken = damage(data_dir)
    report = fsck(data_dir, config)
    assert report.returncode == 1, report.stdout + report.stderr
    out = report.stdout
    assert "logs/conversations/mid-index.jsonl:2: index line is neither" in out
    assert f"logs/responses/{broken['mid-response']}.jsonl:2: undecodable record" in out
    assert "logs/summaries/side-log.jsonl:2: undecodable record" in out
    missing, empty = broken["missing"], broken["empty"]
    assert f"logs/conversations/missing.jsonl:2: names a response file that is missing ({missing})" in out
    assert "logs/conversations/missing.jsonl:4: torn last line" in out
    assert f"logs/conversations/empty.jsonl:2: names a response file that is empty ({empty})" in out
    assert f"logs/responses/{broken['empty']}.jsonl: empty response file" in out
    assert "7 problem(s)" in out
    assert str(tmp_path) not in out.replace(f"in {data_dir}", "")  # relative paths only

    repaired = fsck(data_dir, config, "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert repaired.stdout.count("repaired ") == 7, repaired.stdout
    again = fsck(data_dir, config)
    assert again.returncode == 0 and "no damage found" in again.stdout, again.stdout

    # Nothing deleted: every damaged line and file is in quarantine/, with a note.
    (folder,) = (data_dir / "quarantine").iterdir()
    notes = [orjson.loads(line) for line in (folder / "notes.jsonl").read_bytes().splitlines()]
    assert len(notes) == 7
    moved = folder / "logs"
    assert (moved / "conversations" / "mid-index.jsonl.line-2").read_bytes().startswith(b"\x00\x00garbage")
    bad_record = moved / "responses" / f"{broken['mid-response']}.jsonl.line-2"
    assert bad_record.read_bytes().startswith(b'{"type": "context"')
    assert (moved / "summaries" / "side-log.jsonl.line-2").read_bytes() == b"{not json\n"
    assert (moved / "conversations" / "missing.jsonl.line-2").read_text() == f"{broken['missing']}\n"
    assert (moved / "conversations" / "missing.jsonl.line-4").read_bytes() == b"mock-m-0123456789"
    assert (moved / "conversations" / "empty.jsonl.line-2").read_text() == f"{broken['empty']}\n"
    assert (moved / "responses" / f"{broken['empty']}.jsonl").read_bytes() == b""
    noted = {note["file"] for note in notes}
    assert {"logs/conversations/mid-index.jsonl", "logs/summaries/side-log.jsonl"} <= noted

    # Every damaged conversation goes on, with the history it still has.
    upstream.reset()
    gateway = GatewayProcess(config, data_dir).start()
    try:
        for cid in CONVERSATIONS:
            chat(gateway, cid, f"what is my number in {cid}?")
            sent = " ".join(str(m.get("content")) for m in upstream.requests[-1]["messages"])
            assert f"my number in {cid} is 2" in sent, (cid, sent)
        assert "Traceback" not in gateway.log()
    finally:
        gateway.stop()


def test_fsck_names_a_file_where_the_layout_has_a_folder(tmp_path: Path, upstream: MockServer) -> None:
    """It said "no damage found" of a data dir `serve` refuses and no turn could be stored in."""
    config = write_config(tmp_path / "g.toml", upstream.url)
    data_dir = tmp_path / "var"
    (data_dir / "logs").mkdir(parents=True)
    (data_dir / "logs" / "conversations").write_text("not a folder")
    done = fsck(data_dir, config)
    assert done.returncode == 1
    assert "logs/conversations: a file where the gateway keeps a folder" in done.stdout


def test_fsck_on_a_data_dir_that_is_a_file_says_so(tmp_path: Path, upstream: MockServer) -> None:
    """It said "there is no data dir at ..." of a file."""
    config = write_config(tmp_path / "g.toml", upstream.url)
    (tmp_path / "var").write_text("not a folder")
    done = fsck(tmp_path / "var", config)
    assert done.returncode == 1 and "is a file, not a folder" in done.stderr


def test_fsck_names_a_file_no_reader_can_open_and_leaves_it(tmp_path: Path, upstream: MockServer) -> None:
    """A folder where a response file or an index should be (or a file it may not read) was a
    traceback, with `--repair` too; a folder named like an index was not reported at all."""
    config = write_config(tmp_path / "g.toml", upstream.url)
    data_dir = tmp_path / "var"
    logs = data_dir / "logs"
    (logs / "responses" / "mock-m-0123456789ab.jsonl").mkdir(parents=True)
    (logs / "conversations" / "c1.jsonl").mkdir(parents=True)
    (logs / "conversations" / "c2.jsonl").write_text("mock-m-0123456789ab\n")
    os.mkfifo(logs / "responses" / "mock-m-0123456789ac.jsonl")  # (its read waited for ever)
    for args in ((), ("--repair",)):
        done = fsck(data_dir, config, *args)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert "logs/responses/mock-m-0123456789ab.jsonl: cannot be read (Is a directory)" in done.stdout
        assert "logs/conversations/c1.jsonl: cannot be read (Is a directory)" in done.stdout
        assert "logs/responses/mock-m-0123456789ac.jsonl: cannot be read (not a regular file)" in done.stdout
    assert (logs / "conversations" / "c2.jsonl").read_text() == "mock-m-0123456789ab\n"  # (left)
