"""Every list endpoint reads its parameters one way: an `order` it does not know, or a `limit`
that is not an integer in its range, is a 400 in OpenAI's error shape (never ignored)."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import say_each

CID = "listed"
# Each list, with the orders it takes and its largest page.
LISTS = {
    "conversations": ("/v1/conversations", ("desc",), 100),
    "items": (f"/v1/conversations/{CID}/items", ("asc", "desc"), 100),
    "input items": ("/v1/responses/{rid}/input_items", ("asc", "desc"), 100),
    "stored chat completions": ("/v1/chat/completions", ("asc", "desc"), 100),
    "stored messages": ("/v1/chat/completions/{rid}/messages", ("asc", "desc"), 100),
    "inspector": ("/ui/api/conversations", ("desc",), 200),
}
BAD = {
    "an unknown order": {"order": "sideways"},
    "an empty order": {"order": ""},
    "a negative limit": {"limit": "-1"},
    "a limit that is no number": {"limit": "abc"},
    "a zero limit": {"limit": "0"},
    "a fractional limit": {"limit": "1.5"},
    "an empty limit": {"limit": ""},
    "a huge limit": {"limit": "9" * 40},
}


async def _path(client: httpx.AsyncClient, path: str) -> str:
    [rid] = await say_each(client, CID, ["hello"])
    return path.format(rid=rid)


@pytest.mark.parametrize("query", BAD.values(), ids=list(BAD))
@pytest.mark.parametrize("name", list(LISTS))
async def test_a_meaningless_list_parameter_is_a_400(
    app_client: httpx.AsyncClient, name: str, query: dict[str, str]
) -> None:
    path = await _path(app_client, LISTS[name][0])
    r = await app_client.get(path, params=query)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == next(iter(query)), error


@pytest.mark.parametrize("name", list(LISTS))
async def test_a_limit_past_the_largest_page_is_a_400(app_client: httpx.AsyncClient, name: str) -> None:
    path, _, largest = LISTS[name]
    path = await _path(app_client, path)
    assert (await app_client.get(path, params={"limit": str(largest)})).status_code == 200
    r = await app_client.get(path, params={"limit": str(largest + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
    assert str(largest) in r.json()["error"]["message"]


@pytest.mark.parametrize("name", list(LISTS))
async def test_the_orders_a_list_knows_are_taken(app_client: httpx.AsyncClient, name: str) -> None:
    path, orders, _ = LISTS[name]
    path = await _path(app_client, path)
    for order in orders:
        r = await app_client.get(path, params={"order": order, "limit": "1"})
        assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
    for order in {"asc", "desc"} - set(orders):  # said, not ignored
        r = await app_client.get(path, params={"order": order})
        assert r.status_code == 400 and "desc" in r.json()["error"]["message"], r.text
