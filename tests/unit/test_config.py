"""load_settings: defaults, the shipped file, environment overrides, precedence, clear errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_settings import BaseSettings

from gateway.config import Settings, load_settings, parse_duration
from gateway.config_sources import GatewayEnvSource
from gateway.exceptions import ConfigError

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "config" / "gateway.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(text, encoding="utf-8")
    return path


def config_error(**kwargs: Any) -> str:
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError) as info:
        load_settings(**kwargs)
    message = str(info.value)
    assert "\n" not in message, "a config error is one line"
    return message


# -- sources ------------------------------------------------------------------------------------


def test_defaults_without_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no config/gateway.toml here
    s = load_settings(environ={})
    assert s.default_provider == "demo"
    assert list(s.providers) == ["demo"]
    assert s.providers["demo"].kind == "demo"
    assert (s.server.host, s.server.port, s.server.max_body_bytes) == ("127.0.0.1", 8080, 10_000_000)
    assert (s.storage.backend, s.storage.data_dir, s.storage.durability) == ("jsonl", "var", "fsync")
    assert s.context.max_context_tokens == "auto"
    assert (s.context.reserve_tokens, s.context.max_history_messages) == (4500, 200)
    assert s.context.strategy == "truncate"
    assert (s.sessions.ttl, s.sessions.idle_after) == (0.0, 900.0)
    assert s.auth.keys_env == ""
    assert s.data_path == Path("var")


def test_default_path_is_config_gateway_toml_in_the_working_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(REPO)
    assert load_settings(environ={}).default_provider == "ollama"


def test_shipped_config_loads() -> None:
    s = load_settings(SHIPPED, environ={})
    assert s.default_provider == "ollama"
    assert set(s.providers) == {"demo", "ollama", "openai", "anthropic"}
    assert s.providers["ollama"].kind == "openai"
    assert s.providers["ollama"].base_url == "http://127.0.0.1:11434/v1"
    assert s.providers["openai"].api_key_env == "OPENAI_API_KEY"
    assert s.providers["anthropic"].kind == "litellm"
    assert s.providers["ollama"].timeout == 600.0
    assert s.providers["ollama"].connect_timeout == 10.0
    assert s.models["ollama/phi4-mini"].context_window == 4096
    assert (s.storage.backend, s.storage.data_dir, s.storage.durability) == ("jsonl", "var", "fsync")
    assert s.storage.lock_timeout == 30.0
    assert (s.sessions.ttl, s.sessions.idle_after) == (0.0, 900.0)
    assert s.server.port == 8080


def test_gateway_config_env_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 1234\n")
    assert load_settings(environ={"GATEWAY_CONFIG": str(path)}).server.port == 1234


@pytest.mark.parametrize("how", ["argument", "env"])
def test_missing_explicit_config_path_fails_clearly(tmp_path: Path, how: str) -> None:
    missing = tmp_path / "nope.toml"
    if how == "argument":
        message = config_error(path=missing)
    else:
        message = config_error(environ={"GATEWAY_CONFIG": str(missing)})
    assert str(missing) in message
    assert "does not exist" in message


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    path = write(tmp_path, "[server\nport = 1\n")
    message = config_error(path=path)
    assert str(path) in message
    assert "TOML" in message


# -- environment and precedence ------------------------------------------------------------------


def test_env_overrides() -> None:
    s = load_settings(
        SHIPPED,
        environ={
            "GATEWAY_STORAGE__DATA_DIR": "/srv/var",
            "GATEWAY_SERVER__PORT": "9090",
            "GATEWAY_PROVIDERS__OLLAMA__BASE_URL": "http://gpu:11434/v1",
            "GATEWAY_SESSIONS__TTL": "24h",
            "GATEWAY_SERVER__ACCESS_LOG": "true",
            "GATEWAY_DEFAULT_PROVIDER": "openai",
            "UNRELATED": "x",
            "GATEWAYX_SERVER__PORT": "1",
        },
    )
    assert s.storage.data_dir == "/srv/var"
    assert s.server.port == 9090
    assert isinstance(s.server.port, int)
    assert s.providers["ollama"].base_url == "http://gpu:11434/v1"
    assert s.providers["ollama"].kind == "openai"  # the rest of the table is kept
    assert s.sessions.ttl == 86400.0
    assert s.server.access_log is True
    assert s.default_provider == "openai"
    assert s.server.host == "127.0.0.1"  # untouched keys keep the file's value


def test_env_names_match_provider_and_model_keys_with_punctuation(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'default_provider = "my-llm"\n'
        '[providers.my-llm]\nkind = "openai"\nbase_url = "http://a/v1"\n'
        '[models."ollama/phi4-mini"]\ncontext_window = 4096\n',
    )
    s = load_settings(
        path,
        environ={
            "GATEWAY_PROVIDERS__MY_LLM__BASE_URL": "http://b/v1",
            "GATEWAY_MODELS__OLLAMA_PHI4_MINI__CONTEXT_WINDOW": "8192",
        },
    )
    assert set(s.providers) == {"my-llm", "demo"}  # (demo is built in)
    assert s.providers["my-llm"].base_url == "http://b/v1"
    assert s.models["ollama/phi4-mini"].context_window == 8192


@pytest.mark.parametrize("value", ["2024", "inf", "true", "1979-05-27"])
def test_env_value_for_a_string_key_stays_a_string(value: str) -> None:
    s = load_settings(SHIPPED, environ={"GATEWAY_STORAGE__DATA_DIR": value})
    assert s.storage.data_dir == value


def test_precedence_override_beats_env_beats_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[server]\nport = 7000\nhost = "10.0.0.1"\nmax_body_bytes = 5\n[storage]\ndata_dir = "from-file"\n',
    )
    env = {"GATEWAY_SERVER__PORT": "8000", "GATEWAY_SERVER__HOST": "10.0.0.2"}
    s = load_settings(path, environ=env, overrides={"server": {"port": 9000}})
    assert s.server.port == 9000  # override > env
    assert s.server.host == "10.0.0.2"  # env > file
    assert s.server.max_body_bytes == 5  # file > default
    assert s.storage.data_dir == "from-file"
    assert s.storage.durability == "fsync"  # default
    assert load_settings(path, environ=env).server.port == 8000
    assert load_settings(path, environ={}).server.port == 7000


def test_env_values_take_the_type_of_their_key() -> None:
    s = load_settings(
        SHIPPED,
        environ={
            "GATEWAY_SERVER__PORT": "9090",
            "GATEWAY_SERVER__ACCESS_LOG": "true",
            "GATEWAY_UI__ENABLED": "false",
            "GATEWAY_SERVER__HOST": "0.0.0.0",
            "GATEWAY_CONTEXT__MAX_CONTEXT_TOKENS": "8192",
            "GATEWAY_MODELS__OLLAMA_PHI4_MINI__CONTEXT_WINDOW": "16384",
            "GATEWAY_PROVIDERS__OLLAMA__RETRIES": "3",
        },
    )
    assert s.server.port == 9090 and type(s.server.port) is int
    assert s.server.access_log is True
    assert s.ui.enabled is False
    assert s.server.host == "0.0.0.0"
    assert s.context.max_context_tokens == 8192 and type(s.context.max_context_tokens) is int
    assert s.models["ollama/phi4-mini"].context_window == 16384
    assert s.providers["ollama"].retries == 3
    auto = load_settings(SHIPPED, environ={"GATEWAY_CONTEXT__MAX_CONTEXT_TOKENS": "auto"})
    assert auto.context.max_context_tokens == "auto"


@pytest.mark.parametrize("value", ['{ X-Team = "ml", X-Trace = "1" }', '{"X-Team": "ml", "X-Trace": "1"}'])
def test_env_table_value_as_toml_or_json(value: str) -> None:
    s = load_settings(SHIPPED, environ={"GATEWAY_PROVIDERS__OLLAMA__HEADERS": value})
    assert s.providers["ollama"].headers == {"X-Team": "ml", "X-Trace": "1"}
    assert s.providers["ollama"].base_url == "http://127.0.0.1:11434/v1"


@pytest.mark.parametrize("value", ['["a", "b"]', "['a', 'b']", '["a","b"]'])
def test_env_list_value_as_toml_or_json(value: str) -> None:
    # No gateway key is a list yet: the same source on a settings class with list keys.
    class Tags(BaseModel):
        names: list[str] = []

    class Listed(BaseSettings):
        model_config = Settings.model_config
        names: list[str] = []
        tags: Tags = Tags()

    environ = {"GATEWAY_NAMES": value, "GATEWAY_TAGS__NAMES": value}
    listed = Listed.model_validate(GatewayEnvSource(Listed, environ)())
    assert listed.names == ["a", "b"]
    assert listed.tags.names == ["a", "b"]


def test_provider_created_only_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # no config file: built-in defaults
    s = load_settings(
        environ={
            "GATEWAY_DEFAULT_PROVIDER": "gpu",
            "GATEWAY_PROVIDERS__GPU__KIND": "openai",
            "GATEWAY_PROVIDERS__GPU__BASE_URL": "http://gpu:11434/v1",
            "GATEWAY_PROVIDERS__GPU__TIMEOUT": "90s",
            "GATEWAY_PROVIDERS__GPU__HEADERS": '{ X-Team = "ml" }',
        }
    )
    assert s.default_provider == "gpu"
    gpu = s.providers["gpu"]
    assert (gpu.kind, gpu.base_url, gpu.timeout, gpu.headers) == (
        "openai",
        "http://gpu:11434/v1",
        90.0,
        {"X-Team": "ml"},
    )
    assert gpu.connect_timeout == 10.0  # the rest are the provider defaults


def test_a_provider_from_the_environment_alone_adds_to_the_built_in_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no file and no GATEWAY_DEFAULT_PROVIDER, it replaced `demo`, and the default
    provider `demo` was then "not a configured provider": the documented recipe did not start."""
    monkeypatch.chdir(tmp_path)
    s = load_settings(
        environ={
            "GATEWAY_PROVIDERS__LLAMA__KIND": "openai",
            "GATEWAY_PROVIDERS__LLAMA__BASE_URL": "http://l/v1",
        }
    )
    assert s.default_provider == "demo" and set(s.providers) == {"demo", "llama"}
    assert s.providers["demo"].kind == "demo"


