"""The runtime install has no litellm (it is the `litellm` extra): counting still works offline
from the bundled BPE files, the model map falls back to the bundled snapshot, and a
kind = "litellm" provider says what to install."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

WITHOUT_LITELLM = textwrap.dedent(
    """
    import sys
    sys.modules["litellm"] = None  # as if not installed: find_spec() is None, import fails
    """
)


def run_without_litellm(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_CACHE_DIR"}
    # Any download would go through this proxy, where nothing listens: offline for real.
    env.update(HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", NO_PROXY="")
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_LITELLM + textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_counting_works_offline_without_litellm() -> None:
    result = run_without_litellm(
        """
        import os
        from gateway.tokens import count_text, encoding_name_for
        assert count_text("hello world") == 2
        assert count_text("hello world", "gpt-4o") == 2 and encoding_name_for("gpt-4o") == "o200k_base"
        print(os.environ["TIKTOKEN_CACHE_DIR"])
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(REPO / "gateway" / "tokenizers")


def test_model_map_falls_back_to_the_bundled_snapshot() -> None:
    result = run_without_litellm(
        """
        from gateway.services.models import litellm_context_window
        print(litellm_context_window("gpt-4o"), litellm_context_window("no-such-model"))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["128000", "None"]


def test_litellm_provider_without_litellm_names_the_extra() -> None:
    result = run_without_litellm(
        """
        import asyncio
        from gateway.config import ProviderSettings
        from gateway.exceptions import UpstreamError
        from gateway.upstream.litellm import LitellmUpstream
        up = LitellmUpstream("anthropic", ProviderSettings(kind="litellm"))
        try:
            asyncio.run(up.complete({"model": "claude", "messages": []}))
        except UpstreamError as exc:
            print(exc.status_code, exc.message)
        """
    )
    assert result.returncode == 0, result.stderr
    # (into the environment the gateway runs in: the distribution is not on PyPI)
    assert result.stdout.strip() == (
        "502 Provider 'anthropic' has kind = \"litellm\", which needs litellm: "
        f"{sys.executable} -m pip install 'litellm>=1.50'"
    )


def test_the_bundled_files_are_what_tiktoken_expects() -> None:
    """tiktoken names a cached file by the SHA-1 of its URL and checks its SHA-256."""
    import hashlib

    expected = {
        "cl100k_base": "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        "o200k_base": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    }
    for name, sha256 in expected.items():
        url = f"https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
        path = REPO / "gateway" / "tokenizers" / hashlib.sha1(url.encode()).hexdigest()
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha256


def test_serve_names_litellm_providers_whose_extra_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway import cli_frame
    from gateway.config import load_settings
    from gateway.upstream import litellm

    settings = load_settings(REPO / "config" / "gateway.toml", environ={})
    monkeypatch.setattr(litellm, "litellm_installed", lambda: False)
    cli_frame.notice_missing_litellm(settings)
    assert capsys.readouterr().err == (
        'gateway: note: provider anthropic (kind = "litellm") needs litellm, not installed: '
        f"{sys.executable} -m pip install 'litellm>=1.50'; until then its requests get 502\n"
    )
    monkeypatch.setattr(litellm, "litellm_installed", lambda: True)
    cli_frame.notice_missing_litellm(settings)
    assert capsys.readouterr().err == ""


def test_the_litellm_hint_fits_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """It said `pip install 'llm-continuity-gateway[litellm]'`: not on PyPI, not pipx's venv,
    and the image has no pip."""
    from gateway.upstream import litellm

    monkeypatch.setattr(sys, "prefix", "/root/.local/share/pipx/venvs/llm-continuity-gateway")
    assert litellm._install_hint() == "pipx inject llm-continuity-gateway litellm"
    monkeypatch.setattr(sys, "prefix", "/opt/gateway")
    monkeypatch.setattr(litellm.importlib.util, "find_spec", lambda name: None)
    assert "--build-arg EXTRAS=litellm" in litellm._install_hint()


def test_a_litellm_provider_loads_nothing_at_start() -> None:
    """The litellm seam pulled aiohttp in at start (9 MiB, 0.1 s) for Ollama's window question,
    asked only on a first turn."""
    result = run_without_litellm(
        """
        import sys
        import gateway.app, gateway.upstream.litellm
        print(sorted(m for m in ("aiohttp", "litellm") if sys.modules.get(m) is not None))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_opentelemetry_is_imported_only_when_tracing_is_configured() -> None:
    """Tracing off (no [tracing] endpoint, no OTEL_EXPORTER_OTLP_* variable): starting the app and
    a turn, streamed and not, never import opentelemetry (it is the `tracing` extra)."""
    code = textwrap.dedent(
        """
        import asyncio, sys
        import httpx
        from pathlib import Path
        import gateway.app
        from gateway.config import load_settings

        async def main():
            settings = load_settings(Path("tests/empty.toml"), environ={}, overrides={
                "default_provider": "demo", "storage": {"backend": "memory"}})
            app = gateway.app.create_app(settings)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                for stream in (False, True):
                    r = await client.post("/v1/chat/completions", json={
                        "model": "demo", "conversation_id": "c", "stream": stream,
                        "messages": [{"role": "user", "content": "my dog is Rex"}]})
                    assert r.status_code == 200, r.text

        asyncio.run(main())
        print(sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry"))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
