"""Identifiers: conversation id validation and minted, model-slugged response ids.

Both end up as file names, so both are checked against strict patterns here and nowhere else.
"""

from __future__ import annotations

import re
import secrets

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


def model_slug(model: str) -> str:
    """The model name with every character outside [A-Za-z0-9._-] replaced by '-'."""
    slug = _SLUG_UNSAFE.sub("-", model)[:MAX_SLUG]
    # A leading dot would make the response file hidden (or look like "..").
    return re.sub(r"^\.+", lambda m: "-" * len(m.group()), slug) or "model"


def mint_response_id(model: str) -> str:
    """A new `{model-slug}-{12 hex}` response id."""
    return f"{model_slug(model)}-{secrets.token_hex(6)}"


def is_valid_response_id(value: object) -> bool:
    return (
        isinstance(value, str) and RESPONSE_ID_RE.fullmatch(value) is not None and not value.startswith(".")
    )