def test_env_beats_file_at_every_level(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'default_provider = "a"\n[server]\nport = 7000\n'
        '[providers.a]\nkind = "openai"\nbase_url = "http://file/v1"\ntimeout = 5\n'
        '[providers.b]\nkind = "demo"\n',
    )
    s = load_settings(
        path,
        environ={
            "GATEWAY_DEFAULT_PROVIDER": "b",
            "GATEWAY_SERVER__PORT": "8000",
            "GATEWAY_PROVIDERS__A__BASE_URL": "http://env/v1",
        },
    )
    assert (s.default_provider, s.server.port) == ("b", 8000)
    assert (s.providers["a"].base_url, s.providers["a"].timeout) == ("http://env/v1", 5.0)
    assert set(s.providers) == {"a", "b", "demo"}


def test_gateway_variables_that_are_not_keys_are_left_alone() -> None:
    # auth.keys_env may name a GATEWAY_ variable (the example in docs/http-api.md); tests use others.
    s = load_settings(SHIPPED, environ={"GATEWAY_KEYS": "k1,k2", "GATEWAY_TEST_CACHE": "/tmp/x"})
    assert s.server.port == 8080
    message = config_error(path=SHIPPED, environ={"GATEWAY_KEYS": "k1"}, overrides={"server": {"port": -1}})
    assert message.endswith("[command-line flag]")  # the value came from a flag: not the file, not a variable
    message = config_error(path=SHIPPED, environ={"GATEWAY_KEYS": "k1", "GATEWAY_SERVER__PORT": "-1"})
    assert message.endswith("[environment variable GATEWAY_SERVER__PORT]")


