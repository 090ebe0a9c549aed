"""Configuration: a TOML file, `GATEWAY_<SECTION>__<KEY>` environment overrides, command-line flags.

Precedence: flag > environment > file > built-in default. Validation errors become one
`ConfigError` line that names the offending key.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from gateway.exceptions import ConfigError

ENV_PREFIX = "GATEWAY_"
DEFAULT_CONFIG_PATH = "config/gateway.toml"
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_TYPE_LABEL = re.compile(r"^(int|float|str|bool|none|dict\[.*\]|list\[.*\]|literal\[.*\]|function-.*)$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as "90s", "30m", "24h", "7d"; "0" disables."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or a string like '30m'")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError("a duration must be a finite, non-negative number of seconds")
        return float(value)
    if isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match:
            return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    raise ValueError(f"invalid duration {value!r}: use seconds or a unit, e.g. '90s', '30m', '24h'")


Duration = Annotated[float, BeforeValidator(parse_duration)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(10_000_000, gt=0)
    # Seconds a client may take to send its whole request body ("0" = no limit); then 408.
    body_timeout: Duration = 30.0
    access_log: bool = False


class StorageSettings(_Section):
    backend: Literal["jsonl", "memory", "postgres"] = "jsonl"
    data_dir: str = "var"
    durability: Literal["fsync", "none"] = "fsync"
    dsn: str = ""
    lock_timeout: Duration = 30.0
    archive_deleted: bool = False
    cache_conversations: int = Field(1024, ge=0)
    max_conversation_messages: int = Field(100_000, ge=0)

    def model_post_init(self, _context: Any) -> None:
        if self.backend == "postgres" and not self.dsn.strip():
            raise ConfigError(
                'config error: storage.dsn: required when storage.backend = "postgres" '
                '(e.g. dsn = "postgresql://gateway@127.0.0.1:5432/gateway", or GATEWAY_STORAGE__DSN)'
            )


class ContextSettings(_Section):
    max_context_tokens: int | Literal["auto"] = "auto"
    reserve_tokens: int = Field(4500, ge=0)
    max_history_messages: int = Field(200, ge=0)
    # The newest history messages kept even past max_history_messages (whole tool-call units),
    # before any summary or recap: the answer the newest question replies to survives.
    keep_recent_messages: int = Field(2, ge=0)
    # Keep the conversation's first message (and its tool results) when cutting: for clients
    # that send no system prompt and put their instructions in the first user message.
    keep_first: bool = False
    strategy: Literal["truncate", "summarize"] = "truncate"
    summary_model: str = ""
    summary_max_tokens: int = Field(500, gt=0)


class SessionsSettings(_Section):
    ttl: Duration = 0.0
    idle_after: Duration = 900.0
    lease: Duration = Field(900.0, gt=0, le=1800)  # processing lease; never more than 30 min
    max_attempts: int = Field(3, ge=1)
    recap: bool = False  # opt-in: `user` is often one shared value (abuse monitoring)
    recap_max_tokens: int = Field(300, gt=0)
    default_timezone: str = "UTC"


class UISettings(_Section):
    enabled: bool = True


class AuthSettings(_Section):
    keys_env: str = ""


class ProviderSettings(_Section):
    kind: Literal["openai", "litellm", "demo"]
    base_url: str = ""
    api_key_env: str = ""
    timeout: Duration = 600.0
    connect_timeout: Duration = 10.0
    # Extra attempts after a connection failure or a 502/503/504, only before any byte of the
    # answer has reached the client (never after a stream started; 429 is passed through).
    retries: int = Field(1, ge=0, le=10)
    context_window: int | None = Field(None, gt=0)
    # The largest answer read from the provider (a stream counts every byte); past it: 502.
    max_response_bytes: int = Field(32_000_000, gt=0)
    # litellm only: the litellm provider prefix (defaults to the provider's own name).
    litellm_provider: str = ""
    headers: dict[str, str] = Field(default_factory=dict)


class ModelSettings(_Section):
    context_window: int | None = Field(None, gt=0)


def _default_providers() -> dict[str, ProviderSettings]:
    return {"demo": ProviderSettings(kind="demo")}


class Settings(_Section):
    default_provider: str = "demo"
    server: ServerSettings = ServerSettings()
    storage: StorageSettings = StorageSettings()
    context: ContextSettings = ContextSettings()
    sessions: SessionsSettings = SessionsSettings()
    auth: AuthSettings = AuthSettings()
    ui: UISettings = UISettings()
    providers: dict[str, ProviderSettings] = Field(default_factory=_default_providers)
    models: dict[str, ModelSettings] = Field(default_factory=dict)

    def model_post_init(self, _context: Any) -> None:
        if self.default_provider and self.default_provider not in self.providers:
            raise ConfigError(
                f"config error: default_provider: {self.default_provider!r} is not a configured "
                f"provider (configured: {', '.join(sorted(self.providers)) or 'none'})"
            )

    @property
    def data_path(self) -> Path:
        return Path(self.storage.data_dir)


def _parse_env_value(raw: str) -> Any:
    """Env values stay strings (pydantic converts "9090" or "true" where the key wants it);
    only TOML arrays and inline tables (`[...]`, `{...}`) are parsed, for list/table keys."""
    if raw.lstrip().startswith(("[", "{")):
        try:
            return tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            return raw
    return raw


def _set_path(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """`GATEWAY_STORAGE__DATA_DIR=/srv` -> {"storage": {"data_dir": "/srv"}}."""
    data: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name == "GATEWAY_CONFIG":
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX) :].split("__") if p]
        if not path:
            continue
        _set_path(data, path, _parse_env_value(raw))
    return data


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _format_validation_error(exc: ValidationError, source: str) -> str:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    # Union errors end with pydantic's member label ("int", "literal['auto']"): not part of the key.
    while loc and _TYPE_LABEL.match(loc[-1]):
        loc.pop()
    key = ".".join(loc) or "(root)"
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    got = err.get("input")
    shown = "" if isinstance(got, dict) or err["type"] == "missing" else f" (got {got!r})"
    more = f" (+{len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"config error: {key}: {msg}{shown}{more} [{source}]"


def _fix_env_provider_keys(file_data: dict[str, Any], env_data: dict[str, Any]) -> None:
    # Env var names cannot hold '/', '.' or '-': match them case-insensitively against the file.
    for section in ("providers", "models"):
        env_section = env_data.get(section)
        if not isinstance(env_section, dict):
            continue
        known = {re.sub(r"[^a-z0-9]", "_", k.lower()): k for k in file_data.get(section, {})}
        for key in list(env_section):
            norm = re.sub(r"[^a-z0-9]", "_", key.lower())
            if norm in known and known[norm] != key:
                env_section[known[norm]] = env_section.pop(key)


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Read the TOML file, apply env overrides then explicit overrides, validate.

    `path=None` means `$GATEWAY_CONFIG`, else `config/gateway.toml` if it exists, else defaults.
    """
    environ = os.environ if environ is None else environ
    explicit = path is not None or "GATEWAY_CONFIG" in environ
    config_path = Path(path if path is not None else environ.get("GATEWAY_CONFIG", DEFAULT_CONFIG_PATH))
    file_data: dict[str, Any] = {}
    source = str(config_path)
    if config_path.is_file():
        try:
            file_data = tomllib.loads(config_path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config error: {config_path}: invalid TOML: {exc}") from None
    elif explicit:
        raise ConfigError(f"config error: config file {config_path} does not exist")
    else:
        source = "built-in defaults"
    env_data = env_overrides(environ)
    _fix_env_provider_keys(file_data, env_data)
    data = _merge(_merge(file_data, env_data), overrides or {})
    if env_data:
        source += " + environment"
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None
