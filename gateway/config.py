"""Configuration: a TOML file, `GATEWAY_<SECTION>__<KEY>` environment overrides, command-line flags.

Precedence: flag > environment > file > built-in default (pydantic-settings sources, in
`config_sources.py`). Validation errors become one `ConfigError` line that names the offending
key and where its value came from.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from gateway.config_sources import (
    ENV_DELIMITER,
    ENV_PREFIX,
    GatewayEnvSource,
    TomlFileSource,
    table_names,
)
from gateway.exceptions import ConfigError
from gateway.redact import names_a_secret, redact_dsn
from gateway.types import ascii_int, header_problem

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_TYPE_LABEL = re.compile(r"^(int|float|str|bool|none|dict\[.*\]|list\[.*\]|literal\[.*\]|function-.*)$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


# The longest duration taken: 100 years. Longer ones are mistakes, and past 2^63 ns they no
# longer fit the clocks and the 64-bit integers they are written as (a 500, not a config error).
MAX_DURATION = 100 * 365 * 86_400.0


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as "90s", "30m", "24h", "7d"; "0" disables."""
    if isinstance(value, bool):
        raise ValueError("a duration must be a number of seconds or a string like '30m'")
    seconds: float | None = None
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError("a duration must be a finite, non-negative number of seconds")
        seconds = float(value)
    elif isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match:
            seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if seconds is None:
        raise ValueError(f"invalid duration {value!r}: use seconds or a unit, e.g. '90s', '30m', '24h'")
    if seconds > MAX_DURATION:
        raise ValueError(f"duration {value!r} is longer than 100 years: use '0' for never")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


def _zone_name(value: object) -> object:
    """An IANA time zone this machine knows (checked at start, not at the first request)."""
    if isinstance(value, str):
        try:
            ZoneInfo(value)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {value!r}: use an IANA name, e.g. 'Europe/Berlin'") from None
    return value


def _window_tokens(value: object) -> object:
    """ "auto", or a window of at least one token (a number, or its digits from the environment)."""
    if value == "auto":
        return value
    if isinstance(value, str):  # (digits from the environment)
        value = ascii_int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ValueError('must be "auto" or a number of tokens above 0')


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: object, info: ValidationInfo) -> object:
        """TOML's true/false is not a number (pydantic would read `port = true` as 1)."""
        name = info.field_name
        if isinstance(value, bool) and name is not None and cls.model_fields[name].annotation is not bool:
            raise ValueError("must be a value of its own kind, not true/false")
        return value


class ServerSettings(_Section):
    host: str = Field("127.0.0.1", min_length=1)  # (empty: uvicorn listens on every interface)
    port: int = Field(8080, ge=0, le=65535)
    max_body_bytes: int = Field(10_000_000, gt=0)
    # Seconds a client may take to send its whole request body ("0" = no limit); then 408.
    body_timeout: Duration = 30.0
    # On SIGTERM: how long requests in flight may still take; then they get 503 `shutting_down`.
    shutdown_timeout: Duration = 30.0
    access_log: bool = False
    # Background responses (`background: true`) running at once per key (in each worker
    # process), and the Responses events kept per background response for clients that resume
    # its stream.
    background_responses: int = Field(16, ge=0)
    background_events: int = Field(20_000, ge=1)
    # Turn starts (parse, lock, load, plan) run per pass of the event loop at most, first come
    # first served, so a burst of new requests does not hold up running streams ("0" = no limit).
    starts_per_pass: int = Field(32, ge=0)


