"""Input limits on the real server: a slow body gets 408 after `server.body_timeout`; a body over
`server.max_body_bytes` gets 413 without being read whole; a client that gives up mid-body
costs nothing. The gateway under test runs with body_timeout = 1 s and max_body_bytes = 1 MB."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from tests.conftest import GatewayProcess
from tests.e2e.reliability.faultserver import FaultServer

BODY = json.dumps(
    {"model": "fault/m", "messages": [{"role": "user", "content": "hi"}], "conversation_id": "limits"}
).encode()


def connect(gw: GatewayProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gw.port), timeout=5)


def head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: gateway", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket, timeout: float = 5.0) -> tuple[int, dict[str, str], dict]:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        assert part, f"connection closed before a response: {data!r}"
        data += part
    raw_head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        part = sock.recv(65536)
        if not part:
            break
        rest += part
    return int(status_line.split()[1]), headers, json.loads(rest[:length])


def dribble_until_answered(sock: socket.socket, body: bytes, every: float, limit: float) -> float:
    """Send one byte of `body` every `every` seconds until the server answers; return when."""
    started = time.monotonic()
    for byte in body:
        if select.select([sock], [], [], every)[0]:
            break
        if time.monotonic() - started > limit:
            break
        sock.sendall(bytes([byte]))
    select.select([sock], [], [], limit)
    return time.monotonic() - started


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/conversations"])
def test_slow_body_gets_408_after_body_timeout(gw: GatewayProcess, fault: FaultServer, path: str) -> None:
    with connect(gw) as sock:
        sock.sendall(head(path, {"Content-Length": str(len(BODY))}))
        started = time.monotonic()
        elapsed = dribble_until_answered(sock, BODY, every=0.1, limit=5.0)
        status, headers, payload = read_response(sock)
    assert status == 408, payload
    assert 0.9 <= elapsed < 2.5, elapsed  # body_timeout = 1 s
    assert time.monotonic() - started < 3.0
    assert payload["error"]["code"] == "request_timeout"
    assert "body_timeout" in payload["error"]["message"]
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert fault.requests == []  # nothing reached the provider


def test_headers_without_a_body_get_408(gw: GatewayProcess, fault: FaultServer) -> None:
    with connect(gw) as sock:
        sock.sendall(head("/v1/chat/completions", {"Content-Length": "100"}))
        started = time.monotonic()
        status, _, payload = read_response(sock)
    assert status == 408 and payload["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < 2.5


def test_declared_50_mb_body_gets_413_without_being_read(gw: GatewayProcess, fault: FaultServer) -> None:
    with connect(gw) as sock:
        started = time.monotonic()
        sock.sendall(head("/v1/chat/completions", {"Content-Length": str(50_000_000)}) + b'{"model"')
        status, _, payload = read_response(sock)
        elapsed = time.monotonic() - started
    assert status == 413, payload
    assert payload["error"]["code"] == "request_too_large"
    assert elapsed < 1.0  # answered at once, not after waiting for (or timing out on) 50 MB


def test_chunked_body_over_the_limit_gets_413(gw: GatewayProcess, fault: FaultServer) -> None:
    piece = b"x" * 65536
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    sent = 0
    with connect(gw) as sock:
        sock.sendall(head("/v1/chat/completions", {"Transfer-Encoding": "chunked"}))
        # 4 MB offered, 1 MB allowed: the answer comes once the limit is crossed.
        while sent < 4_000_000 and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        status, _, payload = read_response(sock)
    assert status == 413 and payload["error"]["code"] == "request_too_large"


def test_client_leaving_mid_body_is_not_a_server_error(gw: GatewayProcess, fault: FaultServer) -> None:
    before = gw.log()
    for _ in range(3):
        with connect(gw) as sock:
            sock.sendall(head("/v1/chat/completions", {"Content-Length": str(len(BODY))}) + BODY[:10])
            time.sleep(0.05)
    time.sleep(0.2)
    new_log = gw.log()[len(before) :]
    assert "unhandled error" not in new_log and "Traceback" not in new_log, new_log
    with connect(gw) as sock:  # still serving
        sock.sendall(head("/v1/chat/completions", {"Content-Length": str(len(BODY))}) + BODY)
        status, _, _ = read_response(sock)
    assert status == 200


def wait_closed(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Read until the server closes; return (seconds, bytes received)."""
    started = time.monotonic()
    sock.settimeout(limit)
    data = b""
    while True:
        part = sock.recv(65536)
        if not part:
            return time.monotonic() - started, data
        data += part


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Le"],
    ids=["silent", "partial"],
)
def test_a_stalled_request_head_gets_408_and_is_closed(
    gw: GatewayProcess, fault: FaultServer, sent: bytes
) -> None:
    """Slowloris: a client that connects and sends nothing, or part of a header block, does not
    keep its connection: 408 and close after body_timeout (1 s here)."""
    with connect(gw) as sock:
        sock.sendall(sent)
        elapsed, data = wait_closed(sock, limit=5.0)
    assert 0.9 <= elapsed < 2.5, elapsed
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    assert fault.requests == []


