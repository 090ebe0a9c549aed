"""Providers by name, and routing a requested model to (provider, upstream model)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.config import ProviderSettings, Settings
from gateway.exceptions import NotFound
from gateway.upstream.base import Upstream

__all__ = ["Route", "Router", "Upstream", "build_upstream"]


def build_upstream(name: str, settings: ProviderSettings) -> Upstream:
    if settings.kind == "openai":
        from gateway.upstream.openai import OpenAIUpstream

        return OpenAIUpstream(name, settings)
    if settings.kind == "litellm":
        from gateway.upstream.litellm import LitellmUpstream

        return LitellmUpstream(name, settings)
    from gateway.upstream.demo import DemoUpstream

    return DemoUpstream(name)


@dataclass(frozen=True, slots=True)
class Route:
    provider: str
    upstream: Upstream
    model: str  # the provider's own model name


class Router:
    """The rule that routes a request's model name to a provider (a `Route`).

    `NAME/rest` goes to provider NAME as model `rest`; a bare provider name goes to that provider
    as-is (e.g. `demo`); anything else goes to `default_provider` unchanged.
    """

    def __init__(self, upstreams: dict[str, Upstream], default_provider: str) -> None:
        self.upstreams = upstreams
        self.default_provider = default_provider

    @classmethod
    def from_settings(cls, settings: Settings) -> Router:
        ups = {name: build_upstream(name, p) for name, p in settings.providers.items()}
        return cls(ups, settings.default_provider)

    def resolve(self, model: str) -> Route:
        prefix, sep, rest = model.partition("/")
        if sep and rest and prefix in self.upstreams:
            return Route(prefix, self.upstreams[prefix], rest)
        if model in self.upstreams:
            return Route(model, self.upstreams[model], model)
        if self.default_provider in self.upstreams:
            return Route(self.default_provider, self.upstreams[self.default_provider], model)
        raise NotFound(f"No provider for model {model!r}", param="model", code="model_not_found")

    async def aclose(self) -> None:
        for upstream in self.upstreams.values():
            await upstream.aclose()
