"""The secrets this process holds (provider keys, gateway keys), kept out of everything it says.

What it says: error messages (to clients, and in response logs) and log lines.

A provider may quote the key it was sent in its error ("Incorrect API key provided: Bearer
sk-…"), and a library may put it in an exception's text; the gateway knows each value, so it
replaces it wherever it would pass such text on.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import parse_qsl, unquote, urlsplit

REDACTED = "[redacted]"
# Shorter values are not treated as secrets: replacing them would mangle ordinary text.
MIN_SECRET_CHARS = 6
# Header names whose values are secrets (a provider's `headers` may carry its key).
_SECRET_HEADER_WORDS = ("auth", "key", "token", "secret", "cookie")

_secrets: tuple[str, ...] = ()


def keep_secret(value: str | None) -> None:
    """From now on, `redact` replaces `value`.

    Longest first: a key inside another is not left half shown.
    """
    global _secrets
    if value is None:
        return
    value = value.strip()
    if len(value) < MIN_SECRET_CHARS or value in _secrets:
        return
    _secrets = tuple(sorted((*_secrets, value), key=len, reverse=True))


def keep_password(password: str | None) -> None:
    """A password from a URL: as written there and percent-decoded (a library may quote either)."""
    keep_secret(password)
    if password:
        keep_secret(unquote(password))


def names_a_secret(name: str) -> bool:
    """Does a header or query parameter of this name carry a credential?"""
    return any(word in name.lower() for word in _SECRET_HEADER_WORDS)


def keep_secret_headers(headers: dict[str, str]) -> None:
    """The values of headers that carry credentials (by their names)."""
    for name, value in headers.items():
        if names_a_secret(name):
            keep_secret(value.removeprefix("Bearer ").removeprefix("bearer "))


def keep_url_secrets(url: str) -> None:
    """Keep the credentials a provider URL may carry out of what this process says.

    They are a `user:password@` and query values whose names say they are keys (`?api-key=`,
    `?token=`).
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return
    keep_password(password)
    for name, value in parse_qsl(parts.query):
        if names_a_secret(name):
            keep_secret(value)


def redact(text: str) -> str:
    """`text` with every secret this process holds replaced by REDACTED."""
    for secret in _secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


_KEYWORD_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S*)", re.IGNORECASE)


def dsn_password(dsn: str) -> str | None:
    """The password a DSN holds, to be kept out of every message; None when it has none.

    A URI's, even with an unescaped `/` in it, or a libpq keyword/value DSN's.
    """
    if "://" not in dsn:
        found = _KEYWORD_PASSWORD.search(dsn)
        return found.group(2).strip("'") if found and found.group(2) else None
    _, userinfo, _ = _dsn_uri(dsn)
    return userinfo.partition(":")[2] or None


def redact_dsn(dsn: str) -> str:
    """The DSN without its password, for messages."""
    if "://" not in dsn:  # libpq keyword/value form: host=... password=...
        return _KEYWORD_PASSWORD.sub(lambda m: m.group(1) + "***", dsn)
    scheme, userinfo, hostpart = _dsn_uri(dsn)
    user = f"{userinfo.partition(':')[0]}@" if userinfo else ""
    return f"{scheme}://{user}{hostpart}"


def _dsn_uri(dsn: str) -> tuple[str, str, str]:
    """(scheme, `user:password` or "", host and path) of a URI DSN, its query left out.

    The userinfo ends at the last `@`: a password may hold an unescaped `/`.
    """
    scheme, _, rest = dsn.partition("://")
    userinfo, _, hostpart = rest.split("?", 1)[0].rpartition("@")
    return scheme, userinfo, hostpart


class RedactingFormatter(logging.Formatter):
    """Log lines with the process's secrets replaced.

    A last line of defence: an exception's text logged as it is.
    """

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        return redact(line) if _secrets else line