def test_settings_class_reads_the_same_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, '[server]\nport = 7000\nhost = "10.0.0.1"\n')
    monkeypatch.setenv("GATEWAY_CONFIG", str(path))
    monkeypatch.setenv("GATEWAY_SERVER__PORT", "8000")
    direct = Settings(storage={"data_dir": "flag"})
    assert (direct.server.port, direct.server.host, direct.storage.data_dir) == (8000, "10.0.0.1", "flag")
    assert direct == load_settings(overrides={"storage": {"data_dir": "flag"}})


def test_overrides_merge_into_tables_without_replacing_them() -> None:
    s = load_settings(SHIPPED, environ={}, overrides={"providers": {"ollama": {"timeout": "90s"}}})
    assert s.providers["ollama"].timeout == 90.0
    assert s.providers["ollama"].base_url == "http://127.0.0.1:11434/v1"
    assert "openai" in s.providers


# -- errors name the key -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"storage": {"durability": "sometimes"}}, "storage.durability"),
        ({"storage": {"backend": "mysql"}}, "storage.backend"),
        ({"storage": {"bogus": 1}}, "storage.bogus"),
        ({"bogus": 1}, "bogus"),
        ({"server": {"port": 70000}}, "server.port"),
        ({"server": {"port": "abc"}}, "server.port"),
        ({"sessions": {"ttl": "soon"}}, "sessions.ttl"),
        ({"providers": {"x": {"kind": "weird"}}}, "providers.x.kind"),
        ({"providers": {"x": {}}}, "providers.x.kind"),
        ({"providers": {"demo": {"kind": "demo", "timeout": "forever"}}}, "providers.demo.timeout"),
        ({"models": {"m": {"context_window": 0}}}, "models.m.context_window"),
        # (each was accepted: every turn then failed, or ran somewhere unexpected)
        ({"context": {"max_context_tokens": -100}}, "context.max_context_tokens"),
        ({"context": {"max_context_tokens": 0}}, "context.max_context_tokens"),
        ({"context": {"max_context_tokens": True}}, "context.max_context_tokens"),
        ({"sessions": {"default_timezone": "Mars/Olympus"}}, "sessions.default_timezone"),
        ({"server": {"port": True}}, "server.port"),
        ({"storage": {"data_dir": ""}}, "storage.data_dir"),
        ({"storage": {"data_dir": "  "}}, "storage.data_dir"),
    ],
)
def test_bad_value_or_unknown_key_names_the_dotted_key(overrides: dict[str, Any], key: str) -> None:
    message = config_error(path=SHIPPED, overrides=overrides)
    assert f"{key}:" in message