class StorageSettings(_Section):
    backend: Literal["jsonl", "memory", "postgres"] = "jsonl"
    data_dir: str = Field("var", min_length=1, pattern=r"\S")
    durability: Literal["fsync", "none"] = "fsync"
    dsn: str = ""
    lock_timeout: Duration = 30.0
    archive_deleted: bool = False
    cache_conversations: int = Field(1024, ge=0)
    cache_messages: int = Field(10_000, ge=0)
    max_conversation_messages: int = Field(100_000, ge=0)

    def where(self) -> str:
        """Where the conversations are kept, for what the gateway says (a DSN without its password)."""
        if self.backend == "postgres":
            return f"PostgreSQL {redact_dsn(self.dsn)}"
        if self.backend == "memory":
            return "memory only (nothing persists)"
        return f"data dir {self.data_dir}"

    def model_post_init(self, _context: object) -> None:
        if self.backend == "postgres" and not self.dsn.strip():
            raise ConfigError(
                'config error: storage.dsn: required when storage.backend = "postgres" '
                '(e.g. dsn = "postgresql://gateway@127.0.0.1:5432/gateway", or GATEWAY_STORAGE__DSN)'
            )


class ContextSettings(_Section):
    max_context_tokens: Annotated[int | Literal["auto"], BeforeValidator(_window_tokens)] = "auto"
    reserve_tokens: int = Field(4500, ge=0)
    max_history_messages: int = Field(200, ge=0)
    # The newest history messages kept even past max_history_messages (whole tool-call units),
    # before any summary or recap: the answer the newest question replies to survives.
    keep_recent_messages: int = Field(2, ge=0)
    # Keep the conversation's first message (and its tool results) when cutting: for clients
    # that send no system prompt and put their instructions in the first user message.
    keep_first: bool = False
    # Cuts in steps: a window that no longer fits is cut down to this share of the budget, and
    # the next turns append to an unchanged head until it is full again (prompt caches hit).
    cut_to: float = Field(0.6, gt=0, le=1)
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
    default_timezone: Annotated[str, BeforeValidator(_zone_name)] = "UTC"


class UISettings(_Section):
    enabled: bool = True


def _env_name(value: str) -> str:
    """The name of an environment variable (or "" for none), never the secret it would hold: a
    key pasted in its place was said in errors, logs and answers to clients."""
    if value and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ValueError(
            "must name an environment variable (letters, digits and _, e.g. OPENAI_API_KEY), "
            "not hold the key itself"
        )
    return value


EnvName = Annotated[str, AfterValidator(_env_name)]


def env_name_said(name: str) -> str | None:
    """The name of an environment variable as errors and logs may say it: itself when it is in
    upper case, as variable names are, else None (to be named by its setting): a key of letters,
    digits and `_` (Groq's `gsk_...`, Mistral's) pasted in place of a name is a legal name."""
    return name if re.fullmatch(r"[A-Z_][A-Z0-9_]*", name) else None


def unset_key_variables(providers: Mapping[str, ProviderSettings], environ: Mapping[str, str]) -> list[str]:
    """What a server's start says of the providers whose `api_key_env` names a variable that is
    not set (a typo, a forgotten export): once, rather than at each refused call."""
    said = []
    for name, provider in providers.items():
        if provider.api_key_env and not environ.get(provider.api_key_env):
            then = "are refused (502)" if provider.kind == "litellm" else "go without a key"
            variable = env_name_said(provider.api_key_env) or "a variable"
            said.append(f"providers.{name}.api_key_env names {variable}, which is not set: its calls {then}")
    return said


def _http_headers(headers: dict[str, str]) -> dict[str, str]:
    """Headers HTTP/1.1 can carry (`header_problem`): caught only when sent, a line break in a
    value stopped every worker at its start."""
    for name, value in headers.items():
        problem = header_problem(name, value)
        if problem is not None:
            raise ValueError(problem)
    return headers


class AuthSettings(_Section):
    keys_env: EnvName = ""


def _otlp_endpoint(value: object) -> object:
    """An OTLP/HTTP base URL (http:// or https://), or "" for none."""
    if isinstance(value, str) and value.strip() and not re.match(r"^https?://[^/\s]", value.strip()):
        raise ValueError('must be an http:// or https:// URL, e.g. "http://127.0.0.1:4318", or ""')
    return value.strip().rstrip("/") if isinstance(value, str) else value


