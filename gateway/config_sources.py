"""Where settings come from besides the built-in defaults, as two pydantic-settings sources.

The TOML config file and the `GATEWAY_<SECTION>__<KEY>` environment variables.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource

from gateway.exceptions import ConfigError

ENV_PREFIX = "GATEWAY_"
ENV_DELIMITER = "__"
CONFIG_ENV = "GATEWAY_CONFIG"
DEFAULT_CONFIG_PATH = "config/gateway.toml"
# Tables keyed by names the user chose, which a variable name may not be able to spell.
NAMED_TABLES = ("providers", "models")


def env_spelling(name: str) -> str:
    """A provider or model name as a variable name can hold it: "ollama/phi4-mini" -> "ollama_phi4_mini"."""
    return re.sub(r"[^a-z0-9]", "_", name.lower())


def table_names(*layers: Mapping[str, object] | None) -> dict[str, set[str]]:
    """The provider and model names the given layers configure: {"providers": {"my-llm"}, ...}."""
    names: dict[str, set[str]] = {table: set() for table in NAMED_TABLES}
    for layer in layers:
        for table in NAMED_TABLES:
            entries = (layer or {}).get(table)
            if isinstance(entries, Mapping):
                names[table].update(str(name) for name in entries)
    return names


def config_from_env(environ: Mapping[str, str]) -> str | None:
    """The config file `GATEWAY_CONFIG` names, or None (an empty one, `GATEWAY_CONFIG= gateway ...`,
    is as good as unset)."""
    return environ.get(CONFIG_ENV, "").strip() or None


class TomlFileSource(PydanticBaseSettingsSource):
    """The config file: `path`, else `$GATEWAY_CONFIG`, else config/gateway.toml if it exists.

    A file that was named but is missing, or is not valid TOML, is a `ConfigError` at once.
    """

    def __init__(
        self,
        settings_cls: type[BaseSettings],
        path: str | os.PathLike[str] | None,
        environ: Mapping[str, str],
    ) -> None:
        super().__init__(settings_cls)
        from_env = config_from_env(environ)
        named = path is not None or from_env is not None
        self.path = Path(path if path is not None else from_env or DEFAULT_CONFIG_PATH)
        self.data: dict[str, object] = {}
        self.found = self.path.is_file()
        if self.found:
            try:
                self.data = tomllib.loads(self.path.read_text(encoding="utf-8"))
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"config error: {self.path}: invalid TOML: {exc}") from None
            except OSError as exc:
                raise ConfigError(f"config error: {self.path}: cannot be read: {exc.strerror}") from None
        elif named and self.path.is_dir():
            raise ConfigError(
                f"config error: config file {self.path} is a directory (name the .toml file in it)"
            )
        elif named:
            raise ConfigError(f"config error: config file {self.path} does not exist")

    @property
    def label(self) -> str:
        return str(self.path) if self.found else "built-in defaults"

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[object, str, bool]:
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, object]:
        return self.data


class GatewayEnvSource(EnvSettingsSource):
    """`GATEWAY_<SECTION>__<KEY>` variables of `environ`, with pydantic-settings' nesting.

    A scalar stays the text it is and validation converts it to the key's type (`9090` for a
    number, `true` for a boolean, `2024` for a string key stays "2024"); a table or an array is
    read as a TOML value (`{ X-Team = "ml" }`, `["a", "b"]`), else as JSON. A provider or model
    name is matched against the configured ones (`MY_LLM` is `my-llm`), and a variable with a
    `__` under an unknown section is kept so that validation reports it as an unknown key.
    """

    def __init__(
        self,
        settings_cls: type[BaseSettings],
        environ: Mapping[str, str],
        *,
        names: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        super().__init__(settings_cls, case_sensitive=False)
        prefix = self.env_prefix.lower()
        # Replaces what the base class read from os.environ: names lower-cased, as it does.
        self.env_vars = {name.lower(): value for name, value in environ.items()}
        # The variables that name a key, by key path: GATEWAY_PROVIDERS__MY_LLM__KIND is
        # ("providers", "my_llm", "kind"); GATEWAY_KEYS (no key, no "__") is not one.
        self.variables: dict[tuple[str, ...], str] = {}
        for name in environ:
            if name.lower().startswith(prefix) and name != CONFIG_ENV:
                parts = name[len(prefix) :].lower().split(ENV_DELIMITER)
                path = tuple(env_spelling(part) for part in parts if part)
                if len(path) > 1 or (path and path[0] in settings_cls.model_fields):
                    self.variables[path] = name
        # By table, the configured names each spelling stands for: one, or several that a
        # variable cannot tell apart ("up/gpt-4.1" and "up/gpt-4-1" are both UP_GPT_4_1).
        self.names: dict[str, dict[str, list[str]]] = {}
        for table, found in (names or {}).items():
            spelled = self.names[table] = {}
            for name in sorted(found):
                spelled.setdefault(env_spelling(name), []).append(name)

    def variable_for(self, key: Sequence[str]) -> str | None:
        """The variable that set the dotted `key`, a table holding it or a key inside it, if one did."""
        path = tuple(env_spelling(part) for part in key)
        hits = [
            (len(var_path), name)
            for var_path, name in self.variables.items()
            if path and (var_path[: len(path)] == path or path[: len(var_path)] == var_path)
        ]
        return max(hits)[1] if hits else None

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: object) -> object:
        if not isinstance(value, str):
            return value
        try:
            parsed = tomllib.loads(f"v = {value}")
            if parsed.keys() == {"v"}:
                return parsed["v"]
        except tomllib.TOMLDecodeError:
            pass
        try:
            return json.loads(value)
        except ValueError:
            return value  # not a table: validation names the key and shows the value

    def __call__(self) -> dict[str, object]:
        data: dict[str, object] = super().__call__()
        for table, known in self.names.items():
            entries = data.get(table)
            if isinstance(entries, dict):
                for name in entries:
                    both = known.get(env_spelling(name), [])
                    if len(both) > 1:
                        variable = self.variable_for((table, name)) or f"{ENV_PREFIX}{table.upper()}__..."
                        raise ConfigError(
                            f"config error: {variable}: names {table} "
                            f"{' and '.join(repr(n) for n in both)} alike (a variable spells "
                            "them the same): set this one in the config file"
                        )
                data[table] = {known.get(env_spelling(name), [name])[0]: v for name, v in entries.items()}
        for path in self.variables:
            if len(path) > 1 and path[0] not in self.settings_cls.model_fields:
                data.setdefault(path[0], {})
        return data
