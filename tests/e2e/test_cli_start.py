"""How `gateway serve` and `gateway demo` start, as a user meets them: the port flag, the notice
when no config file is found, and a taken port reported before anything claims to listen."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, free_port
from tests.e2e.test_cli import gw


def _env_without_config() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}


def test_demo_runs_on_the_port_it_is_given(tmp_path: Path) -> None:
    """Without a config file its notice named the default server's 127.0.0.1:8080, which the
    demo does not listen on."""
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "demo", "--port", str(port), "--data-dir", str(tmp_path / "var")],
        cwd=tmp_path,
        env=_env_without_config(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"gateway on http://127.0.0.1:{port}," in result.stdout
    assert "Your name is Bob." in result.stdout
    assert "no config file" in result.stderr and ":8080" not in result.stderr


def test_demo_on_a_taken_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = gw("demo", "--port", str(port), "--data-dir", str(tmp_path / "var"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"gateway: cannot listen on 127.0.0.1:{port}: address already in use (try another --port)"
    ]


def test_no_config_file_is_a_notice_naming_defaults_and_data_dir(tmp_path: Path) -> None:
    """Outside a checkout there is no config/gateway.toml: say so, and where the data goes."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "conversations"],
        cwd=tmp_path,
        env=_env_without_config(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    notice = result.stderr
    assert "no config file" in notice and "config/gateway.toml" in notice
    assert "built-in defaults" in notice and "127.0.0.1:8080" in notice and "demo" in notice
    assert f"data in {tmp_path / 'var'}" in notice
    # An empty GATEWAY_CONFIG is as if unset (it named no file, and no notice said so).
    empty = subprocess.run(
        [sys.executable, "-m", "gateway", "conversations"],
        cwd=tmp_path,
        env={**_env_without_config(), "GATEWAY_CONFIG": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert empty.returncode == 0 and empty.stderr == notice
    # A config file (found, or named) means no notice.
    found = gw("conversations", "--data-dir", str(tmp_path / "var"))
    assert "no config file" not in found.stderr
    named = gw("conversations", "--config", str(REPO / "tests" / "empty.toml"), "--data-dir", str(tmp_path))
    assert "no config file" not in named.stderr


def test_without_a_config_file_an_error_is_still_one_line(tmp_path: Path) -> None:
    """The notice came first, so a failing command said two lines; it is said once a command
    has done well (or, for `serve`, once it is about to listen), never with an error."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "gateway", *args, "--data-dir", str(tmp_path / "var")]
        return subprocess.run(
            command, cwd=tmp_path, env=_env_without_config(), capture_output=True, text=True, timeout=60
        )

    for args in (("show", "nosuch"), ("context", "nosuch-0123456789ab"), ("show", "../x")):
        result = run(*args)
        assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
        assert "no config file" not in result.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run("serve", "--port", str(taken.getsockname()[1]))
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "address already in use" in result.stderr


def test_no_config_notice_reflects_the_environment(tmp_path: Path) -> None:
    env = {**_env_without_config(), "GATEWAY_STORAGE__DATA_DIR": str(tmp_path / "elsewhere")}
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "conversations"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"data in {tmp_path / 'elsewhere'}" in result.stderr
    assert "environment" in result.stderr


def test_serve_on_a_taken_port_says_so_before_any_listening_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = str(REPO / "tests" / "empty.toml")
        result = gw("serve", "--config", config, "--data-dir", str(tmp_path / "var"), "--port", str(port))
    assert result.returncode == 1
    assert "listening" not in result.stderr + result.stdout
    assert result.stderr.strip().splitlines() == [
        f"gateway: cannot listen on 127.0.0.1:{port}: address already in use (try another --port)"
    ]
    assert not (tmp_path / "var").exists()  # a serve that cannot listen leaves no data dir behind


def test_serve_says_listening_once_the_port_is_held(tmp_path: Path) -> None:
    """The "listening" line comes after the port is bound: a client may connect right away."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--config",
            str(REPO / "tests" / "empty.toml"),
            "--data-dir",
            str(tmp_path / "var"),
            "--port",
            str(port),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"gateway listening on http://127.0.0.1:{port}" in line, line
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_serve_refuses_keys_named_but_not_found(tmp_path: Path) -> None:
    """`[auth] keys_env` naming a variable that is unset (a typo, a forgotten export) or empty
    served every tenant's conversations to anyone, without a word."""
    config = tmp_path / "auth.toml"
    config.write_text('[auth]\nkeys_env = "CLI_START_TEST_KEYS"\n')
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "CLI_START_TEST_KEYS"}
    for keys in (None, " , "):
        run_env = env if keys is None else {**env, "CLI_START_TEST_KEYS": keys}
        result = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", port,
             "--data-dir", str(tmp_path / "var")],
            cwd=REPO, env=run_env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 1 and "listening" not in result.stderr
        (line,) = result.stderr.strip().splitlines()
        state = "is not set" if keys is None else "holds no keys"
        assert line.startswith(f"gateway: auth.keys_env names CLI_START_TEST_KEYS, which {state}"), line


def test_demo_with_keys_and_its_hint_reads_the_same_data(tmp_path: Path) -> None:
    """`gateway demo` on a config with [auth] keys crashed with a 401 traceback, and its "try:"
    line left out the --config and --data-dir it was given: copied as printed, it found nothing."""
    config = tmp_path / "auth.toml"
    config.write_text('[auth]\nkeys_env = "CLI_START_DEMO_KEYS"\n')
    data = tmp_path / "demo data"
    env = {"CLI_START_DEMO_KEYS": "demo-key-0123456789"}
    result = gw("demo", "--config", str(config), "--data-dir", str(data), "--port", str(free_port()), env=env)
    assert result.returncode == 0, result.stderr
    assert "Your name is Bob." in result.stdout
    hint = result.stdout.strip().splitlines()[-1]
    show = hint.removeprefix("try: ").split("   |   ")[0]
    assert f"--config {config}" in show and f"--data-dir '{data}'" in show
    shown = subprocess.run(show.replace("gateway", f"{sys.executable} -m gateway", 1), shell=True, cwd=REPO,
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "Lisbon" in shown.stdout
    # The log paths it prints are the files written: the key's tenant folder.
    lines = result.stdout.splitlines()
    index = next(line.split("index", 1)[1].strip() for line in lines if line.strip().startswith("index "))
    assert Path(index).is_file() and "/tenants/t" in index, index


def test_demo_ignores_the_proxy_and_says_an_unwritable_data_dir_in_one_line(tmp_path: Path) -> None:
    """Behind HTTP(S)_PROXY without NO_PROXY the demo sent its loopback requests to the proxy
    (119 lines of traceback); in a folder it cannot write it printed two tracebacks."""
    proxy = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    result = gw("demo", "--port", str(free_port()), "--data-dir", str(tmp_path / "var"), env=proxy)
    assert result.returncode == 0, result.stderr[-500:]
    assert "Your name is Bob." in result.stdout
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the data dir would be")
    result = gw("demo", "--port", str(free_port()), "--data-dir", str(blocked / "var"))
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"gateway: the data dir {blocked / 'var'} cannot be written (Not a directory)"), (
        line
    )


def test_example_config_is_the_shipped_commented_one(tmp_path: Path) -> None:
    """A wheel or pipx install has no checkout: the commented config comes with the package."""
    shipped = (REPO / "config" / "gateway.toml").read_text()
    assert (REPO / "gateway" / "data" / "gateway.toml").read_text() == shipped  # one text, two places
    result = gw("example-config")
    assert result.returncode == 0 and result.stdout == shipped
    # Whatever config is in force: it is the way out of a broken one.
    broken = tmp_path / "broken.toml"
    broken.write_text("[server\n")
    result = gw("example-config", "--config", str(broken), env={"GATEWAY_SERVER__PORT": "abc"})
    assert (result.returncode, result.stdout, result.stderr) == (0, shipped, "")
    (tmp_path / "mine.toml").write_text(result.stdout)
    listed = gw("conversations", "--config", str(tmp_path / "mine.toml"), "--data-dir", str(tmp_path / "var"))
    assert listed.returncode == 0, listed.stderr