class TracingSettings(_Section):
    # OTLP/HTTP base URL: spans go to {endpoint}/v1/traces, metrics to {endpoint}/v1/metrics.
    # Empty: the standard OTEL_EXPORTER_OTLP_*ENDPOINT variables, if set; else off (gateway.tracing).
    endpoint: Annotated[str, BeforeValidator(_otlp_endpoint)] = ""
    service_name: str = Field("gateway", min_length=1)
    # Opt-in (GenAI conventions): the messages sent and the answer, in a span event.
    capture_content: bool = False
    metrics: bool = True  # also the GenAI metrics (gen_ai.client.*), to {endpoint}/v1/metrics


class ProviderSettings(_Section):
    kind: Literal["openai", "litellm", "demo"]
    base_url: str = Field("", validate_default=True)
    api_key_env: EnvName = ""
    # A deadline: a whole answer within it; a stream's first event within it (from the ask).
    timeout: Duration = 600.0
    # A stream's longest wait between events, after its first (unset: `timeout`; "0": none).
    stream_idle_timeout: Duration | None = None
    connect_timeout: Duration = 10.0
    # Extra attempts after a connection failure or a 502/503/504, only before any byte of the
    # answer has reached the client (never after a stream started; 429 is passed through).
    retries: int = Field(1, ge=0, le=10)
    context_window: int | None = Field(None, gt=0)
    # The largest answer read from the provider (a stream counts every byte); past it: 502.
    max_response_bytes: int = Field(32_000_000, gt=0)
    # litellm only: the litellm provider prefix (defaults to the provider's own name).
    litellm_provider: str = ""
    headers: Annotated[dict[str, str], AfterValidator(_http_headers)] = Field(default_factory=dict)
    # Tell the provider how to keep a conversation's prompt cached (gateway/upstream/cache_hints.py):
    # `prompt_cache_key`, llama.cpp's `cache_prompt`/`id_slot`, Anthropic's `cache_control`.
    cache_hints: bool = True

    @field_validator("base_url")
    @classmethod
    def _an_http_url(cls, value: str, info: ValidationInfo) -> str:
        """A provider's `base_url` parses, with a port that is a number; an OpenAI-compatible
        provider is called at it: http(s), with a host. What is said of it leaves out the
        credentials it may hold."""
        if not value:
            if info.data.get("kind") == "openai":
                raise ValueError('required for kind = "openai", e.g. "http://127.0.0.1:11434/v1"')
            return value
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 (raises for a port that is not a number from 0 to 65535)
        except ValueError as exc:
            raise ValueError(f"{_without_credentials(value)!r} is not a URL: {exc}") from None
        if info.data.get("kind") == "openai" and (
            parts.scheme not in ("http", "https") or not parts.hostname
        ):
            raise ValueError(
                f"{_without_credentials(value)!r} is not an http:// or https:// URL: an "
                'OpenAI-compatible provider needs one, e.g. "http://127.0.0.1:11434/v1"'
            )
        return value


def _without_credentials(url: str) -> str:
    """`url` as a message may say it: a `user:password@` as `***@`, and all from its first `?`,
    `;` or `#` on (parameters, a query or a fragment) as `…`: each may hold a credential
    (`?api-key=` for one)."""
    cut = min((at for at in map(url.find, "?;#") if at >= 0), default=len(url))
    url, query = url[:cut], url[cut:]
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rsplit("@", 1)[1]
    return f"{scheme}{sep}{authority}{slash}{path}{query[:1] + '…' if query else ''}"


class ModelSettings(_Section):
    context_window: int | None = Field(None, gt=0)