def test_a_kept_alive_connection_that_stalls_mid_head_is_closed(
    gw: GatewayProcess, fault: FaultServer
) -> None:
    with connect(gw) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        status, _, _ = read_response(sock)
        assert status == 200
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")
        elapsed, data = wait_closed(sock, limit=5.0)
    assert elapsed < 2.5 and data.startswith(b"HTTP/1.1 408 ")


def test_a_slow_but_steady_client_within_the_deadline_is_served(
    gw: GatewayProcess, fault: FaultServer
) -> None:
    with connect(gw) as sock:
        for piece in (b"GET /healthz HTTP/1.1\r\n", b"Host: gateway\r\n", b"\r\n"):
            sock.sendall(piece)
            time.sleep(0.25)
        status, _, payload = read_response(sock)
    assert status == 200 and payload == {"status": "ok"}


@pytest.mark.parametrize("case", ["slow body", "declared too large"])
def test_a_body_refused_unread_closes_the_connection(
    gw: GatewayProcess, fault: FaultServer, case: str
) -> None:
    """408 for a body that did not arrive in time, 413 for one declared too large: the rest of
    that body may still come, so the connection is closed (`connection: close`) instead of
    reading the client's next request as the end of this body."""
    length = "100" if case == "slow body" else str(50_000_000)
    with connect(gw) as sock:
        sock.sendall(head("/v1/chat/completions", {"Content-Length": length}) + b'{"model":')
        status, headers, _ = read_response(sock)
        assert status == (408 if case == "slow body" else 413)
        assert headers.get("connection") == "close"
        elapsed, rest = wait_closed(sock, limit=3.0)
    assert rest == b"" and elapsed < 1.0


@pytest.mark.parametrize(
    "raw",
    [
        b"\x16\x03\x01 not http\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    ],
    ids=["not HTTP", "Content-Length not a number", "under /v1/messages: Anthropic's shape"],
)
def test_a_request_the_parser_refuses_gets_a_json_400_and_a_json_log_line(
    gw: GatewayProcess, fault: FaultServer, raw: bytes
) -> None:
    before = len(gw.log())
    with connect(gw) as sock:
        sock.sendall(raw)
        status, headers, payload = read_response(sock)
        assert sock.recv(1) == b""  # and the connection is closed
    assert status == 400 and headers["content-type"] == "application/json"
    assert payload["error"]["type"] == "invalid_request_error"
    if b"/v1/messages" in raw:
        assert payload["type"] == "error" and "Invalid HTTP request" in payload["error"]["message"]
        assert payload["request_id"].startswith("req_") and headers["request-id"] == payload["request_id"]
    else:
        assert payload["error"]["code"] == "invalid_http_request"
    time.sleep(0.2)
    lines = gw.log()[before:].splitlines()
    assert lines and all(line.startswith("{") for line in lines), lines
    logged = [json.loads(line) for line in lines]
    assert [(e["route"], e["status"]) for e in logged] == [("unparsable", 400)]
    with connect(gw) as sock:  # and it is counted as every request is
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: g\r\nConnection: close\r\n\r\n")
        text = b""
        while chunk := sock.recv(65536):
            text += chunk
    assert 'gateway_requests_total{route="unparsable",status="400"}' in text.decode()


@pytest.mark.parametrize("how", ["one read", "many reads", "request line"])
def test_a_request_head_over_64_kib_is_refused_before_it_is_read_whole(
    gw: GatewayProcess, fault: FaultServer, how: str
) -> None:
    """Headers had no size limit and came before the key was checked: 1.5 GB of them were read
    into memory, and a 70 KB one was answered."""
    header = b"X-Filler: " + b"a" * 70_000 + b"\r\n"
    start = b"GET /healthz HTTP/1.1\r\nHost: g\r\n"
    with connect(gw) as sock:
        if how == "one read":
            sock.sendall(start + header + b"\r\n")
        elif how == "request line":
            sock.sendall(b"GET /v1/models?after=" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: g\r\n\r\n")
        else:  # a head that never ends, sent in small pieces: refused once 64 KiB came
            sock.sendall(start)
            try:
                for _ in range(200):
                    sock.sendall(b"X-More: " + b"b" * 1000 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
        status, headers, payload = read_response(sock)
    assert status == 431 and payload["error"]["code"] == "request_header_too_large"
    with connect(gw) as sock:  # and the gateway goes on
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: g\r\nX-Small: " + b"c" * 10_000 + b"\r\n\r\n")
        status, _, _ = read_response(sock)
    assert status == 200
