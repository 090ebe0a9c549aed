"""Gateway keys and tenants: each key is a tenant, and tenants never see each other's data.

A tenant is named by a hash of its key (never the key itself), and its conversations live in
their own folder, so the same conversation id under two keys names two conversations.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.config import Settings, env_name_said
from gateway.exceptions import AuthenticationError, ConfigError, CrossOriginRefused
from gateway.redact import keep_secret

DEFAULT_TENANT = ""  # auth off: everything lives at the top of the data dir
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/openapi.json"})


def tenant_id(key: str) -> str:
    return "t" + hashlib.sha256(key.encode()).hexdigest()[:16]


class Tenants:
    def __init__(self, keys: list[str]) -> None:
        self._by_key = {key: tenant_id(key) for key in keys if key}

    @classmethod
    def from_settings(cls, settings: Settings, environ: Mapping[str, str] | None = None) -> Tenants:
        environ = os.environ if environ is None else environ
        name = settings.auth.keys_env
        raw = environ.get(name, "") if name else ""
        keys = [k.strip() for k in raw.split(",") if k.strip()]
        if name and not keys:
            # A typo in the name or a forgotten export must not serve every tenant's data open.
            state = "is not set" if name not in environ else "holds no keys"
            said = env_name_said(name)
            raise ConfigError(
                f"auth.keys_env names {said or 'a variable'}, which {state}: the gateway would be open "
                f'to anyone (set {said or "it"} to comma-separated keys, or set auth.keys_env to "" '
                "for an open gateway)"
            )
        for key in keys:
            keep_secret(key)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._by_key)

    def tenant_of(self, key: str) -> str:
        """The tenant of one of the keys."""
        return self._by_key[key]

    @property
    def a_key(self) -> str | None:
        """One of the keys (the first configured), for a client in this process (`gateway demo`)."""
        return next(iter(self._by_key), None)

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> str:
        """The tenant for an `Authorization: Bearer KEY` header, else an `x-api-key: KEY` header.

        Anthropic's clients send the latter. Otherwise a 401.
        """
        if not self.enabled:
            return DEFAULT_TENANT
        if authorization and authorization.lower().startswith("bearer "):
            presented = authorization[7:].strip()
        elif api_key:
            presented = api_key.strip()
        else:
            raise AuthenticationError(
                "Missing gateway key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')"
            )
        for key, tenant in self._by_key.items():
            if hmac.compare_digest(key.encode(), presented.encode()):
                return tenant
        raise AuthenticationError("Invalid gateway key")


class AuthMiddleware:
    """Pure ASGI: resolves the tenant before anything else runs, or answers 401."""

    def __init__(self, app: ASGIApp, tenants: Tenants, loopback: bool = False) -> None:
        self.app = app
        self.tenants = tenants
        # Open and listening on this machine only: names other than its own are refused.
        self.loopback = loopback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        # The inspector's page and assets hold no data; its /ui/api/ calls carry the key.
        is_page = path in ("/ui", "/ui/") or path.startswith("/ui/static/")
        if not self.tenants.enabled:
            refused = self._cross_origin(scope)
            if refused is not None:
                from gateway.api.http import error_response_at

                await error_response_at(path, refused)(scope, receive, send)
                return
        if not self.tenants.enabled or path in OPEN_PATHS or is_page:
            scope["gateway.tenant"] = DEFAULT_TENANT
            await self.app(scope, receive, send)
            return
        header = api_key = None
        for name, value in scope["headers"]:
            if name == b"authorization" and header is None:
                header = value.decode("latin-1")
            elif name == b"x-api-key" and api_key is None:
                api_key = value.decode("latin-1")
        try:
            scope["gateway.tenant"] = self.tenants.authenticate(header, api_key)
        except AuthenticationError as exc:
            from gateway.api.http import error_response_at

            await error_response_at(path, exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _cross_origin(self, scope: Scope) -> CrossOriginRefused | None:
        """The refusal of a browser request from another site; None for any other request.

        An open gateway is open to its clients, not to every web page its user visits: a browser
        request from another site (its `Origin`; SDKs and curl send none) is refused. Listening on
        this machine only, only this machine's names are an origin of its own (a page of a DNS
        name rebound to 127.0.0.1 is same-origin to the browser).
        """
        headers = scope["headers"]
        raw = next((value for name, value in headers if name == b"origin"), None)
        if raw is None:  # not a browser's cross-site request
            return None
        origin = raw.decode("latin-1")
        host = next((value.decode("latin-1") for name, value in headers if name == b"host"), None)
        origin_host = urlsplit(origin).netloc if "://" in origin else origin
        if _is_local(_hostname(origin_host)) or (origin_host == host and not self.loopback):
            return None
        return CrossOriginRefused(
            f"Requests from web pages of other sites ({origin}) are refused: set [auth] keys to use "
            "the gateway from a browser"
        )


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _hostname(netloc: str) -> str:
    """`host` of `host:port`, `[::1]:port` or `host`."""
    if netloc.startswith("["):
        return netloc[1:].partition("]")[0]
    return netloc.rpartition(":")[0] if netloc.count(":") == 1 else netloc


def _is_local(hostname: str) -> bool:
    """Is `hostname` this machine: `localhost`, or a loopback address (127.0.0.0/8, ::1)?

    An address, not a name that begins like one: `127.0.0.1.attacker.example` is another site."""
    if hostname.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False