def _default_providers() -> dict[str, ProviderSettings]:
    return {"demo": ProviderSettings(kind="demo")}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_DELIMITER, extra="forbid", frozen=True
    )

    default_provider: str = "demo"
    server: ServerSettings = ServerSettings()
    storage: StorageSettings = StorageSettings()
    context: ContextSettings = ContextSettings()
    sessions: SessionsSettings = SessionsSettings()
    auth: AuthSettings = AuthSettings()
    tracing: TracingSettings = TracingSettings()
    ui: UISettings = UISettings()
    providers: dict[str, ProviderSettings] = Field(default_factory=_default_providers)
    models: dict[str, ModelSettings] = Field(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """`Settings(**overrides)` reads what `load_settings` does: no .env file, no secrets dir."""
        file = TomlFileSource(settings_cls, None, os.environ)
        return init_settings, GatewayEnvSource(settings_cls, os.environ, names=table_names(file.data)), file

    @field_validator("providers")
    @classmethod
    def _demo_built_in(cls, providers: dict[str, ProviderSettings]) -> dict[str, ProviderSettings]:
        """The `demo` provider is built in: there beside the configured ones unless one is named so
        (providers defined in the environment alone, with no file, add to it: they used to
        replace it, and the default provider `demo` was then "not a configured provider")."""
        if "demo" in providers:
            return providers
        return {**providers, "demo": ProviderSettings(kind="demo")}

    def model_post_init(self, _context: object) -> None:
        if self.default_provider and self.default_provider not in self.providers:
            raise ConfigError(
                f"config error: default_provider: {self.default_provider!r} is not a configured "
                f"provider (configured: {', '.join(sorted(self.providers)) or 'none'})"
            )

    @property
    def data_path(self) -> Path:
        return Path(self.storage.data_dir)


def _sets(layer: Mapping[str, object], key: Sequence[str]) -> bool:
    node: object = layer
    for part in key:
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return bool(key)


# Settings whose value may hold a credential, besides those named like one (`api_key`, ...).
_VALUES_NOT_SHOWN = ("headers", "dsn", "base_url", "password", "api_base")


def _error_line(
    exc: ValidationError, file: TomlFileSource, env: GatewayEnvSource, overrides: Mapping[str, object]
) -> str:
    errors = exc.errors()
    # A mistyped key first: the "required" error of the key it was meant to be follows from it.
    err: ErrorDetails = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = [str(p) for p in err["loc"]]
    # Union errors end with pydantic's member label ("int", "literal['auto']"): not part of the key.
    while loc and _TYPE_LABEL.match(loc[-1]):
        loc.pop()
    key = ".".join(loc) or "(root)"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    got = err.get("input")
    # (an unknown key's value is not shown: a mistyped `api_kye` holds a key all the same)
    shown = (
        "" if isinstance(got, dict) or err["type"] in ("missing", "extra_forbidden") else f" (got {got!r})"
    )
    if any(names_a_secret(part) or part.lower() in _VALUES_NOT_SHOWN for part in loc):
        shown = ""  # (a key, a header's value, a DSN's password: never on stderr or in a log)
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    # A missing key is blamed on whoever made the table it is missing from; a flag on nobody.
    blamed = loc[:-1] if err["type"] == "missing" else loc
    by_flag = _sets(overrides, blamed)
    variable = None if by_flag else env.variable_for(blamed)
    if by_flag and err["type"] != "missing":
        source = "command-line flag"
    elif variable is not None:
        source = f"environment variable {variable}"
    else:
        source = file.label + (" + environment" if env.variables else "")
    return f"config error: {key}: {msg}{shown}{more} [{source}]"


def load_settings(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> Settings:
    """Read the TOML file, apply env overrides then explicit overrides (flags), validate.

    `path=None` means `$GATEWAY_CONFIG`, else `config/gateway.toml` if it exists, else defaults.
    """
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    file = TomlFileSource(Settings, path, environ)
    env = GatewayEnvSource(Settings, environ, names=table_names(file.data, overrides))
    sources = (InitSettingsSource(Settings, init_kwargs=overrides), env, file)
    try:
        return Settings(_build_sources=(sources, {}))
    except ValidationError as exc:
        raise ConfigError(_error_line(exc, file, env, overrides)) from None
    except SettingsError as exc:
        raise ConfigError(f"config error: {exc} [environment]") from None
