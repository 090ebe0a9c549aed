"""Compaction, the pure part: an item's reference, the summary message it stands for, what it covers.

A compaction item's `encrypted_content` is the gateway's own opaque reference, never the
summary: base64 of a version byte, the compaction's id (its record in the tenant's
`compactions` side log) and a secret whose SHA-256 the record keeps. It resolves only in the
store of the tenant that made it, and only with the secret, so a forged or altered reference,
or another tenant's, names nothing.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass

from gateway.context.history import ConversationView
from gateway.context.summary import SUMMARY_HEAD
from gateway.exceptions import InvalidRequest
from gateway.types import JSONObject, Message

_VERSION = 1
ID_BYTES = 12
SECRET_BYTES = 16
_ID_PREFIX = "cmp_"


@dataclass(frozen=True, slots=True)
class Reference:
    """What a compaction item's `encrypted_content` names: a compaction record and its secret."""

    compaction_id: str  # cmp_{24 hex}: the record's key in the `compactions` side log
    secret: bytes

    @classmethod
    def of(cls, random: bytes) -> Reference:
        """A new reference from `ID_BYTES + SECRET_BYTES` random bytes (the caller's)."""
        if len(random) != ID_BYTES + SECRET_BYTES:
            raise ValueError("a reference takes ID_BYTES + SECRET_BYTES random bytes")
        return cls(_ID_PREFIX + random[:ID_BYTES].hex(), random[ID_BYTES:])

    def encode(self) -> str:
        raw = bytes([_VERSION]) + bytes.fromhex(self.compaction_id.removeprefix(_ID_PREFIX)) + self.secret
        return base64.urlsafe_b64encode(raw).decode()

    @property
    def check(self) -> str:
        """What the record keeps of the secret (the secret itself is only in the reference)."""
        return hashlib.sha256(self.secret).hexdigest()

    def opens(self, record: JSONObject) -> bool:
        """Is `record` the compaction this reference names (its id, and the secret's check)?"""
        check = record.get("check")
        return (
            record.get("type") == "compaction"
            and record.get("id") == self.compaction_id
            and isinstance(check, str)
            and hmac.compare_digest(check, self.check)
        )


def read_reference(content: str) -> Reference | None:
    """The reference an `encrypted_content` holds; None when it is not one of the gateway's."""
    try:
        raw = base64.urlsafe_b64decode(content.encode("ascii"))
    except (ValueError, binascii.Error, UnicodeEncodeError):
        return None
    if len(raw) != 1 + ID_BYTES + SECRET_BYTES or raw[0] != _VERSION:
        return None
    return Reference(_ID_PREFIX + raw[1 : 1 + ID_BYTES].hex(), raw[1 + ID_BYTES :])


def unverified(content: str, param: str) -> InvalidRequest:
    """OpenAI's 400 for an `encrypted_content` that does not resolve (shown shortened, as theirs)."""
    shown = f"{content[:4]}...{content[-4:]}" if len(content) > 12 else content
    return InvalidRequest(
        f"The encrypted content {shown} could not be verified.", param=param, code="invalid_encrypted_content"
    )


def compaction_refs(items: object, param: str) -> list[tuple[str, str]]:
    """(where, encrypted_content) of each compaction item in a Responses `input`.

    An input that is a string has none. A compaction item without its `encrypted_content` is a 400.
    """
    if not isinstance(items, list):
        return []
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "compaction":
            where = f"{param}[{i}].encrypted_content"
            content = item.get("encrypted_content")
            if not isinstance(content, str) or not content:
                raise InvalidRequest(f"{where} must be a non-empty string", param=where)
            out.append((where, content))
    return out


def compaction_item(compaction_id: str, encrypted_content: str) -> JSONObject:
    """The `compaction` output item (OpenAI's `ResponseCompactionItem`)."""
    return {"type": "compaction", "id": compaction_id, "encrypted_content": encrypted_content}


def compaction_message(summary: str, item: JSONObject) -> Message:
    """The message a compaction item stands for: the summary as the rolling summary is sent.

    It is marked (`compaction`, a gateway field never sent) with the item it came from.
    """
    mark = {"id": item.get("id"), "encrypted_content": item.get("encrypted_content")}
    return {"role": "system", "content": f"{SUMMARY_HEAD}{summary}", "compaction": mark}


def whole_prompt_tokens(view: ConversationView, covered: int, summary_tokens: int, new_tokens: int) -> int:
    """Tokens of the conversation's prompt as it would be sent whole (`context_management`'s measure).

    The system prompt, the summary covering its first `covered` history messages, every stored
    message after them and the new input (token counts made: `view.count_tokens`).
    """
    system = sum(n or 0 for n in view.system_tokens or [])
    history = sum(n or 0 for n in view.history_tokens[view.loaded_from(covered) :])
    return system + summary_tokens + history + new_tokens


def compaction_target(view: ConversationView, covered: int) -> str | None:
    """The turn a compaction covers through, or None when nothing is left.

    A compaction covers every turn not yet covered but the newest, which stays as it is (the
    newest itself when it is the only one).
    """
    ends: dict[int, str] = {}
    for rid, end in view.history_end.items():  # (in history order)
        if end > covered:
            ends[end] = rid
    turns = list(ends.values())
    if not turns:
        return None
    return turns[-2] if len(turns) > 1 else turns[-1]