def test_bad_value_in_file_names_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[storage]\ndurability = "sometimes"\n')
    message = config_error(path=path)
    assert "storage.durability:" in message
    assert "sometimes" in message
    assert str(path) in message


def test_bad_env_value_names_the_key() -> None:
    message = config_error(path=SHIPPED, environ={"GATEWAY_SERVER__PORT": "lots"})
    assert "server.port:" in message
    assert "environment" in message


@pytest.mark.parametrize(
    ("name", "value", "key"),
    [
        ("GATEWAY_SERVER__PORT", "lots", "server.port"),
        ("GATEWAY_SERVER__ACCESS_LOG", "maybe", "server.access_log"),
        ("GATEWAY_STORAGE__DURABILITY", "sometimes", "storage.durability"),
        ("GATEWAY_SESSIONS__TTL", "soon", "sessions.ttl"),
        ("GATEWAY_PROVIDERS__OLLAMA__HEADERS", "X-Team: ml", "providers.ollama.headers"),
        ("GATEWAY_PROVIDERS__OLLAMA__RETRIES", "99", "providers.ollama.retries"),
        ("GATEWAY_SERVR__PORT", "9090", "servr"),
    ],
)
def test_bad_env_value_names_the_variable(name: str, value: str, key: str) -> None:
    message = config_error(path=SHIPPED, environ={name: value, "GATEWAY_SERVER__HOST": "0.0.0.0"})
    assert message.startswith(f"config error: {key}: ")
    assert message.endswith(f"[environment variable {name}]")
    if key == "providers.ollama.headers":  # (headers may hold a credential: never shown)
        assert value not in message
    elif key != "servr":
        assert repr(value) in message  # the value as it was given


