"""Identifiers: the conversation id pattern, model slugs and minted response ids."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.exceptions import InvalidRequest
from gateway.ids import (
    check_conversation_id,
    is_valid_conversation_id,
    is_valid_response_id,
    mint_response_id,
    model_slug,
)

SPEC_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@pytest.mark.parametrize(
    "cid",
    [
        "a",
        "Z",
        "0",
        "conv-1",
        "user_42.session-7",
        "a..b",
        "a.",
        "x-",
        "9_",
        "A" * 128,
        "a" + "._-" * 42 + "b",
    ],
)
def test_valid_conversation_ids(cid: str) -> None:
    assert is_valid_conversation_id(cid)
    assert check_conversation_id(cid) == cid


@pytest.mark.parametrize(
    "cid",
    [
        "",
        "a" * 129,
        ".",
        "..",
        ".hidden",
        "-flag",
        "_private",
        "../x",
        "a/b",
        "a\\b",
        "/etc/passwd",
        "%2e%2e",
        "a%2fb",
        "a b",
        " a",
        "a\n",
        "a\x00",
        "a\t",
        "a:b",
        "a~",
        "\uff41bc",  # fullwidth a
        "\u0430bc",  # Cyrillic a
        "abc\u200b",  # zero-width space
        "café",
        "\u0131",  # dotless i
        "\u212a",  # Kelvin sign, folds to K under IGNORECASE
        "\u0661\u0662\u0663",  # Arabic-Indic digits match \d but not [0-9]
    ],
)
def test_invalid_conversation_ids(cid: str) -> None:
    assert not is_valid_conversation_id(cid)
    with pytest.raises(InvalidRequest) as info:
        check_conversation_id(cid)
    assert info.value.param == "conversation_id"
    assert info.value.status_code == 400


@pytest.mark.parametrize("value", [None, 123, b"abc", ["abc"], {"id": "a"}])
def test_non_string_conversation_ids(value: object) -> None:
    assert not is_valid_conversation_id(value)
    with pytest.raises(InvalidRequest):
        check_conversation_id(value, param="agent_id")


def test_check_conversation_id_names_the_parameter() -> None:
    with pytest.raises(InvalidRequest) as info:
        check_conversation_id("../x", param="agent_id")
    assert info.value.param == "agent_id"
    assert "agent_id" in info.value.message
    assert "\n" not in info.value.message


def test_128_vs_129_chars() -> None:
    assert is_valid_conversation_id("a" * 128)
    assert not is_valid_conversation_id("a" * 129)
    assert not is_valid_conversation_id("a" * 127 + "-x")


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=140) | st.from_regex(SPEC_PATTERN))
def test_conversation_id_agrees_with_the_spec_regex(value: str) -> None:
    # The spec's regex, matched as ASCII ranges and with no trailing-newline leniency.
    expected = SPEC_PATTERN.match(value) is not None and not value.endswith("\n")
    assert is_valid_conversation_id(value) is expected


@pytest.mark.parametrize(
    ("model", "slug"),
    [
        ("ollama/phi4-mini", "ollama-phi4-mini"),
        ("gpt-4o", "gpt-4o"),
        ("llama3.1:8b", "llama3.1-8b"),
        ("anthropic/claude-3.5 sonnet@2024", "anthropic-claude-3.5-sonnet-2024"),
        ("a_b.c-d", "a_b.c-d"),
        ("модель", "------"),
        ("../etc/passwd", "---etc-passwd"),
        (".hidden", "-hidden"),
        ("...", "---"),
        ("a/../b", "a-..-b"),
        ("", "model"),
    ],
)
def test_model_slug(model: str, slug: str) -> None:
    assert model_slug(model) == slug


@pytest.mark.parametrize(
    "model", ["ollama/phi4-mini", "gpt-4o", "demo", "../x", ".", "", "模型/v1", "a" * 300]
)
def test_mint_response_id(model: str) -> None:
    slug = model_slug(model)
    rid = mint_response_id(model)
    assert re.fullmatch(rf"{re.escape(slug)}-[0-9a-f]{{12}}", rid)
    assert is_valid_response_id(rid)
    assert mint_response_id(model) != rid  # random suffix


def test_minted_id_for_the_spec_example() -> None:
    assert re.fullmatch(r"ollama-phi4-mini-[0-9a-f]{12}", mint_response_id("ollama/phi4-mini"))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_any_model_mints_a_valid_safe_response_id(model: str) -> None:
    slug = model_slug(model)
    assert re.fullmatch(r"[A-Za-z0-9._-]+", slug)
    assert not slug.startswith(".")
    rid = mint_response_id(model)
    assert rid.startswith(f"{slug}-")
    assert re.fullmatch(r"[0-9a-f]{12}", rid[len(slug) + 1 :])
    assert is_valid_response_id(rid)


@pytest.mark.parametrize(
    "rid",
    [
        "",
        "m",
        "m-0123456789a",  # 11 hex
        "m-0123456789AB",  # upper-case hex
        "m-0123456789ag",
        "-0123456789ab",  # empty slug
        "..-0123456789ab",
        ".m-0123456789ab",
        "../m-0123456789ab",
        "a/b-0123456789ab",
        "m-0123456789ab\n",
        "m-0123456789ab.jsonl",
        "ｍ-0123456789ab",
        None,
        42,
    ],
)
def test_invalid_response_ids(rid: object) -> None:
    assert not is_valid_response_id(rid)


def test_a_forked_worker_mints_other_ids_than_its_parent() -> None:
    """Ids come from a pool of random bytes: a forked child must not reuse its parent's."""
    mint_response_id("m")  # the pool is filled
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.write(write, mint_response_id("m").encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 200).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert is_valid_response_id(child)
    assert child != mint_response_id("m")
