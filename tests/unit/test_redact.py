"""Secrets the process holds are replaced in error messages and log lines."""

from __future__ import annotations

import logging

from gateway.config import Settings
from gateway.exceptions import UpstreamStatusError
from gateway.redact import REDACTED, RedactingFormatter, keep_secret, keep_secret_headers, redact
from gateway.tenants import Tenants


def test_kept_secrets_are_replaced_wherever_they_appear() -> None:
    keep_secret("sk-unit-secret-0001")
    keep_secret("sk-unit-secret-0001-longer")  # one key inside another: the longer first
    keep_secret("abc")  # too short to be told from ordinary text: left alone
    text = "key sk-unit-secret-0001-longer then sk-unit-secret-0001, abc"
    assert redact(text) == f"key {REDACTED} then {REDACTED}, abc"


def test_provider_headers_and_gateway_keys_are_secrets() -> None:
    keep_secret_headers({"x-api-key": "hdr-secret-value-42", "x-title": "My App Title"})
    settings = Settings.model_validate({"auth": {"keys_env": "K"}})
    Tenants.from_settings(settings, {"K": "gw-key-one-1234, gw-key-two-5678"})
    assert redact("hdr-secret-value-42 gw-key-one-1234 gw-key-two-5678 My App Title") == (
        f"{REDACTED} {REDACTED} {REDACTED} My App Title"
    )


def test_errors_and_log_lines_carry_no_secret() -> None:
    keep_secret("sk-unit-secret-0002")
    error = UpstreamStatusError("Incorrect API key provided: Bearer sk-unit-secret-0002", upstream_status=401)
    assert error.message == f"Incorrect API key provided: Bearer {REDACTED}"
    assert "sk-unit-secret-0002" not in str(error) and "sk-unit" not in str(error.to_dict())
    record = logging.LogRecord(
        "gateway", logging.ERROR, __file__, 1, "failed: %s", ("sk-unit-secret-0002",), None
    )
    assert RedactingFormatter("%(message)s").format(record) == f"failed: {REDACTED}"


def test_credentials_in_a_provider_url_are_secrets() -> None:
    from gateway.redact import keep_url_secrets

    keep_url_secrets("http://svc:url-pass%2Fword@127.0.0.1:1/v1?api-key=query-key-123&region=eu")
    said = "at http://svc:url-pass%2Fword@127.0.0.1:1/v1?api-key=query-key-123 (url-pass/word)"
    assert "url-pass" not in redact(said) and "query-key-123" not in redact(said)
    assert redact("region=eu") == "region=eu"


def test_a_key_pasted_as_the_gateway_keys_variable_is_not_said_at_start() -> None:
    """`auth.keys_env = "gsk_..."` (a key of letters, digits and `_` is a legal name) was quoted in
    the start error."""
    import pytest

    from gateway.exceptions import ConfigError

    pasted = "gsk_R3alKeyPastedByMistake0123456789abcdef"
    with pytest.raises(ConfigError) as info:
        Tenants.from_settings(Settings.model_validate({"auth": {"keys_env": pasted}}), {})
    assert pasted not in str(info.value)
    assert str(info.value).startswith("auth.keys_env names a variable, which is not set")
    with pytest.raises(ConfigError) as named:
        Tenants.from_settings(Settings.model_validate({"auth": {"keys_env": "GW_KEYS"}}), {"GW_KEYS": " "})
    assert str(named.value).startswith("auth.keys_env names GW_KEYS, which holds no keys")