@pytest.mark.parametrize(
    ("overrides", "environ"),
    [
        ({"providers": {"x": {"kind": "openai", "api_key": "sk-INLINEsecret0001"}}}, {}),
        ({}, {"GATEWAY_PROVIDERS__X__HEADERS": '{ Authorization = "Bearer sk-ENVsecret0005" , X = [1'}),
        ({"storage": {"backend": "postgres", "dsn": ["postgresql://u:pw-secret0007@h/db"]}}, {}),
    ],
)
def test_a_config_error_never_shows_a_credential(overrides: dict[str, Any], environ: dict[str, str]) -> None:
    """An `api_key` put in the file (an unknown key) or a malformed headers variable was quoted
    whole on stderr, where a service's start log keeps it."""
    message = config_error(
        path=SHIPPED, overrides=overrides, environ={"GATEWAY_SERVER__HOST": "0.0.0.0", **environ}
    )
    assert message.startswith("config error: ") and "secret" not in message


def test_env_provider_missing_its_kind_names_the_variable_that_made_it(tmp_path: Path) -> None:
    message = config_error(path=SHIPPED, environ={"GATEWAY_PROVIDERS__GPU__BASE_URL": "http://gpu/v1"})
    assert "providers.gpu.kind: Field required" in message
    assert "GATEWAY_PROVIDERS__GPU__BASE_URL" in message


def test_bad_file_value_is_not_blamed_on_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 70000\n")
    message = config_error(path=path, environ={"GATEWAY_SERVER__HOST": "0.0.0.0"})
    assert "server.port:" in message
    assert f"[{path} + environment]" in message


def test_unknown_env_key_is_an_error() -> None:
    message = config_error(path=SHIPPED, environ={"GATEWAY_STORAGE__DATADIR": "/srv"})
    assert "storage.datadir:" in message
    assert "unknown key" in message


def test_a_mistyped_key_is_named_and_its_value_never_shown(tmp_path: Path) -> None:
    """`api_kye` (or any key the gateway does not know) was quoted with its value; a mistyped
    `basse_url` was hidden behind "base_url: Field required (+1 more)"."""
    path = write(tmp_path, '[providers.x]\nkind = "openai"\napi_kye = "sk-SECRET123"\n')
    message = config_error(path=path)
    assert "providers.x.api_kye: unknown key" in message and "SECRET" not in message
    path = write(tmp_path, '[providers.x]\nkind = "openai"\nbasse_url = "http://gpu:8000/v1"\n')
    assert "providers.x.basse_url: unknown key" in config_error(path=path)


def test_an_empty_host_is_refused() -> None:
    """An empty host (`GATEWAY_SERVER__HOST=${UNSET}`) made uvicorn listen on every interface."""
    assert "server.host:" in config_error(path=SHIPPED, environ={"GATEWAY_SERVER__HOST": ""})


def test_bad_union_value_names_the_key_itself() -> None:
    message = config_error(path=SHIPPED, overrides={"context": {"max_context_tokens": "lots"}})
    assert "context.max_context_tokens:" in message


