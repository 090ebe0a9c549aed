"""The conversation inspector in a real browser: headless Chromium driven by Playwright,
against a real `gateway serve` with a few conversations. Screenshots: $GATEWAY_TEST_ARTIFACTS,
default {tmp}/gateway-test-artifacts/ (never in the work tree)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import GatewayProcess, write_config
from tests.mockserver import MockServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Outside the work tree: a test run leaves nothing in the checkout.
ARTIFACTS = Path(
    os.environ.get("GATEWAY_TEST_ARTIFACTS", Path(tempfile.gettempdir()) / "gateway-test-artifacts")
)
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

if CHROMIUM is None:  # .ci/run installs Debian's chromium; without it these tests cannot run
    pytest.skip("SKIPPED LOUDLY: no chromium binary (apt-get install chromium)", allow_module_level=True)
playwright = pytest.importorskip("playwright.sync_api", reason="SKIPPED LOUDLY: playwright is not installed")


@pytest.fixture
def inspector(tmp_path: Path, upstream: MockServer) -> Iterator[GatewayProcess]:
    config = write_config(
        tmp_path / "g.toml", upstream.url, extra='\n[models."mock/small"]\ncontext_window = 300\n'
    )
    proc = GatewayProcess(config, tmp_path / "var").start()
    yield proc
    proc.stop()


def chat(gw: GatewayProcess, cid: str, text: str, model: str = "mock/m", **extra: Any) -> dict[str, Any]:
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "conversation_id": cid,
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


VIEWPORT = {"width": 1200, "height": 900}


@pytest.fixture
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


def test_inspector_list_conversation_bar_and_live_update(inspector: GatewayProcess, browser: Any) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    chat(inspector, "alpha", "my name is Alice", user="u-alice")
    chat(inspector, "alpha", "what is my name?", user="u-alice")
    for i in range(10):
        chat(
            inspector,
            "tiny",
            f"turn {i}: a message that takes some room in a very small context window",
            model="mock/small",
        )
    page = browser.new_page(viewport=VIEWPORT, bypass_csp=True)  # (wait_for_function evaluates)
    page.goto(f"{inspector.url}/ui")
    page.wait_for_selector("tr.conv-row[data-id='tiny']")
    assert page.locator("tr.conv-row").count() == 2
    page.screenshot(path=str(ARTIFACTS / "inspector-list.png"), full_page=True)

    page.fill("#search", "alice")  # by user (and text): only alpha stays
    page.wait_for_function("document.querySelectorAll('tr.conv-row').length === 1")
    assert page.locator("tr.conv-row").first.get_attribute("data-id") == "alpha"
    page.fill("#search", "")
    page.wait_for_selector("tr.conv-row[data-id='tiny']")

    page.click("tr.conv-row[data-id='tiny']")
    page.wait_for_selector(".turn[data-response-id]")
    assert page.locator(".turn").count() == 10
    last = page.locator(".turn").last
    assert "turn 9" in last.inner_text()
    omitted = last.locator(".facts .omitted")
    assert omitted.count() == 1 and "earlier messages omitted" in omitted.inner_text()
    assert last.locator(".bar .seg-history").count() == 1 and last.locator(".bar .budget").count() == 1
    first = page.locator(".turn").first
    assert first.locator(".facts .omitted").count() == 0  # nothing omitted at the start
    last.locator("button.toggle-sent").click()
    sent = last.locator(".sent-list")
    assert sent.is_visible() and "earlier messages omitted" in sent.inner_text()
    page.screenshot(path=str(ARTIFACTS / "inspector-conversation.png"), full_page=True)

    # A new turn appears without a reload.
    chat(inspector, "tiny", "a live turn arrives", model="mock/small")
    page.wait_for_function("document.querySelectorAll('.turn').length === 11", timeout=10_000)
    assert "a live turn arrives" in page.locator(".turn").last.inner_text()
    page.screenshot(path=str(ARTIFACTS / "inspector-live.png"), full_page=True)


def test_inspector_disabled_and_behind_auth(tmp_path: Path, upstream: MockServer) -> None:
    config = write_config(tmp_path / "g.toml", upstream.url, extra="\n[ui]\nenabled = false\n")
    proc = GatewayProcess(config, tmp_path / "var").start()
    try:
        assert httpx.get(f"{proc.url}/ui").status_code == 404
        assert httpx.get(f"{proc.url}/ui/api/conversations").status_code == 404
    finally:
        proc.stop()
    config = write_config(tmp_path / "h.toml", upstream.url, extra='\n[auth]\nkeys_env = "UI_KEYS"\n')
    proc = GatewayProcess(config, tmp_path / "var2", env={"UI_KEYS": "k-ui"}).start()
    try:
        assert httpx.get(f"{proc.url}/ui").status_code == 200  # the page holds no data
        assert httpx.get(f"{proc.url}/ui/api/conversations").status_code == 401
        ok = httpx.get(f"{proc.url}/ui/api/conversations", headers={"Authorization": "Bearer k-ui"})
        assert ok.status_code == 200 and ok.json() == {"data": []}
    finally:
        proc.stop()


def test_inspector_shows_what_was_deleted(inspector: GatewayProcess, browser: Any) -> None:
    """A deleted item is struck through (no longer sent), with a line where it was deleted."""
    chat(inspector, "gone", "keep this question")
    chat(inspector, "gone", "delete this question")
    items = httpx.get(f"{inspector.url}/v1/conversations/gone/items", params={"order": "asc"}).json()["data"]
    item = next(i for i in items if "delete this" in str(i["content"]))
    assert httpx.delete(f"{inspector.url}/v1/conversations/gone/items/{item['id']}").status_code == 200
    api = httpx.get(f"{inspector.url}/ui/api/conversations/gone").json()
    assert [t.get("not_sent") for t in api["turns"] if "response_id" in t and "marker" not in t] == [[], [0]]
    assert api["turns"][-1]["marker"] == "delete_item"
    page = browser.new_page(viewport=VIEWPORT, bypass_csp=True)  # (wait_for_function evaluates)
    page.goto(f"{inspector.url}/ui#/c/gone")
    page.wait_for_selector(".msg.not-sent")
    assert "delete this question" in page.locator(".msg.not-sent").inner_text()
    assert page.locator(".msg.not-sent").count() == 1
    assert "deleted" in page.locator(".marker-reset").last.inner_text()


def test_inspector_live_view_follows_resets_deletions_and_edits(
    inspector: GatewayProcess, browser: Any
) -> None:
    """On an open conversation: a trailing reset line was added again on every poll; a deletion
    or an edit made meanwhile was never struck through until a reload; a deleted system prompt
    looked active; a malformed %-escape in the address threw and left another conversation on
    screen; the bar's "free" left out the overhead tokens the manifest's total holds."""
    system = {"role": "system", "content": "SYSTEM-PROMPT-TO-DELETE"}
    first = chat(inspector, "live", "hello", messages=[system, {"role": "user", "content": "hello"}])
    chat(inspector, "live", "please forget this line")
    page = browser.new_page(viewport=VIEWPORT, bypass_csp=True)  # (wait_for_function evaluates)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{inspector.url}/ui#/c/live")
    page.wait_for_function("document.querySelectorAll('.turn').length === 2")
    struck = "Array.from(document.querySelectorAll('.msg.not-sent')).map(m => m.textContent)"
    assert page.evaluate(struck) == []

    # A deletion made while the page is open is struck through without a reload.
    items = httpx.get(f"{inspector.url}/v1/conversations/live/items", params={"order": "asc"}).json()["data"]
    forget = next(i for i in items if "please forget" in str(i["content"]))
    assert httpx.delete(f"{inspector.url}/v1/conversations/live/items/{forget['id']}").status_code == 200
    page.wait_for_function(f"{struck}.some(t => t.includes('please forget this line'))", timeout=10_000)
    # So is the system prompt, once its item is deleted (the model no longer gets it).
    sys_item = next(i for i in items if i.get("role") == "system")
    assert httpx.delete(f"{inspector.url}/v1/conversations/live/items/{sys_item['id']}").status_code == 200
    page.wait_for_function(f"{struck}.some(t => t.includes('SYSTEM-PROMPT-TO-DELETE'))", timeout=10_000)

    # An edit (the history resent with the second question changed) strikes the branch it left.
    history = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "an edited question"},
    ]
    chat(inspector, "live", "", messages=history)
    page.wait_for_function("document.querySelectorAll('.turn').length === 3", timeout=10_000)

    # A trailing reset: one line, however many polls pass.
    assert httpx.post(f"{inspector.url}/v1/conversations/live/reset", json={}).status_code == 200
    page.wait_for_function("document.querySelectorAll('.marker-reset').length >= 3", timeout=10_000)
    markers = "Array.from(document.querySelectorAll('.marker-reset'))"
    resets = f"{markers}.filter(m => m.textContent.includes('reset')).length"
    page.wait_for_timeout(3_000)  # three polls
    assert page.evaluate(resets) == 1

    # The bar: used + free is the window, the overhead included.
    bar = page.locator(".turn").last.locator(".bar")
    title = bar.get_attribute("title") or ""
    total = page.locator(".turn").last.locator(".facts").inner_text().split("sent ")[1].split(" tokens")[0]
    assert title.startswith(f"{total} of ")

    # A malformed escape in the address: said, and the conversation no longer shown.
    page.goto(f"{inspector.url}/ui#/c/%E0%A4%A")
    said = "document.querySelector('#status').textContent.includes('Invalid conversation id')"
    page.wait_for_function(said)
    assert page.locator("#conversation-view").is_hidden()
    assert errors == []


def test_inspector_marks_where_each_branch_starts(inspector: GatewayProcess, browser: Any) -> None:
    """Abandoned turns were struck through, but nothing said where the client's version branched,
    nor whether it edited a message or had an answer regenerated."""
    first = chat(inspector, "forks", "first question")
    history = [{"role": "user", "content": "first question"}, first["choices"][0]["message"]]
    chat(inspector, "forks", "", messages=[*history, {"role": "user", "content": "second question"}])
    edited = chat(inspector, "forks", "", messages=[*history, {"role": "user", "content": "second, edited"}])
    history += [{"role": "user", "content": "second, edited"}, edited["choices"][0]["message"]]
    chat(inspector, "forks", "", messages=[*history, {"role": "user", "content": "third question"}])
    chat(inspector, "forks", "", messages=[*history, {"role": "user", "content": "third question"}])
    page = browser.new_page(viewport=VIEWPORT, bypass_csp=True)  # (wait_for_function evaluates)
    page.goto(f"{inspector.url}/ui#/c/forks")
    page.wait_for_function("document.querySelectorAll('.turn').length === 5")
    starts = page.locator(".msg.branch-start")
    assert starts.count() == 2
    assert "second, edited" in starts.nth(0).inner_text() and "third question" in starts.nth(1).inner_text()
    notes = page.locator(".branch-note").all_inner_texts()
    assert any(n.startswith("↪ edited") and "after message 2" in n for n in notes), notes
    assert any(n.startswith("↪ regenerated") and "after message 4" in n for n in notes), notes
    # Where each branch leaves the old line: the first message it left behind, struck through.
    points = page.locator(".msg.branch-point")
    assert points.count() == 2
    assert "second question" in points.nth(0).inner_text() and "not-sent" in (
        points.nth(0).get_attribute("class") or ""
    )
    assert "third question" in points.nth(1).inner_text()
    page.screenshot(path=str(ARTIFACTS / "inspector-branches.png"), full_page=True)


def test_inspector_marks_compactions(inspector: GatewayProcess, browser: Any) -> None:
    """Where a compaction happened (after the turn it covers through, also when it happens
    while the page is open), and the summary a compaction item sent back stands for."""
    url = f"{inspector.url}/v1/responses"
    manage = [{"type": "compaction", "compact_threshold": 40}]
    previous = None
    for text in ["my name is Bob", "my city is Oslo"]:
        body = {
            "model": "mock/m",
            "input": text,
            "previous_response_id": previous,
            "context_management": manage,
        }
        r = httpx.post(url, json=body)
        assert r.status_code == 200, r.text
        previous = r.json()["id"]
    cid = r.json()["conversation"]["id"]
    page = browser.new_page(viewport=VIEWPORT, bypass_csp=True)  # (wait_for_function evaluates)
    page.goto(f"{inspector.url}/ui#/c/{cid}")
    page.wait_for_function("document.querySelectorAll('.turn').length === 2")
    assert page.locator(".marker-compaction").count() == 0
    third = {
        "model": "mock/m",
        "input": "what is my name?",
        "previous_response_id": previous,
        "context_management": manage,
    }
    done = httpx.post(url, json=third).json()
    assert done["output"][0]["type"] == "compaction"
    page.wait_for_selector(".marker-compaction", timeout=10_000)
    assert "context_management" in page.locator(".marker-compaction").first.inner_text()
    # A compaction item sent back: its summary, marked, in a conversation of its own.
    # (it covers the turns before the newest: the name, not yet the city)
    back = {"model": "mock/m", "input": [done["output"][0], {"role": "user", "content": "what is my name?"}]}
    other = httpx.post(url, json=back).json()
    assert other["output"][0]["content"][0]["text"] == "Your name is Bob."
    page.goto(f"{inspector.url}/ui#/c/{other['conversation']['id']}")
    page.wait_for_selector(".msg.compaction")
    assert "compaction item" in page.locator(".msg.compaction").inner_text().lower()
    page.screenshot(path=str(ARTIFACTS / "inspector-compaction.png"), full_page=True)


# Answers for the conversation "slow" and for searches come 600 ms late: a later view is asked
# for before they arrive. Every conversation read is counted (`window.reads`).
LATE_ANSWERS = """
window.reads = [];
const ask = window.fetch;
window.fetch = async (url, options) => {
  const u = String(url);
  if (u.includes("/ui/api/conversations/")) window.reads.push(u);
  const late = u.includes("/ui/api/conversations/slow") || u.includes("q=");
  if (late) await new Promise(r => setTimeout(r, 600));
  return ask(url, options);
};
"""


def test_inspector_shows_the_latest_view_asked_for(inspector: GatewayProcess, browser: Any) -> None:
    """A conversation opened while another one was loading showed the other's turns under its
    title, for good, and left a poll running once a second on every view after (the list
    included); a search cleared while it ran left its results; a poll that succeeded after a
    failure left the error said. The page also carries the headers that keep it to itself."""
    chat(inspector, "slow", "the slow conversation speaks")
    chat(inspector, "fast", "the fast conversation speaks")
    for i in range(3):
        chat(inspector, f"other-{i}", "nothing to find here")
    page = browser.new_page(viewport=VIEWPORT)
    blocked: list[str] = []
    page.on("console", lambda m: blocked.append(m.text) if "Content Security Policy" in m.text else None)
    page.add_init_script(LATE_ANSWERS)
    response = page.goto(f"{inspector.url}/ui#/c/slow")
    assert response is not None
    headers = response.headers
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"
    page.evaluate("location.hash = '#/c/fast'")
    page.wait_for_timeout(1500)  # the slow answer has come meanwhile
    assert page.locator("#conversation-head h1").inner_text() == "fast"
    assert "the fast conversation speaks" in page.locator("#turns").inner_text()
    assert "slow" not in page.locator("#turns").inner_text()
    assert page.locator("#status").inner_text() == "live"

    page.evaluate("location.hash = '#/'")
    page.wait_for_selector("tr.conv-row[data-id='fast']")
    reads = page.evaluate("window.reads.length")
    page.wait_for_timeout(2500)
    assert page.evaluate("window.reads.length") == reads  # no poll left running on the list

    page.fill("#search", "slow conversation")  # (its answer is late)
    page.wait_for_timeout(300)
    page.fill("#search", "")
    page.wait_for_timeout(1500)
    assert page.locator("tr.conv-row").count() == 5
    assert blocked == []
