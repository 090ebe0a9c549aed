"""Model facts: the context window a model really has and how its tokenizer counts.

The window, per (provider, upstream model): configured (`max_context_tokens`, `models."NAME"`,
the provider's `context_window`) wins; else asked of the running server once (llama.cpp
`/props`, vLLM `max_model_len`, Ollama `/api/ps` and `/api/show`; asked again after a
refusal); else litellm's bundled model map (read as JSON, without importing litellm); else
8192. A provider's "prompt too long" refusal caps it with what the provider said.
Counting is calibrated from every answered prompt (provider `prompt_tokens` against our own
count) and persisted in the store's `models` side log, so a restart starts calibrated.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import orjson

from gateway.config import Settings
from gateway.context.calibration import EXACT, MAX_OBSERVATIONS, UNCALIBRATED, Calibration, fit
from gateway.exceptions import GatewayError, Refusal
from gateway.store.base import LRU, Store
from gateway.types import JSONObject
from gateway.upstream import Route
from gateway.upstream.base import ServerWindow

DEFAULT_CONTEXT_WINDOW = 8192
# A server that could not be asked is asked again after this long.
REASK_AFTER = 300.0
# Calibration is written to the store after this many new observations, at most once a
# SAVE_INTERVAL (and at once after a refusal); refitted every REFIT_EVERY once it has learned.
SAVE_EVERY = 8
SAVE_INTERVAL = 60.0
REFIT_EVERY = 8
# Without numbers in a refusal, the window shrinks by this factor (down to MIN_LEARNED_WINDOW).
SHRINK = 0.85
MIN_LEARNED_WINDOW = 256
# Models whose facts are kept in memory at once.
MAX_MODELS = 256
_EXACT_FAMILIES = re.compile(r"^(gpt-|o1|o3|o4|chatgpt-)")
log = logging.getLogger("gateway.models")


@lru_cache(maxsize=1)
def _litellm_windows() -> dict[str, int]:
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = Path(next(iter(spec.submodule_search_locations))) / "model_prices_and_context_window_backup.json"
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        log.warning("cannot read litellm's model map %s: %s", path, exc)
        return {}
    windows: dict[str, int] = {}
    for name, info in data.items():
        if not isinstance(info, dict):
            continue
        value = info.get("max_input_tokens") or info.get("max_tokens")
        if isinstance(value, int) and value > 0:
            windows[name] = value
    return windows


def litellm_context_window(*names: str) -> int | None:
    windows = _litellm_windows()
    for name in names:
        if name in windows:
            return windows[name]
    return None


def configured_window(settings: Settings, model: str, provider: str, upstream_model: str) -> int | None:
    """The window the configuration states: `max_context_tokens`, else `models."NAME"`, else
    the provider's `context_window`; None when it states none ("auto")."""
    explicit = settings.context.max_context_tokens
    if isinstance(explicit, int):
        return explicit
    for name in (model, f"{provider}/{upstream_model}"):
        facts = settings.models.get(name)
        if facts is not None and facts.context_window:
            return facts.context_window
    provider_settings = settings.providers.get(provider)
    if provider_settings is not None and provider_settings.context_window:
        return provider_settings.context_window
    return None


def side_key(provider: str, upstream_model: str) -> str:
    """A store key for a (provider, model) pair: `[A-Za-z0-9._-]`, at most 128 characters."""
    raw = re.sub(r"[^A-Za-z0-9._-]", "-", f"{provider}--{upstream_model}")
    return ("m" + raw)[:128]


@dataclass(frozen=True, slots=True)
class WindowFacts:
    """What a turn plans with: the window, where it came from, and the token calibration."""

    tokens: int
    source: str
    calibration: Calibration
    num_ctx_option: bool = False

    def to_dict(self) -> JSONObject:
        return {"tokens": self.tokens, "source": self.source, "calibration": self.calibration.to_dict()}


@dataclass(slots=True)
class _Entry:
    prior: Calibration
    observations: list[tuple[int, int]] = field(default_factory=list)
    calibration: Calibration | None = None
    learned: int | None = None  # a cap learned from a refusal or a silent truncation
    learned_from: str = ""
    server: ServerWindow | None = None
    asked_at: float | None = None
    asking: asyncio.Task[ServerWindow | None] | None = None
    loaded: bool = False
    unsaved: int = 0
    seen: int = 0
    saved_at: float | None = None
    urgent: bool = False