def test_default_provider_must_be_configured() -> None:
    message = config_error(path=SHIPPED, overrides={"default_provider": "nope"})
    assert "default_provider" in message
    assert "nope" in message


def test_default_provider_unknown_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    message = config_error(environ={"GATEWAY_DEFAULT_PROVIDER": "ollama"})
    assert "default_provider" in message
    assert "ollama" in message


# -- durations ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("90s", 90.0),
        ("30m", 1800.0),
        ("24h", 86400.0),
        ("7d", 604800.0),
        ("1.5h", 5400.0),
        ("250ms", 0.25),
        (" 30m ", 1800.0),
        ("45", 45.0),
        (0, 0.0),
        ("0", 0.0),
        (12, 12.0),
        (2.5, 2.5),
    ],
)
def test_durations(value: Any, seconds: float) -> None:
    assert parse_duration(value) == seconds
    s = load_settings(SHIPPED, environ={}, overrides={"sessions": {"ttl": value, "idle_after": value}})
    assert s.sessions.ttl == seconds
    assert s.sessions.idle_after == seconds


@pytest.mark.parametrize(
    "value",
    # (the last three: past 100 years, once taken, then a 500 where a conversation's expiry is written)
    [
        "soon",
        "",
        "-5",
        -5,
        "5w",
        "30 minutes",
        "m",
        True,
        None,
        [30],
        "99999999999999999999d",
        1e300,
        "36501d",
    ],
)
def test_bad_durations(value: Any) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)
    message = config_error(path=SHIPPED, overrides={"sessions": {"ttl": value}})
    assert "sessions.ttl:" in message


def test_nan_duration_is_rejected() -> None:
    with pytest.raises(ValueError):
        parse_duration(math.nan)


def test_duration_from_env_and_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[sessions]\nttl = "7d"\nidle_after = 60\n')
    s = load_settings(path, environ={"GATEWAY_SESSIONS__IDLE_AFTER": "30m"})
    assert (s.sessions.ttl, s.sessions.idle_after) == (604800.0, 1800.0)


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("512", 512), (" 4096", 4096)])
def test_window_tokens_from_the_environment(value: str, expected: object) -> None:
    environ = {"GATEWAY_CONTEXT__MAX_CONTEXT_TOKENS": value}
    assert load_settings(path=SHIPPED, environ=environ).context.max_context_tokens == expected
    message = config_error(path=SHIPPED, environ={"GATEWAY_CONTEXT__MAX_CONTEXT_TOKENS": "-1"})
    assert message.startswith('config error: context.max_context_tokens: must be "auto" or a number')


@pytest.mark.parametrize("base_url", [None, "", "ftp://host/v1", "127.0.0.1:11434/v1", "http:///v1"])
def test_an_openai_provider_needs_an_http_base_url(base_url: str | None) -> None:
    """Taken before: every request then got a 502 naming no URL ("at  failed: /chat/completions")."""
    provider: dict[str, Any] = {"kind": "openai"}
    if base_url is not None:
        provider["base_url"] = base_url
    message = config_error(path=SHIPPED, overrides={"providers": {"nourl": provider}})
    assert "providers.nourl.base_url:" in message


