"""Lists: the parameters every list endpoint reads, checked one way, and a page in OpenAI's list shape.

The parameters are `order`, `limit`, `after`; the shape is `object`, `data`, `first_id`,
`last_id`, `has_more`.

A parameter a list does not understand is a 400 naming it, never ignored: an `order` the list
does not take, a `limit` that is not an integer between 1 and the list's largest page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.context.items import Item
from gateway.exceptions import InvalidRequest, NotFound
from gateway.types import ascii_int

ORDERS = ("asc", "desc")
# Lists of conversations: most recently active first, the one order the stores page in.
NEWEST_FIRST = ("desc",)


@dataclass(frozen=True, slots=True)
class ListParams:
    """A list request's parameters, checked."""

    order: str
    limit: int
    after: str | None


def list_params(
    query: Mapping[str, str],
    *,
    orders: Sequence[str] = ORDERS,
    default_order: str = "desc",
    default_limit: int = 20,
    max_limit: int = 100,
) -> ListParams:
    """`order` (one of `orders`), `limit` (1 to `max_limit`) and `after` of a query string."""
    order = query.get("order", default_order)
    if order not in orders:
        either = " or ".join(f"'{o}'" for o in orders)
        raise InvalidRequest(f"'order' must be {either}", param="order")
    raw = query.get("limit")
    limit = default_limit if raw is None else ascii_int(raw)
    if limit is None or not 1 <= limit <= max_limit:
        raise InvalidRequest(f"'limit' must be an integer between 1 and {max_limit}", param="limit")
    return ListParams(order, limit, query.get("after") or None)


def page(data: list[Any], has_more: bool) -> dict[str, Any]:
    """A page of objects that have ids, in OpenAI's list shape."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def paginate(
    items: list[Item],
    params: ListParams,
    *,
    place: Callable[[str], tuple[int, ...] | None] | None = None,
) -> dict[str, Any]:
    """A page of `items` (oldest first).

    `place` gives an item id's place in that order, even for an item no longer listed: a page may
    go on after a cursor deleted since (the SDK's loop that lists items and deletes each one).
    """
    ascending = params.order == "asc"
    ordered = items if ascending else list(reversed(items))
    after = params.after
    if after:
        ids = [item["id"] for item in ordered]
        if after in ids:
            ordered = ordered[ids.index(after) + 1 :]
        else:
            cursor = place(after) if place is not None else None
            if place is None or cursor is None:
                raise NotFound(f"No item {after!r} in this list", param="after")
            kept = []
            for item in ordered:
                at = place(str(item["id"]))
                if at is not None and (at > cursor if ascending else at < cursor):
                    kept.append(item)
            ordered = kept
    return page(ordered[: params.limit], len(ordered) > params.limit)
