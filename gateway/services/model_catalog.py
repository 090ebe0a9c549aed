"""The models a client can ask for (`GET /v1/models`), named `provider/model` as requests route them.

The configured ones, the built-in demo model, and what each provider lists itself. Providers are
asked together, with a short timeout, and their answers kept for a minute.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from gateway.config import Settings
from gateway.upstream import Router

REFRESH_AFTER = 60.0


@dataclass(frozen=True, slots=True)
class ModelEntry:
    id: str
    owned_by: str


class ModelCatalog:
    """The models `GET /v1/models` lists, each provider's own listing kept for a minute."""

    def __init__(self, settings: Settings, router: Router) -> None:
        self.settings = settings
        self.router = router
        self._listed: dict[str, tuple[float, list[str]]] = {}

    async def models(self) -> list[ModelEntry]:
        out: dict[str, ModelEntry] = {}
        for name in self.settings.models:
            provider = name.partition("/")[0] if "/" in name else self.settings.default_provider
            out[name] = ModelEntry(name, provider)
        for name, provider_settings in self.settings.providers.items():
            if provider_settings.kind == "demo":
                out[name] = ModelEntry(name, "gateway")
        names = [
            n for n, p in self.settings.providers.items() if p.kind != "demo" and n in self.router.upstreams
        ]
        listed = await asyncio.gather(*(self._listing(n) for n in names))
        for provider, ids in zip(names, listed, strict=True):
            for model in ids:
                out.setdefault(f"{provider}/{model}", ModelEntry(f"{provider}/{model}", provider))
        return list(out.values())

    async def _listing(self, provider: str) -> list[str]:
        cached = self._listed.get(provider)
        if cached is not None and time.monotonic() - cached[0] < REFRESH_AFTER:
            return cached[1]
        ids = await self.router.upstreams[provider].list_models()
        self._listed[provider] = (time.monotonic(), ids)
        return ids