@pytest.mark.parametrize("kind", ["openai", "litellm"])
@pytest.mark.parametrize(
    ("base_url", "said"),
    [
        ("http://127.0.0.1:99999/v1", "Port out of range"),
        ("http://127.0.0.1:abc/v1", "Port could not be cast"),
        ("http://admin:hunter2@10.0.0.1:99999/v1", "'http://***@10.0.0.1:99999/v1'"),
        ("http://10.0.0.1:99999/v1?api-key=hunter2", "'http://10.0.0.1:99999/v1?…'"),
        ("http://10.0.0.1:99999/v1;api-key=hunter2", "'http://10.0.0.1:99999/v1;…'"),
        ("http://10.0.0.1:99999/v1#token=hunter2", "'http://10.0.0.1:99999/v1#…'"),
    ],
)
def test_a_base_url_with_a_bad_port_is_one_config_error_without_its_password(
    kind: str, base_url: str, said: str
) -> None:
    """A port out of range was taken, and every command then ended in a traceback (`serve` once
    it had said it was listening); and a rejected URL was said whole, its password too."""
    message = config_error(path=SHIPPED, overrides={"providers": {"p": {"kind": kind, "base_url": base_url}}})
    assert "providers.p.base_url:" in message and said in message and "hunter2" not in message


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("ftp://admin:hunter2@10.0.0.1/v1", "'ftp://***@10.0.0.1/v1'"),
        ("myres.openai.azure.com/openai?api-key=hunter2", "'myres.openai.azure.com/openai?…'"),
    ],
)
def test_a_rejected_base_url_is_said_without_its_credentials(url: str, said: str) -> None:
    message = config_error(path=SHIPPED, overrides={"providers": {"p": {"kind": "openai", "base_url": url}}})
    assert f"{said} is not an http:// or https:// URL" in message and "hunter2" not in message


def test_other_kinds_need_no_base_url() -> None:
    s = load_settings(SHIPPED, environ={}, overrides={"providers": {"lite": {"kind": "litellm"}}})
    assert s.providers["lite"].base_url == ""


def test_a_variable_that_spells_two_configured_models_alike_is_an_error(tmp_path: Path) -> None:
    """It set one of them, the last read, silently."""
    path = write(
        tmp_path,
        '[models."up/gpt-4.1"]\ncontext_window = 1000\n[models."up/gpt-4-1"]\ncontext_window = 2000\n',
    )
    variable = "GATEWAY_MODELS__UP_GPT_4_1__CONTEXT_WINDOW"
    message = config_error(path=path, environ={variable: "5"})
    assert message.startswith(f"config error: {variable}: names models 'up/gpt-4-1' and 'up/gpt-4.1'")
    alone = load_settings(path, environ={})
    assert alone.models["up/gpt-4.1"].context_window == 1000


@pytest.mark.parametrize("key", ["providers.x.api_key_env", "auth.keys_env"])
def test_a_key_pasted_where_its_variables_name_goes_is_refused_and_never_said(
    tmp_path: Path, key: str
) -> None:
    """`api_key_env = "sk-proj-..."` was said in the 502 every client got, and in the logs; a key
    in `auth.keys_env` in the start error."""
    pasted = "sk-proj-REALKEYpastedByMistake123"
    section, _, name = key.rpartition(".")
    table = f'[{section}]\nkind = "litellm"\n' if section.startswith("providers") else f"[{section}]\n"
    message = config_error(path=write(tmp_path, f'{table}{name} = "{pasted}"\n'))
    assert key in message and "environment variable" in message and pasted not in message
    assert load_settings(path=write(tmp_path, f'{table}{name} = "MY_KEY_2"\n'), environ={})


@pytest.mark.parametrize(
    "headers",
    [
        '{ X-Team = "t1\\r\\nX-Smuggled: yes" }',
        '{ "X Team" = "a" }',
        '{ X-Team = "a\\u0000" }',
        '{ X-Team = "€" }',
    ],
)
def test_a_provider_header_http_cannot_carry_is_a_config_error(tmp_path: Path, headers: str) -> None:
    """Caught only when sent: `serve` printed that it listened, then stopped with a traceback (with
    `--workers 2`, workers were made again and again, never serving), or every request failed."""
    text = f'[providers.up]\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\nheaders = {headers}\n'
    message = config_error(path=write(tmp_path, text))
    assert "providers.up.headers" in message and "Smuggled" not in message
    ok = text.replace(headers, '{ X-Team = "ml", "Ocp-Apim-Subscription-Key" = "k" }')
    assert load_settings(path=write(tmp_path, ok), environ={}).providers["up"].headers["X-Team"] == "ml"
