"""The configuration table of docs/configuration.md and the settings model name the same keys, with the
same defaults."""

from __future__ import annotations

import re
import tomllib
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from gateway.config import ProviderSettings, Settings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
NAME = "NAME"  # how the table spells a provider's or a model's own name


def _models_in(annotation: object) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _literals(annotation: object) -> list[str]:
    """The choices of a `Literal[...]` key, also inside a union (`int | Literal["auto"]`)."""
    if typing.get_origin(annotation) is typing.Literal:
        return [str(choice) for choice in typing.get_args(annotation)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [choice for member in typing.get_args(annotation) for choice in _literals(member)]
    return []


def model_keys() -> dict[str, tuple[type[BaseModel], str]]:
    """Every settings key, dotted as the page writes it, with the model and field that hold it."""
    keys: dict[str, tuple[type[BaseModel], str]] = {}
    for name, field in Settings.model_fields.items():
        section = _models_in(field.annotation)
        if typing.get_origin(field.annotation) is dict:
            section, prefix = _models_in(typing.get_args(field.annotation)[1]), f"{name}.{NAME}."
        else:
            prefix = f"{name}."
        if section is None:
            keys[name] = (Settings, name)
        else:
            keys.update({prefix + key: (section, key) for key in section.model_fields})
    return keys


def documented_rows() -> list[tuple[list[str], str, str]]:
    """The configuration table: ([keys], default cell, meaning cell) per row.

    A row may name several keys, `server.host` / `server.port`; a later one without a dot is in
    the first one's table (`sessions.recap` / `recap_max_tokens`).
    """
    text = PAGE.read_text(encoding="utf-8")
    assert "\n## Keys\n" in text, "docs/configuration.md: no '## Keys' section"
    section = text[text.index("\n## Keys\n") :]
    end = section.find("\n## ", 1)
    section = section if end == -1 else section[:end]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        assert len(cells) == 3, f"a configuration row has three cells: {line}"
        names = [re.sub(r'"([^"]+)"', r"\1", name) for name in re.findall(r"`([^`]+)`", cells[0])]
        table = names[0].rpartition(".")[0]
        keys = [name if "." in name or not table else f"{table}.{name}" for name in names]
        rows.append((keys, cells[1], cells[2]))
    assert rows, "docs/configuration.md: no configuration table under '## Keys'"
    return rows


def test_every_settings_key_is_in_the_table_and_every_table_key_exists() -> None:
    documented = [key for keys, _, _ in documented_rows() for key in keys]
    keys = model_keys()
    assert sorted(set(keys) - set(documented)) == [], "settings keys missing from the page's table"
    assert sorted(set(documented) - set(keys)) == [], "the page's table names keys the settings lack"
    assert len(documented) == len(set(documented)), "a key has two rows"


def test_every_choice_of_a_key_is_named_in_its_row() -> None:
    keys = model_keys()
    for names, default, meaning in documented_rows():
        for name in names:
            model, field = keys[name]
            for choice in _literals(model.model_fields[field].annotation):
                assert f"`{choice}`" in default + meaning or f'`"{choice}"`' in default + meaning, (
                    f"docs/configuration.md: the row of {name} does not name its choice {choice!r}"
                )


def _documented_defaults() -> list[tuple[str, str]]:
    """(key, default cell) where the cell is one value (or "—") per key of its row, not words."""
    pairs = []
    for names, default, _ in documented_rows():
        cells = default.split(" / ")
        if len(cells) == len(names) and all(re.fullmatch(r"`[^`]+`|—", cell) for cell in cells):
            pairs.extend(zip(names, cells, strict=True))
    return pairs


@pytest.mark.parametrize(("key", "cell"), _documented_defaults())
def test_documented_default_is_the_default(key: str, cell: str) -> None:
    model, field = model_keys()[key]
    info = model.model_fields[field]
    if cell == "—":  # no default: required, or unset
        assert info.is_required() or info.get_default(call_default_factory=True) is None, key
        return
    literal = cell.strip("`")
    try:
        value = tomllib.loads(f"v = {literal}")["v"]
    except tomllib.TOMLDecodeError:
        value = literal  # a bare word such as 127.0.0.1
    required = {"kind": "demo"} if model is ProviderSettings else {}
    documented = model.model_validate({**required, field: value})
    default = model.model_validate(required)
    assert getattr(documented, field) == getattr(default, field), f"docs/configuration.md: default of {key}"
