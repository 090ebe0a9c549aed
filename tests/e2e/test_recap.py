"""The "earlier today" recap end to end: one user, two channels, a real gateway process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.conftest import GatewayProcess, write_config
from tests.mockserver import MockServer


@pytest.fixture
def recap_gateway(tmp_path: Path, upstream: MockServer) -> Iterator[GatewayProcess]:
    config = write_config(tmp_path / "gateway.toml", upstream.url, extra="[sessions]\nrecap = true\n")
    gateway = GatewayProcess(config, tmp_path / "var").start()
    yield gateway
    gateway.stop()


def test_recap_across_channels_end_to_end(recap_gateway: GatewayProcess, upstream: MockServer) -> None:
    gateway = recap_gateway
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)

    def ask(cid: str, text: str, user: str) -> str:
        r = client.chat.completions.create(
            model="mock/m",
            messages=[{"role": "user", "content": text}],
            user=user,
            extra_body={"conversation_id": cid},
        )
        return str(r.choices[0].message.content)

    ask("text-1", "my dog is called Rex", "u1")
    assert ask("voice-1", "what is my dog called?", "u1") == "Your dog is Rex."
    recap = upstream.requests[-1]["messages"][0]
    assert (
        recap["role"] == "system"
        and recap["content"].startswith("Earlier today")
        and "Rex" in recap["content"]
    )
    # The recap stays with the new conversation on its next turns.
    assert ask("voice-1", "what is my dog called?", "u1") == "Your dog is Rex."
    # Another user gets no recap.
    assert ask("voice-2", "what is my dog called?", "u2") == "I don't know your dog yet."
    assert upstream.requests[-1]["messages"][0]["role"] == "user"
    assert (gateway.data_dir / "logs" / "users").is_dir()
    # `gateway show --json` has it too: what the model gets (it was only in the text view)
    from tests.e2e.test_cli import gw

    shown = json.loads(gw("show", "voice-1", "--json", "--data-dir", str(gateway.data_dir)).stdout)
    assert shown["recap"]["content"].startswith("Earlier today") and "Rex" in shown["recap"]["content"]


@pytest.mark.parametrize("deleted", ["item", "response", "conversation"])
def test_deleted_content_leaves_the_recaps_made_before(
    recap_gateway: GatewayProcess, upstream: MockServer, deleted: str
) -> None:
    """A recap made before a deletion kept quoting the deleted message (or conversation) to the
    model on every later turn of the conversation that got it; rolling summaries were withdrawn,
    recaps were not."""
    client = OpenAI(base_url=f"{recap_gateway.url}/v1", api_key="x", max_retries=0)
    user, source, other = f"u-{deleted}", f"card-{deleted}", f"voice-{deleted}"

    def ask(cid: str, text: str) -> str:
        r = client.chat.completions.create(
            model="mock/m", messages=[{"role": "user", "content": text}], user=user,
            extra_body={"conversation_id": cid},
        )  # fmt: skip
        return r.id

    said = ask(source, "my card number is CARD-4111")
    ask(other, "hello from the voice channel")
    assert "CARD-4111" in str(upstream.requests[-1]["messages"])  # the recap quotes it
    if deleted == "item":
        first = client.conversations.items.list(source, order="asc").data[0]
        client.conversations.items.delete(first.id, conversation_id=source)
    elif deleted == "response":
        client.responses.delete(said)
    else:
        client.conversations.delete(source)
    ask(other, "what else?")
    assert "CARD-4111" not in str(upstream.requests[-1]["messages"])
    assert len(upstream.requests[-1]["messages"]) == 3  # the conversation's own turns go on
