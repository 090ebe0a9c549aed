"""How every `gateway` command starts and fails: its shared options, the settings and services it
runs with, the notices it says, and its errors as one line (`gateway: …`)."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from gateway.config import Settings, load_settings, unset_key_variables
from gateway.config_sources import CONFIG_ENV, DEFAULT_CONFIG_PATH, config_from_env
from gateway.exceptions import GatewayError
from gateway.ids import is_valid_response_id
from gateway.services import Services

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def common_options(func: F) -> F:
    """--config and --data-dir on every command; errors become one line and exit 1."""

    @click.option(
        "--config",
        "config_path",
        type=click.Path(),
        default=None,
        help="Config file (default config/gateway.toml).",
    )
    @click.option(
        "--data-dir",
        "data_dir",
        type=click.Path(),
        default=None,
        help="Data directory (overrides storage.data_dir).",
    )
    @wraps(func)
    def wrapper(*args: Any, config_path: str | None, data_dir: str | None, **kwargs: Any) -> Any:
        try:
            overrides: dict[str, Any] = {}
            if data_dir is not None:
                overrides["storage"] = {"data_dir": data_dir}
            # `serve --host/--port`: part of the settings from the start, so that the notice
            # below shows them and a bad value is blamed on its flag.
            server = {k: kwargs[k] for k in ("host", "port") if kwargs.get(k) is not None}
            if server and func.__name__ == "serve":  # (demo's --port is its own server's)
                overrides["server"] = server
            settings = load_settings(config_path, overrides=overrides)
            if config_path is None and config_from_env(os.environ) is None:
                serves = func.__name__ != "demo"  # (the demo's server is its own, on its --port)
                click.get_current_context().meta[_NOTICE] = no_config_file_notice(settings, address=serves)
            done = func(settings, *args, config_path=config_path, **kwargs)
            say_notice()
            return done
        except GatewayError as exc:
            click.echo(f"gateway: {exc.message}", err=True)  # the one line: no notice with it
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


# The click context's key for the notice a command says once it has begun well.
_NOTICE = "gateway.notice"


def say_notice() -> None:
    """Say the command's notice, if it has one not yet said.

    A command says it when it is done, or once it has begun (those that run until stopped), so
    that a command that fails says one line, its error."""
    notice = click.get_current_context().meta.pop(_NOTICE, None)
    if notice:
        click.echo(notice, err=True)


def no_config_file_notice(settings: Settings, *, address: bool = True) -> str | None:
    """Which defaults are in force and where the data goes, when there is no config file.

    Outside a checkout there is often no config/gateway.toml: say so instead of silently creating
    ./var. `address`: with the server's host and port (not for a command serving on its own)."""
    if Path(DEFAULT_CONFIG_PATH).is_file():
        return None
    storage = settings.storage
    data = f"data in {Path(storage.data_dir).absolute()}" if storage.backend == "jsonl" else storage.where()
    settings_env = any(k.startswith("GATEWAY_") and k != CONFIG_ENV for k in os.environ)
    env = " + GATEWAY_* environment" if settings_env else ""
    providers = ", ".join(sorted(settings.providers))
    where = f"{settings.server.host}:{settings.server.port}, " if address else ""
    return (
        f"gateway: no config file ({DEFAULT_CONFIG_PATH} not found in {Path.cwd()}; "
        "name one with --config or GATEWAY_CONFIG; `gateway example-config` prints a commented one): "
        f"using built-in defaults{env}: {where}"
        f"providers {providers} (default {settings.default_provider!r}), {data}"
    )


def run_with_services(
    settings: Settings, work: Callable[[Services], Awaitable[T]], *, writes: bool = False
) -> T:
    """Run `work` with the services of the configured store (jsonl or postgres), then close it."""

    async def main() -> T:
        async with Services.for_command(settings, writes=writes) as services:
            return await work(services)

    return asyncio.run(main())


def ids_as_arguments(args: list[str]) -> list[str]:
    """Move the arguments that are response ids beginning with `-` after `--`.

    The model `/m` mints ids like `-m-…`: after `--`, such an id is read as the id it is, not as an option."""
    if "--" in args:
        return args
    ids = [a for a in args if a.startswith("-") and is_valid_response_id(a)]
    if not ids:
        return args
    return [a for a in args if a not in ids] + ["--", *ids]


class GatewayGroup(click.Group):
    """Click's group, with its usage errors as one line (`gateway: …`) instead of a usage block."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        args = ids_as_arguments(sys.argv[1:] if args is None else list(args))
        if not args and standalone_mode:  # a bare `gateway`: its help, as `--help` prints it
            name = prog_name or click.utils._detect_program_name()  # (as click's main names it)
            with self.context_class(self, info_name=name, **self.context_settings) as ctx:
                click.echo(self.get_help(ctx))
            sys.exit(0)
        run = functools.partial(super().main, args, prog_name, complete_var, standalone_mode=False, **extra)
        if not standalone_mode:
            return run()
        try:
            code: Any = run()
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "gateway"
            click.echo(f"gateway: {exc.format_message()} (see '{where} --help')", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"gateway: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("gateway: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def notice_unset_keys(settings: Settings) -> None:
    """A line at start for each provider whose key variable is not set (`unset_key_variables`)."""
    for line in unset_key_variables(settings.providers, os.environ):
        click.echo(f"gateway: note: {line}", err=True)


def notice_missing_litellm(settings: Settings) -> None:
    from gateway.upstream.litellm import INSTALL_HINT, litellm_installed

    names = sorted(name for name, p in settings.providers.items() if p.kind == "litellm")
    if names and not litellm_installed():
        click.echo(
            f"gateway: note: provider{'s' if len(names) > 1 else ''} {', '.join(names)} "
            f'(kind = "litellm") need{"" if len(names) > 1 else "s"} litellm, not installed: '
            f"{INSTALL_HINT}; until then {'their' if len(names) > 1 else 'its'} requests get 502",
            err=True,
        )