class ModelFacts:
    """Per-process facts about every (provider, upstream model) the gateway has talked to."""

    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        # Keyed by the model a client names: bounded, the least recently used dropped (its
        # calibration is saved in the store and read back if it comes again).
        self._entries: LRU[tuple[str, str], _Entry] = LRU(MAX_MODELS)

    def _entry(self, route: Route) -> _Entry:
        key = (route.provider, route.model)
        entry = self._entries.get(key)
        if entry is None:
            if not route.upstream.reports_real_usage:
                prior = Calibration()  # the demo model and test twins count as we do
            elif _EXACT_FAMILIES.match(route.model.lower()):
                prior = EXACT
            else:
                prior = UNCALIBRATED
            entry = self._entries[key] = _Entry(prior=prior)
        return entry

    def calibration(self, route: Route) -> Calibration:
        entry = self._entry(route)
        return entry.calibration or entry.prior

    async def window(self, route: Route, model: str, store: Store | None = None) -> WindowFacts:
        """The window to plan `model`'s next prompt with (asks the server when needed)."""
        entry = self._entry(route)
        if not entry.loaded and store is not None:
            await self._load(entry, route, store)
        configured = configured_window(self.settings, model, route.provider, route.model)
        server: ServerWindow | None = None
        if configured:
            tokens, source = configured, "config"
        else:
            server = await self._ask(entry, route)
            if server is not None:
                tokens, source = server.tokens, server.source
            else:
                known = litellm_context_window(model, f"{route.provider}/{route.model}", route.model)
                found = (known, "litellm model map") if known else (DEFAULT_CONTEXT_WINDOW, "default")
                tokens, source = found
        if entry.learned is not None and entry.learned < tokens:
            tokens, source = entry.learned, f"{entry.learned_from} (was {tokens} from {source})"
        return WindowFacts(
            tokens=tokens,
            source=source,
            calibration=entry.calibration or entry.prior,
            num_ctx_option=bool(server and server.num_ctx_option),
        )

    async def _ask(self, entry: _Entry, route: Route) -> ServerWindow | None:
        fresh = entry.asked_at is not None and self.clock() - entry.asked_at < REASK_AFTER
        if entry.asked_at is not None and (entry.server is not None or fresh):
            return entry.server
        if entry.asking is None or entry.asking.done():
            entry.asking = asyncio.ensure_future(self._describe(route))
        server = await asyncio.shield(entry.asking)
        entry.server, entry.asked_at = server, self.clock()
        if server is not None and entry.learned is not None and server.tokens <= entry.learned:
            entry.learned = None  # the server's own word replaces what a refusal suggested
        return server

    async def _describe(self, route: Route) -> ServerWindow | None:
        try:
            server = await route.upstream.describe(route.model)
        except Exception as exc:  # noqa: BLE001 - discovery is best effort; config or litellm apply
            log.warning("asking %s for %s's window failed: %r", route.provider, route.model, exc)
            return None
        if server is not None:
            log.info(
                orjson.dumps(
                    {
                        "event": "context_window_discovered",
                        "provider": route.provider,
                        "model": route.model,
                        "tokens": server.tokens,
                        "source": server.source,
                    }
                ).decode()
            )
        return server

    def observe(self, route: Route, ours: int, theirs: int) -> None:
        """A prompt we counted as `ours` was counted `theirs` by the provider."""
        entry = self._entry(route)
        if not route.upstream.reports_real_usage or ours <= 0 or theirs <= 0:
            return
        entry.observations.append((ours, theirs))
        del entry.observations[:-MAX_OBSERVATIONS]
        entry.unsaved += 1
        entry.seen += 1
        # Refitted at every prompt while it is learning, then every REFIT_EVERY prompts; a prompt
        # the fit undercounts is refitted at once (it would widen the margin).
        current = entry.calibration
        if (
            current is None
            or entry.seen <= MAX_OBSERVATIONS
            or entry.seen % REFIT_EVERY == 0
            or theirs > current.provider_tokens(ours)
        ):
            entry.calibration = fit(entry.observations, entry.prior)

    def refused(self, route: Route, ours: int, refusal: Refusal, window: int) -> None:
        """The provider refused a prompt we counted as `ours` while planning with `window`."""
        entry = self._entry(route)
        if refusal.prompt_tokens:
            self.observe(route, ours, refusal.prompt_tokens)
        learned = refusal.window or max(MIN_LEARNED_WINDOW, int(window * SHRINK))
        if learned < window or refusal.window:
            entry.learned, entry.learned_from = min(learned, window), "provider refusal"
        entry.server, entry.asked_at = None, None  # ask the server again
        entry.unsaved = max(entry.unsaved, SAVE_EVERY)
        entry.urgent = True

    def truncated(self, route: Route, theirs: int) -> None:
        """The provider answered having seen only `theirs` tokens of a longer prompt (Ollama's
        silent num_ctx cut): plan with no more than that from now on."""
        entry = self._entry(route)
        learned = max(MIN_LEARNED_WINDOW, theirs)
        if entry.learned is None or learned < entry.learned:
            entry.learned, entry.learned_from = learned, "silent truncation"
        entry.server, entry.asked_at = None, None

    async def save(self, route: Route, store: Store) -> None:
        """Persist the calibration when enough is new (a store failure only costs a recount)."""
        entry = self._entry(route)
        if entry.unsaved < SAVE_EVERY or not entry.observations:
            return
        if entry.saved_at is not None and self.clock() - entry.saved_at < SAVE_INTERVAL and not entry.urgent:
            return  # a cache: at most one write a minute under load, unless a refusal taught us
        entry.unsaved, entry.urgent, entry.saved_at = 0, False, self.clock()
        record = {
            "type": "calibration",
            "provider": route.provider,
            "model": route.model,
            "observations": [[ours, theirs] for ours, theirs in entry.observations],
            "calibration": (entry.calibration or entry.prior).to_dict(),
            "at": time.time(),
        }
        with contextlib.suppress(GatewayError, OSError):
            await store.append_side("models", side_key(route.provider, route.model), record)

    async def _load(self, entry: _Entry, route: Route, store: Store) -> None:
        entry.loaded = True
        try:
            records = await store.read_side("models", side_key(route.provider, route.model))
        except (GatewayError, OSError, ValueError) as exc:
            log.warning("cannot read the calibration of %s/%s: %s", route.provider, route.model, exc)
            return
        for record in reversed(records):
            observations = record.get("observations") if isinstance(record, dict) else None
            if isinstance(observations, list):
                pairs = [
                    (int(p[0]), int(p[1]))
                    for p in observations
                    if isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) for v in p)
                ]
                entry.observations = [*pairs, *entry.observations][-MAX_OBSERVATIONS:]
                if entry.observations and route.upstream.reports_real_usage:
                    entry.calibration = fit(entry.observations, entry.prior)
                return
