"""`gateway demo`: an in-process gateway on the built-in `demo` model, driven by the `openai` SDK.

The official `openai` SDK sends ONLY the new message each turn, to show the gateway keeps the
rest.
"""

from __future__ import annotations

import asyncio
import secrets
import shlex

import click

from gateway.config import ProviderSettings, Settings, StorageSettings

SCRIPT = [
    "Hi! My name is Bob and my favourite colour is teal.",
    "I live in Lisbon, by the way. My city is Lisbon.",
    "What is my name?",
    "What is my favourite colour?",
    "And what is my city?",
]


def run_demo(settings: Settings, *, port: int = 0, config_path: str | None = None) -> None:
    from openai import DefaultHttpxClient, OpenAI

    from gateway.app import create_app
    from gateway.server import running_in_thread
    from gateway.services import Services
    from gateway.tenants import Tenants

    providers = dict(settings.providers)
    providers.setdefault("demo", ProviderSettings(kind="demo"))
    if providers["demo"].kind != "demo":
        providers["demo"] = ProviderSettings(kind="demo")
    settings = settings.model_copy(update={"providers": providers})
    conversation_id = f"demo-{secrets.token_hex(3)}"
    # A data dir it cannot write is one line (as for `serve`), not the server's traceback.
    asyncio.run(Services.check_store(settings))
    app = create_app(settings)
    with running_in_thread(app, port=port) as base_url:
        # With [auth] keys, the demo's conversation belongs to the first key's tenant.
        tenants: Tenants = app.state.tenants
        key = tenants.a_key or "not-needed"
        # Its own loopback server: never through the environment's HTTP(S)_PROXY.
        http = DefaultHttpxClient(trust_env=False)
        client = OpenAI(base_url=f"{base_url}/v1", api_key=key, http_client=http)
        click.echo(f"gateway on {base_url}, model 'demo', conversation {conversation_id}")
        click.echo("each request carries only the new user message; the gateway supplies the rest\n")
        for i, text in enumerate(SCRIPT, 1):
            raw = client.chat.completions.with_raw_response.create(
                model="demo",
                messages=[{"role": "user", "content": text}],
                extra_body={"conversation_id": conversation_id},
            )
            completion = raw.parse()
            reply = completion.choices[0].message.content
            click.echo(click.style(f"[{i}] user      ", fg="cyan", bold=True) + text)
            click.echo(click.style("    assistant ", fg="green", bold=True) + str(reply))
            click.echo(click.style(f"    response id {completion.id}", dim=True))
        # One streamed turn too, to show streaming keeps continuity the same way.
        stream = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "What did I first say?"}],
            stream=True,
            extra_body={"conversation_id": conversation_id},
        )
        parts = []
        stream_id = ""
        for chunk in stream:
            stream_id = chunk.id
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        click.echo(
            click.style(f"[{len(SCRIPT) + 1}] user      ", fg="cyan", bold=True)
            + "What did I first say? (streamed)"
        )
        click.echo(click.style("    assistant ", fg="green", bold=True) + "".join(parts))
        click.echo(click.style(f"    response id {stream_id}", dim=True))
    # Where its files are: under the key's tenant folder when the gateway has keys.
    data_dir = Services.data_folder(settings, tenants.tenant_of(key) if tenants.enabled else "")
    click.echo("\nlogs:")
    click.echo(f"  index      {data_dir}/logs/conversations/{conversation_id}.jsonl")
    click.echo(f"  responses  {data_dir}/logs/responses/<response id>.jsonl")
    # The commands suggested read the same data: the config and data dir the demo was given.
    where = f" --config {shlex.quote(config_path)}" if config_path else ""
    if settings.storage.data_dir != StorageSettings.model_fields["data_dir"].default:
        where += f" --data-dir {shlex.quote(settings.storage.data_dir)}"
    click.echo(f"try: gateway show {conversation_id}{where}   |   gateway context {stream_id}{where}")
