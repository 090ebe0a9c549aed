"""Identifiers: conversation id validation and minted, model-slugged response ids.

Both end up as file names, so both are checked against strict patterns here and nowhere else.
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import threading

from gateway.exceptions import InvalidRequest

CONVERSATION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
RESPONSE_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,100}-[0-9a-f]{12}")
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_SLUG = 80


def is_valid_conversation_id(value: object) -> bool:
    return isinstance(value, str) and CONVERSATION_ID_RE.fullmatch(value) is not None


def check_conversation_id(value: object, *, param: str = "conversation_id") -> str:
    """Return the id if it matches the pattern, else raise a 400 naming the parameter."""
    if not is_valid_conversation_id(value):
        shown = repr(value)[:60]
        raise InvalidRequest(
            f"Invalid {param} {shown}: it must match ^[A-Za-z0-9][A-Za-z0-9_.-]{{0,127}}$",
            param=param,
            code="invalid_conversation_id",
        )
    return value  # type: ignore[return-value]


@functools.lru_cache(maxsize=256)
def model_slug(model: str) -> str:
    """The model name with every character outside [A-Za-z0-9._-] replaced by '-'."""
    slug = _SLUG_UNSAFE.sub("-", model)[:MAX_SLUG]
    # A leading dot would make the response file hidden (or look like "..").
    return re.sub(r"^\.+", lambda m: "-" * len(m.group()), slug) or "model"


class _RandomPool:
    """Random bytes from the OS fetched 4 KiB at a time.

    One getrandom() per 680 ids instead of one each (a system call that also hands the GIL to
    whichever thread waits for it).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = b""
        self._at = 0

    def take(self, n: int) -> bytes:
        with self._lock:
            if self._at + n > len(self._data):
                self._data, self._at = secrets.token_bytes(4096), 0
            out = self._data[self._at : self._at + n]
            self._at += n
            return out


_POOL = _RandomPool()
# A forked worker must not mint the ids its parent's leftover bytes would give.
os.register_at_fork(after_in_child=lambda: setattr(_POOL, "_data", b""))


def mint_response_id(model: str) -> str:
    """A new `{model-slug}-{12 hex}` response id."""
    return f"{model_slug(model)}-{_POOL.take(6).hex()}"


def is_valid_response_id(value: object) -> bool:
    return (
        isinstance(value, str) and RESPONSE_ID_RE.fullmatch(value) is not None and not value.startswith(".")
    )


def is_valid_side_key(value: object) -> bool:
    """A side log's key: a conversation id, or a response id (side logs kept per response)."""
    return is_valid_conversation_id(value) or is_valid_response_id(value)


def check_side_key(value: object) -> str:
    """Return the key if it is one (`is_valid_side_key`), else raise a 400 naming `key`."""
    if is_valid_side_key(value):
        return value  # type: ignore[return-value]
    return check_conversation_id(value, param="key")  # (raises, with the pattern)
