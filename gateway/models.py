"""Model facts: the context window a model really has, from config, else litellm's bundled
model map (read as JSON, without importing litellm), else a conservative default."""

from __future__ import annotations

import importlib.util
import logging
from functools import lru_cache
from pathlib import Path

import orjson

from gateway.config import Settings

DEFAULT_CONTEXT_WINDOW = 8192
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


def context_window(settings: Settings, model: str, provider: str, upstream_model: str) -> int:
    """Tokens the model accepts: explicit `max_context_tokens`, else `models."NAME"` config,
    else the provider's `context_window` (Ollama's runtime num_ctx), else litellm, else 8192."""
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
    known = litellm_context_window(model, f"{provider}/{upstream_model}", upstream_model)
    return known or DEFAULT_CONTEXT_WINDOW
